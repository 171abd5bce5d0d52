"""Reading safetensors files: Kiln's checkpoints, MindFormers' and Hugging Face's.

One reader for all of them. The ``safetensors`` library's numpy path cannot return bfloat16 (MindFormers'
and Hugging Face's usual weight dtype) and its header errors name no tensor, so the header is parsed and
checked here against the file — every entry's dtype, shape and data_offsets, the tensors tiling the data —
and tensors are memory-mapped from it. bfloat16 is widened to float32 (exact); other dtypes stay as stored.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

# safetensors dtype code -> how the bytes are read (bfloat16 as its raw 16 bits, widened in ``get``)
NUMPY_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": np.uint16, "F8_E4M3": np.uint8,
                "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U16": np.uint16,
                "U8": np.uint8, "BOOL": np.bool_}
ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "I16": 2, "F16": 2, "BF16": 2,
            "U32": 4, "I32": 4, "F32": 4, "U64": 8, "I64": 8, "F64": 8}
_MAX_HEADER = 100_000_000  # the format's own limit on the JSON header


class SafetensorsFileError(ValueError):
    """A safetensors file that cannot be read as one; the message names the file and, where it is about
    one, the tensor."""


def widen_bfloat16(bits: np.ndarray) -> np.ndarray:
    """float32 values of raw bfloat16 bits (the upper half of a float32, so exact)."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


def read_header(path: Path) -> tuple[dict, int]:
    """The header's tensor entries (``__metadata__`` left out) and where the data starts, checked against the
    file: an error names the file and the first tensor whose entry does not fit it."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            prefix = f.read(8)
            length = int.from_bytes(prefix, "little")
            if len(prefix) == 8 and 0 < length < _MAX_HEADER:
                prefix += f.read(length)
        size = path.stat().st_size
    except OSError as exc:
        raise SafetensorsFileError(f"{path}: not a readable safetensors file ({exc})") from None
    return parse_header(path, prefix, size)


def parse_header(path: Path, prefix: bytes, size: int) -> tuple[dict, int]:
    """``read_header`` of a file of ``size`` bytes whose first bytes (the length and the header, at least) are
    ``prefix``; ``path`` names it in errors."""
    try:
        length = int.from_bytes(prefix[:8], "little")
        if len(prefix) < 8 or not 0 < length < _MAX_HEADER:
            raise ValueError(f"header length {length}")
        header = json.loads(bytes(prefix[8:8 + length]))
        data_bytes = size - 8 - length
        if not isinstance(header, dict) or data_bytes < 0:
            raise ValueError("no JSON object header" if data_bytes >= 0 else "the file ends inside its header")
    except (ValueError, UnicodeDecodeError) as exc:
        raise SafetensorsFileError(f"{path}: not a readable safetensors file ({exc})") from None
    header.pop("__metadata__", None)
    spans = []
    for name, entry in header.items():
        where = f"{path}: tensor {name}"
        try:
            dtype, shape, (begin, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
        except (TypeError, KeyError, ValueError):
            raise SafetensorsFileError(f"{where}: header entry {entry!r} needs dtype, shape and data_offsets "
                                       f"[begin, end]") from None
        if not isinstance(shape, list) or not all(type(n) is int and n >= 0 for n in shape):
            raise SafetensorsFileError(f"{where}: shape {shape!r} is not a list of sizes")
        if not (type(begin) is int and type(end) is int and 0 <= begin <= end):
            raise SafetensorsFileError(f"{where}: data_offsets {[begin, end]!r} are not byte offsets begin <= end")
        if end > data_bytes:
            raise SafetensorsFileError(f"{where}: data_offsets [{begin}, {end}] run past the {data_bytes} bytes "
                                       f"of data in the file (truncated?)")
        size = math.prod(shape) * ITEMSIZE.get(dtype, 0)
        if dtype in ITEMSIZE and end - begin != size:
            raise SafetensorsFileError(f"{where}: data_offsets [{begin}, {end}] hold {end - begin} bytes, its "
                                       f"{dtype} shape {shape} needs {size}")
        spans.append((begin, end, name))
    position = 0
    for begin, end, name in sorted(spans):  # the format: tensors tile the data, no gap, no overlap
        if begin != position:
            raise SafetensorsFileError(f"{path}: tensor {name}: data starts at byte {begin}, the previous "
                                       f"tensor's ends at {position} (overlapping or misplaced data_offsets)")
        position = end
    if position != data_bytes:
        raise SafetensorsFileError(f"{path}: {data_bytes - position} bytes after the last tensor's data "
                                   f"(not a safetensors file, or its header is wrong)")
    return header, 8 + length


def region_bytes(shape: tuple[int, ...], itemsize: int, region: tuple[slice, ...]) -> tuple[int, int]:
    """The bytes [first, end) of a C-ordered tensor of ``shape`` that hold ``region`` (a box of slices with
    explicit bounds): from its first element to its last; (0, 0) for an empty region."""
    if any(box.stop <= box.start for box in region) or 0 in shape:
        return 0, 0
    strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]
    first = sum(box.start * stride for box, stride in zip(region, strides))
    last = sum((box.stop - 1) * stride for box, stride in zip(region, strides))
    return first * itemsize, (last + 1) * itemsize


class SafetensorsFile:
    """The tensors of one file, read on demand: memory-mapped from the file; or, given ``data`` (the file's
    bytes, read once by a caller that verified them), views of those bytes; or, given ``spans`` (tensor name ->
    [(first byte within the tensor, its bytes from there)], what a caller kept of a file it read once),
    ``region`` views of those."""

    def __init__(self, path: Path, data: bytearray | None = None, *, header: tuple[dict, int] | None = None,
                 spans: dict[str, list[tuple[int, bytearray]]] | None = None):
        self.path = Path(path)
        self.data, self.spans = data, spans
        if header is not None:
            self.header, self.data_start = header
        elif data is None:
            self.header, self.data_start = read_header(self.path)
        else:
            self.header, self.data_start = parse_header(self.path, data, len(data))

    def region(self, name: str, region: tuple[slice, ...]) -> np.ndarray:
        """The stored values of a box of the tensor (bfloat16 as uint16 bits): a view of the bytes kept or
        mapped."""
        if self.spans is None:
            return self.raw(name)[region]
        entry = self.header[name]
        dtype, shape = np.dtype(NUMPY_DTYPES[entry["dtype"]]), tuple(entry["shape"])
        first, end = region_bytes(shape, dtype.itemsize, region)
        region_shape = tuple(box.stop - box.start for box in region)
        if first == end:
            return np.zeros(region_shape, dtype)
        span_first, kept = next(((f, b) for f, b in self.spans.get(name, ()) if f <= first and end <= f + len(b)),
                                (None, None))
        if kept is None:
            raise SafetensorsFileError(f"{self.path}: tensor {name}: bytes {first}-{end} were not kept when it was read")
        strides = tuple(math.prod(shape[d + 1:]) * dtype.itemsize for d in range(len(shape)))
        return np.ndarray(region_shape, dtype, buffer=kept, offset=first - span_first, strides=strides)

    def names(self) -> list[str]:
        return list(self.header)

    def dtype(self, name: str) -> str:
        """The stored dtype's safetensors code (F32, BF16, ...)."""
        return self.header[name]["dtype"]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.header[name]["shape"])

    def raw(self, name: str) -> np.ndarray:
        """The stored values, memory-mapped (bfloat16 as uint16 bits)."""
        if name not in self.header:
            raise SafetensorsFileError(f"{self.path}: no tensor {name}")
        entry = self.header[name]
        if entry["dtype"] not in NUMPY_DTYPES:
            raise SafetensorsFileError(f"{self.path}: tensor {name} has dtype {entry['dtype']}; readable: "
                                       f"{', '.join(NUMPY_DTYPES)}")
        dtype = NUMPY_DTYPES[entry["dtype"]]
        begin, end = entry["data_offsets"]
        if end == begin:
            return np.zeros(entry["shape"], dtype)
        if self.data is not None:
            return np.frombuffer(self.data, dtype, math.prod(entry["shape"]),
                                 self.data_start + begin).reshape(entry["shape"])
        return np.memmap(self.path, dtype=dtype, mode="r", offset=self.data_start + begin,
                         shape=tuple(entry["shape"]))

    def get(self, name: str) -> np.ndarray:
        """The tensor in memory: bfloat16 widened to float32, other dtypes as stored."""
        raw = self.raw(name)
        return widen_bfloat16(raw) if self.dtype(name) == "BF16" else np.array(raw)
