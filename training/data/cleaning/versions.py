"""A cleaned chunk's content version and where a recipe file is, in a module of its own: `python -m
pipelines.audit` recomputes the version from a checkpoint's lineage, and the code versions (assets/versions.py)
hash the recipe files, without importing the cleaning's numerical libraries."""
from __future__ import annotations

from pathlib import Path

from training.data.hashing import combined_hash

RECIPE_SUFFIXES = (".yaml", ".yml")


def recipe_file(spec, base: Path | None) -> Path | None:
    """The YAML file a source's ``cleaning:`` names (relative to ``base``, the sources config's folder), or None
    for a built-in name or an inline mapping."""
    if not isinstance(spec, str) or Path(spec).suffix.lower() not in RECIPE_SUFFIXES:
        return None
    return Path(spec) if base is None or Path(spec).is_absolute() else base / spec


def clean_data_version(output_sha256: list[str]) -> str:
    """clean_corpus's data version: over the cleaned files written, what token_shards and the tokenizer read. A
    chunk re-cleaned to the same bytes (its recipe edited without effect on it, or a dedup group peer's change
    that moved no copy of its) keeps its version, so Dagster leaves its shards fresh; the recipe and cleaning
    code that made the files are in the sidecar and the shards' lineage. Every kept record names its raw file's
    sha256, so the files change with the raw files they keep documents of."""
    return combined_hash(["clean", *output_sha256])
