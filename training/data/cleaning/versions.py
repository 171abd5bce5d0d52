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


def clean_data_version(recipe_sha256: str, code_version: str, raw_sha256: list[str], output_sha256: list[str]) -> str:
    """Over the recipe, the cleaning code, the raw files read and the files written (clean_corpus's data version)."""
    return combined_hash([recipe_sha256, code_version, *raw_sha256, *output_sha256])
