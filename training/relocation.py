"""Runs that moved: a run directory (``<runs root>/<run>``) moved or copied together with its data root keeps
its links. Paths recorded absolute when it trained (in its rendered config and its checkpoints' lineage) are
read at the same place relative to the run directory's new location when something is there, else as recorded.
"""
from __future__ import annotations

import os
from pathlib import Path


def moved_path(old_run_dir: Path, new_run_dir: Path, recorded: str | Path) -> Path:
    """``recorded`` (absolute) at its place relative to ``new_run_dir`` when that exists (as a file, a directory or
    a dataset prefix's .bin), else as recorded; unchanged when the run directory did not move."""
    if not os.path.isabs(recorded) or Path(old_run_dir) == Path(new_run_dir):
        return Path(recorded)
    moved = Path(os.path.normpath(Path(new_run_dir) / os.path.relpath(recorded, old_run_dir)))
    return moved if moved.exists() or Path(f"{moved}.bin").exists() else Path(recorded)


def rebase(value, moves: list[tuple[str, str]]):
    """``value`` (a config section: dicts, lists, strings) with every path under a ``moves`` source (old, new)
    moved under its target."""
    if isinstance(value, dict):
        return {key: rebase(item, moves) for key, item in value.items()}
    if isinstance(value, list):
        return [rebase(item, moves) for item in value]
    for old, new in moves:
        old = old.rstrip(os.sep)
        if isinstance(value, str) and (value == old or value.startswith(old + os.sep)):
            return new + value[len(old):]
    return value


def _absolute_paths(value) -> list[str]:
    if isinstance(value, dict):
        return [p for item in value.values() for p in _absolute_paths(item)]
    if isinstance(value, list):
        return [p for item in value for p in _absolute_paths(item)]
    return [value] if isinstance(value, str) and os.path.isabs(value) else []


def moved_rendered_config(data: dict, config_file: Path) -> tuple[dict, Path | None]:
    """A config training_run rendered (``checkpoint.save_path`` is ``<its run dir>/checkpoints``) read from a run
    directory of the same name elsewhere (moved or copied there): every path under the run directory it was
    rendered for moves to this one, so training writes here and not into the original tree, and every other
    path (the data) moves where the same relative place exists. Returns the config and the run directory it was
    rendered for (None: not moved, or not a rendered config)."""
    save_path = (data.get("checkpoint") or {}).get("save_path") if isinstance(data, dict) else None
    if not isinstance(save_path, str) or not os.path.isabs(save_path) or Path(save_path).name != "checkpoints":
        return data, None
    old_run_dir, new_run_dir = Path(save_path).parent, Path(config_file).resolve().parent
    if old_run_dir == new_run_dir or old_run_dir.name != new_run_dir.name:
        return data, None
    moves = [(str(old_run_dir), str(new_run_dir))]
    moves += [(path, str(moved)) for path in dict.fromkeys(_absolute_paths(data))
              if not path.startswith(str(old_run_dir) + os.sep)
              and (moved := moved_path(old_run_dir, new_run_dir, path)) != Path(path)]
    return rebase(data, moves), old_run_dir
