"""Which failures of a training launch a retry can heal, told from the workers' logs.

A worker that stops on an error a second attempt would meet again (its config, its data, its checkpoint,
a run of non-finite steps past ``max_consecutive_skipped_steps``) prints one ``NOT_RETRIABLE`` line to its
log before it exits (a config error: its one ``CONFIG_ERROR`` line, which says it all). A launch that fails without such a line lost a process (a worker or msrun killed, a
node gone, a collective broken by either): resuming from the newest complete checkpoint heals that.
"""
from __future__ import annotations

from pathlib import Path

NOT_RETRIABLE = "[kiln] not retriable:"
CONFIG_ERROR = "config error:"  # how training.run reports a ConfigError, on one line


def not_retriable(exc: BaseException) -> bool:
    """Whether ``exc``, stopping a worker, would stop a retry the same way: an error in what the run was given
    (its config, data or checkpoint: training.boundary's user errors), not one of the machine's."""
    from training.boundary import user_error_types

    return isinstance(exc, user_error_types())


USER_ERROR = "error:"  # how training.run reports a user error a retry may heal (a file the machine could not read)


def error_line(line: str) -> bool:
    """Whether a worker log's line is training.run's one line for a user error."""
    return line.startswith((NOT_RETRIABLE, CONFIG_ERROR, USER_ERROR))


def not_retriable_line(exc: BaseException) -> str:
    first = str(exc).splitlines()[0] if str(exc) else ""
    return f"{NOT_RETRIABLE} {type(exc).__name__}: {first}"


def log_sizes(log_dir: Path) -> dict[str, int]:
    """Each worker log's size now: what a launch starting now appends comes after it."""
    return {p.name: p.stat().st_size for p in Path(log_dir).glob("worker_*.log")}


def not_retriable_cause(log_dir: Path, before: dict[str, int]) -> str | None:
    """The first NOT_RETRIABLE line the workers logged since ``before`` (log_sizes), without the marker;
    None when no worker stopped on such an error."""
    for path in sorted(Path(log_dir).glob("worker_*.log")):
        start = before.get(path.name, 0)
        with open(path, "rb") as log:
            if log.seek(0, 2) < start:  # msrun started the file again
                start = 0
            log.seek(start)
            for line in log.read().decode(errors="replace").splitlines():
                if line.startswith(NOT_RETRIABLE):
                    return f"{path.name}: {line[len(NOT_RETRIABLE):].strip()}"
                if line.startswith(CONFIG_ERROR):
                    return f"{path.name}: {line}"
    return None
