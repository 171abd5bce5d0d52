import io
import json
import random

import numpy as np
import pytest
import sentencepiece

from training.data.corpus import CorpusError
from training.data.hashing import sha256_file
from training.data.indexed import IndexedDataset
from training.data.preprocess import tokenize_to_indexed

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


def _write_jsonl(path, documents):
    with open(path, "w", encoding="utf-8") as stream:
        for doc in documents:
            stream.write(json.dumps({"text": doc}) + "\n")
    return path


def test_shards_decode_back_to_documents(tmp_path, tokenizer_model):
    first, second = _documents(1, 300), _documents(2, 250)
    files = [_write_jsonl(tmp_path / "a.jsonl", first), _write_jsonl(tmp_path / "b.jsonl", second)]
    stats = tokenize_to_indexed(files, tokenizer_model, tmp_path / "out" / "shard")

    processor = sentencepiece.SentencePieceProcessor(model_file=str(tokenizer_model))
    eod = processor.eos_id()
    dataset = IndexedDataset(tmp_path / "out" / "shard")
    documents = first + second
    assert len(dataset) == stats["docs"] == len(documents)
    assert dataset.num_tokens == stats["tokens"]
    assert dataset.dtype == np.uint16 and stats["dtype"] == "uint16"
    for i, doc in enumerate(documents):
        tokens = dataset.get(i).tolist()
        assert tokens[-1] == eod
        assert processor.decode(tokens[:-1]) == doc
    all_tokens = np.concatenate([dataset.get(i) for i in range(len(dataset))])
    assert int((all_tokens == eod).sum()) == len(documents)

    assert stats["bin_sha256"] == sha256_file(stats["bin_path"])
    assert stats["idx_sha256"] == sha256_file(stats["idx_path"])
    assert stats["bin_bytes"] == 2 * stats["tokens"]
    assert stats["idx_bytes"] == 34 + 12 * len(documents) + 8 * (len(documents) + 1)
    assert stats["tokens_per_s"] > 0


def test_two_workers_write_identical_bytes(tmp_path, tokenizer_model):
    path = _write_jsonl(tmp_path / "a.jsonl", _documents(3, 1500))
    one = tokenize_to_indexed([path], tokenizer_model, tmp_path / "one")
    two = tokenize_to_indexed([path], tokenizer_model, tmp_path / "two", workers=2)
    assert (tmp_path / "one.bin").read_bytes() == (tmp_path / "two.bin").read_bytes()
    assert (tmp_path / "one.idx").read_bytes() == (tmp_path / "two.idx").read_bytes()
    assert one["bin_sha256"] == two["bin_sha256"] and one["docs"] == two["docs"] == 1500


def test_without_eod(tmp_path, tokenizer_model):
    path = _write_jsonl(tmp_path / "a.jsonl", ["alpha beta"])
    tokenize_to_indexed(path, tokenizer_model, tmp_path / "shard", append_eod=False)
    processor = sentencepiece.SentencePieceProcessor(model_file=str(tokenizer_model))
    assert IndexedDataset(tmp_path / "shard").get(0).tolist() == processor.encode("alpha beta")


@pytest.mark.parametrize("workers", [1, 2])
def test_bad_line_fails_and_leaves_no_output(tmp_path, tokenizer_model, workers):
    path = tmp_path / "a.jsonl"
    path.write_text("\n".join(json.dumps({"text": d}) for d in _documents(4, 600)) + '\n{"text": 1}\n')
    with pytest.raises(CorpusError, match=rf"a\.jsonl:601: key 'text' is number"):
        tokenize_to_indexed([path], tokenizer_model, tmp_path / "out" / "shard", workers=workers)
    assert list((tmp_path / "out").iterdir()) == []


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
