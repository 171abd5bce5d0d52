"""Reading a checkpoint's files as its save recorded them.

Every file a load reads (safetensors, metadata.json, kiln_state.json) is hashed while it is read, and compared
with the sha256 its checkpoint's ``lineage.json`` recorded: what is verified is exactly what is loaded, with no
second pass over the bytes. Of a safetensors file, a load keeps only the bytes of the tensor regions it needs
(``read_hashed_regions``), so a rank loading its shard holds that shard, not whole files. common.json must hold
what lineage.json recorded of it. A file is read only from inside the checkpoint directory: a name that is
not a plain file name, or a symlink resolving outside the directory (e.g. to another step's file), is refused.

A checkpoint without a lineage.json (MindFormers' own, or one assembled by hand) cannot be verified; it loads
only when the caller asks for that explicitly (``allow_unverified``), and what was read is still hashed, so
the loading run's lineage records the digests it trained from (``origin``).
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from training.safetensors_io import (_MAX_HEADER, ITEMSIZE, SafetensorsFile, SafetensorsFileError, parse_header,
                                     region_bytes)

LINEAGE = "lineage.json"
COMMON = "common.json"
_READ_BYTES = 8 << 20  # hashed as read, a piece at a time, while it is still in the CPU's caches
UNVERIFIED_HINT = ("load it unverified on purpose with --load-unverified (python -m training.run) or "
                   "--allow-unverified (kiln export-hf)")


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used; the message names the file (and tensor) at fault."""


def inside(directory: Path, name: str) -> Path:
    """``directory / name``, refused unless reading it stays in ``directory``: a plain file name, not a symlink
    to anywhere else (e.g. another step's file)."""
    directory = Path(directory)
    if not name or name in (".", "..") or "/" in name or os.sep in name:
        raise CheckpointError(f"{directory}: file name {name!r} is not a file of the directory")
    path = directory / name
    if path.is_symlink() and path.resolve().parent != directory.resolve():
        raise CheckpointError(f"{path}: a symlink to {os.readlink(path)}, outside {directory}; its files must be "
                              f"its own (copy the file in, or load that checkpoint)")
    return path


def _open_recorded(path: Path, expected: dict | None, recorded_in: str):
    """``path`` opened for reading without following a symlink, and its size, refused when ``expected`` records
    another size."""
    try:
        fd = os.open(path.resolve(), os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot be read ({exc.strerror})") from None
    stream = os.fdopen(fd, "rb", buffering=0)
    size = os.fstat(stream.fileno()).st_size
    if expected is not None and expected.get("bytes", size) != size:
        stream.close()
        raise CheckpointError(f"{path}: {size} bytes, {recorded_in} recorded {expected['bytes']} when it was "
                              f"written (truncated or replaced); refusing to load it (restore it from a copy, "
                              f"or load another checkpoint)")
    return stream, size


def _read_into(stream, view: memoryview, path: Path, done: int, size: int) -> int:
    count = stream.readinto(view)
    if not count:
        raise CheckpointError(f"{path}: ended at byte {done} of {size} while it was read")
    return count


def _checked(path: Path, digest, expected: dict | None, recorded_in: str) -> str:
    actual = digest.hexdigest()
    if expected is not None and actual != expected["sha256"]:
        raise CheckpointError(f"{path}: sha256 {actual[:16]}… is not the {expected['sha256'][:16]}… {recorded_in} "
                              f"recorded when it was written: the file changed since; refusing to load it (restore "
                              f"it from a copy, or load another checkpoint)")
    return actual


def read_hashed(path: Path, expected: dict | None, recorded_in: str) -> tuple[bytearray, str]:
    """The bytes of ``path`` and their sha256, hashed as they are read; ``expected`` ({"sha256"} and maybe "bytes", as
    ``recorded_in`` holds them) refuses any other bytes. The file is opened without following a symlink."""
    stream, size = _open_recorded(path, expected, recorded_in)
    with stream:
        data, digest, done = bytearray(size), hashlib.sha256(), 0
        view = memoryview(data)
        while done < size:
            count = _read_into(stream, view[done:done + _READ_BYTES], path, done, size)
            digest.update(view[done:done + count])
            done += count
        view.release()
    return data, _checked(path, digest, expected, recorded_in)


def read_hashed_regions(path: Path, expected: dict | None, recorded_in: str,
                        regions: dict[str, list[tuple[slice, ...]]]) -> tuple[SafetensorsFile, str]:
    """A safetensors file read once, hashed as it is read (as ``read_hashed``), keeping of its bytes only those
    holding ``regions`` (tensor name -> boxes of it): the memory a resharded load needs is what it returns, not
    the whole file. A mismatch with ``expected`` is refused before anything read is used; a header that does
    not parse is reported once the whole file is hashed (a changed file is named as changed)."""
    stream, size = _open_recorded(path, expected, recorded_in)
    with stream:
        digest = hashlib.sha256()
        prefix = stream.read(min(8, size))
        length = int.from_bytes(prefix, "little")
        if len(prefix) == 8 and 0 < length <= size - 8 and length < _MAX_HEADER:
            prefix += stream.read(length)
        digest.update(prefix)
        try:
            header = parse_header(path, prefix, size)
            problem = None
        except SafetensorsFileError as exc:
            header, problem = ({}, 0), exc
        spans = _kept_spans(header, regions)
        done, block = len(prefix), bytearray(min(_READ_BYTES, max(size - len(prefix), 0)))
        view, pending = memoryview(block), 0
        while done < size:
            count = _read_into(stream, view[:min(len(block), size - done)], path, done, size)
            digest.update(view[:count])
            while pending < len(spans) and spans[pending][1] <= done:
                pending += 1  # ended before this block (spans sorted by their first byte)
            for first, end, _, _, kept in spans[pending:]:
                if first >= done + count:
                    break
                lo, hi = max(first, done), min(end, done + count)
                if lo < hi:
                    kept[lo - first:hi - first] = view[lo - done:hi - done]
            done += count
        view.release()
    actual = _checked(path, digest, expected, recorded_in)
    if problem is not None:
        raise problem
    kept_by_name: dict[str, list[tuple[int, bytearray]]] = {}
    for first, _, name, tensor_first, kept in spans:
        kept_by_name.setdefault(name, []).append((tensor_first, kept))
    return SafetensorsFile(path, header=header, spans=kept_by_name), actual


def _kept_spans(header: tuple[dict, int], regions: dict[str, list[tuple[slice, ...]]]) -> list[tuple]:
    """(first file byte, end, tensor, first byte within the tensor, buffer) for each region of a tensor the header
    holds, sorted; a region that does not fit the tensor's header shape keeps nothing (the caller's check of
    the shape against the catalog names the mismatch)."""
    entries, data_start = header
    spans = []
    for name, boxes in regions.items():
        entry = entries.get(name)
        if entry is None or entry["dtype"] not in ITEMSIZE:
            continue
        shape = tuple(entry["shape"])
        for box in boxes:
            if len(box) != len(shape) or any(b.stop > n for b, n in zip(box, shape)):
                continue
            first, end = region_bytes(shape, ITEMSIZE[entry["dtype"]], box)
            if first < end:
                at = data_start + entry["data_offsets"][0]
                spans.append((at + first, at + end, name, first, bytearray(end - first)))
    return sorted(spans, key=lambda span: span[0])


def recorded_files(records, where: Path) -> dict[str, dict]:
    """file name -> {"bytes", "sha256"} of a list of file records ({"name", "bytes", "sha256"})."""
    try:
        return {f["name"]: {"bytes": int(f["bytes"]), "sha256": str(f["sha256"])} for f in records}
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{where}: its file records are malformed ({exc!r})") from None


class CheckpointFiles:
    """The files of one checkpoint directory, each read at most once (verified as it is read) and kept for the
    load: ``json``, ``safetensors``. ``recorded`` is None for an unverifiable checkpoint loaded on purpose."""

    def __init__(self, path: Path, allow_unverified: bool = False):
        self.path = Path(path)
        self.real = self.path.resolve()
        self.lineage_sha256: str | None = None
        self.lineage: dict | None = None
        self.recorded: dict[str, dict] | None = None  # file name -> {"bytes", "sha256"} lineage.json recorded
        self.read_sha256: dict[str, str] = {}  # file name -> the sha256 of the bytes read
        self._safetensors: dict[str, SafetensorsFile] = {}
        if self.exists(LINEAGE):
            data = self._read(LINEAGE, verify=False)
            self.lineage_sha256 = self.read_sha256[LINEAGE]
            self.lineage, self.recorded = self._recorded(data)
        if self.recorded is None and not allow_unverified:
            why = "has no lineage.json" if self.lineage is None else "its lineage.json records no files"
            raise CheckpointError(f"{self.path} {why}, so its files cannot be verified against the sha256 its save "
                                  f"recorded (a MindFormers checkpoint?): {UNVERIFIED_HINT}")

    @property
    def verified(self) -> bool:
        return self.recorded is not None

    def _recorded(self, data: bytearray) -> tuple[dict, dict | None]:
        where = self.path / LINEAGE
        try:
            lineage = json.loads(bytes(data))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CheckpointError(f"{where}: unreadable ({exc}); restore it from a copy of the checkpoint") from None
        files = (lineage.get("checkpoint") or {}).get("files") if isinstance(lineage, dict) else None
        if files is None:
            return lineage if isinstance(lineage, dict) else {}, None
        return lineage, recorded_files(files, where)

    def local(self, name: str) -> Path:
        """The file ``name`` of the checkpoint, refused if reading it would leave the checkpoint directory."""
        return inside(self.path, name)

    def exists(self, name: str) -> bool:
        return self.local(name).exists()

    def _expected(self, name: str, verify: bool = True) -> dict | None:
        """What lineage.json recorded of file ``name`` (None: not verified); a file it does not list is refused."""
        expected = self.recorded.get(name) if verify and self.recorded is not None else None
        if verify and self.recorded is not None and expected is None:
            raise CheckpointError(f"{self.local(name)}: not among the files {LINEAGE} recorded when the checkpoint "
                                  f"was saved; remove it, or restore the checkpoint from a copy")
        return expected

    def _read(self, name: str, verify: bool = True) -> bytearray:
        """The bytes of file ``name``, hashed as they are read and compared with the recorded sha256."""
        data, self.read_sha256[name] = read_hashed(self.local(name), self._expected(name, verify), LINEAGE)
        return data

    def json(self, name: str) -> dict:
        """A JSON object file of the checkpoint, verified (common.json against the copy lineage.json holds)."""
        path = self.local(name)
        if not path.exists():
            raise CheckpointError(f"{path}: missing")
        data = self._read(name, verify=name != COMMON)
        try:
            payload = json.loads(bytes(data))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CheckpointError(f"{path}: unreadable ({exc})") from None
        if not isinstance(payload, dict):
            raise CheckpointError(f"{path}: expected a JSON object, found {type(payload).__name__}")
        recorded = (self.lineage or {}).get("checkpoint", {}).get("common") if self.verified else None
        if name == COMMON and recorded is not None and payload != recorded:
            changed = sorted(k for k in set(payload) | set(recorded) if payload.get(k) != recorded.get(k))
            raise CheckpointError(f"{path}: field(s) {', '.join(changed)} differ from what {LINEAGE} recorded when "
                                  f"it was saved; refusing to load it (restore it from a copy)")
        return payload

    def safetensors(self, name: str, regions: dict[str, list[tuple[slice, ...]]] | None = None) -> SafetensorsFile:
        """A safetensors file of the checkpoint, read once (verified as it is read). ``regions`` (tensor name ->
        the boxes of it a load needs): only their bytes are kept, for this caller (a load reads each file
        once); None: the whole file, parsed from memory and kept for the load (a file read whole already is
        that copy, whatever ``regions`` asks)."""
        try:
            if name in self._safetensors:
                return self._safetensors[name]
            if regions is not None:
                reader, self.read_sha256[name] = read_hashed_regions(self.local(name), self._expected(name), LINEAGE,
                                                                     regions)
                return reader
            self._safetensors[name] = SafetensorsFile(self.local(name), self._read(name))
            return self._safetensors[name]
        except SafetensorsFileError as exc:
            raise CheckpointError(str(exc)) from None

    def origin(self) -> dict:
        """What a run that loads this checkpoint records of it in its own lineage: the sha256 of the
        lineage.json it verified the files against (which names every file's), or, unverified, the sha256 of
        every file it read."""
        parts = self.real.parts
        record = {"path": str(self.real), "run_path": "/".join(parts[-3:]), "verified": self.verified}
        if self.verified:
            return {**record, "lineage_sha256": self.lineage_sha256}
        return {**record, "files_read": dict(sorted(self.read_sha256.items()))}
