import numpy as np
import pytest

from training.data.gpt_dataset import (
    BlendedDataset,
    GPTDataset,
    build_blended_train_dataset,
    parse_data_path,
    split_document_range,
)
from training.data.indexed import IndexedDataset, IndexedDatasetWriter

EOD = 1


def _make_indexed(prefix, num_docs, seed, max_len=40):
    """Documents of random length ending in EOD; token values identify their place in the corpus."""
    rng = np.random.default_rng(seed)
    with IndexedDatasetWriter(prefix, np.int32) as writer:
        next_token = 2
        for _ in range(num_docs):
            length = int(rng.integers(1, max_len))
            writer.add_document(np.append(np.arange(next_token, next_token + length), EOD))
            next_token += length
    return IndexedDataset(prefix)


def _megatron_sample_index(sizes, document_index, seq_length, num_epochs, tokens_per_epoch):
    """Megatron-core's C++ build_sample_idx (add_extra_token=1, drop last partial), line by line."""
    num_samples = (num_epochs * tokens_per_epoch - 1) // seq_length
    out = [(0, 0)]
    doc_idx_index, doc_offset = 0, 0
    for _ in range(num_samples):
        remaining = seq_length + 1
        while remaining != 0:
            doc_length = sizes[document_index[doc_idx_index]] - doc_offset
            remaining -= doc_length
            if remaining <= 0:
                doc_offset += remaining + doc_length - 1
                remaining = 0
            else:
                doc_idx_index += 1
                doc_offset = 0
        out.append((doc_idx_index, doc_offset))
    return np.array(out)


@pytest.fixture
def indexed(tmp_path):
    return _make_indexed(tmp_path / "corpus", 60, seed=0)


def _dataset(indexed, **overrides):
    options = dict(seq_length=16, num_samples=150, seed=1234, eod_id=EOD)
    options.update(overrides)
    return GPTDataset(indexed, **options)


@pytest.mark.parametrize("num_samples", [10, 150, 200, 400])
def test_samples_are_contiguous_slices_of_the_stream(indexed, num_samples):
    dataset = _dataset(indexed, num_samples=num_samples)
    S = dataset.seq_length
    stream = np.concatenate([indexed.get(int(d)) for d in dataset.document_index])
    assert len(dataset) == num_samples
    for i in range(len(dataset)):
        j = int(dataset.shuffle_index[i])
        expected = stream[j * S : j * S + S + 1]
        assert dataset.sample_tokens(i).tolist() == expected.tolist()
        item = dataset[i]
        assert item["input_ids"].tolist() == expected[:-1].tolist()
        assert item["labels"].tolist() == expected[1:].tolist()
        assert item["input_ids"].dtype == np.int32 and item["labels"].dtype == np.int32
        assert item["position_ids"].tolist() == list(range(S))
        assert item["loss_mask"].dtype == np.float32 and item["loss_mask"].sum() == S


@pytest.mark.parametrize("num_samples", [10, 150, 200, 400])
def test_indices_match_megatron(indexed, num_samples):
    dataset = _dataset(indexed, num_samples=num_samples)
    sizes = indexed.sequence_lengths
    expected = _megatron_sample_index(
        sizes, dataset.document_index, dataset.seq_length, dataset.num_epochs, dataset.tokens_per_epoch
    )
    assert np.array_equal(dataset.sample_index, expected)
    # Every epoch uses every document of the split exactly num_epochs times.
    counts = np.bincount(dataset.document_index, minlength=len(indexed))
    assert (counts == dataset.num_epochs).all()
    assert sorted(dataset.shuffle_index.tolist()) == list(range(len(dataset.sample_index) - 1))


def test_separate_final_epoch(indexed):
    tokens = int(indexed.sequence_lengths.sum())
    per_epoch = (tokens - 1) // 16
    # Two full epochs plus a sliver of a third: the third is shuffled on its own.
    dataset = _dataset(indexed, num_samples=2 * per_epoch + 3)
    assert dataset.num_epochs == 3
    first_two = dataset.document_index[: 2 * len(indexed)]
    last = dataset.document_index[2 * len(indexed) :]
    assert sorted(last.tolist()) == list(range(len(indexed)))
    assert (np.bincount(first_two) == 2).all()
    head = dataset.shuffle_index[: (2 * tokens - 1) // 16]
    assert head.max() < len(head)


def test_deterministic_for_a_seed(indexed):
    a, b, c = _dataset(indexed), _dataset(indexed), _dataset(indexed, seed=7)
    for i in range(0, 150, 7):
        assert np.array_equal(a[i]["input_ids"], b[i]["input_ids"])
    assert any(not np.array_equal(a[i]["input_ids"], c[i]["input_ids"]) for i in range(10))


def test_split_ranges(indexed):
    assert split_document_range("8,1,1", 0, 100) == (0, 80)
    assert split_document_range("8, 1, 1", 1, 100) == (80, 90)
    assert split_document_range("98,2", 2, 100) == (100, 100)
    valid = _dataset(indexed, split="50,50,0", split_index=1, num_samples=20)
    assert set(valid.document_index.tolist()) == set(range(30, 60))
    with pytest.raises(ValueError, match="gives split_index 2 no documents"):
        _dataset(indexed, split="50,50,0", split_index=2)
    with pytest.raises(ValueError, match="every ratio must be a number"):
        _dataset(indexed, split="a,b")


def test_pad_is_masked_and_zeroed(indexed):
    dataset = _dataset(indexed, pad_id=EOD)
    for i in range(20):
        tokens = dataset.sample_tokens(i)
        item = dataset[i]
        assert np.array_equal(item["loss_mask"] == 0, tokens[1:] == EOD)
        assert not (item["labels"] == EOD).any() and not (item["input_ids"] == EOD).any()


def test_cache_reused_and_corrupt_cache_rebuilt(indexed, tmp_path):
    cache = tmp_path / "cache"
    built = _dataset(indexed, cache_dir=cache)
    assert not built.loaded_from_cache
    files = sorted(cache.glob("*-GPTDataset-*.npy"))
    assert [f.name.split("-GPTDataset-")[1] for f in files] == [
        "document_index.npy", "sample_index.npy", "shuffle_index.npy"
    ]
    assert not list(cache.glob("*.tmp"))

    loaded = _dataset(indexed, cache_dir=cache)
    assert loaded.loaded_from_cache
    for name in ("document_index", "sample_index", "shuffle_index"):
        assert np.array_equal(getattr(built, name), getattr(loaded, name))

    other = _dataset(indexed, cache_dir=cache, seed=99)
    assert not other.loaded_from_cache

    sample_file = next(f for f in files if f.name.endswith("sample_index.npy"))
    sample_file.write_bytes(sample_file.read_bytes()[:50])  # truncated
    rebuilt = _dataset(indexed, cache_dir=cache)
    assert not rebuilt.loaded_from_cache
    assert np.array_equal(rebuilt.sample_index, built.sample_index)
    assert _dataset(indexed, cache_dir=cache).loaded_from_cache

    np.save(sample_file, np.zeros((3, 2), np.int32))  # readable but wrong
    assert not _dataset(indexed, cache_dir=cache).loaded_from_cache
    assert _dataset(indexed, cache_dir=cache).loaded_from_cache


def test_blended_shares_follow_weights(tmp_path):
    weights = [5, 3, 2]
    sources = [_make_indexed(tmp_path / f"s{k}", 40, seed=k) for k in range(3)]
    size = 500
    datasets = [
        _dataset(src, num_samples=int(np.ceil(size * w / 10 * 1.005))) for src, w in zip(sources, weights)
    ]
    blend = BlendedDataset(datasets, weights, size, seed=1234)
    assert len(blend) == size
    shares = np.array(weights) / 10
    counts = np.zeros(3)
    for n, source in enumerate(blend.dataset_index, start=1):
        counts[source] += 1
        assert (np.abs(counts - shares * n) <= 1).all()
    for i in (0, 1, 2, 250, 499):
        k, j = int(blend.dataset_index[i]), int(blend.dataset_sample_index[i])
        assert np.array_equal(blend[i]["input_ids"], datasets[k][j]["input_ids"])

    with pytest.raises(ValueError, match="blend source 0 must supply"):
        BlendedDataset(datasets, [9, 0.5, 0.5], size, seed=1234)


def test_blend_cache(tmp_path):
    source = _make_indexed(tmp_path / "s", 40, seed=0)
    datasets = [_dataset(source, num_samples=60), _dataset(source, num_samples=60, seed=5)]
    first = BlendedDataset(datasets, [0.5, 0.5], 100, seed=1, cache_dir=tmp_path / "cache")
    second = BlendedDataset(datasets, [1, 1], 100, seed=1, cache_dir=tmp_path / "cache")
    assert not first.loaded_from_cache and second.loaded_from_cache
    assert np.array_equal(first.dataset_index, second.dataset_index)
    index_file = next((tmp_path / "cache").glob("*-BlendedDataset-dataset_index.npy"))
    np.save(index_file, np.full(100, 7, np.int16))
    third = BlendedDataset(datasets, [1, 1], 100, seed=1, cache_dir=tmp_path / "cache")
    assert not third.loaded_from_cache
    assert np.array_equal(first.dataset_index, third.dataset_index)


def test_build_blended_train_dataset(tmp_path):
    for k in range(2):
        _make_indexed(tmp_path / f"s{k}", 50, seed=k)
    data_path = ["0.7", str(tmp_path / "s0"), 0.3, str(tmp_path / "s1")]
    blend = build_blended_train_dataset(
        data_path, seq_length=8, num_samples=200, seed=3, split="90,10,0", eod_id=EOD, cache_dir=tmp_path / "cache"
    )
    assert len(blend) == 200
    assert [len(d) for d in blend.datasets] == [141, 61]  # ceil(200 * w * 1.005)
    assert blend.weights == pytest.approx([0.7, 0.3])
    assert all(d.document_end == 45 for d in blend.datasets)
    assert blend[199]["input_ids"].shape == (8,)


@pytest.mark.parametrize(
    "data_path, message",
    [
        (["1.0"], "got 1 entries"),
        ([], "got 0 entries"),
        ("1.0 prefix", "must be a list"),
        (["heavy", "PREFIX"], r"data_path\[0\]: weight 'heavy' is not a number"),
        ([1, "PREFIX", -2, "PREFIX"], r"data_path\[2\]: weight -2 must be a positive number"),
        ([1, "PREFIX", 1, "MISSING"], r"data_path\[3\]: .*MISSING\.bin not found"),
        ([True, "PREFIX"], r"data_path\[0\]: weight True is not a number"),
    ],
)
def test_malformed_data_path(tmp_path, data_path, message):
    _make_indexed(tmp_path / "s", 5, seed=0)
    if isinstance(data_path, list):
        names = {"PREFIX": str(tmp_path / "s"), "MISSING": str(tmp_path / "MISSING")}
        data_path = [names.get(e, e) if isinstance(e, str) else e for e in data_path]
    with pytest.raises(ValueError, match=message):
        parse_data_path(data_path)
