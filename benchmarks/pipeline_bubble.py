"""Pipeline parallelism on 2 msrun workers (pp 2): the bubble of each schedule, the activations each stage keeps, the
bytes sent between stages, and the step time against data parallelism on the same 2 workers.

configs/qwen3_tiny.yaml widened (hidden 256, 4 layers) trains with 8 micro-batches per step under ``gpipe``,
``1f1b`` and ``interleaved_1f1b`` (2 virtual stages per rank); the three trainers live in one launch and take their steps
in turn, round by round, so the machine's load falls on all alike. Per schedule:

- bubble: the fraction of the schedule's wall time each rank is not computing (its transfers and its waits; the
  workers dispatch synchronously, as under training.run, so a wait is not hidden in the next computation),
  averaged over the ranks, median over the rounds after the first, against the analytic (p − 1)/(v·m + p − 1)
  (v = 1: (p − 1)/(m + p − 1)). The analytic figure assumes a backward as long as a forward and free transfers;
  here a backward also runs the stage's forward again (training/parallel/pipeline.py) and the last stage's
  forward is that same run, and every transfer is a collective of its own.
- activations kept per stage: the most micro-batches a rank has forwarded and not yet backpropagated at once
  (GPipe: all m; 1F1B: p − rank), and the bytes of stage-input hidden states it holds for them (its activations
  under full recompute; the first stage keeps token ids only).
- bytes sent between stages per step, summed over the ranks, against the analytic count: each of the v·p − 1
  boundaries between virtual stages carries every micro-batch's hidden states forward and their gradient back,
  2 · m · (v·p − 1) · b · s · h · 4 bytes.
- step time against DP2 (ZeRO-1, the same global batch as 4 accumulated micro-batches per rank), whose trainer
  takes its steps in the same rounds; median over the rounds after the first.

Run as a script by msrun: ``python benchmarks/pipeline_bubble.py OUT SHARD``.
"""
from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parent.parent
PP, MICRO_BATCHES = 2, 8
SCHEDULES = {"gpipe": (["parallelism.pipeline_parallel_schedule=gpipe"], 1),
             "1f1b": (["parallelism.pipeline_parallel_schedule=1f1b"], 1),
             "interleaved_1f1b": (["parallelism.pipeline_parallel_schedule=interleaved_1f1b",
                                   "parallelism.pipeline_parallel_interleave_num=2"], 2)}
# parallel_memory's widened qwen3_tiny, 8 micro-batches of one sample per step, 2 stages
PIPELINE = [f"training.global_batch_size={MICRO_BATCHES}", "training.local_batch_size=1",
            f"parallelism.pipeline_parallel={PP}"]
DATA_PARALLEL = ["parallelism.pipeline_parallel=1", "parallelism.data_parallel_shard_strategy=optim"]
ROUNDS = 4


def _config(shard: str, overrides: list[str]):
    from benchmarks.parallel_memory import _config as widened_tiny

    return widened_tiny(shard, [*PIPELINE, f"training.steps={ROUNDS}", *overrides])


def worker(out: str, shard: str) -> None:
    """One msrun worker: the schedules' trainers, a step of each in turn per round; this rank's figures."""
    sys.path.insert(0, str(PROJECT_ROOT))
    from training.parallel.mesh import init_world
    from training.reporting import Reporter
    from training.step import configure_runtime
    from training.trainer import Trainer

    configure_runtime(_config(shard, []))
    world = init_world()
    arms = {name: overrides for name, (overrides, _) in SCHEDULES.items()} | {"dp": DATA_PARALLEL}
    trainers = {name: Trainer(_config(shard, overrides), world, Path(out) / name, Reporter(None, enabled=False))
                for name, overrides in arms.items()}
    figures = {name: {"idle": [], "in_flight": 0, "kept_bytes": 0, "sent_bytes": 0, "step_s": []} for name in arms}
    for _ in range(ROUNDS):
        for name, trainer in trainers.items():
            started = time.perf_counter()
            trainer.train_step()
            figures[name]["step_s"].append(time.perf_counter() - started)
            if trainer.parallel.pipeline is None:
                continue
            result = trainer.parallel.pipeline.last_result
            figures[name]["idle"].append(1 - result.busy_s / result.wall_s)
            figures[name]["in_flight"] = max(figures[name]["in_flight"], result.peak_in_flight)
            figures[name]["kept_bytes"] = max(figures[name]["kept_bytes"], result.peak_kept_bytes)
            figures[name]["sent_bytes"] = result.sent_bytes
    figures["shape"] = {"seq": trainers["gpipe"].seq_length, "hidden": trainers["gpipe"].model.config.hidden_size,
                        "batch": trainers["gpipe"].config.training.local_batch_size}
    (Path(out) / f"rank{world.rank}.json").write_text(json.dumps(figures))


def run(report, shard: Path) -> None:
    from training.launch import run_on_local_workers
    from training.parallel.pipeline import analytic_bubble

    with tempfile.TemporaryDirectory(prefix="kiln-bench-pipeline-") as tmp:
        # synchronous dispatch (the launch's default, as training.run's): with MindSpore's threaded dispatch a transfer
        # returns before it completes and the wait for the other stage is charged to the next computation (0.6% idle)
        run_on_local_workers([__file__, tmp, shard], Path(tmp) / "log", PP)
        ranks = [json.loads((Path(tmp) / f"rank{r}.json").read_text()) for r in range(PP)]
        shape = ranks[0]["shape"]
        dp_step = statistics.median(max(r["dp"]["step_s"][i] for r in ranks) for i in range(1, ROUNDS))
        for name, (_, interleave) in SCHEDULES.items():
            step = statistics.median(max(r[name]["step_s"][i] for r in ranks) for i in range(1, ROUNDS))
            report(f"pipeline {name} step (pp {PP})", step, "s", step / dp_step, "DP2 (ZeRO-1) on the same workers")
            sent = sum(r[name]["sent_bytes"] for r in ranks)
            analytic = 2 * MICRO_BATCHES * (interleave * PP - 1) * shape["batch"] * shape["seq"] * shape["hidden"] * 4
            report(f"pipeline {name} sent between stages per step", sent / 2**20, "MiB", sent / analytic,
                   "the analytic count")
            measured = statistics.mean(statistics.median(r[name]["idle"][1:]) for r in ranks)
            analytic = analytic_bubble(PP, MICRO_BATCHES, interleave)
            report(f"pipeline {name} bubble (pp {PP}, {MICRO_BATCHES} micro-batches)", measured * 100, "% idle",
                   measured / analytic, f"the analytic {analytic:.1%}")
            for rank, figures in enumerate(ranks):
                in_flight = figures[name]["in_flight"]
                report(f"pipeline {name} stage {rank} keeps", figures[name]["kept_bytes"] / 2**20,
                       f"MiB of hidden states ({in_flight} micro-batches in flight)", in_flight / MICRO_BATCHES,
                       "all micro-batches")


if __name__ == "__main__":
    worker(*sys.argv[1:])
