"""The sources config (``configs/sources.yaml``): one raw corpus partition per source."""
from __future__ import annotations

import glob
import math
from dataclasses import dataclass
from pathlib import Path


from assets.builtin_corpus import BUILTIN_KINDS
from training.config import ConfigError, check_plain_name, parse_yaml
from training.data.cleaning.recipe import Recipe, RecipeError, load_recipe
from training.data.corpus import ON_BAD_LINE


class SourcesConfigError(ValueError):
    pass


@dataclass(frozen=True)
class SourceSpec:
    name: str
    weight: float
    builtin: str | None = None
    max_bytes: int = 0
    files: tuple[str, ...] = ()
    json_keys: tuple[str, ...] = ("text",)
    on_bad_line: str = "error"  # or "skip": bad records are counted and quarantined, not fatal
    max_shard_tokens: int | None = None  # split the source's tokens into shards of at most this many
    files_per_chunk: int | None = None  # ingest and tokenize the files in chunks of this many (assets/chunks.py)
    # clean_corpus's recipe (training/data/cleaning/recipe.py): a built-in name, a YAML file (relative to the
    # sources config) or an inline mapping; "none" uses the raw documents as they are
    cleaning: str | dict = "none"
    planted_every: int = 0  # a built-in source: plant duplicates and junk after every Nth document (the demo's)

    def input_files(self) -> list[Path]:
        """The user's files (globs expanded, sorted); not used for built-in sources."""
        paths = sorted({Path(p) for pattern in self.files for p in glob.glob(pattern)})
        if not paths:
            raise SourcesConfigError(f"source {self.name!r}: no file matches {list(self.files)}")
        return paths


_KEYS = {"builtin", "max_bytes", "files", "json_keys", "weight", "on_bad_line", "max_shard_tokens", "files_per_chunk",
         "cleaning", "planted_every"}


def source_recipe(spec: SourceSpec, sources_config: str | Path) -> Recipe | None:
    """The source's cleaning recipe (None: not cleaned); a recipe file is found relative to the sources config."""
    try:
        return load_recipe(spec.cleaning, Path(sources_config).parent)
    except RecipeError as exc:
        raise SourcesConfigError(f"{sources_config}: sources.{spec.name}.cleaning: {exc}") from None


def load_sources(path: str | Path) -> dict[str, SourceSpec]:
    path = Path(path)
    try:
        # a source named twice would otherwise be one source, the second silently (parse_yaml refuses it)
        data = parse_yaml(path.read_text(), str(path)) or {}
    except OSError as exc:
        raise SourcesConfigError(f"{path}: unreadable sources config ({exc})") from None
    except ConfigError as exc:
        raise SourcesConfigError(str(exc)) from None
    sources = data.get("sources")
    if not isinstance(sources, dict) or not sources:
        raise SourcesConfigError(f"{path}: expected a non-empty `sources:` mapping")
    specs = {}
    for name, entry in sources.items():
        specs[str(name)] = _source_spec(name, entry, path)
        source_recipe(specs[str(name)], path)  # a bad recipe is named when the config loads
    return specs


def _source_spec(name, entry, path: Path) -> SourceSpec:
    """One entry of the sources config, every field checked, a SourcesConfigError naming the first bad one."""
    where = f"{path}: sources.{name}"
    try:
        check_plain_name(name, f"{path}: source")  # its directories under raw/ and shards/ of the data root
    except ValueError as exc:
        raise SourcesConfigError(str(exc)) from None
    if not isinstance(entry, dict):
        raise SourcesConfigError(f"{where}: expected a mapping")
    unknown = set(entry) - _KEYS
    if unknown:
        raise SourcesConfigError(f"{where}: unknown key(s) {sorted(unknown)}; valid: {sorted(_KEYS)}")
    weight = entry.get("weight", 1.0)
    # a weight-0 source would be read by no training run; the blend's data_path refuses weight 0
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not 0 < weight < math.inf:
        raise SourcesConfigError(f"{where}.weight must be a number > 0, got {weight!r} "
                                 f"(to leave a source out, remove it from {path.name})")
    builtin, files = entry.get("builtin"), entry.get("files")
    if (builtin is None) == (files is None):
        raise SourcesConfigError(f"{where}: set exactly one of `builtin` or `files`")
    if builtin is not None and builtin not in BUILTIN_KINDS:
        raise SourcesConfigError(f"{where}.builtin must be one of {list(BUILTIN_KINDS)}, got {builtin!r}")
    if files is not None and (not isinstance(files, list) or not all(isinstance(f, str) for f in files)):
        raise SourcesConfigError(f"{where}.files must be a list of paths or globs")
    max_bytes = entry.get("max_bytes", 0)
    if builtin is not None and (not isinstance(max_bytes, int) or max_bytes <= 0):
        raise SourcesConfigError(f"{where}.max_bytes must be a positive int for a built-in source")
    json_keys = entry.get("json_keys", ["text"])
    if (not isinstance(json_keys, list) or not json_keys or not all(isinstance(k, str) and k for k in json_keys)
            or len(set(json_keys)) != len(json_keys)):
        raise SourcesConfigError(f"{where}.json_keys must be a list of distinct non-empty strings, got {json_keys!r}")
    on_bad_line = entry.get("on_bad_line", "error")
    if on_bad_line not in ON_BAD_LINE:
        raise SourcesConfigError(f"{where}.on_bad_line must be one of {list(ON_BAD_LINE)}, got {on_bad_line!r}")
    max_shard_tokens = entry.get("max_shard_tokens")
    if max_shard_tokens is not None and (isinstance(max_shard_tokens, bool) or not isinstance(max_shard_tokens, int)
                                         or max_shard_tokens <= 0):
        raise SourcesConfigError(f"{where}.max_shard_tokens must be a positive int, got {max_shard_tokens!r}")
    files_per_chunk = entry.get("files_per_chunk")
    if files_per_chunk is not None and (builtin is not None or isinstance(files_per_chunk, bool)
                                        or not isinstance(files_per_chunk, int) or files_per_chunk <= 0):
        raise SourcesConfigError(f"{where}.files_per_chunk must be a positive int on a `files` source, "
                                 f"got {files_per_chunk!r}")
    planted_every = entry.get("planted_every", 0)
    if builtin is None and planted_every or isinstance(planted_every, bool) or not isinstance(planted_every, int) \
            or planted_every < 0:
        raise SourcesConfigError(f"{where}.planted_every must be an int >= 0 on a built-in source, "
                                 f"got {planted_every!r}")
    return SourceSpec(name=str(name), weight=float(weight), builtin=builtin, max_bytes=max_bytes,
                      files=tuple(files or ()), json_keys=tuple(json_keys), on_bad_line=on_bad_line,
                      max_shard_tokens=max_shard_tokens, files_per_chunk=files_per_chunk,
                      cleaning=entry.get("cleaning", "none"), planted_every=planted_every)
