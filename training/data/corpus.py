"""Reading raw JSONL documents, streamed line by line, with errors that name `file:line`."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator, Sequence

_JSON_TYPE_NAMES = {dict: "object", list: "array", str: "string", int: "number", float: "number", bool: "boolean"}


class CorpusError(ValueError):
    """A line of a raw corpus file is unusable; the message starts with `path:line:`."""


def _normalize_keys(json_keys: str | Sequence[str]) -> tuple[str, ...]:
    keys = (json_keys,) if isinstance(json_keys, str) else tuple(json_keys)
    if not keys or not all(isinstance(key, str) and key for key in keys):
        raise ValueError(f"json_keys must be one or more non-empty strings, got {json_keys!r}")
    return keys


def _json_type(value: object) -> str:
    return "null" if value is None else _JSON_TYPE_NAMES.get(type(value), type(value).__name__)


def _parse_line(path: str | os.PathLike, line_no: int, raw: bytes, keys: tuple[str, ...]) -> str | None:
    """The document text of one line; None for a blank line. Raises CorpusError for a bad line."""
    if not raw.strip():
        return None
    try:
        # utf-8-sig on the first line tolerates a byte-order mark written by some editors.
        # The line terminator is not part of the record (json would call a bare \n a control character).
        line = raw.rstrip(b"\r\n").decode("utf-8-sig" if line_no == 1 else "utf-8")
    except UnicodeDecodeError as err:
        raise CorpusError(f"{path}:{line_no}: invalid UTF-8 at byte {err.start} of the line") from None
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise CorpusError(f"{path}:{line_no}: invalid JSON at column {err.colno}: {err.msg}") from None
    if not isinstance(record, dict):
        raise CorpusError(f"{path}:{line_no}: expected a JSON object, got {_json_type(record)}")
    values = []
    for key in keys:
        if key not in record:
            raise CorpusError(f"{path}:{line_no}: missing key {key!r}")
        value = record[key]
        if not isinstance(value, str):
            raise CorpusError(f"{path}:{line_no}: key {key!r} is {_json_type(value)}, expected a string")
        # JSON may escape a lone surrogate (\ud800) that no tokenizer can encode; only lines
        # with a \u escape can carry one, so the rest skip the check.
        if b"\\u" in raw:
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise CorpusError(f"{path}:{line_no}: key {key!r} contains an unpaired surrogate escape") from None
        values.append(value)
    return "\n".join(values) if any(values) else ""


def _iter_texts(path: str | os.PathLike, keys: tuple[str, ...], digest=None) -> Iterator[tuple[int, str]]:
    """(line number, text) for every non-blank line, empty texts included; feeds `digest` every byte."""
    with open(path, "rb") as stream:
        for line_no, raw in enumerate(stream, start=1):
            if digest is not None:
                digest.update(raw)
            text = _parse_line(path, line_no, raw, keys)
            if text is not None:
                yield line_no, text


def iter_jsonl_documents(
    path: str | os.PathLike, json_keys: str | Sequence[str] = ("text",)
) -> Iterator[tuple[int, str]]:
    """Yield `(line_number, text)` for each document of a JSONL file (line numbers from 1).

    With several keys the text is their values joined by a newline. Blank lines and documents
    whose every value is empty are skipped (`scan_jsonl` counts the latter).
    """
    keys = _normalize_keys(json_keys)
    for line_no, text in _iter_texts(path, keys):
        if text:
            yield line_no, text


def scan_jsonl(path: str | os.PathLike, json_keys: str | Sequence[str] = ("text",)) -> dict:
    """Validate every line and hash the file in one streamed pass.

    Returns {"docs": documents with text, "empty_docs": documents with empty text,
    "bytes": file size, "sha256": hex digest of the file}.
    """
    keys = _normalize_keys(json_keys)
    digest = hashlib.sha256()
    docs = empty_docs = 0
    for _, text in _iter_texts(path, keys, digest):
        if text:
            docs += 1
        else:
            empty_docs += 1
    return {"docs": docs, "empty_docs": empty_docs, "bytes": os.path.getsize(path), "sha256": digest.hexdigest()}
