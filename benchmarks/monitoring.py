"""Step-time cost of ``monitor.train_state`` on the demo model (configs/qwen3_tiny.yaml), one process.

Trainers with monitoring off, with every train_state option on, and with each option alone train on
the same random corpus, one step each in turn (the order reversed every round), so machine load drifts
affect them alike. Figures: the median step time, and the median over rounds of the step-time ratio to the
unmonitored trainer's step in the same round. The health check (``monitor.health_checkpoint``) is always on and in every figure.
"""
from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

PROJECT_ROOT = Path(__file__).resolve().parent.parent
OPTIONS = {"local_norm": "true", "device_norm": "true", "param_norm": "true", "local_loss": "true",
           "device_loss": "true", "max_attention_logit": "true"}


def _random_shard(prefix: Path, vocab_size: int, documents: int = 2000) -> Path:
    from training.data.indexed import IndexedDatasetWriter

    rng = np.random.default_rng(0)
    with IndexedDatasetWriter(prefix, np.uint16) as writer:
        for _ in range(documents):
            writer.add_document(np.append(rng.integers(4, vocab_size, size=rng.integers(20, 400)), 2)
                                .astype(np.uint16))
    return prefix


def _trainer(shard: Path, work: Path, name: str, options: dict[str, str], steps: int):
    from training.collectives import World
    from training.config import load_config
    from training.reporting import Reporter
    from training.trainer import Trainer, configure_runtime

    config = load_config(PROJECT_ROOT / "configs/qwen3_tiny.yaml", [
        f"train_dataset.dataloader.config.data_path=[1.0, '{shard}']", "train_dataset.dataloader.config.eod=2",
        "train_dataset.dataloader.config.pad=3", f"train_dataset.dataloader.config.path_to_cache={work / 'cache'}",
        f"training.steps={steps}", "checkpoint.enable_save=false",
        *(f"monitor.train_state.{key}={value}" for key, value in options.items())])
    configure_runtime(config)
    return Trainer(config, World(rank=0, size=1), work / name, Reporter(None, enabled=False))


def run(report, rounds: int = 16) -> None:
    with tempfile.TemporaryDirectory(prefix="kiln-bench-monitor-") as tmp:
        work = Path(tmp)
        shard = _random_shard(work / "random", vocab_size=4096)
        variants = {"off": {}, "all train_state options": OPTIONS,
                    **{key: {key: value} for key, value in OPTIONS.items()}}
        trainers = {name: _trainer(shard, work, f"run{i}", options, rounds + 1)
                    for i, (name, options) in enumerate(variants.items())}
        times: dict[str, list[float]] = {name: [] for name in trainers}
        for trainer in trainers.values():
            trainer.train_step()  # the first step compiles kernels
        order = list(trainers)
        for _ in range(rounds):
            for name in order:
                started = time.perf_counter()
                trainers[name].train_step()
                times[name].append(time.perf_counter() - started)
            order.reverse()  # alternate the order so a load drift within a round hits both ends alike
        report("step, monitoring off (median)", 1e3 * statistics.median(times["off"]), "ms")
        for name in [n for n in trainers if n != "off"]:
            # the median of per-round ratios: both steps of a pair ran in the same round, so shared load cancels
            ratio = statistics.median(t / base for t, base in zip(times[name], times["off"]))
            report(f"step, {name} (median)", 1e3 * statistics.median(times[name]), "ms", ratio, "off, paired")


if __name__ == "__main__":
    from benchmarks.__main__ import report

    run(report)
