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
