import hashlib
import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from training.data import gpt_dataset
from training.data.gpt_dataset import (
    BlendedDataset,
    GPTDataset,
    build_blended_dataset,
    parse_data_path,
    sample_item,
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


# ---- megatron-core's own outputs, the oracles of the index tests ----------------------------


def _load_megatron_fixtures():
    """fixtures/megatron/generate.py, loaded without importing Megatron: the configurations whose
    indices megatron-core 0.16.1 built and saved there (see its docstring for how)."""
    path = Path(__file__).parent / "fixtures" / "megatron" / "generate.py"
    spec = importlib.util.spec_from_file_location("megatron_fixture", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


MEGATRON = _load_megatron_fixtures()
assert MEGATRON.EOD == EOD


def _megatron(kind, name=None):
    with np.load(MEGATRON.fixture(kind, name), allow_pickle=False) as arrays:
        return dict(arrays)


def _source(stream):
    return IndexedDataset(MEGATRON.HERE / stream)


def _assert_same(built, expected, what):
    """Kiln's array is megatron-core's: same dtype, same values."""
    built = np.asarray(built)
    assert built.dtype == expected.dtype, f"{what}: dtype {built.dtype}, megatron-core {expected.dtype}"
    assert np.array_equal(built, expected), f"{what} differs from megatron-core's"


def _assert_same_digest(built, expected, name):
    """A large array against megatron-core's digest of it (fixtures/megatron/generate.py `_digest`):
    dtype, shape, first and last entries, and the sha256 of its bytes."""
    built = np.ascontiguousarray(built)
    assert built.dtype.str == str(expected[f"{name}-dtype"]), name
    assert built.shape == tuple(expected[f"{name}-shape"]), f"{name}: shape {built.shape}"
    for end, part in (("head", built[:len(expected[f"{name}-head"])]), ("tail", built[-len(expected[f"{name}-tail"]):])):
        assert np.array_equal(part, expected[f"{name}-{end}"]), f"{name}: {end} differs from megatron-core's"
    assert hashlib.sha256(built.tobytes()).hexdigest() == str(expected[f"{name}-sha256"]), f"{name} differs"


def _gpt_case(name, **overrides):
    """Kiln's GPTDataset for GPT_CASES[name] of the fixtures (pad -1, as megatron's default)."""
    case = MEGATRON.GPT_CASES[name]
    options = dict(seq_length=case["seq_length"], num_samples=case["num_samples"], seed=case["seed"], eod_id=EOD,
                   split=case["split"], split_index=case["split_index"], pad_id=-1,
                   add_extra_token_to_sequence=case["add_extra_token_to_sequence"],
                   drop_last_partial_validation_sequence=case["drop_last_partial_validation_sequence"])
    options.update(overrides)
    return GPTDataset(_source(case["stream"]), **options)


# ---- GPTDataset --------------------------------------------------------------------------


@pytest.fixture
def indexed(tmp_path):
    return _make_indexed(tmp_path / "corpus", 60, seed=0)


def _dataset(indexed, **overrides):
    options = dict(seq_length=16, num_samples=150, seed=1234, eod_id=EOD)
    options.update(overrides)
    return GPTDataset(indexed, **options)


@pytest.mark.parametrize("name", sorted(MEGATRON.GPT_CASES))
def test_indices_equal_megatron_cores(name):
    """Document, sample and shuffle index, and every sample's tokens, as megatron-core's GPTDataset built
    them for the same configuration (fixtures/megatron/generate.py says what each case exercises)."""
    expected = _megatron("gpt", name)
    dataset = _gpt_case(name)
    for index in ("document_index", "sample_index", "shuffle_index"):
        _assert_same(getattr(dataset, index), expected[index], f"{name}: {index}")
    assert len(dataset) == len(expected["text"])
    tokens = np.stack([dataset.sample_tokens(i) for i in range(len(dataset))])
    _assert_same(tokens, expected["text"], f"{name}: sample tokens")


@pytest.mark.parametrize("name", sorted(MEGATRON.SAMPLE_INDEX_CASES))
def test_sample_index_equals_megatron_cores_helper(name):
    """build_sample_idx of megatron-core's C++ helpers on a stream too long to save whole: past 2**24
    tokens its single-precision count of samples with a kept last partial sample is what counts."""
    lengths, document_index, seq_length, drop_last, extra = MEGATRON.SAMPLE_INDEX_CASES[name]
    built = gpt_dataset._build_sample_index(np.array(lengths, dtype=np.int32), np.array(document_index, dtype=np.int32),
                                            seq_length, drop_last, int(extra))
    _assert_same_digest(built, _megatron("sample_index", name), "sample_index")


def test_megatron_cases_reach_the_branches_they_name():
    """The fixture cases exercise what their names say (else the comparison above proves less)."""
    epochs, apart = {}, {}
    for name in MEGATRON.GPT_CASES:
        dataset = _gpt_case(name)
        epochs[name], apart[name] = dataset.num_epochs, dataset.separate_final_epoch
    assert epochs["corpus_one_epoch"] == 1
    assert (epochs["corpus_final_epoch_apart"], apart["corpus_final_epoch_apart"]) == (2, True)
    assert (epochs["corpus_final_epoch_joined"], apart["corpus_final_epoch_joined"]) == (2, False)
    assert (epochs["corpus_below_80_percent"], apart["corpus_below_80_percent"]) == (3, True)
    assert (epochs["corpus_at_80_percent"], apart["corpus_at_80_percent"]) == (3, False)
    assert (epochs["corpus_six_epochs"], apart["corpus_six_epochs"]) == (6, True)
    assert epochs["corpus_test_split_one_document"] > 1
    short = [name for name in MEGATRON.GPT_CASES if name.startswith("short_")]
    assert len(short) == 12 and all(epochs[name] > 1 for name in short)
    assert any(apart[name] for name in short) and not all(apart[name] for name in short)
    # the kept last sample is a partial one, padded with -1
    kept = _megatron("gpt", "corpus_valid_keep_last")["text"]
    assert len(kept) == len(_megatron("gpt", "corpus_valid_drop_last")["text"]) + 1 and (kept == -1).any()
    # a document ends exactly at a sample boundary somewhere, and empty documents are in the index
    for name in short:
        dataset = _gpt_case(name)
        lengths = dataset.indexed.sequence_lengths
        assert (lengths[dataset.document_index] == 0).any()
        ends = np.cumsum(lengths[dataset.document_index])
        assert np.isin(np.arange(1, len(dataset)) * dataset.seq_length, ends).any()


@pytest.mark.parametrize("num_samples", [10, 150, 400])
def test_samples_are_contiguous_slices_of_the_stream(indexed, num_samples):
    dataset = _dataset(indexed, num_samples=num_samples)
    stream = np.concatenate([indexed.get(int(d)) for d in dataset.document_index])
    for i in range(len(dataset)):
        j = int(dataset.shuffle_index[i])
        expected = stream[j * 16 : j * 16 + 17]
        assert dataset.sample_tokens(i).tolist() == expected.tolist()
        item = dataset[i]
        assert item["input_ids"].tolist() == expected[:-1].tolist()
        assert item["labels"].tolist() == expected[1:].tolist()
        assert item["input_ids"].dtype == np.int32 and item["labels"].dtype == np.int32
        assert item["position_ids"].tolist() == list(range(16)) and item["position_ids"].dtype == np.int32
        assert item["loss_mask"].dtype == np.float32 and item["loss_mask"].sum() == 16
        assert list(item) == ["input_ids", "labels", "loss_mask", "position_ids"]
    with pytest.raises(IndexError, match=f"sample {len(dataset)} out of range"):
        dataset.sample_tokens(len(dataset))


def test_without_the_extra_token_samples_do_not_overlap(indexed):
    dataset = _dataset(indexed, add_extra_token_to_sequence=False, pad_id=-1)
    stream = np.concatenate([indexed.get(int(d)) for d in dataset.document_index])
    assert len(dataset) == dataset.num_epochs * dataset.tokens_per_epoch // 16
    for i in range(0, len(dataset), 7):
        j = int(dataset.shuffle_index[i])
        item = dataset[i]
        assert item["input_ids"].tolist() == stream[j * 16 : j * 16 + 16].tolist()
        # The last label is unknown: Megatron fills it with the pad id, which is then masked.
        assert item["labels"].tolist() == stream[j * 16 + 1 : j * 16 + 16].tolist() + [0]
        assert item["loss_mask"].tolist() == [1.0] * 15 + [0.0]


def test_last_partial_validation_sample_is_kept_and_padded_on_request(indexed):
    options = dict(split="50,50,0", split_index=1, num_samples=None, pad_id=-1)
    dropped = _dataset(indexed, **options)
    kept = _dataset(indexed, drop_last_partial_validation_sequence=False, **options)
    tokens = dropped.tokens_per_epoch
    assert (tokens - 1) % 16  # this corpus ends in a partial sample
    assert len(dropped) == (tokens - 1) // 16 and len(kept) == len(dropped) + 1
    last = int(np.flatnonzero(kept.shuffle_index == len(kept) - 1)[0])
    stream = np.concatenate([indexed.get(int(d)) for d in kept.document_index])
    tail = stream[(len(kept) - 1) * 16 :]
    assert kept.sample_tokens(last).tolist() == tail.tolist() + [-1] * (17 - tail.size)
    assert kept[last]["loss_mask"].sum() == tail.size - 1
    # The train split always drops it.
    train = _dataset(indexed, split="50,50,0", num_samples=None, drop_last_partial_validation_sequence=False)
    assert len(train) == (train.tokens_per_epoch - 1) // 16


def test_deterministic_for_a_seed(indexed):
    a, b, c = _dataset(indexed), _dataset(indexed), _dataset(indexed, seed=7)
    for i in range(0, 150, 7):
        assert np.array_equal(a[i]["input_ids"], b[i]["input_ids"])
    assert any(not np.array_equal(a[i]["input_ids"], c[i]["input_ids"]) for i in range(10))


def test_split_ranges(indexed):
    assert split_document_range("8,1,1", 0, 100) == (0, 80)
    assert split_document_range("8, 1, 1", 1, 100) == (80, 90)
    assert split_document_range("98,2", 2, 100) == (100, 100)
    # Megatron rounds the bookends half to even: 0.5 * 5 = 2.5 -> 2.
    assert split_document_range("1,1", 0, 5) == (0, 2)
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


# ---- items: masks, positions, compressed EOD ----------------------------------------------


def test_sample_item_by_hand():
    tokens = np.array([5, 6, EOD, 7, EOD, 8, 9, 1, 3])  # inputs 5 6 EOD 7 EOD 8 9 EOD, labels shifted
    item = sample_item(tokens, eod_id=EOD, pad_id=3, reset_position_ids=True, eod_mask_loss=True,
                       create_compressed_eod_mask=True, eod_pad_length=4)
    assert item["input_ids"].tolist() == [5, 6, 1, 7, 1, 8, 9, 1]
    assert item["labels"].tolist() == [6, 1, 7, 1, 8, 9, 1, 0]  # the pad label becomes 0 ...
    assert item["loss_mask"].tolist() == [1, 1, 0, 1, 0, 1, 1, 0]  # ... and EOD inputs and pads are not learned
    assert item["position_ids"].tolist() == [0, 1, 2, 0, 1, 0, 1, 2]
    # Document ends after inputs 2 and 4; the EOD in the last position does not count.
    assert item["actual_seq_len"].tolist() == [3, 5, 8, 8]
    assert item["actual_seq_len"].dtype == np.int32 and "attention_mask" not in item
    assert sample_item(tokens, eod_id=EOD, create_compressed_eod_mask=True, eod_pad_length=2)[
        "actual_seq_len"].tolist() == [3, 5]

    masked = sample_item(tokens, eod_id=EOD, create_attention_mask=True, reset_attention_mask=True)
    assert masked["attention_mask"].shape == (1, 8, 8) and masked["attention_mask"].dtype == np.int32
    assert masked["attention_mask"][0, 3].tolist() == [1, 1, 1, 0, 1, 1, 1, 1]  # row 3 sees only itself
    assert masked["position_ids"].tolist() == list(range(8))  # positions reset only when asked


@pytest.mark.parametrize("flags", MEGATRON.ITEM_FLAGS, ids=[MEGATRON.item_key(*f) for f in MEGATRON.ITEM_FLAGS])
def test_items_equal_megatron_cores(flags):
    """Every item's inputs, labels, loss mask, positions and attention mask as megatron-core's
    GPTDataset.__getitem__ gave them (its `tokens` are Kiln's input_ids; its attention mask is a
    bool, True = masked, Kiln's int32 1 = masked; its positions int64, Kiln's int32)."""
    reset_position_ids, reset_attention_mask, eod_mask_loss, extra = flags
    case = MEGATRON.ITEM_CASE
    expected = _megatron("items")
    key = MEGATRON.item_key(*flags)
    dataset = GPTDataset(_source(case["stream"]), seq_length=case["seq_length"], num_samples=case["num_samples"],
                         seed=case["seed"], eod_id=EOD, pad_id=case["pad_id"], add_extra_token_to_sequence=extra,
                         reset_position_ids=reset_position_ids, reset_attention_mask=reset_attention_mask,
                         eod_mask_loss=eod_mask_loss, create_attention_mask=True)
    items = [dataset[i] for i in range(case["num_samples"])]
    assert all((item["input_ids"] == EOD).sum() >= 2 for item in items)  # several documents per sample
    for field, megatron_field in (("input_ids", "tokens"), ("labels", "labels"), ("loss_mask", "loss_mask"),
                                  ("position_ids", "position_ids"), ("attention_mask", "attention_mask")):
        built = np.stack([item[field] for item in items])
        assert built.shape == expected[f"{key}-{megatron_field}"].shape
        assert np.array_equal(built, expected[f"{key}-{megatron_field}"]), f"{key}: {field}"


def test_compressed_eod_mask_wins_and_overflow_names_the_sample(tmp_path):
    short_docs = _make_indexed(tmp_path / "short", 80, seed=3, max_len=7)
    options = dict(seq_length=24, num_samples=30, seed=5, eod_id=EOD, create_attention_mask=True,
                   create_compressed_eod_mask=True)
    dataset = GPTDataset(short_docs, eod_pad_length=24, **options)
    for i in range(30):
        inputs = dataset.sample_tokens(i)[:-1]
        ends = [k + 1 for k in range(23) if inputs[k] == EOD]
        item = dataset[i]
        assert "attention_mask" not in item
        assert item["actual_seq_len"].tolist() == ends + [24] * (24 - len(ends))
    tight = GPTDataset(short_docs, eod_pad_length=1, **options)
    with pytest.raises(ValueError, match=r"short: sample 0 has \d+ document ends, more than eod_pad_length = 1"):
        tight[0]


@pytest.mark.parametrize("option, value, message", [
    ("eod_pad_length", 0, "eod_pad_length must be a positive integer"),
    ("reset_position_ids", "yes", "reset_position_ids must be true or false"),
    ("drop_last_partial_validation_sequence", 1, "drop_last_partial_validation_sequence must be true or false"),
    ("num_samples", 0, "num_samples must be a positive integer"),
    ("seed", -1, r"seed must be an integer in \[0, 2\*\*32\)"),
])
def test_bad_options_are_named(indexed, option, value, message):
    with pytest.raises(ValueError, match=message):
        _dataset(indexed, split_index=0, **{option: value})


# ---- index cache -------------------------------------------------------------------------


INDEX_NAMES = ("document_index", "sample_index", "shuffle_index")


def _cache_files(cache):
    return {path.name.split("-GPTDataset-train-")[1]: path for path in cache.glob("*-GPTDataset-train-*")}


def test_cache_is_reused(indexed, tmp_path):
    cache = tmp_path / "cache"
    built = _dataset(indexed, cache_dir=cache)
    assert not built.loaded_from_cache
    files = _cache_files(cache)
    assert sorted(files) == ["description.json", "document_index.npy", "sample_index.npy", "shuffle_index.npy"]
    assert not list(cache.glob("*.tmp"))
    assert json.loads(files["description.json"].read_text())["description"] == built.description

    loaded = _dataset(indexed, cache_dir=cache)
    assert loaded.loaded_from_cache
    for name in INDEX_NAMES:
        assert np.array_equal(getattr(built, name), getattr(loaded, name))
        assert getattr(built, name).dtype == getattr(loaded, name).dtype
    # Options that do not change the index share its cache; those that do, do not.
    assert _dataset(indexed, cache_dir=cache, eod_mask_loss=True, pad_id=5).loaded_from_cache
    assert not _dataset(indexed, cache_dir=cache, seed=99).loaded_from_cache
    assert not _dataset(indexed, cache_dir=cache, add_extra_token_to_sequence=False).loaded_from_cache


@pytest.mark.parametrize("damage", ["truncated", "garbage", "wrong array", "missing", "no description",
                                    "other description", "bad json"])
def test_damaged_cache_is_rebuilt(indexed, tmp_path, damage):
    cache = tmp_path / "cache"
    built = _dataset(indexed, cache_dir=cache)
    files = _cache_files(cache)
    sample_file, description_file = files["sample_index.npy"], files["description.json"]
    if damage == "truncated":
        sample_file.write_bytes(sample_file.read_bytes()[:100])
    elif damage == "garbage":
        data = bytearray(sample_file.read_bytes())
        data[-8:] = b"\x07" * 8
        sample_file.write_bytes(bytes(data))
    elif damage == "wrong array":  # a valid .npy of the right shape and dtype, other values
        np.save(sample_file, np.roll(built.sample_index, 1, axis=0))
    elif damage == "missing":
        sample_file.unlink()
    elif damage == "no description":
        description_file.unlink()
    elif damage == "other description":
        manifest = json.loads(description_file.read_text())
        manifest["description"]["seed"] = 7
        description_file.write_text(json.dumps(manifest))
    else:
        description_file.write_text("{not json")

    rebuilt = _dataset(indexed, cache_dir=cache)
    assert not rebuilt.loaded_from_cache
    for name in INDEX_NAMES:
        assert np.array_equal(getattr(rebuilt, name), getattr(built, name))
    assert _dataset(indexed, cache_dir=cache).loaded_from_cache


# ---- blending ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(MEGATRON.BLENDING_CASES))
def test_blending_index_equals_megatron_cores(name, monkeypatch):
    """build_blending_indices of megatron-core's C++ helpers, for weights with ties, lopsided and uneven ones."""
    weights, size = MEGATRON.BLENDING_CASES[name]
    expected = _megatron("blending", name)
    weights = gpt_dataset._normalize(weights)
    _assert_same(np.array(weights), expected["weights"], f"{name}: normalized weights")
    # The scalar loop (small sizes) ...
    built = gpt_dataset._blending_indices(weights, size)
    # ... and the chunked numpy builder, forced on with small chunks; warm-up 0 makes some chunks
    # start from a wrong state, so the repair path runs too.
    monkeypatch.setattr(gpt_dataset, "_BLEND_PARALLEL_MIN_SIZE", 0)
    chunked = [gpt_dataset._blending_indices(weights, size, chunk=64, warmup=w) for w in (16, 0)]
    for dataset_index, dataset_sample_index in [built, *chunked]:
        _assert_same(dataset_index, expected["dataset_index"], f"{name}: dataset_index")
        _assert_same(dataset_sample_index, expected["dataset_sample_index"], f"{name}: dataset_sample_index")


def test_chunks_that_start_out_of_step_are_redone(monkeypatch):
    weights, size = MEGATRON.BLENDING_CASES["five_uneven"]
    weights = gpt_dataset._normalize(weights)
    redone = []
    scalar = gpt_dataset._greedy_steps

    def counting(weights, start, counts, steps):
        redone.append(start)
        return scalar(weights, start, counts, steps)

    monkeypatch.setattr(gpt_dataset, "_BLEND_PARALLEL_MIN_SIZE", 0)
    monkeypatch.setattr(gpt_dataset, "_greedy_steps", counting)
    dataset_index, _ = gpt_dataset._blending_indices(weights, size, chunk=50, warmup=0)
    assert redone and all(start % 50 == 0 for start in redone)
    _assert_same(dataset_index, _megatron("blending", "five_uneven")["dataset_index"], "dataset_index")


def test_blend_shares_stay_within_one_sample_of_the_weights():
    weights = gpt_dataset._normalize([5, 3, 2, 0.5])
    dataset_index, _ = gpt_dataset._blending_indices(weights, 20000)
    taken = np.cumsum(dataset_index[:, None] == np.arange(4), axis=0)
    ideal = np.arange(1, 20001)[:, None] * np.array(weights)
    assert np.abs(taken - ideal).max() <= 1


def _blend_sources(case, num_samples):
    """Kiln's GPTDatasets over a BLEND_CASES blend's streams, num_samples[k] samples (None: one epoch)."""
    return [GPTDataset(_source(stream), seq_length=case["seq_length"], num_samples=n, seed=case["seed"], eod_id=EOD)
            for stream, n in zip(case["streams"], num_samples)]


@pytest.mark.parametrize("name", sorted(MEGATRON.BLEND_CASES))
def test_blend_equals_megatron_cores(name):
    """A BlendedDataset as megatron-core's BlendedMegatronDatasetBuilder built it: each source's three
    indices for the samples the builder asked of it, and the blend's two. "weighted": weights [5, 3, 2]
    and a size (the greedy blend); "unweighted": one epoch of each source, blended exhaustively."""
    case = MEGATRON.BLEND_CASES[name]
    expected = _megatron("blend", name)
    sources = len(case["streams"])
    num_samples = [int(expected[f"num_samples_{k}"]) for k in range(sources)]
    num_samples = [None if n == -1 else n for n in num_samples]
    datasets = _blend_sources(case, num_samples)
    for k, dataset in enumerate(datasets):
        for index in ("document_index", "sample_index", "shuffle_index"):
            _assert_same(getattr(dataset, index), expected[f"{index}_{k}"], f"{name}: source {k} {index}")
    if case["weights"] is None:
        blend = BlendedDataset(datasets, None, None)
    else:
        blend = BlendedDataset(datasets, case["weights"], len(expected["dataset_index"]))
    _assert_same(np.array(blend.weights), expected["weights"] / expected["weights"].sum(), f"{name}: weights")
    _assert_same(blend.source_index, expected["dataset_index"], f"{name}: dataset_index")
    _assert_same(blend.sample_index, expected["dataset_sample_index"], f"{name}: dataset_sample_index")


def test_blended_dataset():
    case = MEGATRON.BLEND_CASES["weighted"]
    expected = _megatron("blend", "weighted")
    datasets = _blend_sources(case, [int(expected[f"num_samples_{k}"]) for k in range(3)])
    size = len(expected["dataset_index"])
    blend = BlendedDataset(datasets, case["weights"], size)
    assert len(blend) == size and blend.weights == pytest.approx([0.5, 0.3, 0.2])
    expected_sources, expected_numbers = expected["dataset_index"], expected["dataset_sample_index"]
    for i in (0, 1, 2, 250, size - 1):
        k, j = int(expected_sources[i]), int(expected_numbers[i])
        assert blend.source_of(i) == k
        item = blend[i]
        assert item["dataset_id"] == k
        assert np.array_equal(item["input_ids"], datasets[k][j]["input_ids"])
    with pytest.raises(IndexError, match=f"sample {size} out of range"):
        blend.source_of(size)

    with pytest.raises(ValueError, match="blend source 1 must supply"):
        BlendedDataset(datasets, [0.5, 20, 0.5], 2000)
    with pytest.raises(ValueError, match="need one weight per dataset"):
        BlendedDataset(datasets, [1, 1], size)
    with pytest.raises(ValueError, match="weights must be finite, non-negative"):
        BlendedDataset(datasets, [1, -1, 1], size)


def test_blend_cache(tmp_path):
    source = _make_indexed(tmp_path / "s", 40, seed=0)
    datasets = [_dataset(source, num_samples=60), _dataset(source, num_samples=60, seed=5)]
    first = BlendedDataset(datasets, [0.5, 0.5], 100, cache_dir=tmp_path / "cache")
    second = BlendedDataset(datasets, [1, 1], 100, cache_dir=tmp_path / "cache")
    assert not first.loaded_from_cache and second.loaded_from_cache
    assert np.array_equal(first.source_index, second.source_index)
    index_file = next((tmp_path / "cache").glob("*-BlendedDataset-dataset_index.npy"))
    np.save(index_file, np.full(100, 1, np.int16))
    third = BlendedDataset(datasets, [1, 1], 100, cache_dir=tmp_path / "cache")
    assert not third.loaded_from_cache
    assert np.array_equal(first.source_index, third.source_index)
    assert not BlendedDataset(datasets, [1, 2], 100, cache_dir=tmp_path / "cache").loaded_from_cache


def test_build_blended_dataset(tmp_path):
    for k in range(2):
        _make_indexed(tmp_path / f"s{k}", 50, seed=k)
    data_path = ["0.7", str(tmp_path / "s0"), 0.3, str(tmp_path / "s1")]
    blend = build_blended_dataset(
        data_path, seq_length=8, num_samples=200, seed=3, split="90,10,0", eod_id=EOD, cache_dir=tmp_path / "cache"
    )
    # Each source is asked for ceil(200 * w * 1.005) samples and the blend holds all of them.
    assert [d.num_samples for d in blend.datasets] == [141, 61]
    assert len(blend) == 202
    assert blend.weights == pytest.approx([0.7, 0.3])
    assert all(d.document_end == 45 for d in blend.datasets)
    assert blend[199]["input_ids"].shape == (8,)
    assert np.bincount(blend.source_index[:200]).tolist() == [140, 60]

    again = build_blended_dataset(
        data_path, seq_length=8, num_samples=200, seed=3, split="90,10,0", eod_id=EOD, cache_dir=tmp_path / "cache",
        create_compressed_eod_mask=True, eod_pad_length=8,
    )
    assert again.loaded_from_cache and all(d.loaded_from_cache for d in again.datasets)
    assert again[0]["actual_seq_len"].shape == (8,)
    with pytest.raises(TypeError, match="create_attention_masks"):
        build_blended_dataset(data_path, seq_length=8, num_samples=200, seed=3, split="90,10,0",
                                    eod_id=EOD, create_attention_masks=True)


@pytest.mark.parametrize(
    "data_path, message",
    [
        ([], r"data_path is empty"),
        ("1.0 prefix", "must be a list"),
        (["heavy", "PREFIX"], r"data_path\[0\]: heavy\.bin not found"),
        (["1.0"], r"data_path\[0\]: 1\.0\.bin not found"),
        ([1, "PREFIX", "x", "PREFIX"], r"data_path\[2\]: weight 'x' is not a number \(the list mixes"),
        ([1, "PREFIX", -2, "PREFIX"], r"data_path\[2\]: weight -2 must be a positive number"),
        ([1, "PREFIX", 1, "MISSING"], r"data_path\[3\]: .*MISSING\.bin not found"),
        (["PREFIX", 0.5], r"data_path\[1\]: prefix 0\.5 is not a path"),
        ([True, "PREFIX"], r"data_path\[0\]: prefix True is not a path"),
    ],
)
def test_malformed_data_path(tmp_path, data_path, message):
    _make_indexed(tmp_path / "s", 5, seed=0)
    if isinstance(data_path, list):
        names = {"PREFIX": str(tmp_path / "s"), "MISSING": str(tmp_path / "MISSING")}
        data_path = [names.get(e, e) if isinstance(e, str) else e for e in data_path]
    with pytest.raises(ValueError, match=message):
        parse_data_path(data_path)


def test_parse_data_path_forms(tmp_path):
    for k in range(3):
        _make_indexed(tmp_path / f"s{k}", 5, seed=k)
    p = [str(tmp_path / f"s{k}") for k in range(3)]
    assert parse_data_path(["2", p[0], 0.5, p[1]]) == ([p[0], p[1]], [2.0, 0.5])
    assert parse_data_path(p) == (p, None)  # odd length: prefixes only
    assert parse_data_path(p[:2]) == (p[:2], None)  # even length, no entry a number: prefixes only


@pytest.mark.parametrize("name", sorted(MEGATRON.EXHAUSTIVE_CASES))
@pytest.mark.parametrize("chunked", [False, True])
def test_exhaustive_blend_equals_megatron_cores(name, chunked, monkeypatch):
    """build_exhaustive_blending_indices of megatron-core's C++ helpers; `chunked` forces Kiln's chunked
    greedy builder on (below its size threshold otherwise) before the used-up sources leave the race."""
    lengths = MEGATRON.EXHAUSTIVE_CASES[name]
    if chunked:
        monkeypatch.setattr(gpt_dataset, "_BLEND_PARALLEL_MIN_SIZE", 0)
    sources, numbers = gpt_dataset._exhaustive_blending_indices(lengths)
    expected = _megatron("exhaustive", name)
    _assert_same(sources, expected["dataset_index"], f"{name}: dataset_index")
    _assert_same(numbers, expected["dataset_sample_index"], f"{name}: dataset_sample_index")


def test_unweighted_blend(tmp_path):
    for k in range(2):
        _make_indexed(tmp_path / f"s{k}", 40 + 30 * k, seed=k)
    prefixes = [str(tmp_path / f"s{k}") for k in range(2)]
    blend = build_blended_dataset(prefixes, seq_length=8, num_samples=50, seed=3, split="1,0,0", eod_id=EOD,
                                  builder_threads=2)
    # each source is read for exactly one epoch, all of it, in proportion to its size
    assert [d.num_samples for d in blend.datasets] == [None, None]
    assert len(blend) == sum(len(d) for d in blend.datasets)
    assert np.bincount(blend.source_index).tolist() == [len(d) for d in blend.datasets]
    np.testing.assert_array_equal(blend[5]["input_ids"], blend.datasets[blend.source_of(5)][
        int(blend.sample_index[5])]["input_ids"])
    with pytest.raises(ValueError, match=r"cfg\.data_path: the unweighted blend holds \d+ samples .* 5000 are needed"):
        build_blended_dataset(prefixes, seq_length=8, num_samples=5000, seed=3, split="1,0,0", eod_id=EOD,
                              where="cfg.data_path")
    # a single prefix without a weight is read for as many epochs as the samples need
    single = build_blended_dataset(prefixes[:1], seq_length=8, num_samples=500, seed=3, split="1,0,0", eod_id=EOD)
    assert len(single) == 500 and single.datasets[0].num_samples == 500 and single.datasets[0].num_epochs > 1


def test_mock_dataset_equals_megatron_cores():
    """Megatron's mock data (MockGPTLowLevelDataset) and the train split of its MockGPTDataset, for which
    megatron forces split "1,1,1"; Kiln's mock honours the configured split, so it is given "1,1,1" here."""
    case = MEGATRON.MOCK_CASE
    expected = _megatron("mock")
    mock = gpt_dataset.MockIndexedDataset(eod_id=case["eod"])
    _assert_same_digest(mock.sequence_lengths, expected, "sequence_lengths")
    for document in case["documents"]:
        _assert_same(mock.get(document), expected[f"document_{document}"], f"document {document}")
        _assert_same(mock.get(document, 2, 5), expected[f"document_{document}_offset_2_length_5"],
                     f"document {document}[2:7]")
    dataset = GPTDataset(mock, seq_length=case["seq_length"], num_samples=case["num_samples"], seed=case["seed"],
                         eod_id=case["eod"], split="1,1,1", split_index=0)
    for index in ("document_index", "sample_index", "shuffle_index"):
        _assert_same_digest(getattr(dataset, index), expected, index)
    tokens = np.stack([dataset.sample_tokens(i) for i in range(case["samples"])])
    _assert_same(tokens, expected["text"], "mock sample tokens")


def test_mock_blend():
    mock = gpt_dataset.MockIndexedDataset(eod_id=7)
    lengths = mock.sequence_lengths
    document = mock.get(3)
    assert np.array_equal(mock.get(3, int(lengths[3]) - 3), document[-3:])
    blend = build_blended_dataset(None, seq_length=16, num_samples=40, seed=1, split="1,0,0", eod_id=7)
    assert len(blend) == 40 and blend[0]["input_ids"].shape == (16,)
    # every sample is a stretch of counting tokens, broken only where a document ends with the eod id
    tokens = blend.sample_tokens(0)
    steps = np.diff(tokens)[tokens[:-1] != 7]
    assert np.all((steps == 1) | (tokens[1:][tokens[:-1] != 7] == 7))
