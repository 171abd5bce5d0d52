"""sha256 of files, streamed: the one hashing helper every lineage record uses."""

from __future__ import annotations

import hashlib
import os

_CHUNK_BYTES = 1 << 20


def sha256_file(path: str | os.PathLike) -> str:
    """Hex sha256 of the file at `path`, read in 1 MiB chunks so memory stays flat."""
    digest = hashlib.sha256()
    with open(path, "rb") as stream:
        while chunk := stream.read(_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()
