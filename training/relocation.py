"""Runs that moved: a copy of a project tree (its runs root and data root, side by side as they were) trains,
evaluates and audits against the copy, never the original tree.

training_run records the two roots once, absolute, in the rendered config (``kiln.roots``: KilnRootsConfig), and
training records them in every checkpoint's lineage (``run.roots``). Every other path the config or the lineage
holds lies under one of them, so where a root is now says where each path is now: the runs root is where the
config's run directory (``<runs root>/<run>/config.yaml``) or the checkpoint (``<runs root>/<run>/checkpoints/
iteration_N``) sits now, and the data root is at the same place relative to it as it was.
Lineages written before the roots were recorded are read by the older rule (``moved_path``).
"""
from __future__ import annotations

import os
from pathlib import Path


def moved_roots(roots: dict, runs_root_now: Path | None) -> list[tuple[str, str]]:
    """(as recorded, now) for the runs root and the data root a run recorded (``roots``: runs_root, data_root),
    when its runs root is now ``runs_root_now``: the data root at its recorded place relative to the runs root.
    The most specific first (a root may hold the other); none when nothing moved."""
    old_runs_root = roots.get("runs_root")
    if not old_runs_root or runs_root_now is None or Path(old_runs_root) == Path(runs_root_now):
        return []
    moves = [(old_runs_root, str(runs_root_now))]
    if roots.get("data_root"):
        moves.append((roots["data_root"],
                      os.path.normpath(Path(runs_root_now) / os.path.relpath(roots["data_root"], old_runs_root))))
    return sorted(moves, key=lambda move: -len(move[0]))


def rebase(value, moves: list[tuple[str, str]]):
    """``value`` (a config section: dicts, lists, strings) with every path under a ``moves`` source (old, new)
    moved under its target (the first that holds it)."""
    if isinstance(value, dict):
        return {key: rebase(item, moves) for key, item in value.items()}
    if isinstance(value, list):
        return [rebase(item, moves) for item in value]
    for old, new in moves:
        old = old.rstrip(os.sep)
        if isinstance(value, str) and (value == old or value.startswith(old + os.sep)):
            return new + value[len(old):]
    return value


def moved_path(old_run_dir: Path, new_run_dir: Path, recorded: str | Path) -> Path:
    """For a lineage written before roots were recorded: ``recorded`` (absolute) at its place relative to
    ``new_run_dir`` when that exists (as a file, a directory or a dataset prefix's .bin), else as recorded."""
    if not os.path.isabs(recorded) or Path(old_run_dir) == Path(new_run_dir):
        return Path(recorded)
    moved = Path(os.path.normpath(Path(new_run_dir) / os.path.relpath(recorded, old_run_dir)))
    return moved if moved.exists() or Path(f"{moved}.bin").exists() else Path(recorded)


class MovedConfigError(ValueError):
    pass


def moved_rendered_config(data: dict, config_file: Path) -> tuple[dict, Path | None]:
    """A config training_run rendered (``checkpoint.save_path`` is ``<runs root>/<run>/checkpoints``, the roots
    recorded in ``kiln.roots``) read from a run directory of the same name in another runs root (a copied
    tree): every path under the recorded roots moved to the copy's, so training writes into the copy and reads
    the copy's data. Returns the config and the run directory it was rendered for (None: not moved, or not a
    rendered config, e.g. a user's copy outside any run directory, whose paths are taken as written).
    MovedConfigError when the copy lacks its data root, or the config was rendered before roots were recorded."""
    checkpoint = data.get("checkpoint") if isinstance(data, dict) else None
    save_path = checkpoint.get("save_path") if isinstance(checkpoint, dict) else None
    if not isinstance(save_path, str) or not os.path.isabs(save_path) or Path(save_path).name != "checkpoints":
        return data, None
    old_run_dir, new_run_dir = Path(save_path).parent, Path(config_file).resolve().parent
    if old_run_dir == new_run_dir or old_run_dir.name != new_run_dir.name:
        return data, None
    kiln = data.get("kiln")
    roots = kiln.get("roots") if isinstance(kiln, dict) else None
    if not isinstance(roots, dict) or not roots.get("runs_root"):
        raise MovedConfigError(
            f"{config_file}: rendered for the run directory {old_run_dir} by a Kiln that did not record its roots "
            f"(kiln.roots), so its paths cannot be moved to this copy: materialize training_run again, or set "
            f"checkpoint.save_path and the data paths for this copy")
    moves = moved_roots(roots, new_run_dir.parent)
    missing = [new for old, new in moves if old == roots.get("data_root") and not Path(new).is_dir()]
    if missing:
        raise MovedConfigError(
            f"{config_file}: rendered for {old_run_dir} on the data root {roots['data_root']}; this copy's data root "
            f"would be {missing[0]} (where it was relative to the runs root), which does not exist: copy the data "
            f"root along, so that the copy does not read the original tree's")
    return rebase(data, moves), old_run_dir
