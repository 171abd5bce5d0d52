"""Data-index figures for `make bench`, on a synthetic corpus of 1,000,000 documents.

- writing the corpus with IndexedDatasetWriter, one add_document call per document;
- opening it and building a GPTDataset index from scratch (document, sample and shuffle index),
  then the same dataset loaded from its index cache;
- Megatron's greedy blend order for 10M samples over 3 sources vs. the scalar greedy loop;
- sample fetching (`__getitem__`) at seq_length 2048 vs. the training step's consumption rate.
"""
from __future__ import annotations

import tempfile
import time
from pathlib import Path

import numpy as np

from training.data import gpt_dataset
from training.data.gpt_dataset import BlendedDataset, GPTDataset
from training.data.indexed import IndexedDataset, IndexedDatasetWriter

EOD = 1
VOCAB_SIZE = 32000
SEQ_LENGTH = 2048
# The demo run's order of magnitude: ~550 tokens/s at seq_length 128 on 2 CPU cores (about 4.3
# samples/s). Callers pass the rate they measured.
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


def _fetch_rate(dataset: GPTDataset, count: int) -> float:
    ids = np.random.default_rng(1).integers(0, len(dataset), size=count).tolist()
    started = time.perf_counter()
    for idx in ids:
        dataset[idx]
    return count / (time.perf_counter() - started)


def run(report, consume_samples_per_s: float = DEFAULT_CONSUME_SAMPLES_PER_S, num_documents: int = 1_000_000,
        mean_tokens: int = 200, blend_size: int = 10_000_000, fetch_samples: int = 3000) -> None:
    with tempfile.TemporaryDirectory(prefix="kiln-bench-index-") as tmp:
        work = Path(tmp)
        started = time.perf_counter()
        tokens = write_synthetic_corpus(work / "corpus", num_documents, mean_tokens)
        seconds = time.perf_counter() - started
        report(f"write {num_documents / 1e6:g}M docs, add_document", num_documents / seconds, "docs/s")

        # Two and a half epochs: a separate final epoch, as a long run over a small corpus gets.
        options = dict(seq_length=SEQ_LENGTH, num_samples=int(2.5 * tokens / SEQ_LENGTH), seed=1234, eod_id=EOD,
                       cache_dir=work / "cache")
        started = time.perf_counter()
        GPTDataset(IndexedDataset(work / "corpus"), **options)
        report(f"open + index build, {num_documents / 1e6:g}M docs", 1e3 * (time.perf_counter() - started), "ms")
        started = time.perf_counter()
        cached = GPTDataset(IndexedDataset(work / "corpus"), **options)
        assert cached.loaded_from_cache
        report("open + index load from cache", 1e3 * (time.perf_counter() - started), "ms")

        weights = [0.5, 0.3, 0.2]
        started = time.perf_counter()
        # The blend only needs its sources' lengths.
        BlendedDataset([range(blend_size)] * len(weights), weights, blend_size)
        blend_rate = blend_size / (time.perf_counter() - started)
        loop_steps = blend_size // 10
        started = time.perf_counter()
        gpt_dataset._greedy_steps(gpt_dataset._normalize(weights), 0, [0] * len(weights), loop_steps)
        loop_rate = loop_steps / (time.perf_counter() - started)
        report(f"blend index, {blend_size / 1e6:g}M, 3 sources", blend_rate, "samples/s",
               blend_rate / loop_rate, "scalar greedy loop")

        for label, extra in (("", {}), (" + EOD options",
                                        dict(reset_position_ids=True, eod_mask_loss=True,
                                             create_compressed_eod_mask=True))):
            rate = _fetch_rate(GPTDataset(IndexedDataset(work / "corpus"), **options, **extra), fetch_samples)
            report(f"fetch, seq {SEQ_LENGTH}{label}", rate, "samples/s", rate / consume_samples_per_s,
                   "training consumption")
