"""Step-time cost of ``monitor.train_state`` on the demo model (configs/qwen3_tiny.yaml), one process.

Two trainers, monitoring off and every train_state option on, train on the same random corpus one step
each in turn (the order swapped every round), so machine load drifts affect both alike. Figures: the
median step time of each, and the median over rounds of the on/off step-time ratio within a round. On a
shared machine that ratio is only good to several percent, so the monitoring work itself (the hooks'
norms, losses and gathers, and the max-logit reductions inside attention) is also timed alone on real
gradients. The health check (``monitor.health_checkpoint``) is always on, so it is in both trainers. A smoke run:
one layer, 32 tokens, SMOKE_STEP's eager step, 2 rounds.
"""
from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks import SMOKE_STEP, blend_settings, smoke_model
from benchmarks.contention import LoadWatch
from benchmarks.suite import Bench, standalone

PROJECT_ROOT = Path(__file__).resolve().parent.parent
OPTIONS = {"local_norm": "true", "device_norm": "true", "param_norm": "true", "local_loss": "true",
           "device_loss": "true", "max_attention_logit": "true"}
KILN_OPTIONS = ("param_norm", "max_attention_logit")  # kiln.train_state's; the others are monitor.train_state's
SMOKE_TRAINER = [*smoke_model(1), *SMOKE_STEP]  # the demo model at a smoke run's size


def _random_shard(prefix: Path, vocab_size: int, documents: int = 2000) -> Path:
    from training.data.indexed import IndexedDatasetWriter

    rng = np.random.default_rng(0)
    with IndexedDatasetWriter(prefix, np.uint16) as writer:
        for _ in range(documents):
            writer.add_document(np.append(rng.integers(4, vocab_size, size=rng.integers(20, 400)), 2)
                                .astype(np.uint16))
    return prefix


def _trainer(shard: Path, work: Path, name: str, options: dict[str, str], steps: int, overrides: list[str] = ()):
    """configs/qwen3_tiny.yaml on ``shard`` (with ``overrides``: a smoke run's size) in one process."""
    from training.parallel.mesh import World
    from training.config import load_config
    from training.reporting import Reporter
    from training.step import configure_runtime
    from training.trainer import Trainer

    config = load_config(PROJECT_ROOT / "configs/qwen3_tiny.yaml", [
        f"train_dataset.dataloader.config.data_path=[1.0, '{shard}']", "train_dataset.dataloader.config.eod=2",
        "train_dataset.dataloader.config.pad=3", f"train_dataset.dataloader.config.path_to_cache={work / 'cache'}",
        *blend_settings(), f"training.steps={steps}", "checkpoint.enable_save=false",
        *(f"{'kiln' if key in KILN_OPTIONS else 'monitor'}.train_state.{key}={value}"
          for key, value in options.items()), *overrides])
    configure_runtime(config)
    return Trainer(config, World(rank=0, size=1), work / name, Reporter(None, enabled=False))


def _hook_seconds(trainer, repeats: int) -> float:
    """Seconds per step spent in the monitoring code of ``trainer`` (all options on): a step's
    per-micro-batch hooks and its record, plus the max-logit reductions on attention scores."""
    from mindspore import Tensor

    outputs, grads = trainer.grad_fn(*trainer._micro_batch(0))  # (scaled loss, loss, loss parts...), gradients
    loss = float(outputs[1].asnumpy())
    model = trainer.model.config
    heads, groups = model.num_attention_heads, model.num_key_value_heads
    seq, batch = trainer.seq_length, trainer.config.training.local_batch_size
    scores = Tensor(np.random.default_rng(0).standard_normal((batch, groups, heads // groups, seq * seq),
                                                              dtype=np.float32))
    trackers = [layer.self_attention.logit_tracker for layer in trainer.model.decoder.layers]
    started = time.perf_counter()
    for _ in range(repeats):
        for _ in range(trainer.accumulation):
            trainer.monitor.micro_batch(loss, grads)
            for tracker in trackers:
                tracker.update(scores)
        trainer.monitor.record(grads, trainer.params, loss, trainer.model.pop_max_attention_logits())
    return (time.perf_counter() - started) / repeats


def measure(bench: Bench, rounds: int, smoke: bool = False) -> None:
    with tempfile.TemporaryDirectory(prefix="kiln-bench-monitor-") as tmp:
        work = Path(tmp)
        shard = _random_shard(work / "random", vocab_size=4096)
        # one step more than timed for compilation, and a batch for _hook_seconds
        size = SMOKE_TRAINER if smoke else []
        trainers = {"off": _trainer(shard, work, "off", {}, rounds + 2, size),
                    "on": _trainer(shard, work, "on", OPTIONS, rounds + 2, size)}
        times: dict[str, list[float]] = {name: [] for name in trainers}
        for trainer in trainers.values():
            trainer.train_step()  # the first step compiles kernels
        order = list(trainers)
        with LoadWatch() as watch:
            for _ in range(rounds):
                for name in order:
                    times[name].append(watch.time(f"monitoring {name}", trainers[name].train_step))
                order.reverse()
            _, hooks = watch.call("monitoring code alone", lambda: _hook_seconds(trainers["on"], rounds))
    bench.report("step, monitoring off (median)", 1e3 * statistics.median(times["off"]), "ms", watch=watch)
    ratio = statistics.median(on / off for on, off in zip(times["on"], times["off"]))
    bench.report("step, all train_state options on", 1e3 * statistics.median(times["on"]), "ms", ratio,
                 "off, paired per round", watch=watch)
    bench.report("  monitoring code alone, per step", 1e3 * hooks, "ms", hooks / statistics.median(times["off"]),
                 "off step", watch=watch)


def run(bench: Bench) -> None:
    measure(bench, rounds=2, smoke=True) if bench.smoke else measure(bench, rounds=30)


if __name__ == "__main__":
    with standalone("monitoring") as bench:
        measure(bench, rounds=30)
