"""`kiln merge`: Megatron merge_datasets.py semantics, and byte-identical to one pass over the same files."""
import json

import numpy as np
import pytest
from test_preprocess import _documents, tokenizer_model  # noqa: F401 (a fixture: the tiny tokenizer)

from training.cli import main
from training.data.indexed import IndexedDatasetWriter
from training.data.merge import dataset_prefixes, merge_datasets
from training.data.preprocess import tokenize_to_indexed


def _jsonl(path, texts):
    path.write_text("".join(json.dumps({"text": t, "title": t[:7]}) + "\n" for t in texts))
    return path


def test_merged_chunks_are_byte_identical_to_one_pass(tmp_path, tokenizer_model):
    files = [_jsonl(tmp_path / f"file{i}.jsonl", _documents(i + 1, 40 + 17 * i)) for i in range(3)]
    keys = ["text", "title"]
    whole = tokenize_to_indexed(files, tokenizer_model, tmp_path / "whole" / "src", json_keys=keys, workers=1)
    # a chunk per file group, named as the chunks of a source are: sorted names follow the files' order
    for chunk, group in enumerate([files[:2], files[2:]]):
        tokenize_to_indexed(group, tokenizer_model, tmp_path / "shards" / f"{chunk:05d}" / f"src_{chunk:05d}",
                            json_keys=keys, workers=2)
    for key, expected in zip(keys, whole["outputs"]):
        out = tmp_path / "merged" / f"src_{key}_document"
        assert main(["merge", "--input", str(tmp_path / "shards"), "--output-prefix", str(out),
                     "--pattern", f"*_{key}_document"]) == 0
        for ext in ("bin", "idx"):
            assert out.with_suffix(f".{ext}").read_bytes() == open(expected[f"{ext}_path"], "rb").read(), (key, ext)
    assert [p.name for p in dataset_prefixes(tmp_path / "shards", "*_text_document")] == [
        "src_00000_text_document", "src_00001_text_document"]


def test_merge_refuses_a_lone_file_a_dtype_mismatch_and_its_own_input(tmp_path, capsys):
    for name, dtype in (("a", np.uint16), ("b", np.int32)):
        with IndexedDatasetWriter(tmp_path / "in" / name, dtype) as writer:
            writer.add_document(np.arange(5))
    with pytest.raises(ValueError, match=r"b\.idx: dtype int32, but .*a\.idx \(the first input\) has uint16"):
        merge_datasets(dataset_prefixes(tmp_path / "in"), tmp_path / "out")
    with pytest.raises(ValueError, match="would overwrite one of the inputs"):
        merge_datasets([tmp_path / "in" / "a"], tmp_path / "in" / "a")
    (tmp_path / "in" / "b.idx").unlink()
    assert main(["merge", "--input", str(tmp_path / "in"), "--output-prefix", str(tmp_path / "out")]) == 2
    assert f"{tmp_path / 'in' / 'b'}.bin: no .idx next to it" in capsys.readouterr().err
    assert not list(tmp_path.glob("out*"))  # nothing written, not even a temporary
