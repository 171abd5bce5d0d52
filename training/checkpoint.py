"""Step checkpoints in MindFormers' layout (DESIGN.md 4.5), written atomically.

Order of writes for step N, so a crash at any point leaves every complete checkpoint as it was: every
rank writes its safetensors files into the staging directory ``.iteration_N.partial/``; a barrier; rank 0
writes ``metadata.json``, ``kiln_state.json``, ``lineage.json`` and ``common.json`` there, renames the directory to
``iteration_N/`` (so a directory under that name is always complete), then writes the tracker
``latest_checkpointed_iteration.txt``, then rotates old checkpoints. No save replaces a complete
checkpoint: saving a step that already has one is an error, found before any file is written.
An async save moves the safetensors writes to a thread; the barrier and what follows it wait until
every rank's thread is done (``CheckpointSaver``).
Nothing is deserialized with pickle: tensors are safetensors, the rest JSON.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from training.atomic import write_atomic, write_json_atomic, write_text_atomic
from training.data.hashing import sha256_file
from training.safetensors_io import SafetensorsFile, SafetensorsFileError

TRACKER = "latest_checkpointed_iteration.txt"
COMMON = "common.json"
# MindFormers' CommonInfo builds itself from every key of common.json, so it holds exactly these; what else
# Kiln keeps per checkpoint (random states, data position, loss, config hash) goes to a sidecar of its own
MINDFORMERS_COMMON_KEYS = ("epoch_num", "step_num", "global_step", "loss_scale", "global_batch_size",
                           "consumed_samples", "ckpt_status")
KILN_STATE = "kiln_state.json"
METADATA = "metadata.json"
LINEAGE = "lineage.json"
_ITERATION_RE = re.compile(r"^iteration_(\d{8})$")
_OPT_FILE_RE = re.compile(r"(^|-)opt-\d+-\d+\.safetensors$")
# MindSpore's dtype names, as MindFormers writes them into metadata.json
_MS_DTYPE_NAMES = {"float32": "Float32", "float16": "Float16", "int64": "Int64", "int32": "Int32",
                   "uint16": "UInt16", "uint8": "UInt8", "bool": "Bool"}
_NUMPY_BY_MS_NAME = {ms_name: np.dtype(np_name) for np_name, ms_name in _MS_DTYPE_NAMES.items()}
# what the reader returns for each stored dtype: bfloat16 (MindFormers' default) widened to float32
_NUMPY_DTYPES = {**_NUMPY_BY_MS_NAME, "BFloat16": np.dtype("float32")}
# safetensors' dtype codes by MindSpore name: how a file without metadata.json describes its tensors
_MS_NAMES_BY_CODE = {"F32": "Float32", "F16": "Float16", "BF16": "BFloat16", "I64": "Int64", "I32": "Int32",
                     "U16": "UInt16", "U8": "UInt8", "BOOL": "Bool"}
_SHARD_FILE_RE = re.compile(r"(?:^|-)(?:model|opt)-(\d{7})-(\d{7})\.safetensors$")
# what a resume needs from common.json
COMMON_REQUIRED = ("global_step", "consumed_samples", "global_batch_size")


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used; the message names the file (and tensor) at fault."""


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


# safetensors' dtype codes
_SAFETENSORS_DTYPES = {"float32": "F32", "float16": "F16", "int64": "I64", "int32": "I32", "uint16": "U16",
                       "uint8": "U8", "bool": "BOOL"}


def _write_safetensors_atomic(path: Path, arrays: dict[str, np.ndarray]) -> None:
    """The safetensors format streamed from the arrays' own memory: ``safetensors.numpy.save`` would first
    build the whole file as one bytes object (two extra copies of a checkpoint, a cost an async save pays
    on the cores training uses). Read back, and so checked, by the safetensors library."""
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

    def write(stream) -> None:
        stream.write(len(encoded).to_bytes(8, "little"))
        stream.write(encoded)
        for array in arrays.values():
            stream.write(np.ascontiguousarray(array).reshape(-1).view(np.uint8).data)
    write_atomic(path, write)


def numpy_dtype(ms_dtype) -> np.dtype:
    """numpy's dtype for a parameter's MindSpore dtype (one of those a checkpoint holds)."""
    if str(ms_dtype) not in _NUMPY_BY_MS_NAME:
        raise CheckpointError(f"dtype {ms_dtype} has no numpy equivalent a checkpoint can hold")
    return _NUMPY_BY_MS_NAME[str(ms_dtype)]


def balanced_assignment(sizes: dict[str, int], ranks: list[int]) -> dict[str, int]:
    """Give each tensor to exactly one of ``ranks``, balancing bytes: largest tensors first (ties by name),
    each to the rank with the fewest bytes so far (ties to the lower rank) — MindFormers' greedy rule for a
    group of ranks that all hold every tensor. Pure, so every rank computes the same plan without talking."""
    load = {r: 0 for r in ranks}
    owner = {}
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        rank = min(ranks, key=lambda r: (load[r], r))
        owner[name] = rank
        load[rank] += sizes[name]
    return owner


# ---- saving ----------------------------------------------------------------------------------------

@dataclass
class SavedCheckpoint:
    step: int
    path: Path
    files: list[dict]  # {"name", "bytes", "sha256"} of every file in the iteration dir


@dataclass
class SavePlan:
    """Which ranks write each tensor, and into which file."""
    writers: dict[str, list[int]]  # tensor -> the ranks writing a copy of it
    files: dict[tuple[str, int], str]  # (kind, rank) -> file name, for every rank writing that kind
    kind: dict[str, str]  # tensor -> "model" | "opt"

    @classmethod
    def build(cls, arrays: dict[str, dict[str, np.ndarray]], prefix: str | None, world_size: int,
              remove_redundancy: bool) -> "SavePlan":
        """``arrays``: {"model": {...}, "opt": {...}}. Replicated data parallelism: every rank holds every
        tensor, so normally every rank writes all of them; ``remove_redundancy`` gives each to one rank."""
        kind = {name: k for k, tensors in arrays.items() for name in tensors}
        ranks = list(range(world_size))
        if remove_redundancy:
            sizes = {name: tensors[name].nbytes for tensors in arrays.values() for name in tensors}
            writers = {name: [rank] for name, rank in balanced_assignment(sizes, ranks).items()}
        else:
            writers = {name: ranks for name in kind}
        files = {}
        for k in arrays:
            writing = sorted({r for name, rs in writers.items() if kind[name] == k for r in rs})
            for index, rank in enumerate(writing):
                # a redundancy-free save numbers its files among the ranks writing one, as MindFormers does
                files[(k, rank)] = (shard_file_name(prefix, k, index, len(writing)) if remove_redundancy
                                    else shard_file_name(prefix, k, rank, world_size))
        return cls(writers=writers, files=files, kind=kind)

    def own_files(self, arrays: dict[str, dict[str, np.ndarray]], rank: int) -> dict[str, dict[str, np.ndarray]]:
        """file name -> the tensors ``rank`` writes into it."""
        out: dict[str, dict[str, np.ndarray]] = {}
        for name, ranks in self.writers.items():
            if rank in ranks:
                k = self.kind[name]
                out.setdefault(self.files[(k, rank)], {})[name] = arrays[k][name]
        return out

    def metadata(self, arrays: dict[str, dict[str, np.ndarray]], world_size: int) -> dict:
        """MindFormers' metadata.json: global shape and shard grid of every tensor (replicated data
        parallelism: one unsharded chunk) and, in storage_data, each file holding a copy and its rank."""
        state, storage = {}, {}
        ranks = list(range(world_size))
        for name, k in self.kind.items():
            array = arrays[k][name]
            if array.dtype.name not in _MS_DTYPE_NAMES:
                raise CheckpointError(f"tensor {name}: dtype {array.dtype} cannot be saved "
                                      f"(one of {sorted(_MS_DTYPE_NAMES)})")
            state[name] = {
                "properties": {"dtype": _MS_DTYPE_NAMES[array.dtype.name], "replica_id": 0,
                               "allow_shape_mismatch": False, "allow_to_save": True},
                "global_shape": list(array.shape),
                "axis_fragmentations": [1] * array.ndim,
                "layout": None,
                "chunk": [{"global_offset": [0], "local_shape": list(array.shape)}],
            }
            storage[str((name, (0,)))] = [
                {"file_name": self.files[(k, r)], "storage_rank": r, "rank_group": ranks} for r in self.writers[name]]
        return {"state_dict_metadata": state, "storage_data": storage}


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


def _write_files(target: Path, files: dict[str, dict[str, np.ndarray]]) -> None:
    for name, tensors in files.items():
        _write_safetensors_atomic(target / name, tensors)


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
             common: dict, lineage: dict, state: dict | None = None) -> None:
        """``common``: MindFormers' common.json fields; ``state``: Kiln's sidecar (none when not given)."""
        extra = sorted(set(common) - set(MINDFORMERS_COMMON_KEYS))
        if extra:
            raise ValueError(f"common.json holds MindFormers' fields only; {', '.join(extra)} belong in the state")
        self.wait()
        arrays = {"model": model, "opt": optim or {}}
        plan = SavePlan.build(arrays, self.prefix, self.world.size, self.remove_redundancy)
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
        metadata = plan.metadata(arrays, self.world.size) if self.world.is_main else {}
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
                                  + (f"; on this rank: {own!r}" if own else "")) from own
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
    files = [{"name": p.name, "bytes": p.stat().st_size, "sha256": sha256_file(p)}
             for p in sorted(staging.iterdir()) if not p.name.startswith(".")]
    write_json_atomic(staging / LINEAGE, {**lineage, "checkpoint": {"step": step, "files": files, "common": common}})
    write_json_atomic(staging / COMMON, common)
    files += [{"name": name, "bytes": (staging / name).stat().st_size, "sha256": sha256_file(staging / name)}
              for name in (LINEAGE, COMMON)]
    os.replace(staging, target)  # no directory by that name: save() refused a complete one, removed any other
    write_text_atomic(save_path / TRACKER, f"{step}\n")
    _rotate(save_path, save_max)
    return SavedCheckpoint(step=step, path=target, files=sorted(files, key=lambda f: f["name"]))


def save_checkpoint(*, save_path: Path, step: int, model: dict[str, np.ndarray], optim: dict[str, np.ndarray] | None,
                    common: dict, lineage: dict, prefix: str | None, save_max: int, world, collectives,
                    remove_redundancy: bool = False, state: dict | None = None) -> SavedCheckpoint | None:
    """One synchronous save (collective). Returns the saved checkpoint on rank 0, None elsewhere."""
    saver = CheckpointSaver(save_path=save_path, prefix=prefix, save_max=save_max, world=world,
                            collectives=collectives, remove_redundancy=remove_redundancy)
    saver.save(step=step, model=model, optim=optim, common=common, lineage=lineage, state=state)
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
    return sorted(int(m.group(1)) for p in save_path.iterdir() if (m := _ITERATION_RE.match(p.name)) and is_complete(p))


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


# ---- random state ------------------------------------------------------------------------------------

def capture_rng_state(seed: int, dropout_masks=None) -> dict:
    """The state of every generator a run draws from, as JSON: the dropout mask stream (the model's
    ``MaskStream``, this rank's), MindSpore's default generator (its raw state bytes) and numpy's global
    MT19937. (Model init draws from its own seeded RandomState, and sample order is a pure function of the
    dataset seed, so neither needs saving.)"""
    import mindspore as ms

    name, key, pos, has_gauss, cached = np.random.get_state()
    state = {"seed": seed,
             "mindspore_default_generator": [int(b) for b in ms.get_rng_state().asnumpy().reshape(-1)],
             "numpy_global": {"bit_generator": name, "key": [int(k) for k in key], "pos": int(pos),
                              "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}}
    if dropout_masks is not None:
        state["dropout_masks"] = dropout_masks.state()
    return state


def restore_rng_state(state: dict, path: Path, dropout_masks=None) -> bool:
    """Set the generators back to ``capture_rng_state``'s record (``path``: the file it came from). Returns
    whether the record had the dropout stream's state (a checkpoint from before Kiln saved it has none: the
    stream then stays where the seed started it)."""
    import mindspore as ms

    if not isinstance(state, dict) or "mindspore_default_generator" not in state:
        raise CheckpointError(f"{path}: field rng has no generator states")
    try:
        ms_state = np.array(state["mindspore_default_generator"], dtype=np.uint8)
        numpy_state = state["numpy_global"]
        np.random.set_state((numpy_state["bit_generator"], np.array(numpy_state["key"], dtype=np.uint32),
                             numpy_state["pos"], numpy_state["has_gauss"], numpy_state["cached_gaussian"]))
        if dropout_masks is not None and "dropout_masks" in state:
            dropout_masks.set_state(state["dropout_masks"])
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{path}: field rng is malformed ({exc!r})") from None
    ms.set_rng_state(ms.Tensor(ms_state))
    return "dropout_masks" in state


# ---- resolving load_path -----------------------------------------------------------------------------

def is_hf_dir(path: Path) -> bool:
    """A Hugging Face model directory: config.json and safetensors weights, none of Kiln's step files."""
    path = Path(path)
    return ((path / "config.json").is_file() and any(path.glob("*.safetensors"))
            and not (path / COMMON).exists() and not (path / TRACKER).exists())


def resolve_load_path(load_path: str | Path) -> Path:
    """``load_path`` is a save root (→ the tracker's step), an ``iteration_*`` directory, or a Hugging Face
    directory (weights only). Anything else, an empty directory included, is an error, never a fresh start."""
    path = Path(load_path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint.load_path {path}: no such directory")
    if not any(path.iterdir()):
        raise CheckpointError(f"checkpoint.load_path {path}: empty directory, nothing to load")
    if is_hf_dir(path):
        return path
    if (path / TRACKER).exists():
        step = tracked_step(path)
        path = iteration_dir(path, step)
        if not path.is_dir():
            raise CheckpointError(f"{path}: named by {TRACKER} but missing")
    elif not _ITERATION_RE.match(path.name):
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

def _read_json(path: Path) -> dict:
    try:
        payload = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: unreadable ({exc})") from None
    if not isinstance(payload, dict):
        raise CheckpointError(f"{path}: expected a JSON object, found {type(payload).__name__}")
    return payload


def read_kiln_state(path: Path, common: dict) -> tuple[dict | None, Path]:
    """Kiln's per-checkpoint state and the file it came from: ``kiln_state.json``, else the extra keys an
    older Kiln wrote into common.json; None for a checkpoint that has neither (MindFormers wrote it)."""
    sidecar = Path(path) / KILN_STATE
    if sidecar.exists():
        return _read_json(sidecar), sidecar
    legacy = {k: v for k, v in common.items() if k not in MINDFORMERS_COMMON_KEYS} if "rng" in common else None
    return legacy, Path(path) / COMMON


def read_common(path: Path) -> dict:
    common = _read_json(Path(path) / COMMON)
    for key in COMMON_REQUIRED:
        if not isinstance(common.get(key), int):
            raise CheckpointError(f"{Path(path) / COMMON}: field {key} must be an integer, "
                                  f"found {common.get(key)!r}")
    return common


@dataclass(frozen=True)
class TensorEntry:
    """One tensor as metadata.json describes it: where its copies are, and what it must look like."""
    kind: str  # "model" | "opt"
    shape: tuple[int, ...]
    stored: str  # MindSpore's name of the dtype in the file ("BFloat16", "Float32", ...)
    copies: tuple[tuple[str, int], ...]  # (file name, storage rank)

    @property
    def dtype(self) -> np.dtype:
        """The dtype the reader returns (bfloat16 widened to float32)."""
        return _NUMPY_DTYPES[self.stored]

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize

    def file_for(self, rank: int) -> str:
        """This rank's own copy when it wrote one, else the first listed."""
        return next((f for f, r in self.copies if r == rank), self.copies[0][0])


def _kind_of(file_name: str) -> str:
    return "opt" if _OPT_FILE_RE.search(file_name) else "model"


def _catalog_from_headers(path: Path) -> dict[str, TensorEntry]:
    """A single-card MindFormers save has no metadata.json: every tensor in its safetensors files is whole,
    as MindFormers' own loader assumes; the storage rank comes from the file name's index."""
    catalog: dict[str, TensorEntry] = {}
    for file_path in sorted(Path(path).glob("*.safetensors")):
        reader = _open(file_path)
        match = _SHARD_FILE_RE.search(file_path.name)
        rank = int(match.group(1)) if match else 0
        for name in reader.names():
            code = reader.dtype(name)
            if code not in _MS_NAMES_BY_CODE:
                raise CheckpointError(f"{file_path}: tensor {name} has dtype {code}, not one of "
                                      f"{sorted(_MS_NAMES_BY_CODE)}")
            entry = TensorEntry(_kind_of(file_path.name), reader.shape(name), _MS_NAMES_BY_CODE[code],
                                ((file_path.name, rank),))
            known = catalog.get(name)
            if known is not None and (known.shape, known.stored) != (entry.shape, entry.stored):
                raise CheckpointError(f"{file_path}: tensor {name} is {entry.stored}{list(entry.shape)}, "
                                      f"{known.copies[0][0]} holds it as {known.stored}{list(known.shape)}")
            catalog[name] = entry if known is None else TensorEntry(
                known.kind, known.shape, known.stored, known.copies + entry.copies)
    return catalog


def read_catalog(path: Path) -> dict[str, TensorEntry]:
    """Every tensor of the checkpoint from metadata.json, or from the safetensors headers when there is
    none. Sharded tensors (a shard grid other than one chunk) are refused by name: Kiln's layouts are
    replicated so far."""
    meta_path = Path(path) / METADATA
    if not meta_path.exists():
        return _catalog_from_headers(path)
    metadata = _read_json(meta_path)
    catalog = {}
    try:
        state, storage = metadata["state_dict_metadata"], metadata["storage_data"]
        for key, entries in storage.items():
            match = re.fullmatch(r"\('(.+)', \((\d+),\)\)", key)
            if not match:
                raise CheckpointError(f"{meta_path}: storage_data key {key!r} is not \"('<name>', (k,))\"")
            name = match.group(1)
            info = state[name]
            if any(n != 1 for n in info["axis_fragmentations"]) or len(info["chunk"]) != 1:
                raise CheckpointError(f"{meta_path}: tensor {name} is sharded (axis_fragmentations "
                                      f"{info['axis_fragmentations']}); only unsharded tensors can be loaded")
            dtype_name = info["properties"]["dtype"]
            if dtype_name not in _NUMPY_DTYPES:
                raise CheckpointError(f"{meta_path}: tensor {name} has dtype {dtype_name}, "
                                      f"not one of {sorted(_NUMPY_DTYPES)}")
            copies = tuple((e["file_name"], int(e["storage_rank"])) for e in entries)
            if not copies:
                raise CheckpointError(f"{meta_path}: tensor {name} is stored in no file")
            catalog[name] = TensorEntry(_kind_of(copies[0][0]), tuple(info["global_shape"]), dtype_name, copies)
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{meta_path}: malformed ({exc!r})") from None
    return catalog


@dataclass
class LoadedCheckpoint:
    path: Path
    model: dict[str, np.ndarray]
    optim: dict[str, np.ndarray]
    common: dict
    state: dict | None  # Kiln's sidecar (read_kiln_state); None for a MindFormers checkpoint
    state_path: Path
    stored: dict[str, str]  # each tensor's dtype in the files, MindSpore's name ("BFloat16", ...)


def _open(file_path: Path) -> SafetensorsFile:
    try:
        return SafetensorsFile(file_path)
    except SafetensorsFileError as exc:
        raise CheckpointError(str(exc)) from None


def read_tensors(path: Path, catalog: dict[str, TensorEntry], names, rank: int) -> dict[str, np.ndarray]:
    """Read ``names`` from the files the catalog lists, each checked against its shape and dtype."""
    path = Path(path)
    by_file: dict[str, list[str]] = {}
    for name in names:
        by_file.setdefault(catalog[name].file_for(rank), []).append(name)
    tensors = {}
    for file_name, file_names in sorted(by_file.items()):
        file_path = path / file_name
        if not file_path.exists():
            raise CheckpointError(f"{file_path}: missing (listed in {METADATA} for tensor {file_names[0]})")
        reader = _open(file_path)
        for name in file_names:
            if name not in reader.header:
                raise CheckpointError(f"{file_path}: tensor {name} listed in {METADATA} is not in the file")
            entry = catalog[name]
            stored = _MS_NAMES_BY_CODE.get(reader.dtype(name), reader.dtype(name))
            if reader.shape(name) != entry.shape or stored != entry.stored:
                raise CheckpointError(f"{file_path}: tensor {name} is {stored}{list(reader.shape(name))}, "
                                      f"{METADATA} says {entry.stored}{list(entry.shape)}")
            tensors[name] = reader.get(name)
    return tensors


def _split(path: Path, catalog: dict[str, TensorEntry], tensors: dict[str, np.ndarray], common: dict
           ) -> LoadedCheckpoint:
    state, state_path = read_kiln_state(path, common)
    return LoadedCheckpoint(path=Path(path), common=common, state=state, state_path=state_path,
                            stored={n: catalog[n].stored for n in tensors},
                            model={n: a for n, a in tensors.items() if catalog[n].kind == "model"},
                            optim={n: a for n, a in tensors.items() if catalog[n].kind == "opt"})


def _wanted(catalog: dict[str, TensorEntry], load_optim: bool) -> list[str]:
    return sorted(n for n, e in catalog.items() if load_optim or e.kind == "model")


def load_checkpoint(path: Path, rank: int = 0, load_optim: bool = True) -> LoadedCheckpoint:
    """Read every tensor named in ``metadata.json`` (optimizer state only with ``load_optim``), from
    whichever file holds it — this rank's own copy when there is one."""
    common = read_common(path)
    catalog = read_catalog(path)
    return _split(path, catalog, read_tensors(path, catalog, _wanted(catalog, load_optim), rank), common)


def load_checkpoint_balanced(path: Path, world, collectives, load_optim: bool = True, readers: int | None = None
                             ) -> LoadedCheckpoint:
    """Collective. The first ``readers`` ranks (all by default) each read a disjoint, byte-balanced subset
    of the tensors from disk; every other tensor arrives by broadcast from the rank that read it. The
    result is bit-identical to ``load_checkpoint`` on every rank."""
    common = read_common(path)
    catalog = read_catalog(path)
    names = _wanted(catalog, load_optim)
    reading_ranks = list(range(min(readers or world.size, world.size)))
    owners = balanced_assignment({n: catalog[n].nbytes for n in names}, reading_ranks)
    own = read_tensors(path, catalog, [n for n in names if owners[n] == world.rank], world.rank)
    specs = {n: (catalog[n].shape, catalog[n].dtype) for n in names}
    return _split(path, catalog, collectives.share_arrays(own, owners, specs), common)
