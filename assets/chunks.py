"""Chunks: the file groups a source is ingested and tokenized in, one `source_chunks` partition each.

A source without ``files_per_chunk`` is one chunk, keyed by the source's name (the demo's built-in sources,
a source of one file). With ``files_per_chunk: N`` its files are grouped into chunks of N, keyed
``<source>/<NNNNN>``. The grouping is kept in ``<data root>/.kiln/chunks/<source>.json`` and never reshuffled:
a file stays in the chunk it was first put in, a new file joins the last chunk while it has room and opens
a new chunk after that, a deleted file leaves its chunk. So a changed file re-ingests and re-shards its
own chunk only, and every chunk's shards stay valid while others are added.

Partition keys are instance state (a dynamic partitions definition): ``register_source_chunks`` adds the
keys of every configured source; ``raw_files_sensor`` does it as files appear, and the demo, `make ui` and
the tests call it before they materialize.
"""
from __future__ import annotations

import json
from pathlib import Path

import dagster as dg

from assets.sources import SourceSpec, load_sources
from resources.storage import KilnStorage
from training.atomic import write_json_atomic

source_chunks = dg.DynamicPartitionsDefinition(name="source_chunks")
CHUNK_SEPARATOR = "/"


class ChunkError(ValueError):
    pass


def chunk_key(source: str, chunk: int) -> str:
    return f"{source}{CHUNK_SEPARATOR}{chunk:05d}"


def source_of(key: str) -> str:
    """The source a partition key belongs to (``web/00003`` → ``web``; an unchunked source's key is its name)."""
    return key.split(CHUNK_SEPARATOR, 1)[0]


def key_stem(key: str) -> str:
    """A file-name stem for a chunk: ``web/00003`` → ``web_00003``; an unchunked source's name as it is."""
    return key.replace(CHUNK_SEPARATOR, "_")


def assignment_path(storage: KilnStorage, source: str) -> Path:
    return storage.root / ".kiln" / "chunks" / f"{source}.json"


def _read_assignment(path: Path) -> list[list[str]]:
    if not path.is_file():
        return []
    try:
        return json.loads(path.read_text())["chunks"]
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise ChunkError(f"{path}: unreadable chunk assignment ({exc}); it records which file is in which "
                         f"chunk: restore it, or delete it to regroup the source from scratch") from None


def assign_chunks(storage: KilnStorage, spec: SourceSpec) -> list[list[str]]:
    """The source's files grouped into chunks (each a list of paths, in the source's file order), after adding
    the files that appeared since the last call and dropping those that went; saved when it changed."""
    if spec.files_per_chunk is None:
        raise ChunkError(f"source {spec.name!r} has no files_per_chunk: it is one chunk, {spec.name!r}")
    path = assignment_path(storage, spec.name)
    previous = _read_assignment(path)
    files = [str(p) for p in spec.input_files()]
    present, assigned = set(files), {f for chunk in previous for f in chunk}
    chunks = [[f for f in chunk if f in present] for chunk in previous]
    for new in (f for f in files if f not in assigned):
        if not chunks or len(chunks[-1]) >= spec.files_per_chunk:
            chunks.append([])
        chunks[-1].append(new)
    if chunks != previous:
        write_json_atomic(path, {"source": spec.name, "chunks": chunks})
    return chunks


def source_chunk_keys(storage: KilnStorage, spec: SourceSpec) -> list[str]:
    """The source's chunks as last assigned (files that appeared since are not in any chunk yet)."""
    if spec.files_per_chunk is None:
        return [spec.name]
    return [chunk_key(spec.name, i) for i in range(len(_read_assignment(assignment_path(storage, spec.name))))]


def chunk_files(storage: KilnStorage, spec: SourceSpec, key: str) -> list[Path]:
    """The user's files of the chunk ``key`` (a file source); every file of an unchunked source."""
    if spec.files_per_chunk is None:
        return spec.input_files()
    chunks = _read_assignment(assignment_path(storage, spec.name))
    index = int(key.rsplit(CHUNK_SEPARATOR, 1)[1])
    if index >= len(chunks):
        raise ChunkError(f"chunk {key!r} is not in {assignment_path(storage, spec.name)} "
                         f"({len(chunks)} chunk(s)); let raw_files_sensor register the source's files first")
    if not chunks[index]:
        raise ChunkError(f"chunk {key!r} has no files left (all of them were deleted from {list(spec.files)})")
    return [Path(f) for f in chunks[index]]


def assign_source_chunks(storage: KilnStorage, spec: SourceSpec) -> dict[str, list[Path]]:
    """chunk key → its files (none for a built-in source), after assigning the files that appeared since the
    last call; the assignment is read once, however many chunks."""
    if spec.files_per_chunk is None:
        return {spec.name: [] if spec.builtin else spec.input_files()}
    return {chunk_key(spec.name, i): [Path(f) for f in files] for i, files in enumerate(assign_chunks(storage, spec))}


def register_source_chunks(instance: dg.DagsterInstance, storage: KilnStorage) -> list[str]:
    """Make the instance's chunks those of the configured sources: add the missing ones, delete those of sources
    no longer configured (a run over every chunk would fail on them). Returns the configured chunk keys."""
    sources = load_sources(storage.sources_config)
    keys = [key for name, spec in sorted(sources.items())
            for key in ([name] if spec.files_per_chunk is None else assign_source_chunks(storage, spec))]
    known = instance.get_dynamic_partitions(source_chunks.name)
    if missing := [key for key in keys if key not in set(known)]:
        instance.add_dynamic_partitions(source_chunks.name, missing)
    for key in known:
        if source_of(key) not in sources:
            instance.delete_dynamic_partition(source_chunks.name, key)
    return keys


def group_chunks(chunk_bytes: dict[str, int], step_bytes: int) -> list[list[str]]:
    """The chunks, in order, cut into contiguous groups of about equal raw bytes, as many as fit ``step_bytes``
    each (one group when they hold less in all; a chunk a group, as before, with ``step_bytes`` 0). A backfill
    tokenizes a group per step, so what a step costs besides tokenizing (its process, the instance's schema
    checks, a dozen events) is paid once per group instead of once per chunk. A chunk is never split: a run over
    one chunk (a changed file) is still a step over that chunk alone."""
    if isinstance(step_bytes, bool) or not isinstance(step_bytes, int) or step_bytes < 0:
        raise ChunkError(f"step_bytes must be an integer >= 0, got {step_bytes!r}")
    total = sum(chunk_bytes.values())
    if step_bytes == 0:
        return [[key] for key in chunk_bytes]
    count = min(len(chunk_bytes), max(1, total // step_bytes))
    groups: list[list[str]] = [[] for _ in range(count)]
    before = 0
    for key, size in chunk_bytes.items():
        # a chunk joins the group its middle byte falls in: contiguous groups, each within a chunk of total/count
        middle = (before + size / 2) / total if total else 0.0
        groups[min(count - 1, int(middle * count))].append(key)
        before += size
    return [group for group in groups if group]
