"""Cleaning recipes: which steps, in which order, with which parameters (declarative, hashed into lineage).

A recipe is a mapping (YAML file, or inline under a source's ``cleaning:`` in the sources config)::

    steps:                          # in order; each a step name, or {name: {parameter: value}}
      - language: {languages: [en], min_score: 0.65}
      - gopher_repetition
      - gopher_quality: {min_doc_words: 50}
    dedup: {exact: true, minhash: true, n_grams: 5, bands: 14, rows: 8, seed: 1}   # or false
    decontaminate: {tasks: [arc_easy, hellaswag], n: 13, min_words: 8, remove: false}
    on_error: fail                  # a step raising on a document: fail naming file:line, or skip (removed, counted)
    max_removed_share: 0.9          # the asset check fails when one step removes more than this share

Built-in recipes: ``fineweb`` (FineWeb's published filters, for web prose), ``code`` (source code: no
stop-word or punctuation rule; length and The Stack's line and alphanumeric rules), ``none`` (no cleaning).
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from training.data.cleaning.filters import FILTERS, Step, parameters
from training.data.cleaning.minhash import MinHashSettings
from training.data.cleaning.versions import recipe_file

ON_ERROR = ("fail", "skip")
BUILTIN_RECIPES: dict[str, dict | None] = {
    # datatrove/examples/fineweb.py: language (fastText en >= 0.65), Gopher repetition and quality, C4 without
    # its terminal-punctuation line rule, FineWeb's filters, MinHash 5-grams 14 x 8
    "fineweb": {"steps": [{"language": {"languages": ["en"], "min_score": 0.65}}, "gopher_repetition",
                          "gopher_quality", {"c4": {"filter_no_terminal_punct": False}}, "fineweb_quality"]},
    # code: no stop-word, punctuation or n-gram rule (they read code as bad prose); a file that is mostly one
    # repeated line is still junk
    "code": {"steps": [{"length": {"min_chars": 20, "max_chars": 1_000_000}}, "code_quality",
                       {"gopher_repetition": {"dup_line_frac": 0.5, "dup_para_frac": None, "dup_line_char_frac": None,
                                              "dup_para_char_frac": None, "top_n_grams": {}, "dup_n_grams": {}}}]},
    "none": None,
}
_RECIPE_KEYS = ("name", "steps", "dedup", "decontaminate", "on_error", "max_removed_share")
_DECONTAMINATE_KEYS = {"tasks": [], "n": 13, "min_words": 8, "remove": False}
_DEDUP_KEYS = {"exact": True, "minhash": True, **asdict(MinHashSettings())}


class RecipeError(ValueError):
    """A recipe that cannot be run; the message names the field (``<recipe>: steps[2].c4.min_words``)."""


@dataclass
class Decontamination:
    tasks: list[str]
    n: int = 13
    min_words: int = 8
    remove: bool = False


@dataclass
class Recipe:
    name: str
    steps: list[Step]
    exact_dedup: bool = True
    minhash: MinHashSettings | None = field(default_factory=MinHashSettings)
    decontaminate: Decontamination | None = None
    on_error: str = "fail"
    max_removed_share: float = 0.9

    def spec(self) -> dict:
        """Everything that decides the output, as plain data (what the recipe hash covers)."""
        return {"name": self.name, "steps": [{s.name: asdict(s)} for s in self.steps],
                "dedup": {"exact": self.exact_dedup,
                          "minhash": asdict(self.minhash) if self.minhash else False},
                "decontaminate": asdict(self.decontaminate) if self.decontaminate else None,
                "on_error": self.on_error}

    @property
    def sha256(self) -> str:
        return hashlib.sha256(json.dumps(self.spec(), sort_keys=True).encode()).hexdigest()

    @property
    def dedups(self) -> bool:
        return self.exact_dedup or self.minhash is not None


def _check_value(where: str, value, default):
    """``value`` when it has the type of the parameter's default (an int where a float is expected is fine)."""
    if default is None or value is None:
        return value
    if isinstance(default, bool) or isinstance(value, bool):
        if not isinstance(value, bool) or not isinstance(default, bool):
            raise RecipeError(f"{where}: expected {type(default).__name__}, got {value!r}")
        return value
    if isinstance(default, (int, float)) and isinstance(value, (int, float)):
        if isinstance(default, int) and not isinstance(value, int):
            raise RecipeError(f"{where}: expected an integer, got {value!r}")
        return value
    if type(value) is not type(default):
        raise RecipeError(f"{where}: expected {type(default).__name__}, got {value!r}")
    return value


def _step(where: str, entry) -> Step:
    if isinstance(entry, str):
        name, params = entry, {}
    elif isinstance(entry, dict) and len(entry) == 1:
        name, params = next(iter(entry.items()))
        params = params or {}
    else:
        raise RecipeError(f"{where}: expected a step name or {{name: {{parameter: value}}}}, got {entry!r}")
    if name not in FILTERS:
        raise RecipeError(f"{where}: unknown step {name!r}; known steps: {', '.join(FILTERS)}")
    if not isinstance(params, dict):
        raise RecipeError(f"{where}.{name}: expected a mapping of parameters, got {params!r}")
    known = parameters(FILTERS[name])
    unknown = sorted(set(params) - set(known))
    if unknown:
        raise RecipeError(f"{where}.{name}: unknown parameter {unknown[0]!r}; {name}'s parameters: "
                          f"{', '.join(known)}")
    values = {k: _check_value(f"{where}.{name}.{k}", v, known[k]) for k, v in params.items()}
    return FILTERS[name](**values)


def _section(where: str, given, defaults: dict) -> dict:
    if not isinstance(given, dict):
        raise RecipeError(f"{where}: expected a mapping, got {given!r}")
    unknown = sorted(set(given) - set(defaults))
    if unknown:
        raise RecipeError(f"{where}: unknown key {unknown[0]!r}; known: {', '.join(defaults)}")
    return {k: _check_value(f"{where}.{k}", given.get(k, v), v) for k, v in defaults.items()}


def recipe_from_mapping(data: dict, name: str, where: str | None = None) -> Recipe:
    where = where or name
    if not isinstance(data, dict):
        raise RecipeError(f"{where}: a recipe is a mapping with {', '.join(_RECIPE_KEYS)}, got {data!r}")
    unknown = sorted(set(data) - set(_RECIPE_KEYS))
    if unknown:
        raise RecipeError(f"{where}: unknown key {unknown[0]!r}; known: {', '.join(_RECIPE_KEYS)}")
    steps = data.get("steps", [])
    if not isinstance(steps, list):
        raise RecipeError(f"{where}.steps: expected a list of steps, got {steps!r}")
    built = [_step(f"{where}: steps[{i}]", entry) for i, entry in enumerate(steps)]
    dedup = data.get("dedup", {})
    dedup = {**_DEDUP_KEYS, "exact": False, "minhash": False} if dedup is False else \
        _section(f"{where}: dedup", dedup, _DEDUP_KEYS)
    settings = MinHashSettings(**{k: dedup[k] for k in asdict(MinHashSettings())})
    if min(settings.n_grams, settings.bands, settings.rows) < 1:
        raise RecipeError(f"{where}: dedup n_grams, bands and rows must be >= 1, got {settings}")
    decontaminate = data.get("decontaminate")
    if decontaminate is not None:
        values = _section(f"{where}: decontaminate", decontaminate, _DECONTAMINATE_KEYS)
        if not values["tasks"] or not all(isinstance(t, str) for t in values["tasks"]):
            raise RecipeError(f"{where}: decontaminate.tasks: expected a non-empty list of task names")
        decontaminate = Decontamination(**values)
    on_error = data.get("on_error", "fail")
    if on_error not in ON_ERROR:
        raise RecipeError(f"{where}: on_error must be one of {', '.join(ON_ERROR)}, got {on_error!r}")
    share = data.get("max_removed_share", 0.9)
    if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 < share <= 1:
        raise RecipeError(f"{where}: max_removed_share must be a number in (0, 1], got {share!r}")
    return Recipe(name=str(data.get("name", name)), steps=built, exact_dedup=dedup["exact"],
                  minhash=settings if dedup["minhash"] else None, decontaminate=decontaminate, on_error=on_error,
                  max_removed_share=float(share))


def load_recipe(spec, base: Path | None = None) -> Recipe | None:
    """A recipe from a built-in name, a YAML file's path (relative to ``base``) or an inline mapping; None for
    ``none`` (the source is used as it is)."""
    if isinstance(spec, dict):
        return recipe_from_mapping(spec, "inline recipe")
    if not isinstance(spec, str):
        raise RecipeError(f"a recipe is a built-in name ({', '.join(BUILTIN_RECIPES)}), a YAML file or a "
                          f"mapping, got {spec!r}")
    if spec in BUILTIN_RECIPES:
        builtin = BUILTIN_RECIPES[spec]
        return None if builtin is None else recipe_from_mapping(builtin, spec)
    path = recipe_file(spec, base)
    if path is None or not path.is_file():
        raise RecipeError(f"recipe {spec!r} is neither a built-in recipe ({', '.join(BUILTIN_RECIPES)}) nor a "
                          f"YAML file")
    from training.config import ConfigError, parse_yaml

    try:  # read as a training config is: duplicate keys name both lines, alias bombs are refused
        data = parse_yaml(path.read_text(), str(path))
    except OSError as exc:
        raise RecipeError(f"{path}: unreadable recipe ({exc})") from None
    except ConfigError as exc:
        raise RecipeError(str(exc)) from None
    return recipe_from_mapping(data, path.stem, str(path))
