"""Data-index figures for `make bench`, on a synthetic corpus of 1,000,000 documents.

- writing the corpus with IndexedDatasetWriter, one add_document call per document;
- opening it and building a GPTDataset index from scratch (document, sample and shuffle index),
  then the same dataset loaded from its index cache;
- Megatron's greedy blend order for 10M samples over 3 sources vs. the scalar greedy loop;
- sample fetching (`__getitem__`) at seq_length 2048 vs. the training step's consumption rate.
"""
from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np

from benchmarks.contention import LoadWatch
from benchmarks.suite import Bench
from training.data import gpt_dataset
from training.data.gpt_dataset import BlendedDataset, GPTDataset
from training.data.indexed import IndexedDataset, IndexedDatasetWriter

EOD = 1
VOCAB_SIZE = 32000
SEQ_LENGTH = 2048
# The demo run's order of magnitude: ~550 tokens/s at seq_length 128 on 2 CPU cores (about 4.3
# samples/s), for a run in which model_flops did not measure it.
DEFAULT_CONSUME_SAMPLES_PER_S = 5.0


def write_synthetic_corpus(prefix: Path, num_documents: int, mean_tokens: int, seed: int = 0) -> int:
    """Documents of uniform random length in [1, 2 * mean_tokens) ending in EOD; returns the token count."""
    rng = np.random.default_rng(seed)
    ends = np.cumsum(rng.integers(1, 2 * mean_tokens, size=num_documents))
    # Content does not matter for speed; a repeating ramp is cheaper to make than random ids.
    tokens = (np.arange(ends[-1]) % (VOCAB_SIZE - 2) + 2).astype(np.uint16)
    tokens[ends - 1] = EOD
    with IndexedDatasetWriter(prefix, np.uint16) as writer:
        for begin, end in zip([0, *ends[:-1].tolist()], ends.tolist()):
            writer.add_document(tokens[begin:end])
    return int(ends[-1])


def _fetch_rate(watch: LoadWatch, variant: str, dataset: GPTDataset, count: int) -> float:
    ids = np.random.default_rng(1).integers(0, len(dataset), size=count).tolist()
    return count / watch.time(variant, lambda: [dataset[idx] for idx in ids], count)


def measure(bench: Bench, consume_samples_per_s: float, num_documents: int, mean_tokens: int, blend_size: int,
            fetch_samples: int) -> None:
    with tempfile.TemporaryDirectory(prefix="kiln-bench-index-") as tmp, LoadWatch(cores=1) as watch:
        work = Path(tmp)
        seconds, tokens = watch.call("write", lambda: write_synthetic_corpus(work / "corpus", num_documents,
                                                                             mean_tokens), num_documents)
        writing = num_documents / seconds

        # Two and a half epochs: a separate final epoch, as a long run over a small corpus gets.
        options = dict(seq_length=SEQ_LENGTH, num_samples=int(2.5 * tokens / SEQ_LENGTH), seed=1234, eod_id=EOD,
                       cache_dir=work / "cache")
        build = watch.time("index build", lambda: GPTDataset(IndexedDataset(work / "corpus"), **options))
        load, cached = watch.call("index load", lambda: GPTDataset(IndexedDataset(work / "corpus"), **options))
        assert cached.loaded_from_cache

        weights = [0.5, 0.3, 0.2]
        # The blend only needs its sources' lengths.
        blend_rate = blend_size / watch.time(
            "blend", lambda: BlendedDataset([range(blend_size)] * len(weights), weights, blend_size), blend_size)
        loop_steps = max(1, blend_size // 10)
        loop_rate = loop_steps / watch.time("scalar loop", lambda: gpt_dataset._greedy_steps(
            gpt_dataset._normalize(weights), 0, [0] * len(weights), loop_steps), loop_steps)

        fetch_rates = {}
        for label, extra in (("", {}), (" + EOD options",
                                        dict(reset_position_ids=True, eod_mask_loss=True,
                                             create_compressed_eod_mask=True))):
            dataset = GPTDataset(IndexedDataset(work / "corpus"), **options, **extra)
            fetch_rates[label] = _fetch_rate(watch, f"fetch{label}", dataset, fetch_samples)
    bench.report(f"write {num_documents / 1e6:g}M docs, add_document", writing, "docs/s", watch=watch)
    bench.report(f"open + index build, {num_documents / 1e6:g}M docs", 1e3 * build, "ms", watch=watch)
    bench.report("open + index load from cache", 1e3 * load, "ms", watch=watch)
    bench.report(f"blend index, {blend_size / 1e6:g}M, 3 sources", blend_rate, "samples/s", blend_rate / loop_rate,
                 "scalar greedy loop", watch=watch)
    for label, rate in fetch_rates.items():
        bench.report(f"fetch, seq {SEQ_LENGTH}{label}", rate, "samples/s", rate / consume_samples_per_s,
                     "training consumption", watch=watch)


def run(bench: Bench) -> None:
    # what the model_flops benchmark measured qwen3_tiny training at, if it ran before in this run
    tokens_per_s = bench.recorded("model_flops", "qwen3_tiny tokens/s, 1 process")
    consume = tokens_per_s / SEQ_LENGTH if tokens_per_s else DEFAULT_CONSUME_SAMPLES_PER_S
    if bench.smoke:
        measure(bench, consume, num_documents=2_000, mean_tokens=200, blend_size=20_000, fetch_samples=50)
    else:
        measure(bench, consume, num_documents=1_000_000, mean_tokens=200, blend_size=10_000_000, fetch_samples=3000)
