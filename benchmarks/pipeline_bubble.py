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

A smoke run: 4 layers (interleaving needs 2 per rank), 32 tokens, 2 micro-batches, 2 rounds.

Run by msrun: ``python -m benchmarks.pipeline_bubble OUT SHARD ROUNDS MICRO_BATCHES [MODEL OVERRIDE ...]`` (default:
parallel_memory's WIDER).
"""
from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import smoke_model
from benchmarks.contention import LoadWatch
from benchmarks.suite import Bench

PP, MICRO_BATCHES = 2, 8
ROUNDS = 4
SMOKE_ROUNDS, SMOKE_MICRO_BATCHES = 2, 2  # the first round is left out of the medians
SMOKE_MODEL = smoke_model(4)
SCHEDULES = {"gpipe": (["parallelism.pipeline_parallel_schedule=gpipe"], 1),
             "1f1b": (["parallelism.pipeline_parallel_schedule=1f1b"], 1),
             "interleaved_1f1b": (["parallelism.pipeline_parallel_schedule=interleaved_1f1b",
                                   "parallelism.pipeline_parallel_interleave_num=2"], 2)}
DATA_PARALLEL = ["parallelism.pipeline_parallel=1", "parallelism.data_parallel_shard_strategy=optim"]
# every arm eager: with the stages compiled (fast_step's default) the first stage's first transfer failed here, at
# load 27-32, in two launches of two ("Broadcast failed"), eager passed; the compiled pipeline's step is
# benchmarks.compiled_parallel's
EAGER = ["fast_step.compile=false"]


def _config(shard: str, overrides: list[str], rounds: int, micro_batches: int, model: list[str]):
    """parallel_memory's qwen3_tiny at ``model``'s size, ``micro_batches`` micro-batches of one sample per step, 2
    stages."""
    from benchmarks.parallel_memory import _config as sized_tiny

    return sized_tiny(shard, [f"training.global_batch_size={micro_batches}", "training.local_batch_size=1",
                              f"parallelism.pipeline_parallel={PP}", *EAGER, *overrides], rounds, model)


def worker(out: str, shard: str, rounds: str, micro_batches: str, *model: str) -> None:
    """One msrun worker: the schedules' trainers, a step of each in turn per round; this rank's figures."""
    rounds, micro_batches = int(rounds), int(micro_batches)
    from benchmarks.parallel_memory import WIDER
    from training.parallel.mesh import init_world
    from training.reporting import Reporter
    from training.step import configure_runtime
    from training.trainer import Trainer

    model = list(model) or WIDER
    configure_runtime(_config(shard, [], rounds, micro_batches, model))
    world = init_world()
    arms = {name: overrides for name, (overrides, _) in SCHEDULES.items()} | {"dp": DATA_PARALLEL}
    trainers = {name: Trainer(_config(shard, overrides, rounds, micro_batches, model), world, Path(out) / name,
                              Reporter(None, enabled=False))
                for name, overrides in arms.items()}
    figures = {name: {"idle": [], "in_flight": 0, "kept_bytes": 0, "sent_bytes": 0, "step_s": [], "cpu_s": []}
               for name in arms}
    for _ in range(rounds):
        for name, trainer in trainers.items():
            started, cpu_started = time.perf_counter(), time.process_time()
            trainer.train_step()
            figures[name]["step_s"].append(time.perf_counter() - started)
            figures[name]["cpu_s"].append(time.process_time() - cpu_started)
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


def measure(bench: Bench, shard: Path, rounds: int, micro_batches: int, model: list[str] = ()) -> None:
    from training.launch import run_on_local_workers
    from training.parallel.pipeline import analytic_bubble

    with tempfile.TemporaryDirectory(prefix="kiln-bench-pipeline-") as tmp, LoadWatch(cores=PP) as watch:
        # synchronous dispatch (the launch's default, as training.run's): with MindSpore's threaded dispatch a transfer
        # returns before it completes and the wait for the other stage is charged to the next computation (0.6% idle)
        run_on_local_workers(["-m", "benchmarks.pipeline_bubble", tmp, shard, rounds, micro_batches, *model],
                             Path(tmp) / "log", PP)
        ranks = [json.loads((Path(tmp) / f"rank{r}.json").read_text()) for r in range(PP)]
        for name in [*SCHEDULES, "dp"]:  # the ranks' CPU seconds per step, summed, after the first round
            for i in range(1, rounds):
                watch.cpu(name, sum(r[name]["cpu_s"][i] for r in ranks))
    shape = ranks[0]["shape"]
    dp_step = statistics.median(max(r["dp"]["step_s"][i] for r in ranks) for i in range(1, rounds))
    for name, (_, interleave) in SCHEDULES.items():
        step = statistics.median(max(r[name]["step_s"][i] for r in ranks) for i in range(1, rounds))
        bench.report(f"pipeline {name} step (pp {PP})", step, "s", step / dp_step, "DP2 (ZeRO-1) on the same workers",
                     watch=watch)
        sent = sum(r[name]["sent_bytes"] for r in ranks)
        analytic = 2 * micro_batches * (interleave * PP - 1) * shape["batch"] * shape["seq"] * shape["hidden"] * 4
        bench.report(f"pipeline {name} sent between stages per step", sent / 2**20, "MiB", sent / analytic,
                     "the analytic count")
        measured = statistics.mean(statistics.median(r[name]["idle"][1:]) for r in ranks)
        analytic = analytic_bubble(PP, micro_batches, interleave)
        bench.report(f"pipeline {name} bubble (pp {PP}, {micro_batches} micro-batches)", measured * 100, "% idle",
                     measured / analytic, f"the analytic {analytic:.1%}", watch=watch)
        for rank, figures in enumerate(ranks):
            in_flight = figures[name]["in_flight"]
            bench.report(f"pipeline {name} stage {rank} keeps", figures[name]["kept_bytes"] / 2**20,
                         f"MiB of hidden states ({in_flight} micro-batches in flight)", in_flight / micro_batches,
                         "all micro-batches")


def run(bench: Bench) -> None:
    if bench.smoke:
        measure(bench, bench.shard(), SMOKE_ROUNDS, SMOKE_MICRO_BATCHES, SMOKE_MODEL)
    else:
        measure(bench, bench.shard(), ROUNDS, MICRO_BATCHES)


if __name__ == "__main__":
    worker(*sys.argv[1:])
