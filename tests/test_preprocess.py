import io
import json
import os
import random

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import sentencepiece

from training.data import preprocess
from training.data.corpus import CorpusError
from training.data.hashing import sha256_file
from training.data.indexed import IndexedDataset
from training.data.preprocess import output_prefix_for, tokenize_to_indexed

WORDS = "alpha beta gamma delta kiln shard token epoch batch loss model data".split()


def _documents(seed, count):
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 40))) for _ in range(count)]


@pytest.fixture(scope="module")
def tokenizer_model(tmp_path_factory):
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(_documents(0, 400)),
        model_writer=model,
        vocab_size=200,
        model_type="unigram",
        character_coverage=1.0,
        hard_vocab_limit=False,
        minloglevel=2,
    )
    path = tmp_path_factory.mktemp("tokenizer") / "tiny.model"
    path.write_bytes(model.getvalue())
    return path


@pytest.fixture(scope="module")
def processor(tokenizer_model):
    return sentencepiece.SentencePieceProcessor(model_file=str(tokenizer_model))


@pytest.fixture
def small_tasks(monkeypatch):
    """Tasks of a few hundred bytes, so even a small test corpus is cut into many of them."""
    monkeypatch.setattr(preprocess, "MIN_CHUNK_BYTES", 300)


def _write_jsonl(path, records):
    with open(path, "w", encoding="utf-8") as stream:
        for record in records:
            stream.write(json.dumps(record if isinstance(record, dict) else {"text": record}) + "\n")
    return path


def _dataset_documents(prefix):
    dataset = IndexedDataset(prefix)
    return [dataset.get(i).tolist() for i in range(len(dataset))]


def test_shards_decode_back_to_documents(tmp_path, tokenizer_model, processor, small_tasks):
    first, second = _documents(1, 300), _documents(2, 250)
    files = [_write_jsonl(tmp_path / "a.jsonl", first), _write_jsonl(tmp_path / "b.jsonl", second)]
    stats = tokenize_to_indexed(files, tokenizer_model, tmp_path / "out" / "src", workers=1)

    eod = processor.eos_id()
    prefix = tmp_path / "out" / "src_text_document"
    dataset = IndexedDataset(prefix)
    documents = first + second
    assert len(dataset) == stats["docs"] == stats["records"] == len(documents)
    assert dataset.num_tokens == stats["tokens"]
    assert dataset.dtype == np.uint16 and stats["dtype"] == "uint16"
    for i, doc in enumerate(documents):
        tokens = dataset.get(i).tolist()
        assert tokens[-1] == eod
        assert processor.decode(tokens[:-1]) == doc
    (output,) = stats["outputs"]
    assert output["prefix"] == str(prefix) and output["key"] == "text" and output["docs"] == len(documents)
    assert output["bin_sha256"] == sha256_file(output["bin_path"])
    assert output["idx_sha256"] == sha256_file(output["idx_path"])
    assert output["bin_bytes"] == 2 * stats["tokens"]
    assert output["idx_bytes"] == 34 + 12 * len(documents) + 8 * (len(documents) + 1)
    assert stats["tokens_per_s"] > 0 and stats["skipped"] == 0 and stats["quarantine"] is None

    lengths = dataset.sequence_lengths
    expected = {}
    for length in lengths.tolist():
        low = 1 << (length.bit_length() - 1)
        label = str(low) if low == 2 * low - 1 else f"{low}-{2 * low - 1}"
        expected[label] = expected.get(label, 0) + 1
    assert stats["length_histogram"] == expected
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["src_text_document.bin", "src_text_document.idx"]


def test_workers_write_identical_bytes(tmp_path, tokenizer_model, small_tasks):
    path = _write_jsonl(tmp_path / "a.jsonl", _documents(3, 1500))
    one = tokenize_to_indexed([path], tokenizer_model, tmp_path / "one", workers=1)
    two = tokenize_to_indexed([path], tokenizer_model, tmp_path / "two", workers=2)
    for ext in ("bin", "idx"):
        assert (tmp_path / f"one_text_document.{ext}").read_bytes() == (tmp_path / f"two_text_document.{ext}").read_bytes()
    assert one["outputs"][0]["bin_sha256"] == two["outputs"][0]["bin_sha256"] and one["docs"] == two["docs"] == 1500


def _die(work):
    os._exit(1)  # as a worker killed by the OOM killer: no exception, the process is gone


def test_a_dead_worker_fails_the_run_and_writes_nothing(tmp_path, tokenizer_model, small_tasks, monkeypatch):
    path = _write_jsonl(tmp_path / "a.jsonl", _documents(3, 1500))
    monkeypatch.setattr(preprocess, "_encode_in_worker", _die)  # the forked workers inherit it
    with pytest.raises(ChildProcessError, match=r"a tokenizing worker process died while .*a.jsonl was being encoded"):
        tokenize_to_indexed([path], tokenizer_model, tmp_path / "out" / "p", workers=2)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == []


def test_eod_and_bos_are_optional(tmp_path, tokenizer_model, processor):
    path = _write_jsonl(tmp_path / "a.jsonl", ["alpha beta"])
    ids = processor.encode("alpha beta")
    tokenize_to_indexed(path, tokenizer_model, tmp_path / "plain", append_eod=False, workers=1)
    assert _dataset_documents(tmp_path / "plain_text_document") == [ids]
    stats = tokenize_to_indexed(path, tokenizer_model, tmp_path / "both", prepend_bos=True, workers=1)
    assert _dataset_documents(tmp_path / "both_text_document") == [[processor.bos_id(), *ids, processor.eos_id()]]
    assert stats["bos_id"] == processor.bos_id() and stats["eod_id"] == processor.eos_id()


def test_each_key_is_its_own_stream_and_empty_documents_are_dropped(tmp_path, tokenizer_model, processor):
    records = [{"title": "alpha", "body": "beta gamma"}, {"title": "", "body": "delta"}, {"title": "kiln", "body": ""},
               {"title": "", "body": ""}]
    path = _write_jsonl(tmp_path / "a.jsonl", records)
    stats = tokenize_to_indexed(path, tokenizer_model, tmp_path / "p", json_keys=["title", "body"], workers=1)
    eod = processor.eos_id()
    assert _dataset_documents(tmp_path / "p_title_document") == [processor.encode(t) + [eod] for t in ("alpha", "kiln")]
    assert _dataset_documents(tmp_path / "p_body_document") == [processor.encode(t) + [eod] for t in ("beta gamma", "delta")]
    assert stats["records"] == 4 and stats["docs"] == 4 and stats["empty_docs"] == 4
    assert [o["key"] for o in stats["outputs"]] == ["title", "body"]


def test_size_limit_splits_into_numbered_shards(tmp_path, tokenizer_model, small_tasks):
    path = _write_jsonl(tmp_path / "a.jsonl", _documents(6, 400))
    whole = tokenize_to_indexed(path, tokenizer_model, tmp_path / "whole", workers=2)
    limit = whole["tokens"] // 5
    stats = tokenize_to_indexed(path, tokenizer_model, tmp_path / "split", workers=2, max_shard_tokens=limit)

    prefixes = [o["prefix"] for o in stats["outputs"]]
    assert prefixes == [str(output_prefix_for(tmp_path / "split", "text", i)) for i in range(len(prefixes))]
    assert prefixes[0].endswith("split_text_document_00000") and len(prefixes) >= 5
    assert all(0 < o["tokens"] <= limit for o in stats["outputs"])
    assert stats["tokens"] == whole["tokens"] and stats["docs"] == whole["docs"]
    split_docs = [doc for prefix in prefixes for doc in _dataset_documents(prefix)]
    assert split_docs == _dataset_documents(tmp_path / "whole_text_document")
    # a shard is only closed when the next document does not fit
    sizes = [IndexedDataset(p).sequence_lengths for p in prefixes]
    assert all(s.sum() + nxt[0] > limit for s, nxt in zip(sizes, sizes[1:]))


def test_document_longer_than_the_limit_gets_its_own_shard(tmp_path, tokenizer_model):
    path = _write_jsonl(tmp_path / "a.jsonl", ["alpha", " ".join(["beta"] * 50), "gamma"])
    stats = tokenize_to_indexed(path, tokenizer_model, tmp_path / "p", max_shard_tokens=10, workers=1)
    assert [o["docs"] for o in stats["outputs"]] == [1, 1, 1]
    assert stats["outputs"][1]["tokens"] > 10


@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("limit", [None, 200])
def test_bad_line_fails_and_leaves_no_output(tmp_path, tokenizer_model, small_tasks, workers, limit):
    path = tmp_path / "a.jsonl"
    path.write_text("\n".join(json.dumps({"text": d}) for d in _documents(4, 600)) + '\n{"text": 1}\n'
                    + json.dumps({"text": "alpha"}) + "\n")
    with pytest.raises(CorpusError, match=rf"^{path}:601: key 'text' is number, expected a string$"):
        tokenize_to_indexed([path], tokenizer_model, tmp_path / "out" / "shard", workers=workers,
                            max_shard_tokens=limit)
    assert list((tmp_path / "out").iterdir()) == []


def test_skip_writes_quarantine_with_file_and_line(tmp_path, tokenizer_model, processor, small_tasks):
    good = _documents(7, 200)
    lines = [json.dumps({"text": d}) for d in good]
    lines.insert(50, '{"text": 5}')
    lines.insert(120, '{"title": "x"}')
    lines.insert(180, '{"text": "broken')
    path = tmp_path / "a.jsonl"
    path.write_bytes(("\n".join(lines) + "\n").encode() + b'{"text": "caf\xe9"}\n')
    stats = tokenize_to_indexed(path, tokenizer_model, tmp_path / "p", on_bad_line="skip", workers=2)

    assert stats["docs"] == len(good) and stats["skipped"] == 4
    assert stats["skipped_by_reason"] == {"not_a_string": 1, "missing_key": 1, "invalid_json": 1, "invalid_utf8": 1}
    quarantine = [json.loads(line) for line in open(stats["quarantine"], encoding="utf-8")]
    assert stats["quarantine"] == f"{tmp_path / 'p'}_quarantine.jsonl"
    assert [(q["line"], q["reason"]) for q in quarantine] == [
        (51, "not_a_string"), (121, "missing_key"), (181, "invalid_json"), (204, "invalid_utf8")]
    assert quarantine[0] == {"file": str(path), "line": 51, "reason": "not_a_string",
                             "detail": "key 'text' is number, expected a string", "raw": '{"text": 5}'}
    assert quarantine[3]["raw"] == '{"text": "caf\\xe9"}'
    decoded = [processor.decode(d[:-1]) for d in _dataset_documents(tmp_path / "p_text_document")]
    assert decoded == good


def test_json_array_and_parquet_give_the_same_shard_as_jsonl(tmp_path, tokenizer_model, small_tasks):
    documents = _documents(8, 300)
    jsonl = _write_jsonl(tmp_path / "a.jsonl", documents)
    array = tmp_path / "a.json"
    array.write_text(json.dumps([{"text": d} for d in documents], indent=1))
    parquet = tmp_path / "a.parquet"
    pq.write_table(pa.table({"text": documents}), parquet, row_group_size=64)
    digests = set()
    for name, path in [("jsonl", jsonl), ("json", array), ("parquet", parquet)]:
        stats = tokenize_to_indexed(path, tokenizer_model, tmp_path / name, workers=2)
        assert stats["docs"] == len(documents)
        digests.add((stats["outputs"][0]["bin_sha256"], stats["outputs"][0]["idx_sha256"]))
    assert len(digests) == 1


def test_bad_element_of_a_json_array_is_named_after_earlier_bad_lines(tmp_path, tokenizer_model, small_tasks):
    jsonl = tmp_path / "a.jsonl"
    jsonl.write_text("\n".join(json.dumps({"text": d}) for d in _documents(9, 100)) + '\n{"text": null}\n')
    array = tmp_path / "b.json"
    array.write_text('[{"text": "alpha"},\n {"text": ]')
    with pytest.raises(CorpusError, match=rf"^{jsonl}:101: key 'text' is null"):
        tokenize_to_indexed([jsonl, array], tokenizer_model, tmp_path / "p", workers=2)
    with pytest.raises(CorpusError, match=rf"^{array}:2: element 1: invalid JSON"):
        tokenize_to_indexed([jsonl, array], tokenizer_model, tmp_path / "p", workers=2, on_bad_line="skip")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.jsonl", "b.json"]


def test_model_without_eos_cannot_append_eod(tmp_path):
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(_documents(5, 200)), model_writer=model, vocab_size=60,
        eos_id=-1, hard_vocab_limit=False, minloglevel=2,
    )
    model_path = tmp_path / "no_eos.model"
    model_path.write_bytes(model.getvalue())
    path = _write_jsonl(tmp_path / "a.jsonl", ["alpha"])
    with pytest.raises(ValueError, match=r"no_eos\.model: the model has no eos piece"):
        tokenize_to_indexed([path], model_path, tmp_path / "shard")


@pytest.mark.parametrize("kwargs, message", [
    ({"workers": 0}, "workers must be a positive integer"),
    ({"max_shard_tokens": 0}, "max_shard_tokens must be a positive integer"),
    ({"on_bad_line": "warn"}, "on_bad_line must be one of"),
    ({"json_keys": []}, "json_keys must be one or more"),
])
def test_bad_arguments(tmp_path, tokenizer_model, kwargs, message):
    path = _write_jsonl(tmp_path / "a.jsonl", ["alpha"])
    with pytest.raises(ValueError, match=message):
        tokenize_to_indexed([path], tokenizer_model, tmp_path / "p", **kwargs)
    with pytest.raises(FileNotFoundError, match=r"missing\.jsonl: input file not found"):
        tokenize_to_indexed([tmp_path / "missing.jsonl"], tokenizer_model, tmp_path / "p")


def test_command_prints_a_summary_and_names_a_bad_line(tmp_path, tokenizer_model, capsys):
    from training.cli import main as kiln

    jsonl = _write_jsonl(tmp_path / "a.jsonl", _documents(10, 30) + [""])
    parquet = tmp_path / "b.parquet"
    pq.write_table(pa.table({"text": _documents(11, 20)}), parquet)
    prefix = tmp_path / "out" / "corpus"
    assert kiln(["preprocess", "--input", str(jsonl), "--input", str(parquet), "--tokenizer-model",
                 str(tokenizer_model), "--output-prefix", str(prefix), "--workers", "2", "--append-eod"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("50 documents, ") and "tokens/s with 2 workers" in out
    assert "dropped 1 empty documents" in out
    assert f"wrote {prefix}_text_document.bin and .idx: 50 documents" in out
    assert len(IndexedDataset(f"{prefix}_text_document")) == 50

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "alpha"}\n{"text": "beta"\n')
    assert kiln(["preprocess", "--input", str(bad), "--tokenizer-model", str(tokenizer_model),
                 "--output-prefix", str(tmp_path / "bad")]) == 2
    assert capsys.readouterr().err.startswith(f"kiln preprocess: {bad}:2: invalid JSON")
    assert not list(tmp_path.glob("bad_*"))


def test_a_file_that_is_not_a_sentencepiece_model_is_one_line_naming_it(tmp_path, capsys):
    from training.cli import main as kiln

    path = _write_jsonl(tmp_path / "a.jsonl", ["alpha"])
    not_a_model = tmp_path / "tokenizer.json"
    not_a_model.write_text('{"model": {"type": "BPE"}}')  # a Hugging Face tokenizer file, say
    for command in (["preprocess", "--input", str(path), "--output-prefix", str(tmp_path / "p")],
                    ["dataset", "inspect", "--config", "tests/configs/qwen3_micro.yaml", "--num", "1",
                     *[arg for setting in ("train_dataset.dataloader.config.mock=true", "model.vocab_size=8192",
                                           "train_dataset.dataloader.config.data_path=null",
                                           "train_dataset.dataloader.config.eod=2", "checkpoint.enable_save=false")
                       for arg in ("--set", setting)]]):
        assert kiln([*command, "--tokenizer-model", str(not_a_model)]) == 2
        err = capsys.readouterr().err
        assert err.splitlines() == [f"kiln {command[0] if command[0] == 'preprocess' else 'dataset inspect'}: "
                                    f"{not_a_model}: not a sentencepiece model (a .model file written by "
                                    f"sentencepiece's trainer, e.g. data/tokenizer/kiln.model)"]
    assert not list(tmp_path.glob("p_*"))
