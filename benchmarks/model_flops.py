"""python -m benchmarks.model_flops [--steps N] — each tiny model config (configs/qwen3_tiny.yaml,
configs/deepseek_v3_tiny.yaml) trained by the real Trainer in one process on the built-in corpus:
tokens/s, model FLOP/s (``flops_per_token``: 6·active matmul params + attention, MoE counting the top-k
experts a token visits, MTP its extra output layers) and the ratio to MindSpore's fp32 matmul peak measured
in the same run, just before each model. `make bench` runs it on the shard it has just tokenized.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import blend_settings

PROJECT_ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ("configs/qwen3_tiny.yaml", "configs/deepseek_v3_tiny.yaml")


def load(config_path: str, shard_prefix: Path, steps: int):
    from resources.tokenizer import SPECIAL_IDS
    from training.config import load_config

    return load_config(PROJECT_ROOT / config_path, [
        f"train_dataset.dataloader.config.data_path=[1.0, '{shard_prefix}']",
        f"train_dataset.dataloader.config.eod={SPECIAL_IDS['eos']}",
        f"train_dataset.dataloader.config.pad={SPECIAL_IDS['pad']}", *blend_settings(),
        f"training.steps={steps}", "checkpoint.enable_save=false"])


def measure(config, shard_prefix: Path, steps: int) -> dict:
    """Train ``steps`` steps; the first (kernel compilation) is left out of the rates."""
    from training.parallel.mesh import World
    from training.reporting import Reporter
    from training.trainer import Trainer

    trainer = Trainer(config, World(rank=0, size=1), shard_prefix.parent / "run", Reporter(None, enabled=False))
    first = trainer.train_step()
    started = time.perf_counter()
    for _ in range(steps - 1):
        last = trainer.train_step()
    seconds = time.perf_counter() - started
    tokens = (steps - 1) * config.training.global_batch_size * trainer.seq_length
    return {"params": trainer.model.num_parameters(), "tokens_per_s": tokens / seconds,
            "flops": trainer.model.flops_per_token(trainer.seq_length) * tokens / seconds,
            "first_loss": first.get("lm_loss", first["loss"]), "last_loss": last.get("lm_loss", last["loss"])}


def run(report, shard_prefix: Path, steps: int, runtime_ready: bool = False) -> None:
    """``runtime_ready``: this process already set MindSpore's mode and device (they can be set only once)."""
    from benchmarks.__main__ import matmul_peak_flops
    from training.step import configure_runtime

    configs = {Path(path).stem: load(path, shard_prefix, steps) for path in CONFIGS}
    if not runtime_ready:
        configure_runtime(next(iter(configs.values())))  # once per process, before any kernel runs
    for name, config in configs.items():
        peak = matmul_peak_flops()
        result = measure(config, shard_prefix, steps)
        report(f"{name} ({result['params'] / 1e6:.2f}M params)", result["tokens_per_s"], "tokens/s")
        report(f"{name} model FLOP/s", result["flops"] / 1e9, "GFLOP/s", result["flops"] / peak,
               f"fp32 matmul peak {peak / 1e9:.1f} GFLOP/s")
        report(f"{name} LM loss at step {steps}", result["last_loss"], f"(step 1: {result['first_loss']:.3f})")


def builtin_shard(work: Path, corpus_bytes: int) -> Path:
    """The built-in source code corpus tokenized with Kiln's default tokenizer (as the demo chain does)."""
    from assets.builtin_corpus import write_builtin_source
    from resources.tokenizer import TokenizerSettings
    from training.data.corpus import iter_texts
    from training.data.preprocess import tokenize_to_indexed

    files = write_builtin_source("python_stdlib_code", work / "raw", corpus_bytes)
    TokenizerSettings(sample_lines=50_000).train((t for p in files for t in iter_texts(p)), work / "tokenizer")
    tokenize_to_indexed(files, work / "tokenizer.model", work / "shard", append_eod=True)
    return work / "shard_text_document"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.model_flops", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--corpus-bytes", type=int, default=3_000_000)
    args = parser.parse_args(argv)
    from benchmarks.__main__ import report

    with tempfile.TemporaryDirectory(prefix="kiln-model-flops-") as tmp:
        run(report, builtin_shard(Path(tmp), args.corpus_bytes), args.steps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
