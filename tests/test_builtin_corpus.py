import json

import pytest

from assets.builtin_corpus import BUILTIN_KINDS, write_builtin_source
from training.data.corpus import scan_jsonl


@pytest.mark.parametrize("kind", BUILTIN_KINDS)
def test_valid_jsonl_within_budget_and_deterministic(tmp_path, kind):
    first = write_builtin_source(kind, tmp_path / "a", max_bytes=60_000)
    second = write_builtin_source(kind, tmp_path / "b", max_bytes=60_000)
    assert [p.name for p in first] == ["part-00000.jsonl"]
    assert [p.read_bytes() for p in first] == [p.read_bytes() for p in second]

    records = [json.loads(line) for line in first[0].read_text(encoding="utf-8").splitlines()]
    assert records and sum(len(r["text"].encode("utf-8")) for r in records) <= 60_000
    assert scan_jsonl(first[0])["docs"] == len(records)
    paths = [r["path"] for r in records]
    assert all(p.endswith(".py") and not p.startswith(("site-packages", "test/")) for p in paths)
    if kind == "python_stdlib_docstrings":
        assert records[0]["qualname"] == "<module>"
        assert all(r["qualname"] and r["text"] for r in records)
    else:
        assert len(set(paths)) == len(paths)
        assert all(set(r) == {"text", "path"} for r in records)
    assert not list((tmp_path / "a").glob("*.tmp"))


def test_parts_split_and_stale_parts_removed(tmp_path):
    out = tmp_path / "out"
    many = write_builtin_source("python_stdlib_docstrings", out, max_bytes=40_000, part_bytes=8_000)
    assert len(many) > 2
    assert all(p.stat().st_size <= 8_000 for p in many)
    single = write_builtin_source("python_stdlib_docstrings", tmp_path / "single", max_bytes=40_000)
    assert b"".join(p.read_bytes() for p in many) == single[0].read_bytes()

    fewer = write_builtin_source("python_stdlib_docstrings", out, max_bytes=40_000)
    assert sorted(out.iterdir()) == fewer


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="unknown builtin source kind 'novels'"):
        write_builtin_source("novels", tmp_path, 1000)
    with pytest.raises(ValueError, match="max_bytes must be a positive integer"):
        write_builtin_source("python_stdlib_code", tmp_path, 0)
    with pytest.raises(ValueError, match="smaller than the first"):
        write_builtin_source("python_stdlib_code", tmp_path / "tiny", 10)
    assert not (tmp_path / "tiny").exists() or not list((tmp_path / "tiny").iterdir())
