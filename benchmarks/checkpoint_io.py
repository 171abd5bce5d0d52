"""Checkpoint I/O of a real trainer in one process: what an async save costs training, and how fast it writes.

The model is configs/qwen3_tiny.yaml widened (hidden 512, 4 layers) so that a checkpoint holds a couple of
hundred MB, enough for the disk rather than the page cache bookkeeping to show. Figures:
- sync save: the seconds ``CheckpointSaver.save`` takes with async_save off (write, fsync, hashes, tracker);
- async stall: the time the training thread is held up by an async save, as a fraction of that sync save
  (target <= 10%): the ``save`` call plus the wait in ``before_update`` for the thread's host copies
  (made while the step computes gradients) — both timed directly. Also printed, for the record: the
  steps that overlapped the write against as many steps right after (CPU and memory bandwidth shared with
  the writer thread); on a shared 2-core machine whose step time swings by 2x, that difference is noise-
  dominated, so it is not the target figure;
- async write throughput: the checkpoint's bytes over the writer thread's time (host copies included,
  training running alongside), against ``dd`` writing as many bytes (with fsync) into the same directory
  right after, paired per round (median of the per-round ratios; target >= 50%). Other jobs on a shared
  machine move both figures severalfold between runs, so only the paired ratio means much.
"""
from __future__ import annotations

import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from benchmarks import blend_settings
from benchmarks.contention import LoadWatch
from benchmarks.monitoring import _random_shard
from benchmarks.suite import Bench, at_least, at_most, standalone

PROJECT_ROOT = Path(__file__).resolve().parent.parent
WIDER = ["model.hidden_size=512", "model.intermediate_size=1536", "model.num_hidden_layers=4",
         "model.head_dim=64", "model.num_attention_heads=8", "model.num_key_value_heads=4",
         "training.local_batch_size=1", "training.global_batch_size=1",
         "train_dataset.dataloader.config.seq_length=64", "model.seq_length=64"]


def _trainer(shard: Path, work: Path, wider: list[str]):
    from training.parallel.mesh import World
    from training.config import load_config
    from training.reporting import Reporter
    from training.step import configure_runtime
    from training.trainer import Trainer

    config = load_config(PROJECT_ROOT / "configs/qwen3_tiny.yaml", [
        f"train_dataset.dataloader.config.data_path=[1.0, '{shard}']", "train_dataset.dataloader.config.eod=2",
        "train_dataset.dataloader.config.pad=3", f"train_dataset.dataloader.config.path_to_cache={work / 'cache'}",
        "training.steps=1000", f"checkpoint.save_path={work / 'checkpoints'}", "checkpoint.save_max=1",
        *blend_settings(), *wider])
    configure_runtime(config)
    return Trainer(config, World(rank=0, size=1), work / "run", Reporter(None, enabled=False))


def _dd_bytes_per_s(directory: Path, megabytes: int) -> float:
    target = directory / "dd.bin"
    started = time.perf_counter()
    subprocess.run(["dd", "if=/dev/zero", f"of={target}", "bs=1M", f"count={megabytes}", "conv=fsync"],
                   check=True, capture_output=True)
    seconds = time.perf_counter() - started
    target.unlink()
    return megabytes * 2**20 / seconds


def measure(bench: Bench, rounds: int, wider: list[str]) -> None:
    """Each round: a sync save, one step (Kiln never saves a step twice), an async save and the steps it
    overlaps, as many steps after it, and dd."""
    from training.checkpoint import CheckpointSaver

    with tempfile.TemporaryDirectory(prefix="kiln-bench-ckpt-") as tmp:
        work = Path(tmp)
        trainer = _trainer(_random_shard(work / "shard", 4096), work, wider)
        for _ in range(3):
            trainer.train_step()  # kernels compiled

        def saver(async_save: bool) -> CheckpointSaver:
            return CheckpointSaver(save_path=work / "checkpoints", prefix="checkpoint", save_max=1,
                                   world=trainer.world, collectives=trainer.collectives, async_save=async_save)

        def save() -> None:  # the model and optimizer state, as the trainer's save hands them over
            trainer.checkpoints.saver.save(step=trainer.step, model=trainer.model_parts.state_dict(),
                                           optim=trainer.optimizer.state_dict(), common={"global_step": trainer.step},
                                           lineage={})

        sync_seconds, stalls, slowdowns, writes, dd_rates, steps_during = [], [], [], [], [], []
        checkpoint_bytes = 0
        with LoadWatch(cores=1) as watch:  # the writer is one thread beside the step
            for _ in range(rounds):
                trainer.checkpoints.saver = saver(async_save=False)
                sync_seconds.append(watch.time("sync save", save))
                latest = max((work / "checkpoints").glob("iteration_*"))
                checkpoint_bytes = sum(p.stat().st_size for p in latest.glob("*.safetensors"))
                trainer.train_step()

                trainer.checkpoints.saver = saver(async_save=True)  # train_step settles it, as in training
                call = watch.time("async save call", save)
                writer = trainer.checkpoints.saver.pending.writer
                steps, during = 0, 0.0
                while steps == 0 or trainer.checkpoints.saver.pending is not None:  # the next round: a newer step
                    during += watch.time("steps during the write", trainer.train_step)
                    steps += 1
                trainer.checkpoints.saver.wait()
                without = watch.time("steps after it", lambda: [trainer.train_step() for _ in range(steps)], steps)
                stalls.append(call + trainer.checkpoints.saver.blocked_seconds)
                slowdowns.append(during - without)
                writes.append(writer.seconds)
                dd_rates.append(watch.call("dd", lambda: _dd_bytes_per_s(work, max(1, checkpoint_bytes // 2**20)))[1])
                steps_during.append(steps)

        sync = statistics.median(sync_seconds)
        stall = statistics.median(stalls)
        write_rates = [checkpoint_bytes / seconds for seconds in writes]
        write_ratio = statistics.median(w / dd for w, dd in zip(write_rates, dd_rates))
    mb = checkpoint_bytes / 1e6
    bench.report(f"sync save ({mb:.0f} MB checkpoint)", sync, "s", watch=watch)
    bench.report("async save stall (training thread)", stall, "s", stall / sync, "sync save", target=at_most(0.10),
                 watch=watch)
    slowdown = statistics.median(slowdowns)
    bench.report(f"  {statistics.median(steps_during):.0f} overlapped steps' extra time", slowdown, "s",
                 slowdown / sync, "sync save; noisy, for the record", watch=watch)
    bench.report("async save write throughput", statistics.median(write_rates) / 1e6, "MB/s", write_ratio,
                 "dd, paired per round", target=at_least(0.50), watch=watch)
    bench.report("dd to the same directory", statistics.median(dd_rates) / 1e6, "MB/s", watch=watch)


def run(bench: Bench) -> None:
    # a smoke run: qwen3_tiny as configured (a checkpoint of a few MB), one round
    measure(bench, 1, []) if bench.smoke else measure(bench, 5, WIDER)


if __name__ == "__main__":
    with standalone("checkpoint_io") as bench:
        measure(bench, 5, WIDER)
