"""Each asset's code version: a hash of the code and config files that decide its output, declared in one
table, ``ASSET_PARTS``, which both the asset definitions and the audit's cross-check read.

Dagster marks an asset stale when its code version differs from the one its latest materialization recorded,
so a hand-maintained "v2" is only as good as the memory of whoever edits the code. Every part is read from its
file, never from an imported object, so the definitions (``versioned_asset``) and ``python -m pipelines.audit``
(``current_code_versions``) run the same code on the same files and get the same versions, and the audit gets
them without importing Dagster or the definitions. tests/test_code_versions.py runs the data assets under a
profile and fails when one calls project code its parts leave out, so the table cannot silently fall behind.

A part is one of:

- ``"assets/data.py:name"``: the definition of the function or class ``name`` (``Class.method`` for a method)
  at the top level of that file, its decorators included (which also hold the asset's settings);
- ``"assets/data.py:<module>"``: that file's top-level statements but its function and class definitions
  (its constants and imports);
- ``"training/data/corpus.py"``: a whole file; ``"training/"``: every Python file under a package;
- ``SOURCES_CONFIG`` or ``TRAINING_CONFIG``: the config file a setting names (``sources_config``,
  ``default_training_config``);
- ``CLEANING_RECIPES``: the recipe YAML files the sources config's ``cleaning:`` entries name (an inline recipe
  is in the sources config itself), so that editing one shows ``clean_corpus`` stale.

The data assets list the functions of ``assets/`` they run and the modules of ``resources/`` and ``training/``.
``training_run`` and ``checkpoint_eval`` launch a process running ``training/``, so they list the whole package,
and of ``assets/`` what decides that process's input (the rendered config, the command); not the step's own
bookkeeping (recording checkpoints, their audits, retries), which decides what the instance records, not the
checkpoint or the evaluation.
"""
from __future__ import annotations

import ast
import functools
import hashlib
import os
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parent.parent
SOURCES_CONFIG = "$KILN_SOURCES"
TRAINING_CONFIG = "$KILN_TRAIN_CONFIG"
ABLATION_CONFIG = "$KILN_ABLATION_SPEC"
CLEANING_RECIPES = "$KILN_SOURCES:cleaning"
TOP_LEVEL = "<module>"  # as Python names a module's own code


def sources_config() -> Path:
    """The sources config the data assets read: ``KILN_SOURCES``, else the project's."""
    return Path(os.environ.get("KILN_SOURCES", PROJECT_ROOT / "configs" / "sources.yaml"))


def default_training_config() -> str:
    """The training YAML a run renders unless its config names another (relative to the project)."""
    return os.environ.get("KILN_TRAIN_CONFIG", "configs/qwen3_tiny.yaml")


_SETTING_FILES = {SOURCES_CONFIG: sources_config, TRAINING_CONFIG: lambda: PROJECT_ROOT / default_training_config(),
                  ABLATION_CONFIG: lambda: Path(os.environ.get("KILN_ABLATION_SPEC",
                                                               PROJECT_ROOT / "configs" / "ablation.yaml"))}

_DATA_COMMON = ("assets/chunks.py", "assets/sources.py", "resources/storage.py", "training/atomic.py",
                "training/data/hashing.py", "training/data/cleaning/recipe.py", "training/data/cleaning/filters.py",
                "training/data/cleaning/minhash.py", "training/config.py:check_plain_name",
                "training/config.py:parse_yaml", "training/config.py:_yaml_problems", "training/config.py:_join",
                SOURCES_CONFIG)
ASSET_PARTS: dict[str, tuple[str, ...]] = {
    "raw_corpus": (
        "assets/data.py:raw_corpus", "assets/data.py:<module>", "assets/data.py:_ingest_chunk",
        "assets/data.py:_source_spec", "assets/data.py:_part_files", "assets/data.py:per_source",
        "assets/data.py:figures", "assets/data.py:combined_result", "assets/data.py:files_table",
        "assets/data.py:failing_as", "assets/builtin_corpus.py", "training/data/corpus.py", *_DATA_COMMON),
    "clean_corpus": (
        "assets/cleaning.py", "assets/data.py:<module>", "assets/data.py:_source_spec", "assets/data.py:raw_files",
        "assets/data.py:_part_files", "assets/data.py:raw_file_hashes", "assets/data.py:clean_dir",
        "assets/data.py:clean_sidecar", "assets/data.py:combined_result", "assets/data.py:figures",
        "assets/data.py:failing_as", "training/data/cleaning/", "training/data/corpus.py", CLEANING_RECIPES,
        *_DATA_COMMON),
    "tokenizer": (
        "assets/data.py:tokenizer", "assets/data.py:<module>", "assets/data.py:raw_files",
        "assets/data.py:_part_files", "assets/data.py:chunk_inputs", "assets/data.py:clean_dir",
        "assets/data.py:clean_sidecar", "assets/data.py:_source_spec", "assets/data.py:failing_as",
        "assets/data.py:_train_tokenizer", "resources/tokenizer.py",
        "training/data/corpus.py", *_DATA_COMMON),
    "token_shards": (
        "assets/data.py:token_shards", "assets/data.py:<module>", "assets/data.py:ChunkStepConfig",
        "assets/data.py:ChunkStep", "assets/data.py:chunks_of_run", "assets/data.py:chunk_steps",
        "assets/data.py:tokenize_chunks", "assets/data.py:_tokenize_chunk", "assets/data.py:shards_of_run",
        "assets/data.py:_source_spec", "assets/data.py:raw_files", "assets/data.py:_part_files",
        "assets/data.py:raw_file_hashes", "assets/data.py:shard_dir", "assets/data.py:shards_hash",
        "assets/data.py:_histogram_table", "assets/data.py:files_table", "assets/data.py:figures",
        "assets/data.py:combined_result", "assets/data.py:chunk_inputs", "assets/data.py:clean_dir",
        "assets/data.py:clean_sidecar", "assets/data.py:clean_file_records", "assets/data.py:failing_as",
        "training/data/corpus.py", "training/data/encoding.py",
        "training/data/indexed.py", "training/data/preprocess.py", *_DATA_COMMON),
    "blend_manifest": (
        "assets/data.py:blend_manifest", "assets/data.py:<module>", "assets/data.py:BlendConfig",
        "assets/data.py:read_shard_sidecar", "assets/data.py:source_shards", "assets/data.py:shard_dir",
        "assets/data.py:shards_hash", "assets/data.py:_blend_summary", "assets/data.py:failing_as",
        "assets/data.py:_blend", "training/data/manifest.py",
        *_DATA_COMMON),
    "training_run": (
        "assets/training.py:training_run", "assets/training.py:<module>", "assets/training.py:TrainingRunConfig",
        # its three parts: prepare (render, check, lineage, mesh), launch, record the result
        "assets/training.py:prepare_run", "assets/training.py:PreparedRun",
        "assets/training.py:checked_training_config", "assets/training.py:launch_run",
        "assets/training.py:LaunchedRun", "assets/training.py:run_result", "assets/training.py:records_metadata",
        "assets/training.py:attempt_config", "assets/training.py:render_training_config",
        "assets/training.py:_init_checkpoint", "resources/storage.py", "training/", TRAINING_CONFIG),
    "checkpoint_eval": (
        "assets/evaluation.py:checkpoint_eval", "assets/evaluation.py:<module>",
        "assets/evaluation.py:CheckpointEvalConfig", "assets/evaluation.py:eval_command",
        "assets/evaluation.py:scores_tasks",
        "assets/evaluation.py:eval_metadata", "assets/evaluation.py:_unevaluated_table",
        "assets/evaluation.py:_bpb_metadata", "assets/evaluation.py:task_metadata", "assets/evaluation.py:_score",
        "assets/evaluation.py:run_leased",
        "assets/training.py:checkpoint_dir", "resources/storage.py", "training/"),
    "ablation_run": (
        "assets/ablation.py:ablation_run", "assets/ablation.py:<module>", "assets/ablation.py:_result_path",
        "assets/ablation.py:_seed_table", "assets/evaluation.py:run_leased",
        "resources/storage.py", "training/", ABLATION_CONFIG),
    "ablation_ranking": (
        "assets/ablation.py:ablation_ranking", "assets/ablation.py:<module>", "assets/ablation.py:_result_path",
        "resources/storage.py", "training/ablation.py", ABLATION_CONFIG),
    "run_comparison": (
        "assets/evaluation.py:run_comparison", "assets/evaluation.py:<module>",
        "assets/evaluation.py:RunComparisonConfig", "assets/evaluation.py:_colors", "resources/storage.py",
        "training/compare.py", "training/reporting.py", "training/atomic.py"),
}


class CodePartError(ValueError):
    """A part of ASSET_PARTS names no file, or no definition in its file."""


@functools.lru_cache(maxsize=16)
def _definitions(source: str) -> dict[str, list[tuple[int, int]]]:
    """Each top-level function's or class's name (and ``Class.method``'s) -> the (first, last) line of every
    definition so named, decorators included; ``<module>`` -> the lines of every other top-level statement.
    Cached: a module holds many parts."""
    spans: dict[str, list[tuple[int, int]]] = {TOP_LEVEL: []}

    def add(name: str, node) -> None:
        first = node.decorator_list[0].lineno if node.decorator_list else node.lineno
        spans.setdefault(name, []).append((first, node.end_lineno))

    for node in ast.parse(source).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            add(node.name, node)
            for member in node.body if isinstance(node, ast.ClassDef) else ():
                if isinstance(member, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    add(f"{node.name}.{member.name}", member)
        else:
            spans[TOP_LEVEL].append((node.lineno, node.end_lineno))
    return spans


def recipe_files_source() -> bytes:
    """Each recipe file the sources config names, by name and content (a missing one as such: loading the sources
    names it). A config that does not parse names none here; the data assets refuse it with its error."""
    import yaml

    from training.data.cleaning.versions import recipe_file

    config = sources_config()
    try:
        sources = (yaml.safe_load(config.read_text()) or {}).get("sources")
    except (OSError, yaml.YAMLError, AttributeError):
        return b""
    out = []
    for name, entry in sorted(sources.items(), key=lambda item: str(item[0])) if isinstance(sources, dict) else ():
        path = recipe_file(entry.get("cleaning"), config.parent) if isinstance(entry, dict) else None
        if path is not None:
            content = path.read_bytes() if path.is_file() else b"missing"
            out.append(f"{name}:{entry['cleaning']}".encode() + b"\0" + content)
    return b"\0".join(out)


def part_source(part: str) -> bytes:
    """The text ``part`` stands for (module docstring)."""
    if part == CLEANING_RECIPES:
        return recipe_files_source()
    if part in _SETTING_FILES:
        path = Path(_SETTING_FILES[part]())
        if not path.is_file():
            raise CodePartError(f"{path} (named by {part[1:]} or its default) is not a file")
        return path.read_bytes()
    relative, _, name = part.partition(":")
    path = PROJECT_ROOT / relative
    if relative.endswith("/"):  # a package: every Python file in it, in a stable order
        if not path.is_dir():
            raise CodePartError(f"{path} is not a directory")
        return b"".join(p.relative_to(path).as_posix().encode() + p.read_bytes() for p in sorted(path.rglob("*.py")))
    if not path.is_file():
        raise CodePartError(f"{path} is not a file")
    if not name:
        return path.read_bytes()
    text = path.read_text()
    try:
        spans = _definitions(text).get(name, [])
    except SyntaxError as exc:
        raise CodePartError(f"{path}, line {exc.lineno}: {exc.msg}") from None
    if name != TOP_LEVEL and len(spans) != 1:
        raise CodePartError(f"{path} defines {len(spans)} top-level functions or classes {name!r}, not one")
    lines = text.split("\n")
    return "\n".join("\n".join(lines[first - 1:last]) for first, last in spans).encode()


def code_version(asset: str) -> str:
    """sha256 (16 hex digits) over the parts ``ASSET_PARTS`` declares for ``asset``."""
    if asset not in ASSET_PARTS:
        raise CodePartError(f"asset {asset!r} has no entry in ASSET_PARTS (assets/versions.py): list its parts there")
    digest = hashlib.sha256()
    for part in ASSET_PARTS[asset]:
        try:
            digest.update(part_source(part))
        except CodePartError as exc:
            raise CodePartError(f"{asset}'s code version (assets/versions.py, ASSET_PARTS[{asset!r}], "
                                f"{part!r}): {exc}") from None
        digest.update(b"\0")
    return digest.hexdigest()[:16]


def current_code_versions() -> dict[str, str]:
    """Each asset's code version as the definitions give it now; a checkpoint carries training_run's."""
    versions = {asset: code_version(asset) for asset in ASSET_PARTS}
    return {**versions, "checkpoint": versions["training_run"]}


def versioned_asset(**asset_kwargs):
    """``@dg.asset(**asset_kwargs)`` whose code version is ``code_version`` of the function's name."""
    import dagster as dg  # here: the audit reads the versions through this module without importing Dagster

    def decorate(fn):
        return dg.asset(code_version=code_version(fn.__name__), **asset_kwargs)(fn)
    return decorate
