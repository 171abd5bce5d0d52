import hashlib
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from training.data import corpus
from training.data.corpus import (
    BadRecords,
    CorpusError,
    Record,
    Rejection,
    file_format,
    iter_records,
    iter_texts,
    jsonl_ranges,
    parse_jsonl_chunk,
    scan_corpus,
)


def _write(tmp_path, data: bytes, name="corpus.jsonl"):
    path = tmp_path / name
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
    assert list(iter_texts(path)) == ["first", "café é", "no newline at end"]
    assert [r.place for r in iter_records(path)] == [{"line": 1}, {"line": 4}, {"line": 5}, {"line": 6}]
    assert scan_corpus(path) == {
        "docs": 3,
        "empty_docs": 1,
        "skipped": 0,
        "skipped_by_reason": {},
        "bytes": len(data),
        "sha256": hashlib.sha256(data).hexdigest(),
    }


def test_several_keys_give_one_value_each(tmp_path):
    path = _write(tmp_path, b'{"title": "T", "body": "B"}\n{"title": "", "body": ""}\n{"title": "", "body": "C"}\n')
    assert [r.values for r in iter_records(path, ("title", "body"))] == [("T", "B"), ("", ""), ("", "C")]
    assert list(iter_texts(path, ["title", "body"])) == ["T", "B", "C"]
    assert scan_corpus(path, ["title", "body"])["empty_docs"] == 1


def test_byte_order_mark_on_first_line_is_accepted(tmp_path):
    path = _write(tmp_path, b'\xef\xbb\xbf{"text": "x"}\n')
    assert list(iter_texts(path)) == ["x"]


BAD_LINES = [
    (b'{"text": "caf\xe9"}', "invalid_utf8", "invalid UTF-8 at byte 13"),
    (b'{"text": "unterminated}', "invalid_json", "invalid JSON at column 10: Unterminated string"),
    (b'["text"]', "not_an_object", "expected a JSON object, got array"),
    (b'"just a string"', "not_an_object", "expected a JSON object, got string"),
    (b'{"body": "x"}', "missing_key", "missing key 'text'"),
    (b'{"text": 3}', "not_a_string", "key 'text' is number, expected a string"),
    (b'{"text": null}', "not_a_string", "key 'text' is null, expected a string"),
    (b'{"text": "\\ud800"}', "invalid_utf8", "key 'text' contains an unpaired surrogate escape"),
]


@pytest.mark.parametrize("bad_line, reason, detail", BAD_LINES)
def test_bad_line_names_file_and_line(tmp_path, bad_line, reason, detail):
    path = _write(tmp_path, b'{"text": "ok"}\n\n' + bad_line + b"\n")
    expected = f"{path}:3: {detail}"
    with pytest.raises(CorpusError) as err:
        list(iter_texts(path))
    assert str(err.value).startswith(expected), str(err.value)
    with pytest.raises(CorpusError) as err:
        scan_corpus(path)
    assert str(err.value).startswith(expected)
    rejection = [r for r in iter_records(path) if isinstance(r, Rejection)][0]
    assert rejection.reason == reason and rejection.place == {"line": 3}


def test_skip_counts_by_reason_and_keeps_the_rest(tmp_path):
    path = _write(tmp_path, b"\n".join([b'{"text": "a"}', b'{"text": 3}', b"{", b'{"x": 1}', b'{"text": "b"}']))
    assert list(iter_texts(path, on_bad_line="skip")) == ["a", "b"]
    scan = scan_corpus(path, on_bad_line="skip")
    assert scan["docs"] == 2 and scan["skipped"] == 3
    assert scan["skipped_by_reason"] == {"not_a_string": 1, "invalid_json": 1, "missing_key": 1}


def test_quarantine_file_is_written_only_on_commit(tmp_path):
    quarantine = tmp_path / "q.jsonl"
    bad = BadRecords("skip", quarantine)
    bad(Rejection("f.jsonl", {"line": 7}, "missing_key", "missing key 'text'", '{"x": "caf\\xe9"}'))
    assert not quarantine.exists()
    bad.commit()
    assert [json.loads(line) for line in quarantine.read_text().splitlines()] == [
        {"file": "f.jsonl", "line": 7, "reason": "missing_key", "detail": "missing key 'text'", "raw": '{"x": "caf\\xe9"}'}]

    failed = BadRecords("skip", tmp_path / "other.jsonl")
    failed(Rejection("f.jsonl", {"line": 1}, "invalid_json", "x", "{"))
    failed.discard()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["q.jsonl"]

    clean = BadRecords("skip", quarantine)
    clean.commit()  # nothing skipped this time: the old quarantine file would be misleading
    assert not quarantine.exists()


def test_on_bad_line_and_keys_are_checked(tmp_path):
    path = _write(tmp_path, b'{"text": "x"}\n')
    assert list(iter_texts(path, "text")) == ["x"]
    with pytest.raises(ValueError, match="json_keys"):
        list(iter_texts(path, ()))
    with pytest.raises(ValueError, match="on_bad_line must be one of"):
        BadRecords("ignore")


def test_jsonl_ranges_hold_whole_lines_and_cover_the_file(tmp_path):
    lines = [json.dumps({"text": "x" * n}).encode() for n in (1, 50, 3, 200, 7, 0, 90)]
    data = b"\n".join(lines) + b"\n"
    path = _write(tmp_path, data)
    ranges = list(jsonl_ranges(path, 64))
    assert ranges[0][0] == 0 and ranges[-1][1] == len(data)
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    assert all(data[end - 1:end] == b"\n" for _, end in ranges)
    texts = []
    for start, end in ranges:
        records, rejected, count = parse_jsonl_chunk(data[start:end], ("text",), start == 0)
        assert rejected == [] and count == data[start:end].count(b"\n")
        texts += [values[0] for _, values in records]
    assert texts == ["x" * n for n in (1, 50, 3, 200, 7, 0, 90)]


def test_jsonl_chunk_reports_line_index_and_raw_text():
    records, rejected, count = parse_jsonl_chunk(b'{"text": "a"}\n\n{"text": 1}\n{"text": "b"}', ("text",), False)
    assert records == [(0, ("a",)), (3, ("b",))]
    assert rejected == [(2, "not_a_string", "key 'text' is number, expected a string", '{"text": 1}')]
    assert count == 4


TRICKY_LINES = [
    b'{"text": "plain"}', b'{"text": "caf\xc3\xa9 \\u00e9"}', b'{"text": "tab\\tnew\\nline"}\r',
    b'{"text": "a"}  ', b'  {"text": "leading space"}', b'{"text": "a"}{"text": "b"}', b'{"text": "a"}, 5',
    b'{"text": "\\ud800 lone"}', b'{"text": "\\ud83d\\ude00 pair"}', b'{"text": ["list"]}', b'{"txt": "x"}',
    b'["text"]', b'{"text": "unterminated', b'{"text": "bad \xff byte"}', b'\xef\xbb\xbf{"text": "bom"}',
    b'{"text": "x", "text": 7}', b'   ', b'{"text": NaN}', b'{"text": "dup", "text": "last"}',
]


@pytest.mark.parametrize("first", [0, 14])
@pytest.mark.parametrize("with_invalid_utf8", [False, True])  # True: the whole chunk takes the careful path
def test_jsonl_chunk_agrees_with_the_line_parser_on_every_line(first, with_invalid_utf8):
    """The chunk parser's fast path must give each line exactly the careful parser's verdict."""
    lines = TRICKY_LINES[first:] + TRICKY_LINES[:first]
    lines = [line for line in lines if with_invalid_utf8 or b"\xff" not in line]
    records, rejected, count = parse_jsonl_chunk(b"\n".join(lines) + b"\n", ("text",), True)
    expected_records, expected_rejected = [], []
    for index, raw in enumerate(lines):
        try:
            values = corpus.parse_jsonl_line(raw, ("text",), index == 0)
        except corpus.BadRecord as bad:
            expected_rejected.append((index, bad.reason, bad.detail))
            continue
        if values is not None:
            expected_records.append((index, values))
    assert records == expected_records
    assert [r[:3] for r in rejected] == expected_rejected
    assert count == len(lines)
    assert {r[1] for r in rejected} >= {"invalid_json", "invalid_utf8", "not_a_string", "missing_key",
                                        "not_an_object"}


# ------------------------------------------------------------------------------------- JSON arrays

ARRAY = (
    '[\n'
    '  {"text": "one", "n": 1},\n'
    '  {"text": "tw\\u00f6 \\"quoted\\" [x]"},\n'
    '\n'
    '  {"text": ""}, {"text": "four"}\n'
    ']\n'
)


@pytest.mark.parametrize("block", [1, 3, 7, 1 << 20])
def test_json_array_is_streamed_across_read_blocks(tmp_path, monkeypatch, block):
    monkeypatch.setattr(corpus, "_READ_BLOCK", block)
    path = _write(tmp_path, ARRAY.encode(), "a.json")
    assert file_format(path) == "json"
    records = list(iter_records(path))
    assert records == [
        Record({"line": 2, "element": 0}, ("one",)),
        Record({"line": 3, "element": 1}, ('twö "quoted" [x]',)),
        Record({"line": 5, "element": 2}, ("",)),
        Record({"line": 5, "element": 3}, ("four",)),
    ]


@pytest.mark.parametrize("block", [2, 1 << 20])
def test_json_array_bad_elements_name_line_and_element(tmp_path, monkeypatch, block):
    monkeypatch.setattr(corpus, "_READ_BLOCK", block)
    data = b'[{"text": "ok"},\n 12345,\n {"text": 7},\n {"text": "caf\xe9"},\n {"text": "fine"}]'
    path = _write(tmp_path, data, "a.json")
    with pytest.raises(CorpusError, match=rf"^{path}:2: element 1: expected a JSON object, got number$"):
        list(iter_texts(path))
    items = list(iter_records(path))
    assert [(type(i).__name__, i.place["element"]) for i in items] == [
        ("Record", 0), ("Rejection", 1), ("Rejection", 2), ("Rejection", 3), ("Record", 4)]
    assert [i.reason for i in items if isinstance(i, Rejection)] == ["not_an_object", "not_a_string", "invalid_utf8"]
    assert items[3].raw == '{"text": "caf\\xe9"}'
    assert list(iter_texts(path, on_bad_line="skip")) == ["ok", "fine"]


@pytest.mark.parametrize(
    "data, message",
    [
        (b'[{"text": "x"},\n {"text": }]', r":2: element 1: invalid JSON: Expecting value"),
        (b'[{"text": "x"} {"text": "y"}]', r":1: expected ',' or ']' after element 0"),
        (b'[{"text": "x"}', r":1: expected ',' or ']' after element 0"),
        (b'[{"text": "x"}] trailing', r":1: unexpected data after the closing"),
    ],
)
def test_json_array_syntax_errors_fail_even_when_skipping(tmp_path, data, message):
    path = _write(tmp_path, data, "a.json")
    for policy in ("error", "skip"):
        with pytest.raises(CorpusError, match=message):
            list(iter_texts(path, on_bad_line=policy))


def test_json_suffix_holding_json_lines_is_read_as_jsonl(tmp_path):
    path = _write(tmp_path, b'{"text": "a"}\n{"text": "b"}\n', "lines.json")
    assert file_format(path) == "jsonl"
    assert list(iter_texts(path)) == ["a", "b"]
    with pytest.raises(CorpusError, match=r"unsupported file type '\.txt'"):
        file_format(_write(tmp_path, b"x", "notes.txt"))


# ----------------------------------------------------------------------------------------- Parquet

def test_parquet_rows_in_batches(tmp_path, monkeypatch):
    monkeypatch.setattr(corpus, "_PARQUET_BATCH_ROWS", 2)
    path = tmp_path / "c.parquet"
    pq.write_table(pa.table({"text": ["a", None, "", "d", "e"], "title": ["t1", "t2", "t3", "t4", "t5"]}), path,
                   row_group_size=3)
    items = list(iter_records(path, ("text", "title")))
    assert [i.place for i in items] == [{"row": n} for n in range(5)]
    assert isinstance(items[1], Rejection) and items[1].message == f"{path}:row 1: key 'text' is null, expected a string"
    assert items[1].raw == '{"text": null, "title": "t2"}'
    assert list(iter_texts(path, ("text",), on_bad_line="skip")) == ["a", "d", "e"]
    with pytest.raises(CorpusError, match=r":row 1: key 'text' is null"):
        scan_corpus(path)


def test_parquet_binary_column_must_be_utf8(tmp_path):
    path = tmp_path / "b.parquet"
    pq.write_table(pa.table({"text": pa.array([b"ok", b"caf\xe9"], pa.binary())}), path)
    with pytest.raises(CorpusError, match=r":row 1: key 'text': invalid UTF-8 at byte 3"):
        list(iter_texts(path))


@pytest.mark.parametrize("table, message", [
    (pa.table({"body": ["x"]}), r"no column 'text' \(columns: body\)"),
    (pa.table({"text": [1]}), r"column 'text' has type int64, expected a string column"),
])
def test_parquet_without_a_text_column_always_fails(tmp_path, table, message):
    path = tmp_path / "c.parquet"
    pq.write_table(table, path)
    with pytest.raises(CorpusError, match=message):
        list(iter_texts(path, on_bad_line="skip"))
