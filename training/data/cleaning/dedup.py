"""Global duplicate clusters over every chunk's keys and signatures, one band (and shard of it) at a time.

Documents are numbered in chunk order (chunk keys sorted) and, inside a chunk, in raw order; the copy kept of a
cluster is its lowest number, so the choice depends only on the corpus, never on timing or workers. Two documents
are linked when their exact keys are equal, or when all ``rows`` hashes of one of the ``bands`` are equal (LSH);
clusters are the connected components of those links (DataTrove's buckets and clusters stages).

Links are found per ``LinkJob``: the exact keys or one band, and of those only the documents whose first value
falls in the job's shard (value mod shards). Equal rows have equal first values, so every group of equal rows
is whole in one shard and the links do not depend on the number of shards (DataTrove splits a bucket among
workers by hash range the same way). A job reads its column from the memory-mapped files of every chunk a block
at a time and keeps only its shard's rows: its memory is about 1/shards of a band (8 bytes x rows a document),
and the shards per band grow with the corpus (``SHARD_DOCS``), so no task holds more than a bounded share.
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


SHARD_DOCS = 2_000_000  # documents a link job sorts at most, on average: ~150 MB of a band's rows and its sort
_READ_ROWS = 1 << 20    # rows of a chunk's column read at once


@dataclass(frozen=True)
class LinkJob:
    """The exact keys (``band`` None) or MinHash band ``band``, for the documents in shard ``shard`` of ``shards``."""
    band: int | None
    shard: int = 0
    shards: int = 1


def link_jobs(stage_dirs: list[Path], bands: int, exact: bool = True, near: bool = True,
              shard_docs: int = SHARD_DOCS) -> list[LinkJob]:
    """Every job the clusters need: shards enough that each holds about ``shard_docs`` documents."""
    docs = sum(len(matrix(d / EXACT, 2)) for d in stage_dirs)
    shards = max(1, -(-docs // shard_docs))
    kinds = ([None] if exact else []) + (list(range(bands)) if near else [])
    return [LinkJob(kind, shard, shards) for kind in kinds for shard in range(shards)]


def links(stage_dirs: list[Path], job: LinkJob, rows: int, bands: int) -> tuple[np.ndarray, np.ndarray]:
    """(first member, other member) of each group of equal rows in the job's column and shard, numbered over the
    stages in order; a document without shingles is in no band's group."""
    columns, numbers, offset = [], [], 0
    for stage in stage_dirs:
        data = matrix(stage / EXACT, 2) if job.band is None else \
            matrix(stage / SIGNATURES, bands * rows)[:, job.band * rows:(job.band + 1) * rows]
        for start in range(0, len(data), _READ_ROWS):
            block = np.asarray(data[start:start + _READ_ROWS])
            mine = block[:, 0] % np.uint64(job.shards) == job.shard
            if job.band is not None:
                mine &= block[:, 0] != NO_SHINGLES
            columns.append(block[mine])
            numbers.append(offset + start + np.flatnonzero(mine))
        offset += len(data)
    if not sum(len(n) for n in numbers):
        return np.empty(0, np.int64), np.empty(0, np.int64)
    column, number = np.concatenate(columns), np.concatenate(numbers).astype(np.int64)
    keys = np.ascontiguousarray(column).view(np.dtype((np.void, column.dtype.itemsize * column.shape[1]))).ravel()
    order = np.argsort(keys, kind="stable")  # equal rows in number order: a group's first is its lowest number
    ordered = keys[order]
    starts = np.ones(len(ordered), dtype=bool)
    starts[1:] = ordered[1:] != ordered[:-1]
    members = number[order]
    group_first = members[np.maximum.accumulate(np.where(starts, np.arange(len(ordered)), 0))]
    linked = members != group_first
    return group_first[linked], members[linked]


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


def cluster(stage_dirs: list[Path], bands: int, rows: int, exact: bool = True, near: bool = True,
            shard_docs: int = SHARD_DOCS) -> Clusters:
    """The clusters of every document of the chunks whose stage directories are given, in that order."""
    jobs = link_jobs(stage_dirs, bands, exact, near, shard_docs)
    return components(stage_dirs, [links(stage_dirs, job, rows, bands) for job in jobs])


def matrix(path: Path, width: int, dtype=np.uint64) -> np.ndarray:
    """A flat binary file of ``width`` values a row, memory-mapped (read as needed, never whole)."""
    if width == 0 or path.stat().st_size == 0:
        return np.zeros((0, width), dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r").reshape(-1, width)
