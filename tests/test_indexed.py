import hashlib
import importlib.util
import struct
from pathlib import Path

import numpy as np
import pytest

from training.data.indexed import (
    IndexedDataset,
    IndexedDatasetError,
    IndexedDatasetWriter,
    dtype_for_vocab,
)

def _megatron_streams():
    """STREAMS of fixtures/megatron/generate.py, loaded without importing Megatron."""
    path = Path(__file__).parent / "fixtures" / "megatron" / "generate.py"
    spec = importlib.util.spec_from_file_location("megatron_fixture", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.STREAMS


MEGATRON_STREAMS = _megatron_streams()
DOCUMENTS = MEGATRON_STREAMS["uint16_empty_document"][1]  # an empty one among them


def _write(prefix, documents, dtype=np.uint16):
    with IndexedDatasetWriter(prefix, dtype) as writer:
        for doc in documents:
            writer.add_document(doc)
    return writer


def test_dtype_for_vocab():
    assert dtype_for_vocab(200) == np.uint16
    assert dtype_for_vocab(65499) == np.uint16
    assert dtype_for_vocab(65500) == np.int32
    assert dtype_for_vocab(152064) == np.int32


def test_round_trip(tmp_path):
    prefix = tmp_path / "shard"
    _write(prefix, DOCUMENTS)
    dataset = IndexedDataset(prefix)
    assert len(dataset) == len(DOCUMENTS)
    assert dataset.num_documents == len(DOCUMENTS)
    assert dataset.dtype == np.uint16
    assert dataset.num_tokens == sum(map(len, DOCUMENTS))
    assert dataset.sequence_lengths.tolist() == [4, 2, 0, 5]
    assert dataset.sequence_pointers.tolist() == [0, 8, 12, 12]
    assert dataset.document_indices.tolist() == [0, 1, 2, 3, 4]
    for i, doc in enumerate(DOCUMENTS):
        assert dataset.get(i).tolist() == doc
    assert dataset.get(3, offset=1, length=2).tolist() == [65000, 3]
    assert dataset.get(0, offset=2).tolist() == [7, 2]
    with pytest.raises(IndexError):
        dataset.get(4)
    with pytest.raises(IndexError):
        dataset.get(1, offset=1, length=2)


def test_exception_leaves_nothing(tmp_path):
    with pytest.raises(RuntimeError):
        with IndexedDatasetWriter(tmp_path / "shard", np.uint16) as writer:
            writer.add_document([1, 2, 3])
            raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []


def test_value_out_of_dtype_range_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="do not fit uint16"):
        with IndexedDatasetWriter(tmp_path / "shard", np.uint16) as writer:
            writer.add_document([1, 70000])
    assert list(tmp_path.iterdir()) == []


def _corrupt(path, offset, data):
    raw = bytearray(path.read_bytes())
    raw[offset : offset + len(data)] = data
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize(
    "offset, data, message",
    [
        (0, b"XXIDIDX", r"bad magic: expected b'MMIDIDX\\x00\\x00', got b'XXIDIDX"),
        (9, struct.pack("<Q", 2), "bad version: expected 1, got 2"),
        (17, struct.pack("<B", 9), "bad dtype code: expected one of .*, got 9"),
        (18, struct.pack("<Q", 5), "size does not match header"),
        (34 + 4 * 4 + 8, struct.pack("<q", 9), r"sequence_pointers\[1\]: expected 8 .*got 9"),
    ],
)
def test_corrupt_index_names_file_and_problem(tmp_path, offset, data, message):
    prefix = tmp_path / "shard"
    _write(prefix, DOCUMENTS)
    _corrupt(tmp_path / "shard.idx", offset, data)
    with pytest.raises(IndexedDatasetError, match=message) as err:
        IndexedDataset(prefix)
    assert str(tmp_path / "shard.idx") in str(err.value)


def test_truncated_files(tmp_path):
    prefix = tmp_path / "shard"
    _write(prefix, DOCUMENTS)
    bin_path = tmp_path / "shard.bin"
    bin_path.write_bytes(bin_path.read_bytes()[:-2])
    with pytest.raises(IndexedDatasetError, match=r"shard\.bin: size does not match shard\.idx: expected 22 bytes .*got 20"):
        IndexedDataset(prefix)
    idx_path = tmp_path / "shard.idx"
    idx_path.write_bytes(idx_path.read_bytes()[:20])
    with pytest.raises(IndexedDatasetError, match="truncated header: expected at least 34 bytes, got 20"):
        IndexedDataset(prefix)
    idx_path.unlink()
    with pytest.raises(IndexedDatasetError, match=r"shard\.idx: file not found"):
        IndexedDataset(prefix)


MEGATRON_FIXTURES = Path(__file__).parent / "fixtures" / "megatron"


@pytest.mark.parametrize("name", sorted(MEGATRON_STREAMS))
@pytest.mark.parametrize("batched", [False, True])
def test_bytes_equal_megatron_core_output(tmp_path, name, batched):
    """The fixtures were written by Megatron-core's IndexedDatasetBuilder (see fixtures/megatron/generate.py):
    uint16 and int32 token files, and an empty document."""
    dtype, documents = MEGATRON_STREAMS[name]
    with IndexedDatasetWriter(tmp_path / name, np.dtype(dtype)) as writer:
        if batched:
            writer.add_documents([len(d) for d in documents], np.concatenate(documents).astype(dtype))
        else:
            for doc in documents:
                writer.add_document(doc)
    for ext in ("bin", "idx"):
        assert (tmp_path / f"{name}.{ext}").read_bytes() == (MEGATRON_FIXTURES / f"{name}.{ext}").read_bytes()
    assert writer.bin_sha256 == hashlib.sha256((MEGATRON_FIXTURES / f"{name}.bin").read_bytes()).hexdigest()
    assert writer.idx_sha256 == hashlib.sha256((MEGATRON_FIXTURES / f"{name}.idx").read_bytes()).hexdigest()


def test_add_documents_checks_dtype_and_lengths(tmp_path):
    with IndexedDatasetWriter(tmp_path / "shard", np.uint16) as writer:
        with pytest.raises(ValueError, match=r"tokens must be a 1-D uint16 array, got 1-D int32"):
            writer.add_documents([2], np.array([1, 2], np.int32))
        with pytest.raises(ValueError, match=r"2 documents of 3 tokens in all, but 4 tokens given"):
            writer.add_documents([1, 2], np.arange(4, dtype=np.uint16))
        writer.add_documents([1, 2], np.arange(3, dtype=np.uint16))
    assert IndexedDataset(tmp_path / "shard").sequence_lengths.tolist() == [1, 2]


def test_closed_writers_commit_later(tmp_path):
    writer = IndexedDatasetWriter(tmp_path / "shard", np.uint16)
    writer.add_document([1, 2])
    writer.close()
    assert sorted(p.suffix for p in tmp_path.iterdir()) == [".tmp", ".tmp"]
    writer.commit()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shard.bin", "shard.idx"]
    with pytest.raises(RuntimeError, match="writer is committed, expected open"):
        writer.add_document([3])


def test_without_mmap_the_tokens_are_read_from_the_file_alike(shard):
    mapped, read = IndexedDataset(shard), IndexedDataset(shard, mmap_bin=False)
    assert mapped.get(0).base is not None and read.get(0).base is None  # a view of the mapping; a fresh array
    for idx in range(len(mapped)):
        assert np.array_equal(read.get(idx), mapped.get(idx))
        assert np.array_equal(read.get(idx, 1, 2), mapped.get(idx, 1, 2))
    assert read.num_tokens == mapped.num_tokens
