import hashlib

import pytest

from training.data.corpus import CorpusError, iter_jsonl_documents, scan_jsonl


def _write(tmp_path, data: bytes):
    path = tmp_path / "corpus.jsonl"
    path.write_bytes(data)
    return path


def test_documents_blank_lines_and_empty_texts(tmp_path):
    data = (
        b'{"text": "first", "id": 1}\n'
        b"\n"
        b'   \n'
        b'{"text": ""}\n'
        b'{"text": "caf\xc3\xa9 \\u00e9"}\n'
        b'{"text": "no newline at end"}'
    )
    path = _write(tmp_path, data)
    assert list(iter_jsonl_documents(path)) == [(1, "first"), (5, "café é"), (6, "no newline at end")]
    assert scan_jsonl(path) == {
        "docs": 3,
        "empty_docs": 1,
        "bytes": len(data),
        "sha256": hashlib.sha256(data).hexdigest(),
    }


def test_several_keys_are_joined_by_newline(tmp_path):
    path = _write(tmp_path, b'{"title": "T", "body": "B"}\n{"title": "", "body": ""}\n')
    assert list(iter_jsonl_documents(path, ("title", "body"))) == [(1, "T\nB")]
    assert scan_jsonl(path, ["title", "body"])["empty_docs"] == 1


def test_byte_order_mark_on_first_line_is_accepted(tmp_path):
    path = _write(tmp_path, b'\xef\xbb\xbf{"text": "x"}\n')
    assert list(iter_jsonl_documents(path)) == [(1, "x")]


@pytest.mark.parametrize(
    "bad_line, reason",
    [
        (b'{"text": "caf\xe9"}', "invalid UTF-8 at byte 13"),
        (b'{"text": "unterminated}', "invalid JSON at column 10: Unterminated string"),
        (b'["text"]', "expected a JSON object, got array"),
        (b'"just a string"', "expected a JSON object, got string"),
        (b'{"body": "x"}', "missing key 'text'"),
        (b'{"text": 3}', "key 'text' is number, expected a string"),
        (b'{"text": null}', "key 'text' is null, expected a string"),
        (b'{"text": "\\ud800"}', "key 'text' contains an unpaired surrogate escape"),
    ],
)
def test_bad_line_names_file_and_line(tmp_path, bad_line, reason):
    path = _write(tmp_path, b'{"text": "ok"}\n\n' + bad_line + b"\n")
    expected = f"{path}:3: {reason}"
    with pytest.raises(CorpusError) as err:
        list(iter_jsonl_documents(path))
    assert str(err.value).startswith(expected), str(err.value)
    with pytest.raises(CorpusError) as err:
        scan_jsonl(path)
    assert str(err.value).startswith(expected)


def test_json_keys_must_be_strings(tmp_path):
    path = _write(tmp_path, b'{"text": "x"}\n')
    assert list(iter_jsonl_documents(path, "text")) == [(1, "x")]
    with pytest.raises(ValueError, match="json_keys"):
        list(iter_jsonl_documents(path, ()))
