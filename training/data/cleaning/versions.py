"""A cleaned chunk's content version, in a module of its own: `python -m pipelines.audit` recomputes it from a
checkpoint's lineage without importing the cleaning's numerical libraries."""
from __future__ import annotations

from training.data.hashing import combined_hash


def clean_data_version(recipe_sha256: str, code_version: str, raw_sha256: list[str], output_sha256: list[str]) -> str:
    """Over the recipe, the cleaning code, the raw files read and the files written (clean_corpus's data version)."""
    return combined_hash([recipe_sha256, code_version, *raw_sha256, *output_sha256])
