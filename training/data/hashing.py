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


def combined_hash(hashes: list[str]) -> str:
    """One data version for several files: the sha256 of their hex digests, in the order given."""
    return hashlib.sha256("".join(hashes).encode()).hexdigest()


# the metadata label `data_version/<chunk>` of each chunk's version in a step over several chunks
# (assets.data.per_source; python -m pipelines.audit reads it back)
PER_SOURCE_DATA_VERSION = "data_version"
