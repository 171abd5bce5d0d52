"""Reading raw corpus files — JSONL, JSON arrays, Parquet — streamed, with bad records named by place.

A record is a JSON object (a Parquet row) whose `json_keys` all hold strings. A record that is not
(invalid JSON, not an object, a missing key, a non-string value, invalid UTF-8) is a `Rejection`
naming where it is:

    JSONL        `file:LINE: reason`              (lines counted from 1)
    JSON array   `file:LINE: element N: reason`   (the line the element starts on; N from 0)
    Parquet      `file:row N: reason`             (N from 0)

`BadRecords` applies the `on_bad_line` policy to them: "error" raises `CorpusError` with that
message, "skip" counts them by reason and streams them to a quarantine file.

Nothing here holds a whole file: JSONL is read line by line (or by byte range, see
`parse_jsonl_chunk`), JSON arrays by an incremental parser over a buffered read, Parquet by row
batches. pyarrow is imported only when a Parquet file is read: it is slow to import, and
`kiln preprocess` pays every import in its start-up.
"""

from __future__ import annotations

import codecs
import json
import os
import re
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import orjson

from training.atomic import temporary_file
from training.data.hashing import sha256_file

ON_BAD_LINE = ("error", "skip")
REASONS = ("invalid_json", "not_an_object", "missing_key", "not_a_string", "invalid_utf8")
SUFFIXES = (".jsonl", ".ndjson", ".json", ".parquet")

_JSON_TYPE_NAMES = {dict: "object", list: "array", str: "string", int: "number", float: "number", bool: "boolean"}
_READ_BLOCK = 1 << 20
# A JSON array element the incremental parser cannot complete within this many bytes is an error,
# so one broken element cannot make the parser buffer the rest of a huge file.
MAX_ELEMENT_BYTES = 1 << 30
_PARQUET_BATCH_ROWS = 1024
_WHITESPACE = re.compile(r"[ \t\r\n]*")  # JSON's whitespace


class CorpusError(ValueError):
    """A raw corpus file or record is unusable; the message starts with `path:place:`."""


class BadRecord(Exception):
    """Raised by the parsers for one bad record; `reason` is one of REASONS."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True)
class Record:
    place: dict  # {"line": 3} | {"line": 7, "element": 5} | {"row": 12}
    values: tuple[str, ...]  # one per json key


@dataclass(frozen=True)
class Rejection:
    path: str
    place: dict
    reason: str
    detail: str
    raw: str  # the record's text as read, for the quarantine file

    @property
    def message(self) -> str:
        return f"{self.path}:{format_place(self.place)}: {self.detail}"


def format_place(place: dict) -> str:
    if "row" in place:
        return f"row {place['row']}"
    if "element" in place:
        return f"{place['line']}: element {place['element']}"
    return str(place["line"])


def normalize_keys(json_keys: str | Sequence[str]) -> tuple[str, ...]:
    keys = (json_keys,) if isinstance(json_keys, str) else tuple(json_keys)
    if not keys or not all(isinstance(key, str) and key for key in keys):
        raise ValueError(f"json_keys must be one or more non-empty strings, got {json_keys!r}")
    if len(set(keys)) != len(keys):
        raise ValueError(f"json_keys has duplicates: {list(keys)}")
    return keys


def check_on_bad_line(on_bad_line: str) -> str:
    if on_bad_line not in ON_BAD_LINE:
        raise ValueError(f"on_bad_line must be one of {list(ON_BAD_LINE)}, got {on_bad_line!r}")
    return on_bad_line


def _json_type(value: object) -> str:
    return "null" if value is None else _JSON_TYPE_NAMES.get(type(value), type(value).__name__)


def record_values(record: object, keys: tuple[str, ...], check_surrogates: bool) -> tuple[str, ...]:
    """The string under each key; raises BadRecord. `check_surrogates`: the text may hold lone
    surrogates (from a \\ud800 escape or undecodable bytes) that no tokenizer can encode."""
    if not isinstance(record, dict):
        raise BadRecord("not_an_object", f"expected a JSON object, got {_json_type(record)}")
    values = []
    for key in keys:
        if key not in record:
            raise BadRecord("missing_key", f"missing key {key!r}")
        value = record[key]
        if not isinstance(value, str):
            raise BadRecord("not_a_string", f"key {key!r} is {_json_type(value)}, expected a string")
        if check_surrogates:
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise BadRecord("invalid_utf8", f"key {key!r} contains an unpaired surrogate escape or invalid UTF-8") from None
        values.append(value)
    return tuple(values)


# ---------------------------------------------------------------------------------------------- JSONL

def parse_jsonl_line(raw: bytes, keys: tuple[str, ...], first_in_file: bool) -> tuple[str, ...] | None:
    """The values of one JSONL line (its terminator may be included); None for a blank line.
    Raises BadRecord. This is the hot loop of preprocessing: no copies of the line but the decode."""
    if raw.isspace() or not raw:
        return None
    if raw.endswith((b"\n", b"\r")):
        # not part of the record: an unterminated string would be reported as a control character
        raw = raw.rstrip(b"\r\n")
    try:
        # utf-8-sig on the first line tolerates a byte-order mark written by some editors
        line = raw.decode("utf-8-sig" if first_in_file else "utf-8")
    except UnicodeDecodeError as err:
        raise BadRecord("invalid_utf8", f"invalid UTF-8 at byte {err.start} of the line") from None
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise BadRecord("invalid_json", f"invalid JSON at column {err.colno}: {err.msg}") from None
    # only a line with a \u escape can carry a lone surrogate, so the others skip the check
    return record_values(record, keys, check_surrogates=b"\\u" in raw)


def _fast_values(line: bytes, keys: tuple[str, ...]) -> tuple[str, ...] | None:
    """The values of a plain good record line, or None for anything else (the careful path then
    says what is wrong). orjson is strict where json is lenient (NaN, lone surrogates), so a line
    it refuses still gets the careful path's verdict."""
    try:
        record = orjson.loads(line)
    except orjson.JSONDecodeError:
        return None
    if type(record) is not dict:
        return None
    try:
        values = tuple([record[key] for key in keys])
    except KeyError:
        return None
    return values if all(type(value) is str for value in values) else None


def parse_jsonl_chunk(data: bytes, keys: tuple[str, ...], at_file_start: bool):
    """Parse whole lines of JSONL (a byte range of a file that starts at a line start).

    Returns (records, rejected, line_count): records are (line index in the chunk, values),
    rejected are (line index, reason, detail, raw text); the caller adds the chunk's first line
    number, which only it knows. This is the hot loop of preprocessing: each line is parsed by
    orjson (2.5x the speed of json on prose); a line that is not a plain good record goes through
    `parse_jsonl_line`, which says why.
    """
    records, rejected = [], []
    lines = data.split(b"\n")
    if lines[-1] == b"":
        lines.pop()  # the terminator of the last line starts no new line
    for index, raw in enumerate(lines):
        if raw[:1] == b"{" and (values := _fast_values(raw, keys)) is not None:
            records.append((index, values))
            continue
        try:
            values = parse_jsonl_line(raw, keys, at_file_start and index == 0)
        except BadRecord as bad:
            rejected.append((index, bad.reason, bad.detail, raw.decode("utf-8", "backslashreplace")))
            continue
        if values is not None:
            records.append((index, values))
    return records, rejected, len(lines)


def _iter_jsonl(path: Path, keys: tuple[str, ...]) -> Iterator[Record | Rejection]:
    with open(path, "rb") as stream:
        for line_no, raw in enumerate(stream, start=1):
            try:
                values = parse_jsonl_line(raw, keys, line_no == 1)
            except BadRecord as bad:
                yield Rejection(str(path), {"line": line_no}, bad.reason, bad.detail,
                                raw.rstrip(b"\r\n").decode("utf-8", "backslashreplace"))
                continue
            if values is not None:
                yield Record({"line": line_no}, values)


def jsonl_ranges(path: Path, chunk_bytes: int) -> Iterator[tuple[int, int]]:
    """Byte ranges of about `chunk_bytes` that each hold whole lines, covering the file."""
    size = path.stat().st_size
    with open(path, "rb") as stream:
        start = 0
        while start < size:
            end = _line_start_at_or_after(stream, start + chunk_bytes, size)
            yield start, end
            start = end


def _line_start_at_or_after(stream, position: int, size: int) -> int:
    """The offset just past the first newline at or after `position - 1` (or the file size)."""
    if position >= size:
        return size
    stream.seek(position - 1)
    offset = position - 1
    # read in blocks, not readline(): one huge line must not be pulled into memory whole
    while block := stream.read(1 << 16):
        newline = block.find(b"\n")
        if newline >= 0:
            return offset + newline + 1
        offset += len(block)
    return size


# ----------------------------------------------------------------------------------------- JSON array

class _JsonArrayReader:
    """Elements of a file holding one top-level JSON array, parsed one at a time.

    `json.JSONDecoder.raw_decode` parses an element from a text buffer that is refilled as needed;
    the buffer only ever holds the current element plus one read block. Bytes that are not UTF-8
    decode to lone surrogates (surrogateescape), so the element that holds them is rejected as
    invalid UTF-8 rather than the file failing. A syntax error cannot be skipped: nothing marks
    where the next element starts, so it always raises CorpusError.
    """

    def __init__(self, path: Path, stream) -> None:
        self.path = path
        self._stream = stream
        self._decoder = json.JSONDecoder()
        self._text_decoder = codecs.getincrementaldecoder("utf-8-sig")(errors="surrogateescape")
        self._buffer = ""
        self._pos = 0
        self._line = 1  # line number at self._pos
        self._eof = False

    def elements(self) -> Iterator[tuple[int, int, object, str]]:
        """(line, index, value, raw text) of each element."""
        self._expect("[", "expected a JSON array (the file's first character must be '[')")
        if self._peek() == "]":
            self._advance(1)
        else:
            index = 0
            while True:
                yield self._element(index)
                index += 1
                separator = self._peek()
                if separator == "]":
                    self._advance(1)
                    break
                self._expect(",", f"expected ',' or ']' after element {index - 1}")
        if self._peek() != "":
            self._fail("unexpected data after the closing ']'")

    def _element(self, index: int) -> tuple[int, int, object, str]:
        self._peek()  # to the element's first character
        line = self._line
        while True:
            try:
                value, end = self._decoder.raw_decode(self._buffer, self._pos)
            except json.JSONDecodeError as err:
                if self._eof or not self._may_be_truncated(err):
                    self._fail(f"element {index}: invalid JSON: {err.msg}", at=err.pos)
                self._read_more(index)
                continue
            if end == len(self._buffer) and not self._eof:
                self._read_more(index)  # a number at the buffer's end may go on in the next block
                continue
            raw = self._buffer[self._pos:end]
            self._advance(end - self._pos)
            return line, index, value, raw

    def _may_be_truncated(self, err: json.JSONDecodeError) -> bool:
        # An unterminated string, or an error in the buffer's last few characters (a split
        # escape, number or literal), may only mean the element goes on in the next block.
        return err.msg.startswith("Unterminated string") or err.pos >= len(self._buffer) - 16

    def _read_more(self, index: int) -> None:
        if len(self._buffer) - self._pos > MAX_ELEMENT_BYTES:
            self._fail(f"element {index} is longer than {MAX_ELEMENT_BYTES} bytes or not valid JSON")
        # at least as much as is buffered: an element spanning many blocks is re-parsed only
        # a logarithmic number of times
        block = self._stream.read(max(_READ_BLOCK, len(self._buffer) - self._pos))
        self._eof = not block
        self._buffer = self._buffer[self._pos:] + self._text_decoder.decode(block, final=self._eof)
        self._pos = 0

    def _peek(self) -> str:
        """The next non-whitespace character ('' at the end of the file), skipping whitespace."""
        while True:
            self._advance(_WHITESPACE.match(self._buffer, self._pos).end() - self._pos)
            if self._pos < len(self._buffer) or self._eof:
                return self._buffer[self._pos:self._pos + 1]
            self._read_more(-1)

    def _expect(self, char: str, message: str) -> None:
        if self._peek() != char:
            self._fail(message)
        self._advance(1)

    def _advance(self, count: int) -> None:
        self._line += self._buffer.count("\n", self._pos, self._pos + count)
        self._pos += count

    def _fail(self, message: str, at: int | None = None) -> None:
        line = self._line
        if at is not None:
            line += self._buffer.count("\n", self._pos, at)
        raise CorpusError(f"{self.path}:{line}: {message}")


def _iter_json_array(path: Path, keys: tuple[str, ...]) -> Iterator[Record | Rejection]:
    with open(path, "rb") as stream:
        for line, index, value, raw in _JsonArrayReader(path, stream).elements():
            place = {"line": line, "element": index}
            try:
                values = record_values(value, keys, check_surrogates=True)
            except BadRecord as bad:
                yield Rejection(str(path), place, bad.reason, bad.detail, raw.encode("utf-8", "surrogateescape")
                                .decode("utf-8", "backslashreplace"))
                continue
            yield Record(place, values)


# -------------------------------------------------------------------------------------------- Parquet

def _parquet_columns(path: Path, keys: tuple[str, ...]):
    import pyarrow as pa  # slow to import, and only Parquet needs it
    import pyarrow.parquet as pq

    parquet = pq.ParquetFile(path)
    schema = parquet.schema_arrow
    for key in keys:
        # A missing or non-text column is a property of the whole file, not of a row: always an error.
        if key not in schema.names:
            raise CorpusError(f"{path}: no column {key!r} (columns: {', '.join(schema.names)})")
        kind = schema.field(key).type
        if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_binary(kind)
                or pa.types.is_large_binary(kind)):
            raise CorpusError(f"{path}: column {key!r} has type {kind}, expected a string column")
    return parquet


def _parquet_value(value: object, key: str) -> str:
    if value is None:
        raise BadRecord("not_a_string", f"key {key!r} is null, expected a string")
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError as err:
            raise BadRecord("invalid_utf8", f"key {key!r}: invalid UTF-8 at byte {err.start}") from None
    return value


def _iter_parquet(path: Path, keys: tuple[str, ...]) -> Iterator[Record | Rejection]:
    row = 0
    for batch in _parquet_columns(path, keys).iter_batches(batch_size=_PARQUET_BATCH_ROWS, columns=list(keys)):
        for raw_values in zip(*(batch.column(key).to_pylist() for key in keys)):
            place = {"row": row}
            row += 1
            try:
                values = tuple(_parquet_value(value, key) for value, key in zip(raw_values, keys))
            except BadRecord as bad:
                raw = json.dumps(dict(zip(keys, raw_values)), default=repr, ensure_ascii=False)
                yield Rejection(str(path), place, bad.reason, bad.detail, raw)
                continue
            yield Record(place, values)


# ------------------------------------------------------------------------------------------- any file

def file_format(path: str | os.PathLike) -> str:
    """"jsonl", "json" (one top-level array) or "parquet", from the suffix; a `.json` file whose
    first character is not '[' is read as JSON lines."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        return "parquet"
    if suffix in (".jsonl", ".ndjson"):
        return "jsonl"
    if suffix == ".json":
        with open(path, "rb") as stream:
            head = stream.read(4096).lstrip(b"\xef\xbb\xbf \t\r\n")
        return "json" if head.startswith(b"[") else "jsonl"
    raise CorpusError(f"{path}: unsupported file type {suffix!r}; expected one of {', '.join(SUFFIXES)}")


def iter_records(path: str | os.PathLike, json_keys: str | Sequence[str] = ("text",)) -> Iterator[Record | Rejection]:
    """Every record of a file, in order, as a Record or (for a bad one) a Rejection."""
    path = Path(path)
    readers = {"jsonl": _iter_jsonl, "json": _iter_json_array, "parquet": _iter_parquet}
    return readers[file_format(path)](path, normalize_keys(json_keys))


class BadRecords:
    """Applies `on_bad_line` to rejections: "error" raises CorpusError naming the record;
    "skip" counts them by reason and, given a path, writes them to a JSONL quarantine file
    (file, line/element/row, reason, detail, raw) under a temporary name until `commit()`."""

    def __init__(self, on_bad_line: str = "error", quarantine_path: str | os.PathLike | None = None) -> None:
        self.on_bad_line = check_on_bad_line(on_bad_line)
        self.counts: Counter[str] = Counter()
        self.quarantine_path = Path(quarantine_path) if quarantine_path is not None else None
        self._stream = None
        self._temp: Path | None = None

    def __call__(self, rejection: Rejection) -> None:
        if self.on_bad_line == "error":
            raise CorpusError(rejection.message)
        self.counts[rejection.reason] += 1
        if self.quarantine_path is not None:
            if self._stream is None:
                self.quarantine_path.parent.mkdir(parents=True, exist_ok=True)
                fd, name = temporary_file(self.quarantine_path.parent, self.quarantine_path.name + ".")
                self._temp, self._stream = Path(name), os.fdopen(fd, "w", encoding="utf-8")
            entry = {"file": rejection.path, **rejection.place, "reason": rejection.reason,
                     "detail": rejection.detail, "raw": rejection.raw}
            self._stream.write(json.dumps(entry, ensure_ascii=False) + "\n")

    @property
    def skipped(self) -> int:
        return sum(self.counts.values())

    def commit(self) -> None:
        """Move the quarantine file into place; with nothing skipped, remove one left by an earlier run."""
        if self.quarantine_path is None:
            return
        if self._stream is None:
            self.quarantine_path.unlink(missing_ok=True)
            return
        self._stream.flush()
        os.fsync(self._stream.fileno())  # on disk before the rename, like every file Kiln writes
        self._stream.close()
        os.replace(self._temp, self.quarantine_path)

    def discard(self) -> None:
        if self._stream is not None:
            self._stream.close()
            self._temp.unlink(missing_ok=True)


def iter_texts(path: str | os.PathLike, json_keys: str | Sequence[str] = ("text",),
               on_bad_line: str = "error") -> Iterator[str]:
    """Every non-empty value of every key, in order (a tokenizer's training text)."""
    bad = BadRecords(on_bad_line)
    for item in iter_records(path, json_keys):
        if isinstance(item, Rejection):
            bad(item)
            continue
        yield from (value for value in item.values if value)


def scan_corpus(path: str | os.PathLike, json_keys: str | Sequence[str] = ("text",), on_bad_line: str = "error") -> dict:
    """Validate every record of a file and hash it.

    Returns {"docs": records with some text, "empty_docs": records whose every value is empty,
    "skipped": bad records skipped (0 unless on_bad_line="skip"), "skipped_by_reason": {reason: n},
    "bytes": file size, "sha256": hex digest of the file}.
    """
    bad = BadRecords(on_bad_line)
    docs = empty_docs = 0
    for item in iter_records(path, json_keys):
        if isinstance(item, Rejection):
            bad(item)
        elif any(item.values):
            docs += 1
        else:
            empty_docs += 1
    return {"docs": docs, "empty_docs": empty_docs, "skipped": bad.skipped, "skipped_by_reason": dict(bad.counts),
            "bytes": os.path.getsize(path), "sha256": sha256_file(path)}


# The name the built-in corpus tests call it by.
scan_jsonl = scan_corpus
