"""Whole-file writes that never leave a half-written file under the final name: the content goes to a
temporary name in the same directory (same filesystem, so the rename is atomic), is flushed to disk,
and only then renamed over the target."""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import BinaryIO, Callable


def write_atomic(path: str | os.PathLike, write: Callable[[BinaryIO], object]) -> None:
    """``write(stream)`` into a temporary file next to ``path``, then rename it to ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as stream:
            write(stream)
            stream.flush()
            os.fsync(stream.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    write_atomic(path, lambda stream: stream.write(text.encode("utf-8")))


def write_json_atomic(path: str | os.PathLike, payload: dict) -> None:
    write_text_atomic(path, json.dumps(payload, indent=4) + "\n")
