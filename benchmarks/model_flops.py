"""python -m benchmarks.model_flops [--steps N] — each tiny model config (configs/qwen3_tiny.yaml,
configs/deepseek_v3_tiny.yaml) trained by the real Trainer in one process on the built-in corpus:
tokens/s, model FLOP/s (``flops_per_token``: 6·active matmul params + attention, MoE counting the top-k
experts a token visits, MTP its extra output layers) and the ratio to MindSpore's fp32 matmul peak measured
in the same run, just before each model; each model's LM loss at its last step against its first. A smoke run:
each config at one layer of each kind, 32 tokens, SMOKE_STEP's eager step, and a 256³ peak.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from benchmarks import SMOKE_STEP, blend_settings, smoke_model
from benchmarks.contention import LoadWatch
from benchmarks.suite import Bench, standalone

PROJECT_ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ("configs/qwen3_tiny.yaml", "configs/deepseek_v3_tiny.yaml")
STEPS, SMOKE_STEPS = 12, 2
SMOKE_OVERRIDES = {"configs/qwen3_tiny.yaml": smoke_model(1), "configs/deepseek_v3_tiny.yaml": smoke_model(2)}


def load(config_path: str, shard_prefix: Path, steps: int, overrides: list[str] = ()):
    from resources.tokenizer import SPECIAL_IDS
    from training.config import load_config

    return load_config(PROJECT_ROOT / config_path, [
        f"train_dataset.dataloader.config.data_path=[1.0, '{shard_prefix}']",
        f"train_dataset.dataloader.config.eod={SPECIAL_IDS['eos']}",
        f"train_dataset.dataloader.config.pad={SPECIAL_IDS['pad']}", *blend_settings(),
        f"training.steps={steps}", "checkpoint.enable_save=false", *overrides])


def matmul_peak_flops(size: int = 1024, repeats: int = 20) -> float:
    """This machine's fp32 matmul FLOP/s in MindSpore, eagerly, a ``size``³ product ``repeats`` times."""
    import time

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


def measure(config, shard_prefix: Path, steps: int, watch: LoadWatch, name: str) -> dict:
    """Train ``steps`` steps; the first (kernel compilation) is left out of the rates."""
    from training.parallel.mesh import World
    from training.reporting import Reporter
    from training.trainer import Trainer

    trainer = Trainer(config, World(rank=0, size=1), shard_prefix.parent / name, Reporter(None, enabled=False))
    first = trainer.train_step()
    seconds, records = watch.call(name, lambda: [trainer.train_step() for _ in range(steps - 1)], steps - 1)
    tokens = (steps - 1) * config.training.global_batch_size * trainer.seq_length
    return {"params": trainer.model.num_parameters(), "tokens_per_s": tokens / seconds,
            "flops": trainer.model.flops_per_token(trainer.seq_length) * tokens / seconds,
            "first_loss": first.get("lm_loss", first["loss"]),
            "last_loss": records[-1].get("lm_loss", records[-1]["loss"])}


def measure_all(bench: Bench, shard_prefix: Path, steps: int, smoke: bool = False) -> None:
    from training.step import configure_runtime

    configs = {Path(path).stem: load(path, shard_prefix, steps, [*SMOKE_OVERRIDES[path], *SMOKE_STEP] if smoke else [])
               for path in CONFIGS}
    configure_runtime(next(iter(configs.values())))  # once per process, before any kernel runs
    peak_size, peak_repeats = (256, 2) if smoke else (1024, 20)
    for name, config in configs.items():
        with LoadWatch() as watch:
            _, peak = watch.call("matmul peak", lambda: matmul_peak_flops(peak_size, peak_repeats))
            result = measure(config, shard_prefix, steps, watch, name)
        bench.report(f"fp32 matmul {peak_size}³ (MindSpore), before {name}", peak / 1e9, "GFLOP/s", watch=watch)
        bench.report(f"{name} tokens/s, 1 process", result["tokens_per_s"], "tokens/s", watch=watch)
        bench.report(f"{name} model FLOP/s ({result['params'] / 1e6:.2f}M params)", result["flops"] / 1e9, "GFLOP/s",
                     result["flops"] / peak, "the fp32 matmul peak", watch=watch)
        bench.report(f"{name} LM loss at step {steps}", result["last_loss"], f"(step 1: {result['first_loss']:.3f})")


def run(bench: Bench) -> None:
    measure_all(bench, bench.shard(), SMOKE_STEPS if bench.smoke else STEPS, bench.smoke)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.model_flops", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=STEPS)
    args = parser.parse_args(argv)
    with standalone("model_flops") as bench:
        measure_all(bench, bench.shard(), args.steps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
