"""Compiled tensor, pipeline and ZeRO-3 data parallelism on 2 msrun workers: each one's step against the same
layout eager and against DP 2 compiled, and what an all-gather costs in a graph, where only all-reduce runs on a
sub-group.

Steps: configs/qwen3_tiny.yaml (or ``--config``) at a 512-token sequence, 2 samples per step, ZeRO-1 unless named:
TP 2 with sequence parallelism (one micro-batch of both samples), PP 2 (1F1B, a micro-batch per sample) and ZeRO-3
(a sample per rank), each eager (``fast_step.compile=false``) and compiled (TP: forward and backward in one
mindspore.jit graph, its gathers and reduce-scatters as all-reduces, ``comm.for_graph``; PP: each stage's forward
and recomputing backward, the transfers between them on the host; ZeRO-3: each layer gathers its chunks in the
graph and again in its backward, ``Parallelism.gather_in_layers``), and DP 2 compiled (a sample per rank), the
layout without any of them. The variants' steps alternate round by round in one launch (the machine is shared:
each round sees the same load); each ratio is a median of per-round ratios.

Gathers (what ZeRO-3's units move): one decoder layer's weights, half on each rank, gathered whole. Eagerly the
CPU backend uses mint.distributed's list-form all_gather; in a graph a sub-group all-gather must be an all-reduce
of a zero-padded buffer (group-size times the bytes, summed), and only the world group has ops.AllGather. On 2
workers the group is the world, so both graph forms are timed.

``python -m benchmarks.compiled_parallel [--config PATH] [--rounds N]``; run by msrun as
``python -m benchmarks.compiled_parallel OUT SHARD CONFIG ROUNDS SEQ [OVERRIDE ...]``. A smoke run: 32 tokens, one
round, every variant eager (benchmarks.SMOKE_EAGER).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import SMOKE_EAGER
from benchmarks.contention import LoadWatch
from benchmarks.suite import Bench, standalone

PROJECT_ROOT = Path(__file__).resolve().parent.parent
SEQ, ROUNDS = 512, 5
SMOKE_SEQ, SMOKE_ROUNDS = 32, 1  # at qwen3_tiny's 2 layers: a stage each under PP 2
SMOKE_OVERRIDES = [SMOKE_EAGER]
DEFAULT_CONFIG = "configs/qwen3_tiny.yaml"
TP2 = ["parallelism.tensor_parallel=2", "parallelism.sequence_parallel=true", "training.local_batch_size=2"]
PP2 = ["parallelism.pipeline_parallel=2", "training.local_batch_size=1"]
ZERO3 = ["parallelism.data_parallel_shard_strategy=optim_grads_params", "training.local_batch_size=1"]
VARIANTS = {"TP 2 eager": [*TP2, "fast_step.compile=false"],
            "TP 2 compiled": [*TP2, "fast_step.compile=true"],
            "PP 2 eager": [*PP2, "fast_step.compile=false"],
            "PP 2 compiled": [*PP2, "fast_step.compile=true"],
            "ZeRO-3 eager": [*ZERO3, "fast_step.compile=false"],
            "ZeRO-3 compiled": [*ZERO3, "fast_step.compile=true"],
            "DP 2 compiled": ["training.local_batch_size=1", "fast_step.compile=true"]}


def _config(shard: str, config_path: str, rounds: int, seq: int, overrides: list[str]):
    from resources.tokenizer import SPECIAL_IDS
    from training.config import load_config

    data = "train_dataset.dataloader.config"
    return load_config(PROJECT_ROOT / config_path, [
        f"{data}.data_path=[1.0, '{shard}']", f"{data}.eod={SPECIAL_IDS['eos']}", f"{data}.pad={SPECIAL_IDS['pad']}",
        f"{data}.seq_length={seq}", f"model.seq_length={seq}", f"{data}.split='100,0,0'",
        "training.global_batch_size=2", f"training.steps={rounds + 1}",
        "parallelism.data_parallel_shard_strategy=optim", "checkpoint.enable_save=false", *overrides])


def _median_seconds(fn, repeats: int) -> float:
    fn()  # the first call compiles
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def _gather_times(layer, group, repeats: int) -> dict[str, float]:
    """Seconds to gather one layer's weights (half on each rank) eagerly and in a graph, medians."""
    import mindspore as ms
    import numpy as np
    from mindspore import Tensor, nn, ops

    from training.parallel import comm

    size = sum(int(np.prod(p.shape)) for p in layer.get_parameters())
    half = Tensor(np.ones(size // group.size, np.float32))
    padded = comm.AllGather(group, 0)
    comm.for_graph(padded)

    class WorldGather(nn.Cell):
        def __init__(self):
            super().__init__()
            self.gather = ops.AllGather(group.backend_name)

        def construct(self, x):
            return self.gather(x)

    graph_padded, graph_world = ms.jit(padded), ms.jit(WorldGather())
    return {"eager list-form all_gather": _median_seconds(lambda: comm.all_gather(half, 0, group).asnumpy(), repeats),
            "graph all-reduce of a padded buffer": _median_seconds(lambda: graph_padded(half).asnumpy(), repeats),
            "graph ops.AllGather (world group only)": _median_seconds(lambda: graph_world(half).asnumpy(), repeats),
            "bytes": size * 4}


def worker(out: str, shard: str, config_path: str, rounds: str, seq: str, *extra: str) -> None:
    """One msrun worker: every variant's trainer, their steps alternating round by round, then the gathers.
    ``extra``: overrides given after each variant's."""
    from training.parallel.mesh import init_world, world_group
    from training.reporting import Reporter
    from training.step import configure_runtime
    from training.trainer import Trainer

    rounds, seq = int(rounds), int(seq)
    configure_runtime(_config(shard, config_path, rounds, seq, []))
    world = init_world()
    trainers = {name: Trainer(_config(shard, config_path, rounds, seq, [*overrides, *extra]), world, Path(out) / name,
                              Reporter(None, enabled=False))
                for name, overrides in VARIANTS.items()}
    times = {name: [] for name in VARIANTS}
    cpu = {name: [] for name in VARIANTS}
    for round_ in range(rounds + 1):
        for name, trainer in trainers.items():
            started, cpu_started = time.perf_counter(), time.process_time()
            trainer.train_step()
            if round_:  # the first round compiles
                times[name].append(time.perf_counter() - started)
                cpu[name].append(time.process_time() - cpu_started)
    gathers = _gather_times(trainers["DP 2 compiled"].model.decoder.layers[0], world_group(world), 2 * rounds)
    if world.is_main:
        (Path(out) / "figures.json").write_text(json.dumps({
            "times": times, "cpu": cpu, "modes": {name: t.step_mode for name, t in trainers.items()},
            "gathers": gathers}))


def measure(bench: Bench, shard: Path, config_path: str, rounds: int, seq: int, extra: list[str] = ()) -> None:
    from training.launch import run_on_local_workers

    with tempfile.TemporaryDirectory(prefix="kiln-bench-compiled-parallel-") as tmp, LoadWatch(cores=2) as watch:
        run_on_local_workers(["-m", "benchmarks.compiled_parallel", tmp, shard, config_path, rounds, seq, *extra],
                             Path(tmp) / "log", 2)
        figures = json.loads((Path(tmp) / "figures.json").read_text())
        for name, cpu_seconds in figures["cpu"].items():
            for seconds in cpu_seconds:
                watch.cpu(name, seconds)  # rank 0's
    times = figures["times"]
    for name, mode in figures["modes"].items():
        print(f"  {name}: {mode[:110]}")

    def speed(name: str, reference: str) -> float:
        return statistics.median(r / s for r, s in zip(times[reference], times[name]))
    for name, seconds in times.items():
        bench.report(f"{name} step, {seq} tokens x 2", statistics.median(seconds) * 1000, "ms",
                     speed(name, "DP 2 compiled"), "DP 2 compiled's speed, paired per round", watch=watch)
    for layout in ("TP 2", "PP 2", "ZeRO-3"):
        bench.report(f"{layout} compiled vs eager", statistics.median(times[f"{layout} compiled"]) * 1000, "ms",
                     speed(f"{layout} compiled", f"{layout} eager"), f"{layout} eager's speed, paired per round",
                     watch=watch)
    gathers = figures["gathers"]
    size = gathers.pop("bytes")
    eager_gather = gathers["eager list-form all_gather"]
    for name, seconds in gathers.items():
        bench.report(f"gather of {size / 2**20:.2f} MiB: {name}", seconds * 1000, "ms", seconds / eager_gather,
                     "the eager gather's time", watch=watch)


def run(bench: Bench) -> None:
    if bench.smoke:
        measure(bench, bench.shard(), DEFAULT_CONFIG, SMOKE_ROUNDS, SMOKE_SEQ, SMOKE_OVERRIDES)
    else:
        measure(bench, bench.shard(), DEFAULT_CONFIG, ROUNDS, SEQ)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=DEFAULT_CONFIG)
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    args = parser.parse_args(argv)
    import numpy as np

    from training.data.indexed import IndexedDatasetWriter

    with standalone("compiled_parallel") as bench:
        shard = bench.work / "random"  # what is trained does not change a step's time: random documents will do
        rng = np.random.default_rng(0)
        with IndexedDatasetWriter(shard, np.uint16) as writer:
            for _ in range(64):
                writer.add_document(np.append(rng.integers(4, 4096, size=rng.integers(100, 1000)), 2).astype(np.uint16))
        measure(bench, shard, args.config, args.rounds, SEQ)
    return 0


if __name__ == "__main__":
    if len(sys.argv) >= 6 and not sys.argv[1].startswith("-"):
        os.environ.setdefault("MS_DEV_HOST_BLOCKING_RUN", "1")  # before MindSpore loads: single-threaded dispatch
        worker(*sys.argv[1:])
    else:
        sys.exit(main())
