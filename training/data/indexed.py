"""Megatron-LM indexed dataset (`<prefix>.bin` + `<prefix>.idx`), byte-compatible with Megatron.

Layout of `.idx` (little-endian), as Megatron-core's `_IndexWriter` writes it:

    magic            9 bytes  b"MMIDIDX\\x00\\x00"
    version          uint64   1
    dtype code       uint8    see _DTYPE_CODES
    sequence count   uint64   n
    document count   uint64   len(document_indices)  (number of documents + 1)
    sequence lengths int32[n]
    sequence ptrs    int64[n] byte offset of each sequence in .bin
    document indices int64[document count]  sequence index where each document starts,
                              with a leading 0 and n at the end

`.bin` is the token ids of every sequence, concatenated, in the index's dtype.
Kiln writes one sequence per document, so document_indices is [0, 1, ..., n].
"""

from __future__ import annotations

import array
import hashlib
import os
import struct
from pathlib import Path

import numpy as np

from training.atomic import temporary_file

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER_BYTES = len(MAGIC) + 8 + 1 + 8 + 8  # = 34

_DTYPE_CODES: dict[int, np.dtype] = {
    1: np.dtype(np.uint8),
    2: np.dtype(np.int8),
    3: np.dtype(np.int16),
    4: np.dtype(np.int32),
    5: np.dtype(np.int64),
    6: np.dtype(np.float64),
    7: np.dtype(np.float32),
    8: np.dtype(np.uint16),
}
_CODE_FOR_DTYPE = {dtype: code for code, dtype in _DTYPE_CODES.items()}

_INT32_MAX = np.iinfo(np.int32).max
# Pointer validation works in blocks so checking a 100M-sequence index needs no 100M-sized temporaries.
_VALIDATE_BLOCK = 1 << 20
_SCAN_BLOCK = 1 << 23  # tokens per block when scanning a .bin (check_token_ids)


def token_id_fix(largest: int, vocab_size: int, field: str, negative: str) -> str:
    """What to do about token ids outside [0, ``vocab_size``): ``negative`` says why a negative id is wrong."""
    if largest < vocab_size:
        return negative
    return (f"was it tokenized with a larger vocabulary? Re-tokenize it with the model's tokenizer, or set {field} "
            f"to at least {largest + 1}")


class IndexedDatasetError(ValueError):
    """An indexed dataset file is missing, malformed or inconsistent with its partner file."""


def dtype_for_vocab(vocab_size: int) -> np.dtype:
    """Token dtype for a vocabulary, Megatron's rule: uint16 below 65,500 ids, else int32."""
    if vocab_size <= 0:
        raise ValueError(f"vocab_size must be positive, got {vocab_size}")
    return np.dtype(np.uint16) if vocab_size < 65500 else np.dtype(np.int32)


def _code_for(dtype: np.dtype) -> int:
    dtype = np.dtype(dtype)
    try:
        return _CODE_FOR_DTYPE[dtype]
    except KeyError:
        names = ", ".join(str(d) for d in _CODE_FOR_DTYPE)
        raise ValueError(f"dtype {dtype} has no Megatron code; use one of {names}") from None


def _temp_path_next_to(path: Path) -> Path:
    fd, name = temporary_file(path.parent, path.name + ".")
    os.close(fd)
    return Path(name)


class IndexedDatasetWriter:
    """Writes `<prefix>.bin` and `<prefix>.idx`, one sequence per document.

    Tokens stream to a temporary `.bin` as documents arrive (hashed on the way, so the sha256 costs
    no second read); only the per-sequence lengths stay in memory. `finalize()` is `close()` (write
    the `.idx`, still under a temporary name) then `commit()` (rename both into place); a caller
    writing several datasets closes each and commits them all at the end. Leaving the `with` block
    through an exception (or calling `abort()`) deletes the temporaries, so no half-written dataset
    ever carries the final names.
    """

    def __init__(self, prefix: str | os.PathLike, dtype: np.dtype | type) -> None:
        self.prefix = Path(prefix)
        self.dtype = np.dtype(dtype)
        self._code = _code_for(self.dtype)
        self.bin_path = Path(f"{self.prefix}.bin")
        self.idx_path = Path(f"{self.prefix}.idx")
        self.bin_path.parent.mkdir(parents=True, exist_ok=True)
        self._lengths = array.array("i")  # int32, as in the .idx
        self._num_tokens = 0
        self._bin_tmp = _temp_path_next_to(self.bin_path)
        self._idx_tmp: Path | None = None
        self._bin = open(self._bin_tmp, "wb")
        self._bin_digest = hashlib.sha256()
        self.bin_sha256 = self.idx_sha256 = None
        self._state = "open"

    def __enter__(self) -> "IndexedDatasetWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()
        elif self._state != "committed":
            self.finalize()

    @property
    def num_documents(self) -> int:
        return len(self._lengths)

    @property
    def num_tokens(self) -> int:
        return self._num_tokens

    def _require(self, state: str) -> None:
        if self._state != state:
            raise RuntimeError(f"{self.prefix}: writer is {self._state}, expected {state}")

    def add_document(self, tokens) -> None:
        """Append one document (one sequence) of token ids."""
        self._require("open")
        source = np.asarray(tokens)
        if source.ndim != 1:
            raise ValueError(f"{self.prefix}: document {len(self._lengths)} must be 1-D, got shape {source.shape}")
        values = source.astype(self.dtype, copy=False)
        # A silent wrap-around (e.g. id 70000 into uint16) would corrupt the corpus undetectably.
        if values.dtype != source.dtype and source.size and not np.array_equal(values, source):
            raise ValueError(
                f"{self.prefix}: document {len(self._lengths)} has values that do not fit {self.dtype} "
                f"(min {source.min()}, max {source.max()})"
            )
        if values.size > _INT32_MAX:
            raise ValueError(f"{self.prefix}: document {len(self._lengths)} has {values.size} tokens, over int32")
        self._write(values, np.array([values.size], dtype=np.int32))

    def add_documents(self, lengths, tokens) -> None:
        """Append several documents at once: their `lengths` and their tokens, concatenated, in
        this dataset's dtype (checked: no conversion here, so no value can silently wrap)."""
        self._require("open")
        lengths = np.asarray(lengths, dtype=np.int32)
        tokens = np.asarray(tokens)
        if tokens.dtype != self.dtype or tokens.ndim != 1:
            raise ValueError(f"{self.prefix}: tokens must be a 1-D {self.dtype} array, got {tokens.ndim}-D {tokens.dtype}")
        if int(lengths.sum()) != tokens.size:
            raise ValueError(f"{self.prefix}: {lengths.size} documents of {int(lengths.sum())} tokens in all, "
                             f"but {tokens.size} tokens given")
        self._write(tokens, lengths)

    def _write(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        data = np.ascontiguousarray(tokens, dtype=self.dtype.newbyteorder("<")).data
        self._bin.write(data)
        self._bin_digest.update(data)
        self._lengths.frombytes(lengths.astype(np.int32).tobytes())
        self._num_tokens += int(lengths.sum())

    def close(self) -> None:
        """Finish the `.bin` and write the `.idx`, both still under temporary names."""
        self._require("open")
        try:
            _flush_to_disk(self._bin)  # on disk before the rename, like every file Kiln writes
            self._bin.close()
            self._idx_tmp = _temp_path_next_to(self.idx_path)
            lengths = np.array(self._lengths, dtype=np.int64)
            with open(self._idx_tmp, "wb") as idx:
                self.idx_sha256 = _write_index(idx, self._code, self.dtype.itemsize, lengths)
                _flush_to_disk(idx)
            self.bin_sha256 = self._bin_digest.hexdigest()
        except BaseException:
            self.abort()
            raise
        self._state = "closed"

    def commit(self) -> None:
        """Move both files to their final names."""
        self._require("closed")
        os.replace(self._bin_tmp, self.bin_path)
        # The .idx lands last: a reader never sees a new .idx describing an old .bin.
        os.replace(self._idx_tmp, self.idx_path)
        self._state = "committed"

    def finalize(self) -> None:
        """Write the `.idx` and move both files to their final names."""
        self.close()
        self.commit()

    def abort(self) -> None:
        """Discard everything written so far (files already committed stay)."""
        if self._state == "committed":
            return
        self._state = "aborted"
        self._bin.close()
        for path in (self._bin_tmp, self._idx_tmp):
            if path is not None:
                path.unlink(missing_ok=True)


def _flush_to_disk(stream) -> None:
    stream.flush()
    os.fsync(stream.fileno())


def _write_index(stream, code: int, itemsize: int, lengths: np.ndarray) -> str:
    """Write the `.idx` for sequences of `lengths`; returns its sha256."""
    count = lengths.size
    pointers = np.zeros(count, dtype=np.int64)
    if count > 1:
        np.cumsum(lengths[:-1] * itemsize, out=pointers[1:])
    document_indices = np.arange(count + 1, dtype=np.int64)
    parts = [
        MAGIC,
        struct.pack("<Q", VERSION),
        struct.pack("<B", code),
        struct.pack("<Q", count),
        struct.pack("<Q", document_indices.size),
        lengths.astype("<i4").tobytes(),
        pointers.astype("<i8").tobytes(),
        document_indices.astype("<i8").tobytes(),
    ]
    digest = hashlib.sha256()
    for part in parts:
        stream.write(part)
        digest.update(part)
    return digest.hexdigest()


class IndexedDataset:
    """Reader of `<prefix>.bin/.idx`; validates the pair on open. The index is memory-mapped; the tokens are
    too with `mmap_bin` (Megatron's `mmap_bin_files`), else each `get` reads its tokens from the file (less
    address space and page cache per process, one read per call)."""

    def __init__(self, prefix: str | os.PathLike, mmap_bin: bool = True) -> None:
        self.prefix = Path(prefix)
        self.mmap_bin = mmap_bin
        self.idx_path = Path(f"{self.prefix}.idx")
        self.bin_path = Path(f"{self.prefix}.bin")
        for path in (self.idx_path, self.bin_path):
            if not path.is_file():
                raise IndexedDatasetError(f"{path}: file not found")
        self._read_index()
        self._open_bin()

    def _fail(self, path: Path, what: str) -> IndexedDatasetError:
        return IndexedDatasetError(f"{path}: {what}")

    def _read_index(self) -> None:
        path = self.idx_path
        size = path.stat().st_size
        if size < HEADER_BYTES:
            raise self._fail(path, f"truncated header: expected at least {HEADER_BYTES} bytes, got {size}")
        with open(path, "rb") as stream:
            header = stream.read(HEADER_BYTES)
        magic = header[: len(MAGIC)]
        if magic != MAGIC:
            raise self._fail(path, f"bad magic: expected {MAGIC!r}, got {magic!r}")
        version, code, count, doc_count = struct.unpack("<QBQQ", header[len(MAGIC):])
        if version != VERSION:
            raise self._fail(path, f"bad version: expected {VERSION}, got {version}")
        if code not in _DTYPE_CODES:
            raise self._fail(path, f"bad dtype code: expected one of {sorted(_DTYPE_CODES)}, got {code}")
        if doc_count < 1:
            raise self._fail(path, "document count is 0: expected at least 1 (the leading 0 entry)")
        expected = HEADER_BYTES + count * (4 + 8) + doc_count * 8
        if size != expected:
            raise self._fail(
                path,
                f"size does not match header ({count} sequences, {doc_count} document indices): "
                f"expected {expected} bytes, got {size}"
                + (" (per-sequence modes of multimodal datasets are not supported)" if size == expected + count else ""),
            )
        self._dtype = _DTYPE_CODES[code]
        index = np.memmap(path, mode="r", dtype=np.uint8)
        offset = HEADER_BYTES
        self._lengths = np.frombuffer(index, dtype="<i4", count=count, offset=offset)
        offset += 4 * count
        self._pointers = np.frombuffer(index, dtype="<i8", count=count, offset=offset)
        offset += 8 * count
        self._document_indices = np.frombuffer(index, dtype="<i8", count=doc_count, offset=offset)

        docs = self._document_indices
        if docs[0] != 0:
            raise self._fail(path, f"document_indices[0]: expected 0, got {docs[0]}")
        if docs[-1] != count:
            raise self._fail(path, f"document_indices[-1]: expected {count} (sequence count), got {docs[-1]}")
        steps = np.diff(docs)
        if steps.size and steps.min() < 0:
            bad = int(np.argmax(steps < 0)) + 1
            raise self._fail(path, f"document_indices[{bad}] = {docs[bad]} is below the previous entry {docs[bad - 1]}")

    def _open_bin(self) -> None:
        itemsize = self._dtype.itemsize
        lengths, pointers = self._lengths, self._pointers
        expected_next = 0
        for start in range(0, lengths.size, _VALIDATE_BLOCK):
            block_lengths = lengths[start : start + _VALIDATE_BLOCK].astype(np.int64)
            block_pointers = pointers[start : start + _VALIDATE_BLOCK]
            if block_lengths.min() < 0:
                bad = start + int(np.argmax(block_lengths < 0))
                raise self._fail(self.idx_path, f"sequence_lengths[{bad}] is negative ({lengths[bad]})")
            ends = expected_next + np.cumsum(block_lengths * itemsize)
            expected = np.concatenate(([expected_next], ends[:-1]))
            mismatch = np.flatnonzero(block_pointers != expected)
            if mismatch.size:
                bad = start + int(mismatch[0])
                raise self._fail(
                    self.idx_path,
                    f"sequence_pointers[{bad}]: expected {expected[mismatch[0]]} (sum of previous lengths "
                    f"x {itemsize} bytes), got {pointers[bad]}",
                )
            expected_next = int(ends[-1])
        bin_size = self.bin_path.stat().st_size
        if bin_size != expected_next:
            raise self._fail(
                self.bin_path,
                f"size does not match {self.idx_path.name}: expected {expected_next} bytes "
                f"({expected_next // itemsize} {self._dtype} tokens), got {bin_size}",
            )
        self._num_tokens = bin_size // itemsize
        # np.memmap refuses empty files; an empty dataset simply has no tokens.
        self._tokens = (
            np.memmap(self.bin_path, mode="r", dtype=self._dtype).view(np.ndarray)
            if bin_size and self.mmap_bin
            else None
        )

    def __len__(self) -> int:
        return self._lengths.size

    def get(self, idx: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens of sequence `idx` from `offset`, `length` of them (default: to the end)."""
        count = self._lengths.size
        if not 0 <= idx < count:
            raise IndexError(f"{self.prefix}: sequence {idx} out of range [0, {count})")
        size = int(self._lengths[idx])
        if length is None:
            length = size - offset
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(f"{self.prefix}: sequence {idx} has {size} tokens; cannot read [{offset}, {offset + length})")
        start = int(self._pointers[idx]) // self._dtype.itemsize + offset
        if self._tokens is not None:
            return self._tokens[start : start + length]
        tokens = np.empty(length, self._dtype)
        with open(self.bin_path, "rb", buffering=0) as stream:
            stream.seek(start * self._dtype.itemsize)
            read = stream.readinto(tokens)
        if read != tokens.nbytes:  # the file shrank since it was validated
            raise self._fail(self.bin_path, f"short read: {read} of {tokens.nbytes} bytes at token {start}")
        return tokens

    @property
    def sequence_lengths(self) -> np.ndarray:
        return self._lengths

    @property
    def sequence_pointers(self) -> np.ndarray:
        return self._pointers

    @property
    def document_indices(self) -> np.ndarray:
        return self._document_indices

    @property
    def num_documents(self) -> int:
        return self._document_indices.size - 1

    @property
    def dtype(self) -> np.dtype:
        return self._dtype

    @property
    def num_tokens(self) -> int:
        return self._num_tokens

    def check_token_ids(self, vocab_size: int, field: str) -> None:
        """Every token id is in [0, ``vocab_size``) (``field`` names the setting it comes from), else an error
        naming this shard, the first sequence holding an id outside and the largest id. The .bin is read in
        blocks of _SCAN_BLOCK tokens, so memory stays bounded whatever its size."""
        unsigned = np.issubdtype(self._dtype, np.unsignedinteger)
        if self._num_tokens == 0 or (unsigned and np.iinfo(self._dtype).max < vocab_size):
            return  # the dtype cannot hold an id outside
        tokens = np.memmap(self.bin_path, mode="r", dtype=self._dtype)
        first, largest = None, 0
        for start in range(0, self._num_tokens, _SCAN_BLOCK):
            block = tokens[start : start + _SCAN_BLOCK]
            block_max = block.max()
            if first is None and (block_max >= vocab_size or (not unsigned and block.min() < 0)):
                first = start + int(np.argmax((block >= vocab_size) | (block < 0)))
            largest = max(largest, block_max)
        if first is None:
            return
        sequence = int(np.searchsorted(self._pointers, first * self._dtype.itemsize, side="right")) - 1
        offset = first - int(self._pointers[sequence]) // self._dtype.itemsize
        fix = token_id_fix(largest, vocab_size, field, "negative ids are never valid")
        raise self._fail(self.bin_path, f"token ids up to {largest}, but {field} is {vocab_size} (first outside "
                                        f"[0, {vocab_size}): {tokens[first]} at token {offset} of sequence "
                                        f"{sequence}): {fix}")
