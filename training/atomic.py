"""Writes that never leave a half-written file or directory under the final name: the content goes to a
temporary name in the same directory (same filesystem, so the rename is atomic), is flushed to disk,
and only then renamed over the target."""
from __future__ import annotations

import ctypes
import errno
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import BinaryIO, Callable


def _umask() -> int:
    """The process's umask: Linux tells it in /proc/self/status; elsewhere it is read by setting it and back."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def default_mode(directory: bool = False) -> int:
    """The mode open() or mkdir() gives a new file or directory: 0o666 / 0o777 less the umask. tempfile's mkstemp
    and mkdtemp create theirs 0o600 / 0o700, which renamed into place would keep every output from the group
    (shared storage on a cluster) whatever the umask says."""
    return (0o777 if directory else 0o666) & ~_umask()


def temporary_file(directory: str | os.PathLike, prefix: str) -> tuple[int, str]:
    """A new file ``<directory>/<prefix>…tmp`` (its descriptor and path) with the mode open() would give it, so
    that renamed into place it is as readable as the umask says (see default_mode)."""
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=prefix, suffix=".tmp")
    os.fchmod(fd, default_mode())
    return fd, tmp


def write_atomic(path: str | os.PathLike, write: Callable[[BinaryIO], object]) -> None:
    """``write(stream)`` into a temporary file next to ``path``, then rename it to ``path`` (mode as the umask
    gives a new file)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = temporary_file(path.parent, f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as stream:
            write(stream)
            stream.flush()
            os.fsync(stream.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(exc, OSError) and exc.errno is not None and exc.filename is None:
            # a failed write() (ENOSPC, EIO) names no file: say which one could not be written
            raise OSError(exc.errno, exc.strerror, str(path)) from exc
        raise


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    write_atomic(path, lambda stream: stream.write(text.encode("utf-8")))


def write_json_atomic(path: str | os.PathLike, payload: dict) -> None:
    write_text_atomic(path, json.dumps(payload, indent=4) + "\n")


_RENAME_EXCHANGE = 2  # linux/fs.h: swap two existing paths in one step


def _exchange(a: Path, b: Path) -> bool:
    """Swap two existing paths atomically with Linux's renameat2(RENAME_EXCHANGE); False where the C library
    or the filesystem cannot (the caller falls back to two renames)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    at_fdcwd = -100
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, f"exchanging {a} and {b}: {os.strerror(err)}")


def replace_dir(staging: str | os.PathLike, target: str | os.PathLike) -> None:
    """Put the fully written directory ``staging`` at ``target``, removing what was there. Readers see the
    old directory or the new one, never neither: an existing target is swapped with the staging directory
    in one step (Linux), then the old one, now under the staging name, is removed. Where the swap is not
    available, the old directory is renamed aside first, leaving a moment with no target."""
    staging, target = Path(staging), Path(target)
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(staging, target)
        return
    if _exchange(staging, target):
        shutil.rmtree(staging)
        return
    old = target.with_name(f".{target.name}.old")
    shutil.rmtree(old, ignore_errors=True)
    os.replace(target, old)
    os.replace(staging, target)
    shutil.rmtree(old)
