"""Directory replacement: readers find the old directory or the new one, never neither."""
import threading

import pytest

import training.atomic as atomic
from training.atomic import replace_dir


def make_dir(path, content):
    path.mkdir()
    (path / "file").write_text(content)
    return path


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2", "two-renames"])
def test_replace_dir_puts_the_new_directory_in_place_and_removes_the_old(tmp_path, monkeypatch, exchange):
    if not exchange:
        monkeypatch.setattr(atomic, "_exchange", lambda a, b: False)
    target = make_dir(tmp_path / "target", "old")
    replace_dir(make_dir(tmp_path / ".staging", "new"), target)
    assert (target / "file").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["target"]
    replace_dir(make_dir(tmp_path / ".staging", "first"), tmp_path / "new/target")  # no target yet
    assert (tmp_path / "new/target/file").read_text() == "first"


def test_a_reader_never_finds_the_target_missing_while_it_is_replaced(tmp_path):
    target = make_dir(tmp_path / "target", "0")
    missing, done = [], threading.Event()

    def read():
        while not done.is_set():
            if not (target / "file").exists():
                missing.append(1)
    reader = threading.Thread(target=read)
    reader.start()
    for i in range(1, 300):
        replace_dir(make_dir(tmp_path / ".staging", str(i)), target)
    done.set()
    reader.join()
    assert (target / "file").read_text() == "299" and missing == []


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o027, 0o640), (0o077, 0o600)])
def test_written_files_take_the_mode_the_umask_gives(tmp_path, umask, mode):
    """A checkpoint, shard, built-in corpus part, MindRecord file or export written through a temporary file is as
    readable as a file open() creates: group-readable under umask 022 (shared storage), private under 077."""
    import os

    from assets.builtin_corpus import write_builtin_source
    from training.atomic import write_text_atomic
    from training.data.indexed import IndexedDatasetWriter
    from training.data.mindrecord import convert_to_mindrecord

    previous = os.umask(umask)
    try:
        write_text_atomic(tmp_path / "out.json", "{}")
        with IndexedDatasetWriter(tmp_path / "shard", "uint16") as writer:
            writer.add_document(list(range(1, 20)))
        write_builtin_source("python_stdlib_docstrings", tmp_path / "corpus", max_bytes=2000)
        convert_to_mindrecord(tmp_path / "shard", tmp_path / "s.mindrecord", seq_length=4, eod_id=0)
    finally:
        os.umask(previous)
    for name in ("out.json", "shard.bin", "shard.idx", "corpus/part-00000.jsonl", "s.mindrecord", "s.mindrecord.db",
                 "s.mindrecord.json"):
        assert (tmp_path / name).stat().st_mode & 0o777 == mode, name
