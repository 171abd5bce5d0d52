"""Step checkpoints in MindFormers' layout (DESIGN.md 4.5), written atomically.

Order of writes for step N, so a crash at any point leaves either a complete checkpoint or one that
resume refuses: every rank renames its safetensors files into ``iteration_N/``; a barrier; rank 0
writes ``metadata.json`` and ``lineage.json``, then ``common.json`` (its presence marks the directory
complete), then the tracker ``latest_checkpointed_iteration.txt``, then rotates old checkpoints.
Nothing is deserialized with pickle: tensors are safetensors, the rest JSON.
"""
from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save

from training.atomic import write_atomic, write_json_atomic, write_text_atomic
from training.data.hashing import sha256_file

TRACKER = "latest_checkpointed_iteration.txt"
COMMON = "common.json"
METADATA = "metadata.json"
LINEAGE = "lineage.json"
_ITERATION_RE = re.compile(r"^iteration_(\d{8})$")
# MindSpore's dtype names, as MindFormers writes them into metadata.json
_MS_DTYPE_NAMES = {"float32": "Float32", "float16": "Float16", "int64": "Int64", "int32": "Int32",
                   "uint16": "UInt16", "bool": "Bool"}


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used; the message names the file (and tensor) at fault."""


def iteration_dir(save_path: Path, step: int) -> Path:
    return Path(save_path) / f"iteration_{step:08d}"


def shard_file_name(prefix: str | None, kind: str, rank: int, world_size: int) -> str:
    stem = f"{kind}-{rank:07d}-{world_size:07d}.safetensors"
    return f"{prefix}-{stem}" if prefix else stem


def _write_safetensors_atomic(path: Path, arrays: dict[str, np.ndarray]) -> None:
    data = save({k: np.ascontiguousarray(v) for k, v in arrays.items()})
    write_atomic(path, lambda stream: stream.write(data))


@dataclass
class SavedCheckpoint:
    step: int
    path: Path
    files: list[dict]  # {"name", "bytes", "sha256"} of every file in the iteration dir


def _metadata(model: dict[str, np.ndarray], optim: dict[str, np.ndarray], prefix, world_size: int) -> dict:
    """Global shape and shard grid of every tensor; with replicated data parallelism each tensor is one
    unsharded chunk held, and written, by every rank."""
    state, storage = {}, {}
    ranks = list(range(world_size))
    for kind, arrays in (("model", model), ("opt", optim)):
        for name, array in arrays.items():
            state[name] = {
                "properties": {"dtype": _MS_DTYPE_NAMES[array.dtype.name], "replica_id": 0,
                               "allow_shape_mismatch": False, "allow_to_save": True},
                "global_shape": list(array.shape),
                "axis_fragmentations": [1] * array.ndim,
                "layout": None,
                "chunk": [{"global_offset": [0], "local_shape": list(array.shape)}],
            }
            storage[str((name, (0,)))] = [
                {"file_name": shard_file_name(prefix, kind, r, world_size), "storage_rank": r, "rank_group": ranks}
                for r in ranks]
    return {"state_dict_metadata": state, "storage_data": storage}


def save_checkpoint(*, save_path: Path, step: int, model: dict[str, np.ndarray], optim: dict[str, np.ndarray] | None,
                    common: dict, lineage: dict, prefix: str | None, save_max: int, world, collectives
                    ) -> SavedCheckpoint | None:
    """Collective: every rank calls it. Returns the saved checkpoint on rank 0, None elsewhere."""
    save_path = Path(save_path)
    target = iteration_dir(save_path, step)
    if world.is_main:
        if target.exists():  # left over by a run that crashed mid-save, or saved again after a resume
            shutil.rmtree(target)
        target.mkdir(parents=True)
    collectives.barrier()
    _write_safetensors_atomic(target / shard_file_name(prefix, "model", world.rank, world.size), model)
    if optim is not None:
        _write_safetensors_atomic(target / shard_file_name(prefix, "opt", world.rank, world.size), optim)
    collectives.barrier()
    if not world.is_main:
        return None
    write_json_atomic(target / METADATA, _metadata(model, optim or {}, prefix, world.size))
    files = [{"name": p.name, "bytes": p.stat().st_size, "sha256": sha256_file(p)}
             for p in sorted(target.iterdir()) if not p.name.startswith(".")]
    write_json_atomic(target / LINEAGE, {**lineage, "checkpoint": {"step": step, "files": files, "common": common}})
    write_json_atomic(target / COMMON, common)
    write_text_atomic(save_path / TRACKER, f"{step}\n")
    _rotate(save_path, save_max)
    files += [{"name": name, "bytes": (target / name).stat().st_size, "sha256": sha256_file(target / name)}
              for name in (LINEAGE, COMMON)]
    return SavedCheckpoint(step=step, path=target, files=sorted(files, key=lambda f: f["name"]))


def tracked_step(save_path: Path) -> int | None:
    tracker = Path(save_path) / TRACKER
    if not tracker.exists():
        return None
    text = tracker.read_text().strip()
    if not text.isdigit():
        raise CheckpointError(f"{tracker}: expected a step number, found {text[:40]!r}")
    return int(text)


def _rotate(save_path: Path, save_max: int) -> None:
    """Keep the newest ``save_max`` complete checkpoints (earlier runs' included); never the tracked one."""
    keep_step = tracked_step(save_path)
    complete = sorted(int(m.group(1)) for p in save_path.iterdir()
                      if (m := _ITERATION_RE.match(p.name)) and (p / COMMON).exists())
    for step in complete[:-save_max] if len(complete) > save_max else []:
        if step != keep_step:
            shutil.rmtree(iteration_dir(save_path, step))


def resolve_load_path(load_path: str | Path) -> Path:
    """``load_path`` is a save root (→ the tracker's step) or an ``iteration_*`` directory."""
    path = Path(load_path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint.load_path {path}: no such directory")
    if (path / TRACKER).exists():
        step = tracked_step(path)
        path = iteration_dir(path, step)
        if not path.is_dir():
            raise CheckpointError(f"{path}: named by {TRACKER} but missing")
    elif not _ITERATION_RE.match(path.name):
        raise CheckpointError(f"checkpoint.load_path {path}: neither a save root with {TRACKER} "
                              f"nor an iteration_XXXXXXXX directory")
    for name in (COMMON, METADATA):
        if not (path / name).exists():
            raise CheckpointError(f"{path}: incomplete checkpoint, {name} is missing")
    return path


def latest_complete_checkpoint(save_path: Path) -> Path | None:
    """The tracker's checkpoint when the save root has one, else None (a fresh start)."""
    if tracked_step(save_path) is None:
        return None
    return resolve_load_path(save_path)


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: unreadable ({exc})") from None


@dataclass
class LoadedCheckpoint:
    path: Path
    model: dict[str, np.ndarray]
    optim: dict[str, np.ndarray]
    common: dict


def load_checkpoint(path: Path, rank: int = 0, load_optim: bool = True) -> LoadedCheckpoint:
    """Read every tensor named in ``metadata.json``, preferring this rank's own copy."""
    path = Path(path)
    common = _read_json(path / COMMON)
    metadata = _read_json(path / METADATA)
    tensors: dict[str, dict[str, np.ndarray]] = {"model": {}, "opt": {}}
    try:
        storage = metadata["storage_data"]
        shapes = {name: entry["global_shape"] for name, entry in metadata["state_dict_metadata"].items()}
    except (KeyError, TypeError) as exc:
        raise CheckpointError(f"{path / METADATA}: malformed ({exc!r} missing)") from None
    by_file: dict[str, list[str]] = {}
    for key, entries in storage.items():
        name = key.split("'")[1]
        entry = next((e for e in entries if e["storage_rank"] == rank), entries[0])
        by_file.setdefault(entry["file_name"], []).append(name)
    for file_name, names in sorted(by_file.items()):
        kind = "opt" if re.search(r"(^|-)opt-\d+-\d+\.safetensors$", file_name) else "model"
        if kind == "opt" and not load_optim:
            continue
        file_path = path / file_name
        if not file_path.exists():
            raise CheckpointError(f"{file_path}: missing (listed in {METADATA})")
        try:
            with safe_open(str(file_path), framework="numpy") as f:
                for name in names:
                    array = f.get_tensor(name)
                    if list(array.shape) != shapes[name]:
                        raise CheckpointError(f"{file_path}: tensor {name} has shape {list(array.shape)}, "
                                              f"{METADATA} says {shapes[name]}")
                    tensors[kind][name] = array
        except SafetensorError as exc:
            raise CheckpointError(f"{file_path}: not a readable safetensors file ({exc})") from None
    return LoadedCheckpoint(path=path, model=tensors["model"], optim=tensors["opt"], common=common)
