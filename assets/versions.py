"""Code versions derived from the code and config that determine an asset's output.

Dagster marks an asset stale when its code version differs from the one its latest materialization
recorded, so a hand-maintained "v2" is only as good as the memory of whoever edits the code. Here the
version is a hash of the functions' source, the modules' files and the config files the asset reads.
"""
from __future__ import annotations

import hashlib
import inspect
from pathlib import Path
from types import FunctionType, ModuleType

import dagster as dg


def _source_bytes(part) -> bytes:
    if isinstance(part, (FunctionType, ModuleType)):
        return inspect.getsource(part).encode()
    if isinstance(part, (str, Path)):
        path = Path(part)
        if path.is_dir():  # a package: every Python file in it, in a stable order
            return b"".join(p.relative_to(path).as_posix().encode() + p.read_bytes()
                            for p in sorted(path.rglob("*.py")))
        return path.read_bytes() if path.is_file() else f"missing:{path}".encode()
    raise TypeError(f"code_version_of: expected a function, module or path, got {type(part).__name__}")


def code_version_of(*parts) -> str:
    """sha256 (16 hex digits) over ``parts``: functions, modules, files or package directories."""
    digest = hashlib.sha256()
    for part in parts:
        digest.update(_source_bytes(part))
        digest.update(b"\0")
    return digest.hexdigest()[:16]


def versioned_asset(*parts, **asset_kwargs):
    """``@dg.asset(**asset_kwargs)`` whose code version hashes the function (decorator included) and ``parts``."""
    def decorate(fn):
        return dg.asset(code_version=code_version_of(fn, *parts), **asset_kwargs)(fn)
    return decorate
