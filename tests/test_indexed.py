import struct

import numpy as np
import pytest

from training.data.indexed import (
    IndexedDataset,
    IndexedDatasetError,
    IndexedDatasetWriter,
    dtype_for_vocab,
)

DOCUMENTS = [[5, 6, 7, 2], [9, 2], [], [1, 65000, 3, 4, 2]]


def _megatron_idx(lengths, dtype_code, itemsize):
    """The .idx Megatron-LM's _IndexWriter writes, spelled out field by field with struct."""
    pointers, position = [], 0
    for length in lengths:
        pointers.append(position)
        position += length * itemsize
    document_indices = list(range(len(lengths) + 1))
    return (
        b"MMIDIDX\x00\x00"
        + struct.pack("<Q", 1)
        + struct.pack("<B", dtype_code)
        + struct.pack("<Q", len(lengths))
        + struct.pack("<Q", len(document_indices))
        + struct.pack(f"<{len(lengths)}i", *lengths)
        + struct.pack(f"<{len(lengths)}q", *pointers)
        + struct.pack(f"<{len(document_indices)}q", *document_indices)
    )


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


def test_idx_and_bin_bytes_equal_megatron_layout(tmp_path):
    prefix = tmp_path / "shard"
    _write(prefix, DOCUMENTS)
    lengths = [len(d) for d in DOCUMENTS]
    assert (tmp_path / "shard.idx").read_bytes() == _megatron_idx(lengths, 8, 2)
    tokens = [t for d in DOCUMENTS for t in d]
    assert (tmp_path / "shard.bin").read_bytes() == struct.pack(f"<{len(tokens)}H", *tokens)

    _write(tmp_path / "wide", DOCUMENTS, np.int32)
    assert (tmp_path / "wide.idx").read_bytes() == _megatron_idx(lengths, 4, 4)


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
