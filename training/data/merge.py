"""Merge Megatron `.bin/.idx` datasets into one, with the semantics of Megatron-LM's tools/merge_datasets.py.

The inputs are every `.bin/.idx` pair of a directory, taken in sorted order of their prefixes (a `.bin` or
`.idx` without its partner is an error); the output has the first input's dtype, which every other input
must share; sequences are appended in that order, so the `.bin` is the inputs' `.bin` files concatenated.
Kiln's chunked sources name their chunks so that this order is the order of the source's files: merging
a source's chunks gives the bytes a single `kiln preprocess` of the same files writes.

Kiln writes one sequence per document; an input whose documents span several sequences is refused
(naming it) rather than flattened.
"""
from __future__ import annotations

import fnmatch
import os
from pathlib import Path

import numpy as np

from training.data.indexed import IndexedDataset, IndexedDatasetError, IndexedDatasetWriter

# sequences handed to the writer at once: bounds the memory of a merge, whatever the inputs' sizes
_SEQUENCES_PER_WRITE = 1 << 16


def dataset_prefixes(directory: str | os.PathLike, pattern: str = "*") -> list[Path]:
    """The prefixes of every `.bin/.idx` pair under ``directory`` (its subdirectories too) whose file name
    matches ``pattern``, sorted by their path relative to it (in a flat directory, Megatron's order)."""
    root = Path(directory)
    if not root.is_dir():
        raise FileNotFoundError(f"{root}: not a directory")
    found: dict[Path, set[str]] = {}
    for path in root.rglob("*"):
        if path.suffix in (".bin", ".idx") and path.is_file() and fnmatch.fnmatch(path.stem, pattern):
            found.setdefault(path.with_suffix(""), set()).add(path.suffix)
    for prefix, suffixes in sorted(found.items()):
        if len(suffixes) == 1:
            missing = ".idx" if ".bin" in suffixes else ".bin"
            raise IndexedDatasetError(f"{prefix}{suffixes.pop()}: no {missing} next to it ({prefix}{missing})")
    if not found:
        raise IndexedDatasetError(f"{root}: no .bin/.idx pair" + ("" if pattern == "*" else f" matching {pattern!r}"))
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())


def merge_datasets(prefixes: list[str | os.PathLike], output_prefix: str | os.PathLike) -> dict:
    """Append the datasets at ``prefixes`` (in that order) into ``<output_prefix>.bin/.idx``, written under
    temporary names and renamed only when complete. Returns the output's documents, tokens and sha256s."""
    if not prefixes:
        raise ValueError("nothing to merge: no input prefix")
    output = Path(output_prefix)
    inputs = [Path(p).resolve() for p in prefixes]
    if output.resolve() in inputs:
        raise ValueError(f"{output}: the output would overwrite one of the inputs")
    datasets = [IndexedDataset(prefix) for prefix in inputs]
    for dataset in datasets:
        if dataset.dtype != datasets[0].dtype:
            raise IndexedDatasetError(f"{dataset.idx_path}: dtype {dataset.dtype}, but {datasets[0].idx_path} "
                                      f"(the first input) has {datasets[0].dtype}; every input needs the same")
        if not np.array_equal(dataset.document_indices, np.arange(len(dataset) + 1)):
            raise IndexedDatasetError(f"{dataset.idx_path}: documents of several sequences (document_indices is "
                                      f"not 0..{len(dataset)}); Kiln merges one-sequence-per-document datasets")
    with IndexedDatasetWriter(output, datasets[0].dtype) as writer:
        for dataset in datasets:
            # np.memmap refuses an empty file: a dataset of empty sequences has no tokens to map
            tokens = (np.memmap(dataset.bin_path, mode="r", dtype=dataset.dtype) if dataset.num_tokens
                      else np.empty(0, dataset.dtype))
            lengths = dataset.sequence_lengths
            start = 0
            for first in range(0, len(dataset), _SEQUENCES_PER_WRITE):
                block = lengths[first:first + _SEQUENCES_PER_WRITE]
                end = start + int(block.sum(dtype=np.int64))
                writer.add_documents(block, tokens[start:end])
                start = end
    return {"prefix": str(output), "inputs": [str(p) for p in prefixes], "docs": writer.num_documents,
            "tokens": writer.num_tokens, "dtype": str(writer.dtype), "bin_sha256": writer.bin_sha256,
            "idx_sha256": writer.idx_sha256}

