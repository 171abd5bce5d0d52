"""Step checkpoints in MindFormers' layout (docs/architecture.md, Step checkpoint), written atomically.

Order of writes for step N, so a crash at any point leaves every complete checkpoint as it was: every
rank writes its safetensors files into the staging directory ``.iteration_N.partial/``; a barrier; rank 0
writes ``metadata.json``, ``kiln_state.json``, ``lineage.json`` and ``common.json`` there, renames the directory to
``iteration_N/`` (so a directory under that name is always complete), then writes the tracker
``latest_checkpointed_iteration.txt``, then rotates old checkpoints. No save replaces a complete
checkpoint: saving a step that already has one is an error, found before any file is written.
An async save moves the safetensors writes to a thread; the barrier and what follows it wait until
every rank's thread is done (``CheckpointSaver``).
Nothing is deserialized with pickle: tensors are safetensors, the rest JSON. A load verifies every file it
reads against the sha256 its save recorded in lineage.json (training/checkpoint_files.py).
"""
from __future__ import annotations

import hashlib
import itertools
import json
import math
import os
import re
import shutil
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from training.atomic import write_atomic, write_json_atomic, write_text_atomic
from training.checkpoint_files import COMMON, LINEAGE, CheckpointError, CheckpointFiles
from training.data.hashing import sha256_file
from training.lineage import ITERATION_NAME, record_in_index
from training.parallel.layout import TensorLayout
from training.safetensors_io import SafetensorsFile, widen_bfloat16

TRACKER = "latest_checkpointed_iteration.txt"
# MindFormers' CommonInfo builds itself from every key of common.json, so it holds exactly these; what else
# Kiln keeps per checkpoint (random states, data position, loss, config hash) goes to a sidecar of its own
MINDFORMERS_COMMON_KEYS = ("epoch_num", "step_num", "global_step", "loss_scale", "global_batch_size",
                           "consumed_samples", "ckpt_status")
KILN_STATE = "kiln_state.json"
METADATA = "metadata.json"
_OPT_FILE_RE = re.compile(r"(^|-)opt-\d+-\d+\.safetensors$")
# MindSpore's dtype names, as MindFormers writes them into metadata.json
_MS_DTYPE_NAMES = {"float32": "Float32", "float16": "Float16", "int64": "Int64", "int32": "Int32",
                   "uint16": "UInt16", "uint8": "UInt8", "bool": "Bool"}
_NUMPY_BY_MS_NAME = {ms_name: np.dtype(np_name) for np_name, ms_name in _MS_DTYPE_NAMES.items()}
# what the reader returns for each stored dtype: bfloat16 (MindFormers' default) widened to float32
_NUMPY_DTYPES = {**_NUMPY_BY_MS_NAME, "BFloat16": np.dtype("float32")}
# safetensors' dtype codes of the numpy dtypes Kiln saves
_SAFETENSORS_DTYPES = {"float32": "F32", "float16": "F16", "int64": "I64", "int32": "I32", "uint16": "U16",
                       "uint8": "U8", "bool": "BOOL"}
# MindSpore's name by safetensors' code: how a file without metadata.json describes its tensors
_MS_NAMES_BY_CODE = {**{code: _MS_DTYPE_NAMES[np_name] for np_name, code in _SAFETENSORS_DTYPES.items()},
                     "BF16": "BFloat16"}
_SHARD_FILE_RE = re.compile(r"(?:^|-)(?:model|opt)-(\d{7})-(\d{7})\.safetensors$")
# what a resume needs from common.json
COMMON_REQUIRED = ("global_step", "consumed_samples", "global_batch_size")


def iteration_dir(save_path: Path, step: int) -> Path:
    return Path(save_path) / f"iteration_{step:08d}"


def staging_dir(target: Path) -> Path:
    """Where the files of checkpoint directory ``target`` are written until it is complete."""
    return target.with_name(f".{target.name}.partial")


def is_complete(path: Path) -> bool:
    """A checkpoint directory every file of which is in place (common.json is written last)."""
    return (Path(path) / COMMON).is_file()


def shard_file_name(prefix: str | None, kind: str, rank: int, world_size: int) -> str:
    stem = f"{kind}-{rank:07d}-{world_size:07d}.safetensors"
    return f"{prefix}-{stem}" if prefix else stem



def _write_safetensors_atomic(path: Path, arrays: dict[str, np.ndarray]) -> str:
    """The safetensors format streamed from the arrays' own memory: ``safetensors.numpy.save`` would first
    build the whole file as one bytes object (two extra copies of a checkpoint, a cost an async save pays
    on the cores training uses). Read back, and so checked, by the safetensors library. Returns the sha256
    of the bytes written, computed as they are written: no process reads the file again just to hash it."""
    header, offset = {}, 0
    for name, array in arrays.items():
        if array.dtype.name not in _SAFETENSORS_DTYPES:
            raise CheckpointError(f"tensor {name}: dtype {array.dtype} cannot be saved "
                                  f"(one of {sorted(_SAFETENSORS_DTYPES)})")
        header[name] = {"dtype": _SAFETENSORS_DTYPES[array.dtype.name], "shape": list(array.shape),
                        "data_offsets": [offset, offset + array.nbytes]}
        offset += array.nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned, as the library writes it

    digest = hashlib.sha256()

    def write(stream) -> None:
        def put(part) -> None:
            digest.update(part)
            stream.write(part)
        put(len(encoded).to_bytes(8, "little"))
        put(encoded)
        for array in arrays.values():  # one contiguous copy at a time, where an array needs one
            put(np.ascontiguousarray(array).reshape(-1).view(np.uint8).data)
    write_atomic(path, write)
    return digest.hexdigest()


def _written_sha256_path(path: Path) -> Path:
    """Where the writer of a staged file leaves its sha256: hidden, so not a checkpoint file, and removed by
    rank 0 before the staging directory becomes the checkpoint."""
    return path.with_name(f".{path.name}.sha256")


def _staged_file_record(path: Path) -> dict:
    """A staged file's lineage.json entry. Its sha256 is the one its writer computed from the bytes it wrote
    (every rank hashes its own tensor files, in parallel) or, for rank 0's small JSON files, read back.
    Either way a record of what was written, not a verification: the page cache would have served a re-read
    too. What certifies the bytes on disk is the audit, which reads every file and compares it with this."""
    written = _written_sha256_path(path)
    sha256 = written.read_text() if written.is_file() else sha256_file(path)
    return {"name": path.name, "bytes": path.stat().st_size, "sha256": sha256}


def numpy_dtype(ms_dtype) -> np.dtype:
    """numpy's dtype for a parameter's MindSpore dtype (one of those a checkpoint holds)."""
    if str(ms_dtype) not in _NUMPY_BY_MS_NAME:
        raise CheckpointError(f"dtype {ms_dtype} has no numpy equivalent a checkpoint can hold")
    return _NUMPY_BY_MS_NAME[str(ms_dtype)]


def balanced_assignment(sizes: dict, holders: dict) -> dict:
    """Give each item (a chunk, or a tensor) to exactly one of the ranks holding it, balancing bytes —
    MindFormers' greedy rule (``distribute_shards``): items with the fewest holders first, then the larger,
    then by key; each to its least-loaded holder (ties to the lower rank). Pure, so every rank computes the
    same plan without talking. ``sizes``: item -> bytes; ``holders``: item -> the ranks that have it."""
    load = {r: 0 for ranks in holders.values() for r in ranks}
    owner = {}
    for item in sorted(sizes, key=lambda i: (len(holders[i]), -sizes[i], i)):
        rank = min(sorted(holders[item]), key=lambda r: load[r])
        owner[item] = rank
        load[rank] += sizes[item]
    return owner


def storage_key(name: str, chunk: int) -> str:
    """metadata.json's key of one chunk: the text of MindFormers' Python tuple (name, (k,))."""
    return str((name, (chunk,)))


# ---- saving ----------------------------------------------------------------------------------------

@dataclass
class SavedCheckpoint:
    step: int
    path: Path
    files: list[dict]  # {"name", "bytes", "sha256"} of every file in the iteration dir


@dataclass
class SavePlan:
    """Which ranks write each distinct chunk of each tensor, and into which file. Computed alike on every
    rank from the layouts alone, so rank 0 describes every rank's files without gathering anything."""
    layouts: dict[str, TensorLayout]  # every saved tensor's, replicated ones included
    kind: dict[str, str]  # tensor -> "model" | "opt"
    dtype: dict[str, np.dtype]
    holders: dict[tuple[str, int], list[int]]  # (tensor, chunk) -> the ranks holding it, ascending
    writers: dict[tuple[str, int], list[int]]  # (tensor, chunk) -> the ranks writing a copy of it
    files: dict[tuple[str, int], str]  # (kind, rank) -> file name, for every rank writing that kind
    mindspore_layouts: dict[str, dict | None]  # tensor -> its metadata.json ``layout`` (TensorLayout.mindspore_layout)

    @classmethod
    def build(cls, arrays: dict[str, dict[str, np.ndarray]], layouts: dict[str, TensorLayout] | None,
              prefix: str | None, world_size: int, remove_redundancy: bool,
              remote: dict[str, tuple[str, np.dtype]] | None = None) -> "SavePlan":
        """``arrays``: {"model": {...}, "opt": {...}}, this rank's local arrays; ``layouts``: how each tensor
        is spread over the ranks (a tensor without one is replicated; layouts of tensors not saved, e.g.
        the optimizer's under no_save_optim, are not used). ``remote``: tensors this rank holds nothing of
        (pipeline parallelism: other stages' layers), name -> (kind, dtype), each with its layout in ``layouts``.
        Normally every holder of a chunk writes it; ``remove_redundancy`` gives each chunk to one holder, planned
        per kind as MindFormers plans its model and optimizer files apart."""
        remote = {n: spec for n, spec in (remote or {}).items() if spec[0] in arrays}  # kinds not saved drop out
        kind = {name: k for k, tensors in arrays.items() for name in tensors}
        dtype = {name: tensors[name].dtype for tensors in arrays.values() for name in tensors}
        kind.update({name: k for name, (k, _) in remote.items()})
        dtype.update({name: np.dtype(d) for name, (_, d) in remote.items()})
        full, mindspore_layouts = {}, {}
        for name in kind:
            local = arrays[kind[name]].get(name)
            layout = (layouts or {}).get(name) or TensorLayout.replicated(local.shape, world_size)
            mindspore_layouts[name] = _checked_mindspore_layout(name, layout, local, world_size)
            full[name] = layout
        holders = {(name, k): ranks for name, layout in full.items() for k, ranks in enumerate(layout.holders())}
        if remove_redundancy:
            writers = {}
            for k in arrays:
                chunks = {storage_key(*chunk): chunk for chunk in holders if kind[chunk[0]] == k}
                sizes = {key: math.prod(full[chunk[0]].local_shape) * dtype[chunk[0]].itemsize
                         for key, chunk in chunks.items()}
                owner = balanced_assignment(sizes, {key: holders[chunk] for key, chunk in chunks.items()})
                writers.update({chunks[key]: [rank] for key, rank in owner.items()})
        else:
            writers = holders
        files = {}
        for k in arrays:
            writing = sorted({r for chunk, ranks in writers.items() if kind[chunk[0]] == k for r in ranks})
            for index, rank in enumerate(writing):
                # a redundancy-free save numbers its files among the ranks writing one, as MindFormers does
                files[(k, rank)] = (shard_file_name(prefix, k, index, len(writing)) if remove_redundancy
                                    else shard_file_name(prefix, k, rank, world_size))
        return cls(layouts=full, kind=kind, dtype=dtype, holders=holders, writers=writers, files=files,
                   mindspore_layouts=mindspore_layouts)

    def own_files(self, arrays: dict[str, dict[str, np.ndarray]], rank: int) -> dict[str, dict[str, np.ndarray]]:
        """file name -> the tensors ``rank`` writes into it (its own chunk of each, so one entry per tensor)."""
        out: dict[str, dict[str, np.ndarray]] = {}
        for name, layout in self.layouts.items():
            chunk = layout.chunk_of_rank[rank]
            if chunk is not None and rank in self.writers[(name, chunk)]:
                k = self.kind[name]
                out.setdefault(self.files[(k, rank)], {})[name] = arrays[k][name]
        return out

    def metadata(self) -> dict:
        """MindFormers' metadata.json: every tensor's global shape, shard grid and distinct chunks, and in
        storage_data, for each chunk, every file holding a copy, the rank that wrote it and the chunk's
        holders. ``replica_id`` of a sharded tensor is MindFormers' per-rank list: rank r's index among the
        holders of its chunk; an unsharded tensor has 0. ``layout``: MindSpore's device matrix, tensor map and
        rank list of a sharded tensor, which MindFormers' loader reshards from; null for an unsharded one."""
        state, storage = {}, {}
        for name, layout in self.layouts.items():
            if self.dtype[name].name not in _MS_DTYPE_NAMES:
                raise CheckpointError(f"tensor {name}: dtype {self.dtype[name]} cannot be saved "
                                      f"(one of {sorted(_MS_DTYPE_NAMES)})")
            replica_id = _replica_ids(layout) if layout.is_sharded else 0
            state[name] = {
                "properties": {"dtype": _MS_DTYPE_NAMES[self.dtype[name].name], "replica_id": replica_id,
                               "allow_shape_mismatch": False, "allow_to_save": True},
                "global_shape": list(layout.global_shape),
                "axis_fragmentations": list(layout.fragmentations),
                "layout": self.mindspore_layouts[name],
                "chunk": [{"global_offset": [k], "local_shape": list(layout.local_shape)}
                          for k in range(layout.num_chunks)],
            }
            for k in range(layout.num_chunks):
                storage[storage_key(name, k)] = [
                    {"file_name": self.files[(self.kind[name], r)], "storage_rank": r,
                     "rank_group": self.holders[(name, k)]} for r in self.writers[(name, k)]]
        return {"state_dict_metadata": state, "storage_data": storage}


def _replica_ids(layout: TensorLayout) -> list[int]:
    """MindFormers' replica_id of a sharded tensor: for each rank, how many lower ranks hold its chunk (None for
    a rank holding none of the tensor)."""
    seen = [0] * layout.num_chunks
    ids = []
    for chunk in layout.chunk_of_rank:
        if chunk is None:
            ids.append(None)
            continue
        ids.append(seen[chunk])
        seen[chunk] += 1
    return ids


def _checked_mindspore_layout(name: str, layout: TensorLayout, local: np.ndarray | None, world_size: int
                              ) -> dict | None:
    """The layout as metadata.json records it, once checked: the rank's array (None: it holds none of the tensor)
    is its chunk of the layout, every chunk has a holder to write it, and MindSpore's device matrix can describe
    it."""
    if len(layout.chunk_of_rank) != world_size:
        raise CheckpointError(f"tensor {name}: its layout places {len(layout.chunk_of_rank)} ranks, the world "
                              f"has {world_size}")
    if local is not None and tuple(local.shape) != layout.local_shape:
        raise CheckpointError(f"tensor {name}: this rank's array is {list(local.shape)}, its layout's chunk is "
                              f"{list(layout.local_shape)} (global {list(layout.global_shape)} cut "
                              f"{list(layout.fragmentations)})")
    orphans = sorted(set(range(layout.num_chunks)) - set(layout.chunk_of_rank))
    if orphans:
        raise CheckpointError(f"tensor {name}: chunks {orphans} of its layout are held by no rank, "
                              f"so no file would hold them")
    try:
        return layout.mindspore_layout()
    except ValueError as exc:
        raise CheckpointError(f"tensor {name}: {exc}") from None


def _host_copies(files: dict[str, dict[str, np.ndarray]]) -> dict[str, dict[str, np.ndarray]]:
    """Private copies: a parameter's ``asnumpy()`` shares its memory, which the next optimizer step overwrites."""
    return {f: {n: np.array(a, copy=True, order="C") for n, a in tensors.items()} for f, tensors in files.items()}


class _AsyncWrite:
    """One rank's part of an async save, in a thread: copy the tensors (while the training step computes
    its gradients), signal ``copied``, write the files."""

    def __init__(self, target: Path, files: dict[str, dict[str, np.ndarray]]):
        self.copied = threading.Event()

        def work() -> None:
            try:
                copies = _host_copies(files)
            finally:
                self.copied.set()  # on failure too: the error surfaces through settle()
            files.clear()  # drop the references to the live parameters
            _write_files(target, copies)

        self.job = _Job(f"kiln-save-{target.name}", work)


class _Job(threading.Thread):
    """Runs ``work()`` once; its error and result are kept for the main thread, its duration for benchmarks."""

    def __init__(self, name: str, work):
        super().__init__(name=name)
        self.work, self.error, self.result, self.seconds = work, None, None, None

    def run(self) -> None:
        started = time.perf_counter()
        try:
            self.result = self.work()
        except BaseException as exc:  # noqa: BLE001 -- raised by the main thread
            self.error = exc
        self.work = None  # release the host copies
        self.seconds = time.perf_counter() - started


def _write_files(staging: Path, files: dict[str, dict[str, np.ndarray]]) -> None:
    """A rank's files in the staging directory, each with its sha256 next to it for rank 0's lineage.json."""
    for name, tensors in files.items():
        write_text_atomic(_written_sha256_path(staging / name), _write_safetensors_atomic(staging / name, tensors))


@dataclass
class _PendingSave:
    step: int
    target: Path
    metadata: dict
    common: dict
    state: dict | None
    lineage: dict
    write: _AsyncWrite

    @property
    def writer(self) -> "_Job":
        return self.write.job


class CheckpointSaver:
    """The step checkpoints of one run. ``save`` is collective: every rank calls it at the same steps.

    With ``async_save``, ``save`` copies this rank's tensors to host memory, starts a thread that writes
    them, and returns. Completion is agreed from the main thread (collectives from a side thread are not
    safe): the trainer adds ``status()`` to an all-reduce it makes every step anyway and hands the sums
    to ``settle``; once every rank's writer is done, rank 0 starts a thread that writes metadata, lineage
    (hashing every file), common.json and the tracker — no collective, so safe off the main thread — so
    the tracker names a finished async save a step later, not one save later as in MindFormers. ``wait``
    does the same with a blocking all-reduce and joins that thread; it runs before the next save and at
    the end of training, so the last save is always finalized.
    """

    def __init__(self, *, save_path: Path, prefix: str | None, save_max: int, world, collectives,
                 remove_redundancy: bool = False, async_save: bool = False):
        self.save_path = Path(save_path)
        self.prefix, self.save_max = prefix, save_max
        self.world, self.collectives = world, collectives
        self.remove_redundancy = remove_redundancy
        self.async_save = async_save
        self.pending: _PendingSave | None = None
        self.finalizer: _Job | None = None  # rank 0's finalization of the last settled async save
        self.blocked_seconds = 0.0  # time before_update waited for host copies (benchmarks report it)
        self.completed: list[SavedCheckpoint] = []

    def save(self, *, step: int, model: dict[str, np.ndarray], optim: dict[str, np.ndarray] | None,
             common: dict, lineage: dict, state: dict | None = None,
             layouts: dict[str, TensorLayout] | None = None,
             remote: dict[str, tuple[str, np.dtype]] | None = None) -> None:
        """``model``/``optim``: this rank's local arrays; ``layouts``: tensor name (model and optimizer
        alike) -> how it is spread over the ranks, each array being this rank's chunk of it; a tensor
        without a layout is replicated (every rank holds it whole); ``remote``: the tensors only other ranks
        hold (``SavePlan.build``). ``common``: MindFormers' common.json
        fields; ``state``: Kiln's sidecar (none when not given)."""
        extra = sorted(set(common) - set(MINDFORMERS_COMMON_KEYS))
        if extra:
            raise ValueError(f"common.json holds MindFormers' fields only; {', '.join(extra)} belong in the state")
        self.wait()
        arrays = {"model": model, "opt": optim or {}}
        plan = SavePlan.build(arrays, layouts, self.prefix, self.world.size, self.remove_redundancy, remote)
        target = iteration_dir(self.save_path, step)
        if is_complete(target):  # every rank sees the same directory, so every rank stops here alike
            raise CheckpointError(f"{target}: a complete checkpoint of step {step} is already there; Kiln never "
                                  f"replaces one (save into a new checkpoint.save_path)")
        staging = staging_dir(target)
        if self.world.is_main:
            for leftover in (staging, target):  # a crashed save's files; an incomplete dir of an older Kiln
                shutil.rmtree(leftover, ignore_errors=True)
            staging.mkdir(parents=True)
        self.collectives.barrier()
        metadata = plan.metadata() if self.world.is_main else {}
        files = plan.own_files(arrays, self.world.rank)
        if self.async_save:
            write = _AsyncWrite(staging, files)
            self.pending = _PendingSave(step, target, metadata, common, state, lineage, write)
            write.job.start()
            return
        _write_files(staging, files)
        self.collectives.barrier()
        if self.world.is_main:
            self.completed.append(_finalize(self.save_path, step, target, metadata, common, state, lineage,
                                            self.save_max))

    def before_update(self) -> None:
        """Call before the optimizer changes parameters in place: waits until a pending async save has
        copied them (it copies while the step computes its gradients)."""
        if self.pending is not None:
            started = time.perf_counter()
            self.pending.write.copied.wait()
            self.blocked_seconds += time.perf_counter() - started

    def status(self) -> np.ndarray:
        """[this rank's writer is done (or there is none), it failed]: to be summed over ranks."""
        writer = self.pending.writer if self.pending else None
        if writer is None:
            return np.array([1.0, 0.0])
        if writer.is_alive():
            return np.array([0.0, 0.0])
        return np.array([1.0, float(writer.error is not None)])

    def settle(self, totals: np.ndarray) -> None:
        """Finish the pending save if ``totals`` (``status()`` summed over ranks) says every writer is done."""
        if self.pending is None or totals[0] < self.world.size:
            return
        pending, self.pending = self.pending, None
        pending.writer.join()
        if totals[1] > 0:
            own = pending.writer.error
            raise CheckpointError(f"{pending.target}: async save failed on {int(totals[1])} rank(s)"
                                  + (f"; on this rank: {type(own).__name__}: {own}" if own else "")) from own
        if self.world.is_main:
            self.finalizer = _Job(f"kiln-finalize-{pending.target.name}", lambda: _finalize(
                self.save_path, pending.step, pending.target, pending.metadata, pending.common, pending.state,
                pending.lineage, self.save_max))
            self.finalizer.start()

    def wait(self) -> None:
        """Block until the pending save, if any, is complete and tracked (collective)."""
        if self.pending is not None:
            self.pending.writer.join()
            self.settle(self.collectives.all_reduce_array(self.status()))
        if self.finalizer is not None:
            self.finalizer.join()
            self._collect_finalized()

    def _collect_finalized(self) -> None:
        finalizer = self.finalizer
        if finalizer is None or finalizer.is_alive():
            return
        self.finalizer = None
        if finalizer.error is not None:
            raise CheckpointError(f"{finalizer.name}: finalizing the checkpoint failed: "
                                  f"{finalizer.error!r}") from finalizer.error
        self.completed.append(finalizer.result)

    def take_completed(self) -> list[SavedCheckpoint]:
        """Checkpoints completed since the last call (on rank 0; empty elsewhere)."""
        self._collect_finalized()
        done, self.completed = self.completed, []
        return done


def _finalize(save_path: Path, step: int, target: Path, metadata: dict, common: dict, state: dict | None,
              lineage: dict, save_max: int) -> SavedCheckpoint:
    """Rank 0, once every rank's files are in the staging directory: metadata, Kiln's state, lineage (which
    hashes those), common.json, the rename that completes the checkpoint, the tracker, then rotation."""
    staging = staging_dir(target)
    write_json_atomic(staging / METADATA, metadata)
    if state is not None:
        write_json_atomic(staging / KILN_STATE, state)
    files = [_staged_file_record(p) for p in sorted(staging.iterdir()) if not p.name.startswith(".")]
    write_json_atomic(staging / LINEAGE, {**lineage, "checkpoint": {"step": step, "files": files, "common": common}})
    write_json_atomic(staging / COMMON, common)
    files += [_staged_file_record(staging / name) for name in (LINEAGE, COMMON)]
    for written in staging.glob(".*.sha256"):
        written.unlink()
    os.replace(staging, target)  # no directory by that name: save() refused a complete one, removed any other
    write_text_atomic(save_path / TRACKER, f"{step}\n")
    record_in_index(save_path, step, lineage)
    _rotate(save_path, save_max)
    return SavedCheckpoint(step=step, path=target, files=sorted(files, key=lambda f: f["name"]))


def save_checkpoint(*, save_path: Path, step: int, model: dict[str, np.ndarray], optim: dict[str, np.ndarray] | None,
                    common: dict, lineage: dict, prefix: str | None, save_max: int, world, collectives,
                    remove_redundancy: bool = False, state: dict | None = None,
                    layouts: dict[str, TensorLayout] | None = None,
                    remote: dict[str, tuple[str, np.dtype]] | None = None) -> SavedCheckpoint | None:
    """One synchronous save (collective; ``CheckpointSaver.save``). Returns the saved checkpoint on rank 0,
    None elsewhere."""
    saver = CheckpointSaver(save_path=save_path, prefix=prefix, save_max=save_max, world=world,
                            collectives=collectives, remove_redundancy=remove_redundancy)
    saver.save(step=step, model=model, optim=optim, common=common, lineage=lineage, state=state, layouts=layouts,
               remote=remote)
    done = saver.take_completed()
    return done[0] if done else None


def tracked_step(save_path: Path) -> int | None:
    tracker = Path(save_path) / TRACKER
    if not tracker.exists():
        return None
    text = tracker.read_text().strip()
    if not text.isdigit():
        raise CheckpointError(f"{tracker}: expected a step number, found {text[:40]!r}")
    return int(text)


def complete_steps(save_path: Path) -> list[int]:
    """The steps of the complete checkpoints under ``save_path``, ascending."""
    save_path = Path(save_path)
    if not save_path.is_dir():
        return []
    return sorted(int(m.group(1)) for p in save_path.iterdir()
                  if (m := ITERATION_NAME.match(p.name)) and is_complete(p))


def _rotate(save_path: Path, save_max: int) -> None:
    """Keep the newest ``save_max`` complete checkpoints (earlier runs' included); never the tracked one.
    Staging directories left by crashed saves go too: no save is under way while rank 0 rotates."""
    keep_step = tracked_step(save_path)
    complete = complete_steps(save_path)
    for step in complete[:-save_max] if len(complete) > save_max else []:
        if step != keep_step:
            shutil.rmtree(iteration_dir(save_path, step))
    for leftover in save_path.glob(".iteration_*.partial"):
        shutil.rmtree(leftover, ignore_errors=True)


# ---- resolving load_path -----------------------------------------------------------------------------

def is_hf_dir(path: Path) -> bool:
    """A Hugging Face model directory: config.json and safetensors weights, none of Kiln's step files."""
    path = Path(path)
    return ((path / "config.json").is_file() and any(path.glob("*.safetensors"))
            and not (path / COMMON).exists() and not (path / TRACKER).exists())


def resolve_load_path(load_path: str | Path) -> Path:
    """``load_path`` is a save root (→ the tracker's step, or a newer complete one), an ``iteration_*``
    directory, or a Hugging Face directory (weights only). Anything else, an empty directory included, is an
    error, never a fresh start."""
    path = Path(load_path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint.load_path {path}: no such directory")
    if not any(path.iterdir()):
        raise CheckpointError(f"checkpoint.load_path {path}: empty directory, nothing to load")
    if is_hf_dir(path):
        return path
    if (path / TRACKER).exists():
        # the tracker is written after the rename that completes a checkpoint: a complete one newer than it
        # is a save whose process died in between, and the step to resume from
        step = max([tracked_step(path), *complete_steps(path)])
        path = iteration_dir(path, step)
        if not path.is_dir():
            raise CheckpointError(f"{path}: named by {TRACKER} but missing")
    elif not ITERATION_NAME.match(path.name):
        raise CheckpointError(f"checkpoint.load_path {path}: neither a save root with {TRACKER}, "
                              f"an iteration_XXXXXXXX directory, nor a Hugging Face directory "
                              f"(config.json + *.safetensors)")
    if not (path / COMMON).exists():
        raise CheckpointError(f"{path}: incomplete checkpoint, {COMMON} is missing")
    # MindFormers writes no metadata.json for a single-card save: its safetensors headers describe it
    if not (path / METADATA).exists() and not any(path.glob("*.safetensors")):
        raise CheckpointError(f"{path}: incomplete checkpoint, neither {METADATA} nor *.safetensors files")
    return path


def latest_complete_checkpoint(save_path: Path) -> Path | None:
    """The tracker's checkpoint when the save root has one, else None (a fresh start)."""
    if tracked_step(save_path) is None:
        return None
    return resolve_load_path(save_path)


# ---- loading -------------------------------------------------------------------------------------

def read_kiln_state(files: CheckpointFiles, common: dict) -> tuple[dict | None, Path]:
    """Kiln's per-checkpoint state and the file it came from: ``kiln_state.json``, else the extra keys an
    older Kiln wrote into common.json; None for a checkpoint that has neither (MindFormers wrote it)."""
    if files.exists(KILN_STATE):
        return files.json(KILN_STATE), files.path / KILN_STATE
    legacy = {k: v for k, v in common.items() if k not in MINDFORMERS_COMMON_KEYS} if "rng" in common else None
    return legacy, files.path / COMMON


def read_common(files: CheckpointFiles) -> dict:
    common = files.json(COMMON)
    for key in COMMON_REQUIRED:
        if not isinstance(common.get(key), int):
            raise CheckpointError(f"{files.path / COMMON}: field {key} must be an integer, "
                                  f"found {common.get(key)!r}")
    return common


Copies = tuple[tuple[str, int], ...]  # (file name, storage rank) of every stored copy of one chunk


@dataclass(frozen=True)
class TensorEntry:
    """One tensor as the checkpoint describes it: global shape and shard grid, where each chunk's copies
    are, and what the files must hold."""
    kind: str  # "model" | "opt"
    shape: tuple[int, ...]  # global
    stored: str  # MindSpore's name of the dtype in the file ("BFloat16", "Float32", ...)
    fragmentations: tuple[int, ...]  # chunks along each dim (all 1: unsharded)
    chunks: tuple[Copies, ...]  # chunk k (MindFormers' global_offset index) -> its copies

    @property
    def dtype(self) -> np.dtype:
        """The dtype the reader returns (bfloat16 widened to float32)."""
        return _NUMPY_DTYPES[self.stored]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    @property
    def grid(self) -> TensorLayout:
        """The shard grid, holding no ranks: where each chunk lies is all a reader needs."""
        return TensorLayout(self.shape, self.fragmentations, ())

    def file_for(self, chunk: int, rank: int) -> str:
        """The file to read ``chunk`` from: this rank's own copy when it wrote one, else the first listed."""
        copies = self.chunks[chunk]
        return next((f for f, r in copies if r == rank), copies[0][0])

    def describe(self, chunk: int) -> str:
        """How errors name one chunk of this tensor."""
        if len(self.chunks) == 1:
            return f"{self.stored}{list(self.shape)}"
        return (f"chunk {chunk} of {self.stored}{list(self.shape)} cut {list(self.fragmentations)}, "
                f"{self.stored}{list(self.grid.local_shape)}")


def _kind_of(file_name: str) -> str:
    return "opt" if _OPT_FILE_RE.search(file_name) else "model"


def _catalog_from_headers(files: CheckpointFiles) -> dict[str, TensorEntry]:
    """A single-card MindFormers save has no metadata.json: every tensor in its safetensors files is whole,
    as MindFormers' own loader assumes; the storage rank comes from the file name's index."""
    catalog: dict[str, TensorEntry] = {}
    for file_path in sorted(files.path.glob("*.safetensors")):
        reader = files.safetensors(file_path.name)
        match = _SHARD_FILE_RE.search(file_path.name)
        rank = int(match.group(1)) if match else 0
        for name in reader.names():
            code = reader.dtype(name)
            if code not in _MS_NAMES_BY_CODE:
                raise CheckpointError(f"{file_path}: tensor {name} has dtype {code}, not one of "
                                      f"{sorted(_MS_NAMES_BY_CODE)}")
            shape, stored = reader.shape(name), _MS_NAMES_BY_CODE[code]
            known = catalog.get(name)
            if known is not None and (known.shape, known.stored) != (shape, stored):
                raise CheckpointError(f"{file_path}: tensor {name} is {stored}{list(shape)}, "
                                      f"{known.chunks[0][0][0]} holds it as {known.stored}{list(known.shape)}")
            copies = (known.chunks[0] if known else ()) + ((file_path.name, rank),)
            catalog[name] = TensorEntry(_kind_of(file_path.name), shape, stored, (1,) * len(shape), (copies,))
    return catalog


def read_catalog(files: CheckpointFiles) -> dict[str, TensorEntry]:
    """Every tensor of the checkpoint, its chunks and the files holding each, from metadata.json, or from
    the safetensors headers when there is none."""
    meta_path = files.path / METADATA
    if not files.exists(METADATA):
        return _catalog_from_headers(files)
    metadata = files.json(METADATA)
    try:
        state, storage = metadata["state_dict_metadata"], metadata["storage_data"]
        stored_chunks: dict[str, dict[int, Copies]] = {}
        for key, entries in storage.items():
            match = re.fullmatch(r"\('(.+)', \((\d+),\)\)", key)
            if not match:
                raise CheckpointError(f"{meta_path}: storage_data key {key!r} is not \"('<name>', (k,))\"")
            copies = tuple((e["file_name"], int(e["storage_rank"])) for e in entries)
            if not copies:
                raise CheckpointError(f"{meta_path}: tensor {match.group(1)} chunk {match.group(2)} is stored "
                                      f"in no file")
            stored_chunks.setdefault(match.group(1), {})[int(match.group(2))] = copies
        return {name: _catalog_entry(meta_path, name, state.get(name), chunks)
                for name, chunks in stored_chunks.items()}
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{meta_path}: malformed ({exc!r})") from None


def _catalog_entry(meta_path: Path, name: str, info: dict | None, chunks: dict[int, Copies]) -> TensorEntry:
    """One tensor of metadata.json: its description, and storage for every chunk of its grid."""
    if info is None:
        raise CheckpointError(f"{meta_path}: storage_data lists tensor {name}, state_dict_metadata does not "
                              f"describe it")
    dtype_name = info["properties"]["dtype"]
    if dtype_name not in _NUMPY_DTYPES:
        raise CheckpointError(f"{meta_path}: tensor {name} has dtype {dtype_name}, "
                              f"not one of {sorted(_NUMPY_DTYPES)}")
    shape, fragmentations = tuple(info["global_shape"]), tuple(info["axis_fragmentations"])
    try:
        num_chunks = TensorLayout(shape, fragmentations, ()).num_chunks
    except ValueError as exc:
        raise CheckpointError(f"{meta_path}: tensor {name}: {exc}") from None
    missing, extra = sorted(set(range(num_chunks)) - set(chunks)), sorted(set(chunks) - set(range(num_chunks)))
    if missing or extra:
        raise CheckpointError(f"{meta_path}: tensor {name} is cut {list(fragmentations)} into {num_chunks} "
                              f"chunk(s); storage_data " + (f"has no file for chunk(s) {missing}" if missing
                                                            else f"lists chunk(s) {extra} outside the grid"))
    return TensorEntry(_kind_of(chunks[0][0][0]), shape, dtype_name, fragmentations,
                       tuple(chunks[k] for k in range(num_chunks)))


@dataclass
class LoadedCheckpoint:
    path: Path
    model: dict[str, np.ndarray]
    optim: dict[str, np.ndarray]
    common: dict
    state: dict | None  # Kiln's sidecar (read_kiln_state); None for a MindFormers checkpoint
    state_path: Path
    stored: dict[str, str]  # each tensor's dtype in the files, MindSpore's name ("BFloat16", ...)
    origin: dict  # what the loading run's lineage records of it (CheckpointFiles.origin)


Region = tuple[slice, ...]  # a box of a tensor's global coordinates


def whole(shape: tuple[int, ...]) -> Region:
    return tuple(slice(0, n) for n in shape)


def target_regions(path: Path, catalog: dict[str, TensorEntry], names, layouts: dict[str, TensorLayout] | None,
                   rank: int) -> dict[str, Region]:
    """Where this rank's local array of each tensor lies, under the loading run's ``layouts`` (a tensor
    without one is loaded whole). The loading run's global shapes must be the checkpoint's."""
    regions = {}
    for name in names:
        shape, layout = catalog[name].shape, (layouts or {}).get(name)
        if layout is None:
            regions[name] = whole(shape)
            continue
        if 0 <= rank < len(layout.chunk_of_rank) and layout.chunk_of_rank[rank] is None:
            continue  # the loading run places none of it on this rank (another pipeline stage's)
        if tuple(layout.global_shape) != shape:
            raise CheckpointError(f"{path}: tensor {name} is {list(shape)} in the checkpoint, the loading run's "
                                  f"layout has it {list(layout.global_shape)}")
        if not 0 <= rank < len(layout.chunk_of_rank):
            raise CheckpointError(f"tensor {name}: its layout places {len(layout.chunk_of_rank)} ranks, "
                                  f"this is rank {rank}")
        regions[name] = layout.chunk_slices(layout.chunk_of_rank[rank])
    return regions


def _overlaps(grid: TensorLayout, region: Region):
    """(chunk, the overlap's slices within that chunk, within the region) for every chunk of ``grid``
    that ``region`` overlaps."""
    spans = []
    for box, size in zip(region, grid.local_shape):
        if box.start >= box.stop:
            return  # an empty region overlaps nothing (and a dim of size 0 has no chunk size to divide by)
        spans.append(range(box.start // size, -(-box.stop // size)))
    for coords in itertools.product(*spans):
        chunk = 0
        for coordinate, parts in zip(coords, grid.fragmentations):
            chunk = chunk * parts + coordinate  # row-major, MindFormers' global_offset index
        lows = [max(box.start, c * n) for box, c, n in zip(region, coords, grid.local_shape)]
        highs = [min(box.stop, (c + 1) * n) for box, c, n in zip(region, coords, grid.local_shape)]
        yield (chunk,
               tuple(slice(lo - c * n, hi - c * n) for lo, hi, c, n in zip(lows, highs, coords, grid.local_shape)),
               tuple(slice(lo - box.start, hi - box.start) for lo, hi, box in zip(lows, highs, region)))


def read_regions(files: CheckpointFiles, catalog: dict[str, TensorEntry], regions: dict[str, Region], rank: int
                 ) -> dict[str, np.ndarray]:
    """Each tensor's region, assembled from the stored chunks it overlaps. Only the files holding those chunks
    are read, one at a time, each once (verified as it is read), keeping only the bytes of the chunks' parts
    the regions need; every chunk is checked against the catalog's shape and dtype first. A region inside one
    chunk whose bytes are contiguous (a cut along the first dim, or the chunk whole) is a view of the bytes
    kept, not a copy."""
    pieces: dict[str, list[tuple[str, int, Region, Region]]] = {}  # file -> (tensor, chunk, in chunk, in region)
    for name, region in regions.items():
        entry = catalog[name]
        for chunk, in_chunk, in_region in _overlaps(entry.grid, region):
            file_name = entry.file_for(chunk, rank)
            if not files.exists(file_name):
                raise CheckpointError(f"{files.path / file_name}: missing (listed in {METADATA} for tensor {name})")
            pieces.setdefault(file_name, []).append((name, chunk, in_chunk, in_region))
    shapes = {name: tuple(box.stop - box.start for box in region) for name, region in regions.items()}
    one_piece = {name for name, count in Counter(n for wanted in pieces.values() for n, *_ in wanted).items()
                 if count == 1}
    tensors: dict[str, np.ndarray] = {}
    for file_name, wanted in pieces.items():
        reader = files.safetensors(file_name, {name: [in_chunk for n, _, in_chunk, _ in wanted if n == name]
                                               for name, *_ in wanted})
        for name, chunk, in_chunk, in_region in wanted:
            entry = catalog[name]
            part = _stored_part(reader, name, entry, chunk, in_chunk)
            if name in one_piece and entry.stored != "BFloat16" and part.shape == shapes[name] \
                    and part.flags.c_contiguous and part.flags.aligned:
                tensors[name] = part  # the region lies in one chunk, its bytes kept in one piece: no copy
                continue
            if name not in tensors:
                tensors[name] = np.empty(shapes[name], entry.dtype)
            tensors[name][in_region] = widen_bfloat16(part) if entry.stored == "BFloat16" else part
    return {name: tensors[name] if name in tensors else np.empty(shapes[name], catalog[name].dtype)
            for name in regions}


def _stored_part(reader: SafetensorsFile, name: str, entry: TensorEntry, chunk: int, in_chunk: Region
                 ) -> np.ndarray:
    """The part ``in_chunk`` of the chunk as stored (a view of the file's verified bytes; bfloat16 as its raw
    bits), once the chunk's shape and dtype are checked."""
    if name not in reader.header:
        raise CheckpointError(f"{reader.path}: tensor {name} listed in {METADATA} is not in the file")
    stored = _MS_NAMES_BY_CODE.get(reader.dtype(name), reader.dtype(name))
    if reader.shape(name) != entry.grid.local_shape or stored != entry.stored:
        raise CheckpointError(f"{reader.path}: tensor {name} is {stored}{list(reader.shape(name))}, "
                              f"{METADATA} says {entry.describe(chunk)}")
    return reader.region(name, in_chunk)


def read_tensors(files: CheckpointFiles, catalog: dict[str, TensorEntry], names, rank: int
                 ) -> dict[str, np.ndarray]:
    """Read ``names`` whole."""
    return read_regions(files, catalog, {n: whole(catalog[n].shape) for n in names}, rank)


def _split(files: CheckpointFiles, catalog: dict[str, TensorEntry], tensors: dict[str, np.ndarray], common: dict
           ) -> LoadedCheckpoint:
    state, state_path = read_kiln_state(files, common)
    return LoadedCheckpoint(path=files.path, common=common, state=state, state_path=state_path,
                            stored={n: catalog[n].stored for n in tensors}, origin=files.origin(),
                            model={n: a for n, a in tensors.items() if catalog[n].kind == "model"},
                            optim={n: a for n, a in tensors.items() if catalog[n].kind == "opt"})


def _wanted(catalog: dict[str, TensorEntry], load_optim: bool) -> list[str]:
    return sorted(n for n, e in catalog.items() if load_optim or e.kind == "model")


def load_checkpoint(path: Path, rank: int = 0, load_optim: bool = True,
                    layouts: dict[str, TensorLayout] | None = None, allow_unverified: bool = False
                    ) -> LoadedCheckpoint:
    """This rank's arrays of every tensor of the checkpoint (optimizer state only with ``load_optim``)
    under the loading run's ``layouts``: each tensor's chunk of ``rank`` (a tensor without a layout, or
    every tensor when ``layouts`` is None, whole), whatever layout the checkpoint was saved under. Every file
    read is verified against its lineage.json (CheckpointFiles); ``allow_unverified`` loads one without."""
    files = CheckpointFiles(path, allow_unverified)
    common = read_common(files)
    catalog = read_catalog(files)
    regions = target_regions(path, catalog, _wanted(catalog, load_optim), layouts, rank)
    return _split(files, catalog, read_regions(files, catalog, regions, rank), common)


def load_checkpoint_balanced(path: Path, world, collectives, load_optim: bool = True, readers: int | None = None,
                             layouts: dict[str, TensorLayout] | None = None, allow_unverified: bool = False
                             ) -> LoadedCheckpoint:
    """Collective. ``load_checkpoint``'s result on every rank, with the disk reads of the tensors every
    rank loads whole spread out: the first ``readers`` ranks (all by default) each read a disjoint,
    byte-balanced subset of them, and every other rank receives it by broadcast from the rank that read
    it. A tensor the loading run shards (``layouts``) differs per rank, so each rank reads its own chunk."""
    files = CheckpointFiles(path, allow_unverified)
    common = read_common(files)
    catalog = read_catalog(files)
    names = _wanted(catalog, load_optim)
    regions = target_regions(path, catalog, names, layouts, world.rank)
    sharded = {n for n in names if layouts and n in layouts
               and (layouts[n].is_sharded or not layouts[n].held_by_all)}
    shared_names = [n for n in names if n not in sharded]
    reading_ranks = tuple(range(min(readers or world.size, world.size)))
    owners = balanced_assignment({n: catalog[n].nbytes for n in shared_names},
                                 {n: reading_ranks for n in shared_names})
    # what this rank reads, in one pass over each file: the shared tensors it owns whole, its own sharded regions
    own = [n for n in shared_names if owners[n] == world.rank]
    read = read_regions(files, catalog, {**{n: whole(catalog[n].shape) for n in own},
                                         **{n: regions[n] for n in sorted(sharded) if n in regions}}, world.rank)
    specs = {n: (catalog[n].shape, catalog[n].dtype) for n in shared_names}
    tensors = collectives.share_arrays({n: read[n] for n in own}, owners, specs)
    tensors.update({n: read[n] for n in sorted(sharded) if n in read})
    return _split(files, catalog, tensors, common)
