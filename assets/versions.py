"""Code versions derived from the code and config that determine an asset's output.

Dagster marks an asset stale when its code version differs from the one its latest materialization
recorded, so a hand-maintained "v2" is only as good as the memory of whoever edits the code. Here the
version is a hash of the functions' source, the modules' files and the config files the asset reads.

The audit's cross-check prints the version each asset has now, without importing Dagster (0.5-0.8 s) and the
definitions when it can. Three ways, fastest first (``current_code_versions``):

1. ``.kiln/code_versions.json`` holds the versions while no file the definitions may read changed
   (``code_fingerprint``).
2. Else from the *recipe* kept there: each asset's parts (a function as its file and qualified name, a
   module as its file, a path), recorded by ``code_version_of`` as the definitions were built; the parts'
   sources are read from the files exactly as ``inspect.getsource`` gives them. The recipe is what the code
   run at import time chose, so it holds while what that code is and reads is unchanged: every project
   module imported then (none shadowed since by a package or an extension module of its name), compared
   without the bodies of the functions that did not run then (a profile of the import says which did); the
   files it opened and the directories it listed, but for the parts' sources; the ``KILN_*`` settings and
   the Python version.
3. Else the definitions are imported, in a fresh process so that the profile sees every import, and the
   versions and a new recipe written to the cache.
"""
from __future__ import annotations

import ast
import functools
import hashlib
import inspect
import json
import linecache
import os
import re
import subprocess
import sys
import time
from importlib.machinery import EXTENSION_SUFFIXES, all_suffixes
from pathlib import Path
from types import FunctionType, ModuleType

PROJECT_ROOT = Path(__file__).resolve().parent.parent
CODE_DIRS = ("assets", "pipelines", "resources", "training", "configs")  # all that code_version_of hashes
CONFIG_SETTINGS = ("KILN_SOURCES", "KILN_TRAIN_CONFIG")  # environment settings naming hashed config files
CODE_VERSIONS_CACHE = PROJECT_ROOT / ".kiln" / "code_versions.json"

# a version -> its parts as files (recipe_part), for every version computed in this process; None: not known
_recipes: dict[str, list[list[str]] | None] = {}


def _source_bytes(part) -> bytes:
    if isinstance(part, (FunctionType, ModuleType)):
        return inspect.getsource(part).encode()
    if isinstance(part, (str, Path)):
        path = Path(part)
        if path.is_dir():  # a package: every Python file in it, in a stable order
            return b"".join(p.relative_to(path).as_posix().encode() + p.read_bytes()
                            for p in sorted(path.rglob("*.py")))
        return path.read_bytes() if path.is_file() else f"missing:{path}".encode()
    raise TypeError(f"code_version_of: expected a function, module or path, got {type(part).__name__}")


def recipe_part(part) -> list[str] | None:
    """Where ``part``'s source is, for reading it without an import; None where no file says (a lambda, a
    function defined in another function)."""
    if isinstance(part, FunctionType):
        function = inspect.unwrap(part)  # as inspect.getsource reads it
        if "<" in function.__qualname__:
            return None
        return ["function", inspect.getsourcefile(function), function.__qualname__]
    if isinstance(part, ModuleType):
        return ["module", inspect.getsourcefile(part)]
    return ["path", os.path.abspath(part)]  # as the definitions' process, whose directory is the project's


def code_version_of(*parts) -> str:
    """sha256 (16 hex digits) over ``parts``: functions, modules, files or package directories."""
    digest = hashlib.sha256()
    for part in parts:
        digest.update(_source_bytes(part))
        digest.update(b"\0")
    version = digest.hexdigest()[:16]
    recipe = [recipe_part(part) for part in parts]
    # two lists of parts with the same sources now (a module and its file) may differ after a change
    ambiguous = _recipes.get(version, recipe) != recipe
    _recipes[version] = None if None in recipe or ambiguous else recipe
    return version


def versioned_asset(*parts, **asset_kwargs):
    """``@dg.asset(**asset_kwargs)`` whose code version hashes the function (decorator included) and ``parts``."""
    import dagster as dg  # here: the audit reads versions through this module without importing Dagster

    def decorate(fn):
        return dg.asset(code_version=code_version_of(fn, *parts), **asset_kwargs)(fn)
    return decorate


# --- reading a recipe's sources from the files ----------------------------------------------------------------

def _functions(node, prefix: str = ""):
    """(qualified name, node) of every function defined in ``node``, named as ``__qualname__`` names it."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
            name = prefix + child.name
            yield name, child
            yield from _functions(child, name + ".<locals>.")
        elif isinstance(child, ast.ClassDef):
            yield from _functions(child, prefix + child.name + ".")
        elif isinstance(child, (ast.stmt, ast.excepthandler, ast.match_case)):  # an expression defines none
            yield from _functions(child, prefix)


_DEFINITION_LINE = re.compile(r"^(\s*def\s)|(\s*async\s+def\s)|(.*(?<!\w)lambda(:|\s))|^(\s*@)")  # inspect's


def _lines(path: str) -> list[str]:
    linecache.checkcache(path)  # as inspect does: a file changed since it was cached is read again
    return linecache.getlines(path)


@functools.lru_cache(maxsize=64)
def _first_lines(source: str) -> dict[str, list[int]]:
    """Each function's qualified name -> the first line of its code object (its first decorator's, else the
    def's), of every function so named in ``source``. Cached: a module holds many parts."""
    first_lines: dict[str, list[int]] = {}
    for name, node in _functions(ast.parse(source)):
        first_lines.setdefault(name, []).append(node.decorator_list[0].lineno if node.decorator_list else node.lineno)
    return first_lines


def function_source(path: str, qualname: str) -> str | None:
    """``inspect.getsource`` of the function ``qualname`` defined in ``path``, without importing it: from the
    code object's first line back to a line that starts a definition as inspect goes, through the block
    inspect's tokenizer ends. None when the file defines no such function or several."""
    lines = _lines(path)
    try:
        starts = _first_lines("".join(lines)).get(qualname, [])
    except (SyntaxError, ValueError):
        return None
    if len(starts) != 1 or starts[0] > len(lines):
        return None
    start = starts[0] - 1
    while start > 0 and not _DEFINITION_LINE.match(lines[start]):
        start -= 1
    return "".join(inspect.getblock(lines[start:]))


def _part_bytes(part: list[str]) -> bytes | None:
    kind, path = part[0], part[1]
    if kind == "function":
        source = function_source(path, part[2])
        return None if source is None else source.encode()
    if kind == "module":
        lines = _lines(path)
        return "".join(lines).encode() if lines else None
    return _source_bytes(path)


def version_from_recipe(parts: list[list[str]]) -> str | None:
    """code_version_of(*parts) from the files alone; None when a function or module is not found."""
    digest = hashlib.sha256()
    for part in parts:
        source = _part_bytes(part)
        if source is None:
            return None
        digest.update(source)
        digest.update(b"\0")
    return digest.hexdigest()[:16]


# --- when a recipe holds -------------------------------------------------------------------------------------

def skeleton_digest(source: str, ran: set[str] | None) -> str:
    """A module's code as its import runs it: its syntax tree without positions and without the bodies of
    the functions not in ``ran`` (qualified names; None: every body kept)."""
    tree = ast.parse(source)
    for name, node in _functions(tree):
        if ran is not None and name not in ran:
            node.body = []
    return hashlib.sha256(ast.dump(tree).encode()).hexdigest()


def _stat(path: str) -> list[int] | None:
    try:
        stat = os.stat(path)
    except OSError:
        return None
    return [stat.st_size, stat.st_mtime_ns]


def _listing_digest(directory: str) -> str | None:
    try:
        names = sorted(os.listdir(directory))
    except OSError:
        return None
    return hashlib.sha256("\0".join(names).encode()).hexdigest()


def _file_digest(path: str) -> str | None:
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError:
        return None


def settings_digest() -> str:
    """What else the definitions' import may read: Kiln's environment settings (hashed: some are passwords),
    and the Python running it."""
    settings = {"python": sys.version, **{k: v for k, v in os.environ.items() if k.startswith("KILN_")}}
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()


def _shadowed(path: str) -> bool:
    """Whether the import system would now find another module than the file ``path``: an extension module
    of its name, or a package of its name next to it (both are looked for first)."""
    directory, name = os.path.split(path)
    stem = name.removesuffix(".py")
    if any(os.path.isfile(os.path.join(directory, stem + suffix)) for suffix in EXTENSION_SUFFIXES):
        return True
    return stem != "__init__" and any(os.path.isfile(os.path.join(directory, stem, "__init__" + suffix))
                                      for suffix in all_suffixes())


def recipe_holds(recipe: dict) -> bool:
    """Whether the code run at import time is what it was when ``recipe`` was recorded. Updates the stats
    kept for the files found unchanged, so that the next check does not read them again."""
    if recipe.get("settings") != settings_digest():
        return False
    for path, module in recipe["modules"].items():
        stat = _stat(path)
        if stat is None or _shadowed(path):
            return False
        if stat != module["stat"]:
            try:
                ran = None if module["ran"] is None else set(module["ran"])
                if skeleton_digest("".join(_lines(path)), ran) != module["skeleton"]:
                    return False
            except (SyntaxError, ValueError):
                return False
            module["stat"] = stat
    for path, opened in recipe["opened"].items():
        stat = _stat(path)
        if stat != opened["stat"]:
            if _file_digest(path) != opened["sha256"]:
                return False
            opened["stat"] = stat
    return all(_listing_digest(d) == digest for d, digest in recipe["listed"].items())


def versions_from_recipe(recipe: dict | None) -> dict[str, str] | None:
    """Every asset's code version from the files, or None when the recipe may not hold any more."""
    if not recipe or not recipe_holds(recipe):
        return None
    versions = {}
    for key, parts in recipe["assets"].items():
        version = version_from_recipe(parts)
        if version is None:
            return None
        versions[key] = version
    return versions


# --- the versions the definitions give, and the recipe, recorded by importing them --------------------------

def code_versions_from_definitions() -> dict[str, str]:
    """Each asset's code version as the code here defines it; a checkpoint carries training_run's."""
    import dagster as dg

    from pipelines.definitions import ALL_ASSETS

    versions = {key.to_user_string(): version for asset in ALL_ASSETS if isinstance(asset, dg.AssetsDefinition)
                for key, version in asset.code_versions_by_key.items() if version}
    return {**versions, "checkpoint": versions["training_run"]}


def _read_by_import_time_code(caller) -> bool:
    """Whether a file or directory read by the frame ``caller`` is one the code run at import time read: not
    the import system looking for modules (recipe_holds checks that none is shadowed), nor code_version_of
    reading a part's source (the recipe reads it again)."""
    if caller.f_code.co_filename.startswith("<frozen importlib"):
        return False
    frame = caller
    while frame is not None:
        if frame.f_code is _source_bytes.__code__:
            return False
        frame = frame.f_back
    return True


def _in_project(path: str) -> bool:
    return path.startswith(f"{PROJECT_ROOT}{os.sep}") and not path.startswith(f"{PROJECT_ROOT / '.venv'}{os.sep}")


def record_recipe(asked_at: int) -> tuple[dict[str, str], dict | None]:
    """The definitions imported in this process: (their code versions, the recipe; None when a file it read
    changed after ``asked_at``, time.time_ns() when the recording was asked for: the import may have read it
    before). Meant for a fresh process (``record_in_subprocess``): a module imported before this keeps every
    function body in its skeleton, as no profile saw its import."""
    import cProfile

    import dagster  # noqa: F401 -- imported outside the profile: it is not the project's code

    imported_before = set(sys.modules)
    opened, listed = set(), set()
    named = {os.path.abspath(PROJECT_ROOT / os.environ[name]) for name in CONFIG_SETTINGS if os.environ.get(name)}
    profiling = True

    def note(event: str, args: tuple) -> None:  # audit hooks cannot be removed: this one stops noting
        if (profiling and event in ("open", "os.listdir", "os.scandir") and isinstance(args[0], str)
                and _read_by_import_time_code(sys._getframe(1))):
            path = os.path.abspath(args[0])
            if event == "open" and (_in_project(path) or path in named):
                opened.add(path)
            elif _in_project(path):
                listed.add(path)

    sys.addaudithook(note)
    profile = cProfile.Profile()
    profile.enable()
    try:
        versions = code_versions_from_definitions()
    finally:
        profile.disable()
        profiling = False
    ran: dict[str, set[str]] = {}
    for entry in profile.getstats():
        if not isinstance(entry.code, str):
            ran.setdefault(entry.code.co_filename, set()).add(entry.code.co_qualname)
    modules = {}
    for name, module in list(sys.modules.items()):
        path = getattr(module, "__file__", None)
        if path and _in_project(path) and path.endswith(".py"):
            keep = None if name in imported_before else ran.get(path, set())
            modules[path] = {"stat": _stat(path), "ran": None if keep is None else sorted(keep),
                             "skeleton": skeleton_digest("".join(_lines(path)), keep)}
    assets = {key: _recipes.get(version) for key, version in versions.items()}
    if None in assets.values():
        return versions, None  # a part no file names: every change imports the definitions
    recipe = {"settings": settings_digest(), "assets": assets, "modules": modules,
              # a file missing then is recorded too: one that appears may change what the import does
              "opened": {p: {"stat": _stat(p), "sha256": _file_digest(p)} for p in sorted(opened)
                         if not p.endswith((".py", ".pyc"))},
              "listed": {d: _listing_digest(d) for d in sorted(listed)}}
    # a file changed after the import read it would be recorded as it is now, not as it ran: none is kept
    # (a second's margin: file times run behind the clock)
    if any(entry["stat"] and entry["stat"][1] > asked_at - 10**9
           for entry in [*modules.values(), *recipe["opened"].values()]):
        return versions, None
    return versions, recipe


def code_fingerprint(root: Path = PROJECT_ROOT) -> str:
    """What the code versions are computed from: every file under CODE_DIRS (path, size, mtime), the
    settings and the config files they name. A file edited, added or removed changes it."""
    digest = hashlib.sha256(settings_digest().encode())
    paths = [p for d in CODE_DIRS for p in (root / d).rglob("*") if "__pycache__" not in p.parts and p.is_file()]
    paths += [root / os.environ[name] for name in CONFIG_SETTINGS if os.environ.get(name)]  # absolute: itself
    for path in sorted(paths):
        try:
            stat = path.stat()
            digest.update(f"{path}\0{stat.st_size}\0{stat.st_mtime_ns}\0".encode())
        except OSError:
            digest.update(f"{path}\0missing\0".encode())
    return digest.hexdigest()


def _write_cache(cache: Path, fingerprint: str, versions: dict[str, str], recipe: dict | None) -> None:
    from training.atomic import write_json_atomic  # here: imported before record_recipe, it would keep every body

    try:
        write_json_atomic(cache, {"fingerprint": fingerprint, "versions": versions, "recipe": recipe})
    except OSError:
        pass  # a read-only checkout: every cross-check computes them again


class RecordingFailed(RuntimeError):
    """Importing the definitions in a process of their own failed."""


def record_in_subprocess(cache: Path, root: Path = PROJECT_ROOT) -> dict[str, str]:
    """The definitions under ``root`` imported in a fresh process, which writes ``cache``: the versions."""
    from assets.sources import SourcesConfigError

    # -c, not -m assets.versions: run as __main__ the module would be a second copy of the one imported
    done = subprocess.run([sys.executable, "-c", "import sys, assets.versions as v; v.main(*sys.argv[1:])",
                           str(cache), str(time.time_ns())], cwd=root, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(
                              [str(root), *filter(None, [os.environ.get("PYTHONPATH")])])})
    try:
        answer = json.loads(done.stdout.splitlines()[-1])
    except (IndexError, ValueError):
        raise RecordingFailed(f"importing the definitions under {root} failed (exit {done.returncode}):\n"
                              f"{done.stderr[-3000:]}") from None
    if "sources_config_error" in answer:
        raise SourcesConfigError(answer["sources_config_error"])
    return answer["versions"]


def main(cache: str, asked_at: str) -> None:
    """In record_in_subprocess's process: the versions and recipe into ``cache``, the versions (or the
    sources config's error) as the last line of stdout."""
    fingerprint = code_fingerprint()  # before the import reads the files it covers
    try:
        versions, recipe = record_recipe(int(asked_at))
    except Exception as exc:
        from assets.sources import SourcesConfigError  # after the import: record_recipe must see it

        if not isinstance(exc, SourcesConfigError):
            raise
        print(json.dumps({"sources_config_error": str(exc)}))
        return
    _write_cache(Path(cache), fingerprint, versions, recipe)
    print(json.dumps({"versions": versions}))


def current_code_versions(cache: Path | None = None) -> dict[str, str]:
    """Each asset's code version as the definitions give it now: cached while nothing they read changed,
    else from the recipe's files, else by importing them (module docstring)."""
    cache = cache or CODE_VERSIONS_CACHE
    fingerprint = code_fingerprint()
    try:
        cached = json.loads(cache.read_text())
        if cached["fingerprint"] == fingerprint:
            return cached["versions"]
        recipe = cached.get("recipe")
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        recipe = None  # no cache yet, or an unreadable one
    try:
        versions = versions_from_recipe(recipe)
    except (KeyError, TypeError, AttributeError):
        versions = None  # a recipe of another shape
    if versions is None:
        return record_in_subprocess(cache)
    _write_cache(cache, fingerprint, versions, recipe)
    return versions
