"""python -m benchmarks [--steps N] — preprocessing and training throughput on this machine.

Each line is `name: figure (ratio × reference)`, the reference measured in the same process:
- tokenizing: the parallel `.bin/.idx` writer vs. bare sentencepiece encoding × workers (1.0 means
  reading, pickling and writing cost nothing);
- training: the trainer's tokens/s and FLOP/s vs. this machine's fp32 matmul peak in MindSpore.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

PROJECT_ROOT = Path(__file__).resolve().parent.parent


def report(name: str, value: float, unit: str, ratio: float | None = None, reference: str = "") -> None:
    suffix = f"  ({ratio:.2f} × {reference})" if ratio is not None else ""
    print(f"{name:<34} {value:>14,.1f} {unit}{suffix}", flush=True)


def bench_tokenizing(work: Path, corpus_bytes: int) -> Path:
    """Builds the built-in code source, a 4,096-piece tokenizer and its shard; returns the shard prefix."""
    import sentencepiece

    from assets.builtin_corpus import write_builtin_source
    from resources.tokenizer import TokenizerSettings
    from training.data.corpus import iter_jsonl_documents
    from training.data.preprocess import tokenize_to_indexed

    files = write_builtin_source("python_stdlib_code", work / "raw", corpus_bytes)
    texts = [text for path in files for _, text in iter_jsonl_documents(path, ["text"])]
    started = time.perf_counter()
    TokenizerSettings(sample_lines=50_000).train(texts, work / "tokenizer")
    report("tokenizer training (50k lines)", time.perf_counter() - started, "s")

    model = str(work / "tokenizer.model")
    processor = sentencepiece.SentencePieceProcessor(model_file=model)
    started = time.perf_counter()
    bare_tokens = sum(len(ids) + 1 for ids in processor.encode(texts, out_type=int, num_threads=1))
    bare_rate = bare_tokens / (time.perf_counter() - started)
    report("sentencepiece encode, 1 thread", bare_rate, "tokens/s")

    workers = os.cpu_count() or 1
    stats = tokenize_to_indexed(files, model, work / "shard", workers=workers)
    report(f"tokenize_to_indexed, {workers} workers", stats["tokens_per_s"], "tokens/s",
           stats["tokens_per_s"] / (bare_rate * workers), f"bare encode × {workers}")
    return work / "shard"


def matmul_peak_flops(size: int = 1024, repeats: int = 20) -> float:
    import mindspore as ms
    from mindspore import Tensor, ops

    a = Tensor(np.random.default_rng(0).standard_normal((size, size), dtype=np.float32))
    ops.matmul(a, a).asnumpy()  # first call compiles the kernel
    started = time.perf_counter()
    for _ in range(repeats):
        out = ops.matmul(a, a)
    out.asnumpy()
    assert out.dtype == ms.float32
    return 2 * size ** 3 * repeats / (time.perf_counter() - started)


def bench_training(shard_prefix: Path, steps: int) -> None:
    """The demo's model (configs/qwen3_tiny.yaml) trained by the real Trainer in one process."""
    from training.collectives import World
    from resources.tokenizer import SPECIAL_IDS
    from training.config import load_config
    from training.reporting import Reporter
    from training.trainer import Trainer, configure_runtime

    config = load_config(PROJECT_ROOT / "configs/qwen3_tiny.yaml", [
        f"train_dataset.dataloader.config.data_path=[1.0, '{shard_prefix}']",
        f"train_dataset.dataloader.config.eod={SPECIAL_IDS['eos']}",
        f"train_dataset.dataloader.config.pad={SPECIAL_IDS['pad']}",
        f"training.steps={steps}", "checkpoint.enable_save=false"])
    configure_runtime(config)
    peak = matmul_peak_flops()
    report("fp32 matmul 1024³ (MindSpore)", peak / 1e9, "GFLOP/s")

    trainer = Trainer(config, World(rank=0, size=1), shard_prefix.parent / "run", Reporter(None, enabled=False))
    trainer.train_step()  # compiles kernels
    started = time.perf_counter()
    for _ in range(steps - 1):
        trainer.train_step()
    seconds = time.perf_counter() - started
    tokens = (steps - 1) * config.training.global_batch_size * trainer.seq_length
    flops = trainer.model.flops_per_token(trainer.seq_length) * tokens / seconds
    report(f"training {trainer.model.num_parameters() / 1e6:.1f}M params, 1 process", tokens / seconds, "tokens/s")
    report("training model FLOP/s", flops / 1e9, "GFLOP/s", flops / peak, "fp32 matmul peak")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus-bytes", type=int, default=20_000_000)
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="kiln-bench-") as tmp:
        shard = bench_tokenizing(Path(tmp), args.corpus_bytes)
        bench_training(shard, args.steps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
