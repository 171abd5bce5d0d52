import json
import logging
import os

import numpy as np
import pytest
from mindspore.mindrecord import FileReader, FileWriter

from training.data.gpt_dataset import GPTDataset
from training.data.hashing import sha256_file
from training.data.indexed import IndexedDataset, IndexedDatasetWriter
from training.data.mindrecord import (
    MultiSourceMindRecordDataset,
    build_mindrecord_train_dataset,
    check_token_ids,
    convert_to_mindrecord,
    read_mindrecord_samples,
)

EOD = 1
PAD = 7  # a real token id of corpus A, so pad masking is exercised
SEQ = 16
SEED = 1234
# Corpus B's ids (all but EOD) start here, so every sample tells which corpus it came from.
B_BASE = 20000
A_SAMPLES, B_SAMPLES = 60, 30


def _write_corpus(prefix, num_docs, base, dtype, seed):
    rng = np.random.default_rng(seed)
    with IndexedDatasetWriter(prefix, dtype) as writer:
        for _ in range(num_docs):
            length = int(rng.integers(3, 30))
            writer.add_document(np.append(rng.integers(base + 2, base + 500, length), EOD))
    return str(prefix)


def _gpt(prefix, num_samples):
    return GPTDataset(IndexedDataset(prefix), seq_length=SEQ, num_samples=num_samples, seed=SEED,
                      eod_id=EOD, pad_id=PAD)


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpora")
    return {"a": _write_corpus(root / "a", 80, 0, np.int32, seed=1),
            "b": _write_corpus(root / "b", 50, B_BASE, np.uint16, seed=2)}


@pytest.fixture(scope="module")
def converted(tmp_path_factory, corpora):
    """A as one file; B written as two files, one directory level down."""
    root = tmp_path_factory.mktemp("mindrecord")
    a = root / "a.mindrecord"
    b = root / "nested" / "deeper" / "b.mindrecord"
    convert_to_mindrecord(corpora["a"], a, seq_length=SEQ, eod_id=EOD, pad_id=PAD, num_samples=A_SAMPLES, seed=SEED)
    convert_to_mindrecord(corpora["b"], b, seq_length=SEQ, eod_id=EOD, pad_id=PAD, num_samples=B_SAMPLES, seed=SEED,
                          shard_num=2)
    return {"a": str(a), "b_dir": str(root / "nested"),
            "b_files": [str(b.with_name("b_0.mindrecord")), str(b.with_name("b_1.mindrecord"))]}


def _dataset(converted, **options):
    defaults = dict(pad_id=PAD, seed=3, shuffle=False)
    return MultiSourceMindRecordDataset([converted["a"], converted["b_files"]], **{**defaults, **options})


def _all_from_b(records):
    return bool((records.max(axis=1) >= B_BASE).all())


# ---- conversion ----------------------------------------------------------------------------


def test_records_are_the_gpt_dataset_samples_in_order(converted, corpora):
    expected = _gpt(corpora["a"], A_SAMPLES)
    records = read_mindrecord_samples(converted["a"], "a")
    assert records.dtype == np.int32 and records.shape == (A_SAMPLES, SEQ + 1)
    assert np.array_equal(records, np.stack([expected.sample_tokens(i) for i in range(A_SAMPLES)]))


def test_a_sharded_write_is_files_mindformers_reads_holding_the_samples_in_order(converted, corpora):
    expected = _gpt(corpora["b"], B_SAMPLES)
    sidecar = json.loads(open(os.path.join(os.path.dirname(converted["b_files"][0]), "b.mindrecord.json")).read())
    assert sidecar["files"] == ["b_0.mindrecord", "b_1.mindrecord"]
    halves = [read_mindrecord_samples([name], "b") for name in converted["b_files"]]
    assert [len(h) for h in halves] == [B_SAMPLES // 2, B_SAMPLES - B_SAMPLES // 2]
    assert np.array_equal(np.concatenate(halves), np.stack([expected.sample_tokens(i) for i in range(B_SAMPLES)]))


def test_an_output_named_otherwise_than_mindformers_reads_is_refused(corpora, tmp_path):
    with pytest.raises(ValueError, match=r"must be named <name>\.mindrecord: MindFormers' loader reads no other"):
        convert_to_mindrecord(corpora["a"], tmp_path / "a.mr", seq_length=SEQ, eod_id=EOD, num_samples=4)
    with pytest.raises(ValueError, match=r"shard_num = 5 files for 4 samples would leave a file empty"):
        convert_to_mindrecord(corpora["a"], tmp_path / "a.mindrecord", seq_length=SEQ, eod_id=EOD, num_samples=4,
                              shard_num=5)
    assert not list(tmp_path.iterdir())


def test_sidecar_records_the_source(converted, corpora, tmp_path):
    sidecar = json.loads(open(converted["a"] + ".json").read())
    prefix = corpora["a"]
    assert sidecar["seq_length"] == SEQ and sidecar["num_samples"] == A_SAMPLES
    assert sidecar["files"] == ["a.mindrecord"] and sidecar["columns"] == ["input_ids"]
    assert sidecar["source"]["prefix"] == prefix
    assert sidecar["source"]["bin_sha256"] == sha256_file(prefix + ".bin")
    assert sidecar["source"]["idx_sha256"] == sha256_file(prefix + ".idx")
    assert (sidecar["source"]["seed"], sidecar["source"]["pad_id"]) == (SEED, PAD)


def test_default_count_is_one_pass_over_the_split(corpora, tmp_path):
    sidecar = convert_to_mindrecord(corpora["a"], tmp_path / "all.mindrecord", seq_length=SEQ, eod_id=EOD)
    tokens = int(IndexedDataset(corpora["a"]).sequence_lengths.sum())
    assert sidecar["num_samples"] == (tokens - 1) // SEQ
    assert len(read_mindrecord_samples(tmp_path / "all.mindrecord", "all")) == sidecar["num_samples"]


def test_a_ready_gpt_dataset_can_be_converted_and_must_agree(corpora, tmp_path):
    dataset = _gpt(corpora["a"], 20)
    convert_to_mindrecord(dataset, tmp_path / "ready.mindrecord", seq_length=SEQ, eod_id=EOD)
    assert np.array_equal(read_mindrecord_samples(tmp_path / "ready.mindrecord", "ready")[5], dataset.sample_tokens(5))
    with pytest.raises(ValueError, match="seq_length = 32 disagrees"):
        convert_to_mindrecord(dataset, tmp_path / "other.mindrecord", seq_length=32, eod_id=EOD)


def test_actual_seq_len_marks_document_ends(corpora, tmp_path):
    output = tmp_path / "eod.mindrecord"
    convert_to_mindrecord(corpora["a"], output, seq_length=SEQ, eod_id=EOD, num_samples=20, actual_seq_len=True,
                          eod_pad_length=8)
    reader = FileReader(str(output), num_consumer=1)
    rows = list(reader.get_next())
    reader.close()
    assert len(rows) == 20
    for row in rows:
        tokens = row["input_ids"]
        ends = [i + 1 for i in range(SEQ - 1) if tokens[i] == EOD]
        assert row["actual_seq_len"].tolist() == ends + [SEQ] * (8 - len(ends))


def test_existing_output_needs_overwrite(corpora, tmp_path):
    output = tmp_path / "x.mindrecord"
    convert_to_mindrecord(corpora["a"], output, seq_length=SEQ, eod_id=EOD, num_samples=10)
    with pytest.raises(FileExistsError, match="x.mindrecord: already exists"):
        convert_to_mindrecord(corpora["a"], output, seq_length=SEQ, eod_id=EOD, num_samples=10)
    convert_to_mindrecord(corpora["b"], output, seq_length=SEQ, eod_id=EOD, num_samples=12, shard_num=2,
                          overwrite=True)
    # The single-file output is gone; only the new two-shard group and its sidecar remain.
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "x.mindrecord.json", "x_0.mindrecord", "x_0.mindrecord.db", "x_1.mindrecord", "x_1.mindrecord.db"]
    assert _all_from_b(read_mindrecord_samples(tmp_path / "x_0.mindrecord", "x"))
    # and back: the files of the sharded output are replaced, MindSpore's shard names of an older Kiln too
    (tmp_path / "x.mindrecord0").write_bytes(b"an older Kiln's shard")
    convert_to_mindrecord(corpora["a"], output, seq_length=SEQ, eod_id=EOD, num_samples=10, overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.mindrecord", "x.mindrecord.db", "x.mindrecord.json"]


class _FailingDataset(GPTDataset):
    """A GPTDataset whose source breaks after a few hundred samples, i.e. mid-conversion."""

    def sample_tokens(self, idx):
        if idx == 300:
            raise OSError("disk went away")
        return super().sample_tokens(idx)


def test_a_failure_mid_conversion_leaves_no_files(corpora, tmp_path):
    failing = _FailingDataset(IndexedDataset(corpora["a"]), seq_length=SEQ, num_samples=400, seed=SEED, eod_id=EOD)
    with pytest.raises(OSError, match="disk went away"):
        convert_to_mindrecord(failing, tmp_path / "f.mindrecord", seq_length=SEQ, eod_id=EOD)
    assert list(tmp_path.iterdir()) == []


def test_a_failed_overwrite_keeps_the_old_output(corpora, tmp_path):
    output = tmp_path / "keep.mindrecord"
    convert_to_mindrecord(corpora["a"], output, seq_length=SEQ, eod_id=EOD, num_samples=10)
    before = {p.name: sha256_file(p) for p in tmp_path.iterdir()}
    failing = _FailingDataset(IndexedDataset(corpora["a"]), seq_length=SEQ, num_samples=400, seed=SEED, eod_id=EOD)
    with pytest.raises(OSError):
        convert_to_mindrecord(failing, output, seq_length=SEQ, eod_id=EOD, overwrite=True)
    assert {p.name: sha256_file(p) for p in tmp_path.iterdir()} == before


def test_too_many_document_ends_name_the_sample(corpora, tmp_path):
    with pytest.raises(ValueError, match=r"sample \d+ has \d+ document ends, more than eod_pad_length = 1"):
        convert_to_mindrecord(corpora["a"], tmp_path / "e.mindrecord", seq_length=SEQ, eod_id=EOD, num_samples=50,
                              actual_seq_len=True, eod_pad_length=1)
    assert list(tmp_path.iterdir()) == []


# ---- reading -------------------------------------------------------------------------------


def test_items_match_gpt_dataset_items(converted, corpora):
    dataset = MultiSourceMindRecordDataset([converted["a"]], pad_id=PAD, seed=0, shuffle=False)
    expected = _gpt(corpora["a"], A_SAMPLES)
    assert dataset.seq_length == SEQ and len(dataset) == A_SAMPLES
    masked = 0
    for i in range(A_SAMPLES):
        item, reference = dataset[i], expected[i]
        assert item.keys() == reference.keys()
        for key in item:
            assert item[key].dtype == reference[key].dtype and np.array_equal(item[key], reference[key]), (i, key)
        masked += int((item["loss_mask"] == 0).sum())
    assert masked > 0  # the pad id occurs, so the masking path ran


def test_source_of_names_where_each_item_came_from(converted):
    dataset = _dataset(converted, shuffle="global")
    for i in range(len(dataset)):
        from_b = bool(dataset.sample_tokens(i).max() >= B_BASE)
        assert dataset.source_of(i) == int(from_b)
    with pytest.raises(IndexError):
        dataset.source_of(len(dataset))


@pytest.mark.parametrize("options, counts", [
    ({}, [A_SAMPLES, B_SAMPLES]),
    ({"dataset_ratios": [0.7, 0.3], "samples_count": 50}, [35, 15]),
    ({"dataset_ratios": [0.55, 0.45], "samples_count": 33}, [18, 14]),  # int() floors each share
    ({"dataset_ratios": [1.0, 0.0], "samples_count": 40}, [40, 0]),
    ({"nums_per_dataset": [12, 25]}, [12, 25]),
])
def test_counts_follow_ratios_exactly(converted, options, counts):
    for shuffle in (False, "global"):
        dataset = _dataset(converted, shuffle=shuffle, **options)
        assert dataset.counts == counts and len(dataset) == sum(counts)
        assert np.bincount(dataset.source_index, minlength=2).tolist() == counts


def test_counts_above_a_source_size_are_capped_with_a_warning(converted, caplog):
    with caplog.at_level(logging.WARNING, logger="training.data.mindrecord"):
        dataset = _dataset(converted, nums_per_dataset=[10, 100])
    assert dataset.counts == [10, B_SAMPLES]
    assert "asks for 100 samples but the source holds 30" in caplog.text
    with caplog.at_level(logging.WARNING, logger="training.data.mindrecord"):
        _dataset(converted, dataset_ratios=[0.5, 0.5], samples_count=100)
    assert "dataset_ratios[1] * samples_count = 0.5 * 100 asks for 50 samples" in caplog.text


def _in_source_order(dataset):
    return [dataset.sample_index[dataset.source_index == k].tolist() for k in range(2)]


def _shuffle_signature(dataset):
    return dataset.source_index.tolist(), dataset.sample_index.tolist()


def _assert_balanced(dataset, window):
    """Every prefix holds each source's exact share, give or take one shuffle window."""
    weights = np.array(dataset.counts) / sum(dataset.counts)
    taken = np.cumsum(np.eye(2)[dataset.source_index], axis=0)
    expected = np.outer(np.arange(1, len(dataset) + 1), weights)
    assert np.abs(taken - expected).max() <= window + 1


def test_no_shuffle_concatenates_sources_in_order(converted):
    dataset = _dataset(converted, nums_per_dataset=[20, 10], shuffle=False)
    assert dataset.source_index.tolist() == [0] * 20 + [1] * 10
    assert _in_source_order(dataset) == [list(range(20)), list(range(10))]


@pytest.mark.parametrize("mode, interleaved, shuffled_inside", [
    ("global", True, True), (True, True, True), ("files", True, False), ("infile", False, True)])
def test_shuffle_modes(converted, mode, interleaved, shuffled_inside):
    build = lambda seed: _dataset(converted, shuffle=mode, seed=seed, shuffle_buffer_size=8,  # noqa: E731
                                  nums_per_dataset=[40, 20])
    dataset = build(5)
    is_sorted = dataset.source_index.tolist() == sorted(dataset.source_index.tolist())
    assert is_sorted != interleaved
    if interleaved:
        _assert_balanced(dataset, window=8)
    picks = _in_source_order(dataset)
    for source, size, count in ((0, A_SAMPLES, 40), (1, B_SAMPLES, 20)):
        assert len(set(picks[source])) == count and all(0 <= j < size for j in picks[source])
        assert (picks[source] != list(range(count))) == shuffled_inside
    assert _shuffle_signature(build(5)) == _shuffle_signature(dataset)
    assert _shuffle_signature(build(6)) != _shuffle_signature(dataset)


def test_true_means_global(converted):
    assert _shuffle_signature(_dataset(converted, shuffle=True, seed=9)) == \
        _shuffle_signature(_dataset(converted, shuffle="GLOBAL", seed=9))


def test_more_samples_than_an_epoch_repeat_it_reshuffled(converted):
    dataset = _dataset(converted, nums_per_dataset=[20, 10], shuffle="global", num_samples=75)
    assert len(dataset) == 75 and dataset.epoch_size == 30
    first, second = dataset.source_index[:30], dataset.source_index[30:60]
    assert np.bincount(first).tolist() == np.bincount(second).tolist() == [20, 10]
    assert not np.array_equal(dataset.sample_index[:30], dataset.sample_index[30:60])


# ---- YAML builder --------------------------------------------------------------------------


def _build(dataset_files, shuffle=False, num_samples=10, **blend):
    from training.config import KilnMindRecordConfig

    return build_mindrecord_train_dataset(dataset_files, shuffle=shuffle, num_samples=num_samples,
                                          blend=KilnMindRecordConfig(**{"seed": 1, "pad": PAD, **blend}))


def test_builder_reads_files_and_directories(converted):
    dataset = _build([converted["a"], converted["b_dir"]], shuffle=True, num_samples=40, dataset_ratios=[0.6, 0.4],
                     samples_count=50)
    assert dataset.counts == [30, 20] and len(dataset) == 40
    assert dataset.labels == ["train_dataset.dataloader.dataset_files[0]", "train_dataset.dataloader.dataset_files[1]"]
    # The directory's two files are one source holding all of B.
    assert len(dataset.records[1]) == B_SAMPLES and _all_from_b(dataset.records[1])


def test_builder_takes_a_single_path(converted):
    dataset = _build(converted["a"], num_samples=5)
    assert dataset.counts == [A_SAMPLES] and len(dataset) == 5


def test_without_shuffle_kiln_reads_what_mindformers_mind_dataset_reads_in_its_order(converted):
    """MindFormers' PyNative trainer reads a MindDataset section as mindspore.dataset.MindDataset over the files
    its loader finds (every *.mindrecord of a directory, a named .mindrecord file), shuffle off by default."""
    from mindspore.dataset import MindDataset

    files = [converted["a"], *converted["b_files"]]
    theirs = [row["input_ids"] for row in MindDataset(files, columns_list=["input_ids"], shuffle=False)
              .create_dict_iterator(num_epochs=1, output_numpy=True)]
    ours = _build([converted["a"], converted["b_dir"]], num_samples=A_SAMPLES + B_SAMPLES)
    assert np.array_equal(np.stack(theirs), np.stack([ours.sample_tokens(i) for i in range(len(ours))]))


def test_a_directory_source_holds_the_files_mindformers_finds(converted):
    walked = sorted(os.path.join(root, name) for root, _, names in os.walk(converted["b_dir"])
                    for name in names if name.endswith(".mindrecord"))  # its _get_mindrecord_files rule
    assert walked == converted["b_files"]
    dataset = _build([converted["b_dir"]], num_samples=B_SAMPLES)
    assert np.array_equal(dataset.records[0], read_mindrecord_samples(walked, "b"))


@pytest.fixture(scope="module")
def broken(tmp_path_factory, corpora):
    """An empty directory, a file that is no MindRecord, a MindRecord cut in half, one that MindFormers' loader
    skips for its name, a directory holding MindSpore's shard names and a MindRecord without records."""
    root = tmp_path_factory.mktemp("broken")
    (root / "empty").mkdir()
    (root / "garbage.mindrecord").write_bytes(b"not a mindrecord")
    truncated = root / "truncated.mindrecord"
    convert_to_mindrecord(corpora["a"], truncated, seq_length=SEQ, eod_id=EOD, num_samples=10)
    # In place: MindRecord files are sparse and large, a copy would write tens of MB.
    os.truncate(truncated, truncated.stat().st_size // 2)
    convert_to_mindrecord(corpora["a"], root / "renamed.mindrecord", seq_length=SEQ, eod_id=EOD, num_samples=4)
    os.rename(root / "renamed.mindrecord", root / "renamed.records")
    (root / "legacy").mkdir()
    (root / "legacy" / "x.mindrecord0").write_bytes(b"")
    writer = FileWriter(str(root / "no_records.mindrecord"), shard_num=1)
    writer.add_schema({"input_ids": {"type": "int32", "shape": [-1]}}, "empty")
    writer.commit()
    return {"EMPTY": str(root / "empty"), "GARBAGE": str(root / "garbage.mindrecord"), "TRUNCATED": str(truncated),
            "RENAMED": str(root / "renamed.records"), "LEGACY": str(root / "legacy"),
            "NO_RECORDS": str(root / "no_records.mindrecord")}


@pytest.mark.parametrize("files, blend, message", [
    (["A", "missing.mindrecord"], {},
     r"train_dataset\.dataloader\.dataset_files\[1\]: no such file or directory: missing\.mindrecord"),
    (["A", "EMPTY"], {}, r"dataset_files\[1\]: no \*\.mindrecord files under"),
    (["GARBAGE"], {}, r"dataset_files\[0\]: cannot read MindRecord .*garbage\.mindrecord"),
    (["TRUNCATED"], {}, r"dataset_files\[0\]: cannot read MindRecord .*truncated\.mindrecord"),
    (["RENAMED"], {}, r"dataset_files\[0\]: \S+renamed\.records does not end in \.mindrecord: MindFormers' "
                      r"loader skips it"),
    (["LEGACY"], {}, r"dataset_files\[0\]: \S+legacy holds x\.mindrecord0, which MindFormers' loader skips .*: a "
                     r"MindSpore shard group; write it again with `kiln mindrecord --shards N`"),
    (["A", "NO_RECORDS"], {}, r"dataset_files\[1\]: holds no records"),
    ([], {}, r"train_dataset\.dataloader\.dataset_files must be a path or a non-empty list"),
    (["A", 3], {}, r"dataset_files\[1\]: 3 is not a path"),
    (["A", "B"], {"dataset_ratios": [1.0]}, r"kiln\.mindrecord\.dataset_ratios has 1 entries but there are 2 sources"),
    (["A", "B"], {"dataset_ratios": [0.5, 0.6], "samples_count": 10}, r"dataset_ratios must sum to 1"),
    (["A", "B"], {"dataset_ratios": [1.5, -0.5], "samples_count": 10},
     r"dataset_ratios\[1\] must be a non-negative number"),
    (["A", "B"], {"dataset_ratios": [0.5, 0.5]}, r"kiln\.mindrecord\.samples_count must be a positive integer"),
    (["A", "B"], {"samples_count": 10}, r"samples_count is only used with"),
    (["A", "B"], {"nums_per_dataset": [3, -1]}, r"nums_per_dataset\[1\] must be a non-negative integer"),
    (["A", "B"], {"nums_per_dataset": [0, 0]}, r"select no samples"),
    (["A", "B"], {"nums_per_dataset": [1, 1], "dataset_ratios": [0.5, 0.5], "samples_count": 2}, r"are exclusive"),
])
def test_builder_errors_name_the_yaml_path(converted, broken, files, blend, message):
    places = {"A": converted["a"], "B": converted["b_files"][0], **broken}
    with pytest.raises(ValueError, match=message):
        _build([places.get(f, f) if isinstance(f, str) else f for f in files], **blend)


def test_sources_of_different_lengths_are_rejected(converted, corpora, tmp_path):
    convert_to_mindrecord(corpora["a"], tmp_path / "long.mindrecord", seq_length=SEQ * 2, eod_id=EOD, num_samples=5)
    with pytest.raises(ValueError, match=r"different lengths .*dataset_files\[1\]: 33"):
        _build([converted["a"], str(tmp_path / "long.mindrecord")], num_samples=5)


def test_token_ids_beyond_the_model_vocabulary_are_refused_naming_the_file_record_and_field(corpora, tmp_path):
    """Checked when the dataset is built, through the trainer's own call (build_dataset with model.vocab_size)."""
    from conftest import MICRO_CONFIG, PROJECT_ROOT
    from training.config import load_config
    from training.data.loader import build_dataset

    # one source, a directory of two files read in name order: A's ids (< 500) first, then B's (> 20000)
    directory = tmp_path / "source"
    convert_to_mindrecord(corpora["a"], directory / "x.mindrecord", seq_length=SEQ, eod_id=EOD, num_samples=5)
    convert_to_mindrecord(corpora["b"], directory / "y.mindrecord", seq_length=SEQ, eod_id=EOD, num_samples=5)
    config = load_config(PROJECT_ROOT / MICRO_CONFIG, [
        f"train_dataset.dataloader={{type: MindDataset, dataset_files: ['{directory}']}}", f"kiln.mindrecord.pad={PAD}",
        "checkpoint.enable_save=false"])
    with pytest.raises(ValueError) as raised:
        build_dataset(config, num_samples=8, vocab_size=1000)
    first = read_mindrecord_samples(directory / "y.mindrecord", "y")[0]
    token = int(np.argmax((first >= 1000) | (first < 0)))
    largest = int(read_mindrecord_samples(directory / "y.mindrecord", "y").max())
    assert str(raised.value) == (
        f"train_dataset.dataloader.dataset_files[0]: {directory / 'y.mindrecord'}: token ids up to {largest}, but "
        f"model.vocab_size is 1000 (first outside [0, 1000): {first[token]} at token {token} of record 0): was it "
        f"tokenized with a larger vocabulary? Re-tokenize it with the model's tokenizer, or set model.vocab_size to "
        f"at least {largest + 1}")
    assert len(build_dataset(config, num_samples=8, vocab_size=largest + 1)) == 8
    # a stored pad id is masked when read, so a negative one is no error; any other negative id is
    records = read_mindrecord_samples(directory / "x.mindrecord", "x")
    records[2, 3] = -1
    check_token_ids(records, "x.mindrecord", vocab_size=1000, pad_id=-1, where="x")
    with pytest.raises(ValueError, match=r"^x: x\.mindrecord: token ids up to \d+, but model\.vocab_size is 1000 "
                                         r"\(first outside \[0, 1000\): -1 at token 3 of record 2\): negative ids "
                                         r"other than the pad id \(7\) are never valid$"):
        check_token_ids(records, "x.mindrecord", vocab_size=1000, pad_id=PAD, where="x")
