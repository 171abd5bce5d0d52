"""Global duplicate clusters over every chunk's keys and signatures, one band at a time.

Documents are numbered in chunk order (chunk keys sorted) and, inside a chunk, in raw order; the copy kept of a
cluster is its lowest number, so the choice depends only on the corpus, never on timing or workers. Two documents
are linked when their exact keys are equal, or when all ``rows`` hashes of one of the ``bands`` are equal (LSH);
clusters are the connected components of those links (DataTrove's buckets and clusters stages). A band is read
from the memory-mapped signature files of every chunk and dropped before the next: memory is a band's column
(16 bytes a document per hash) and the links, not the signatures (8 bytes x bands x rows a document).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from scipy.sparse import coo_matrix
from scipy.sparse.csgraph import connected_components

from training.data.cleaning.minhash import NO_SHINGLES

SIGNATURES = "signatures.bin"  # (docs, bands * rows) uint64 per chunk stage, flat
EXACT = "exact.bin"            # (docs, 2) uint64, flat


@dataclass
class Clusters:
    """For each document (global number): the kept copy of its cluster, the cluster's size and whether its link
    to the kept copy is an exact duplicate."""
    kept: np.ndarray       # int64: its own number when it is kept
    size: np.ndarray       # int64
    exact: np.ndarray      # bool: same exact key as the kept copy


def _group_links(keys: np.ndarray, valid: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(first member, other member) of each group of equal rows of ``keys`` (rows as bytes)."""
    rows = np.ascontiguousarray(keys).view(np.dtype((np.void, keys.dtype.itemsize * keys.shape[1]))).ravel()
    index = np.arange(len(rows)) if valid is None else np.flatnonzero(valid)
    rows = rows[index]
    order = np.argsort(rows, kind="stable")
    ordered = rows[order]
    starts = np.ones(len(ordered), dtype=bool)
    starts[1:] = ordered[1:] != ordered[:-1]
    group_first = index[order][np.maximum.accumulate(np.where(starts, np.arange(len(ordered)), 0))]
    members = index[order]
    linked = members != group_first
    return group_first[linked], members[linked]


def exact_links(stage_dirs: list[Path]) -> tuple[np.ndarray, np.ndarray]:
    """Links between documents with equal exact keys, numbered over the stages in order."""
    keys = [matrix(d / EXACT, 2) for d in stage_dirs]
    if not sum(len(k) for k in keys):
        return np.empty(0, np.int64), np.empty(0, np.int64)
    return _group_links(np.concatenate([np.asarray(k) for k in keys]))


def band_links(stage_dirs: list[Path], band: int, rows: int, bands: int) -> tuple[np.ndarray, np.ndarray]:
    """Links between documents whose ``band``-th ``rows`` hashes are all equal: one band of every chunk's
    signatures in memory, read from the memory-mapped files (a worker of its own per band on a cluster)."""
    signatures = [matrix(d / SIGNATURES, bands * rows) for d in stage_dirs]
    if not sum(len(s) for s in signatures):
        return np.empty(0, np.int64), np.empty(0, np.int64)
    column = np.concatenate([np.asarray(s[:, band * rows:(band + 1) * rows]) for s in signatures])
    return _group_links(column, column[:, 0] != NO_SHINGLES)


def components(stage_dirs: list[Path], links: list[tuple[np.ndarray, np.ndarray]]) -> Clusters:
    """The clusters the links make: connected components, each kept as its lowest-numbered document."""
    exact_all = [np.asarray(matrix(d / EXACT, 2)) for d in stage_dirs]
    exact_all = np.concatenate(exact_all) if exact_all else np.zeros((0, 2), np.uint64)
    total = len(exact_all)
    if not total:
        empty = np.zeros(0, np.int64)
        return Clusters(kept=empty, size=empty, exact=np.zeros(0, bool))
    src = np.concatenate([np.empty(0, np.int64), *(a for a, _ in links)])
    dst = np.concatenate([np.empty(0, np.int64), *(b for _, b in links)])
    graph = coo_matrix((np.ones(len(src), dtype=np.int8), (src, dst)), shape=(total, total))
    _, labels = connected_components(graph, directed=False)
    first = np.full(labels.max() + 1, total, dtype=np.int64)
    np.minimum.at(first, labels, np.arange(total))
    kept = first[labels]
    size = np.bincount(labels)[labels].astype(np.int64)
    return Clusters(kept=kept, size=size, exact=(exact_all == exact_all[kept]).all(axis=1))


def cluster(stage_dirs: list[Path], bands: int, rows: int, exact: bool = True, near: bool = True) -> Clusters:
    """The clusters of every document of the chunks whose stage directories are given, in that order."""
    links = [exact_links(stage_dirs)] if exact else []
    if near:
        links += [band_links(stage_dirs, band, rows, bands) for band in range(bands)]
    return components(stage_dirs, links)


def matrix(path: Path, width: int, dtype=np.uint64) -> np.ndarray:
    """A flat binary file of ``width`` values a row, memory-mapped (read as needed, never whole)."""
    if width == 0 or path.stat().st_size == 0:
        return np.zeros((0, width), dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r").reshape(-1, width)
