"""Context parallelism on 2 msrun workers: step time against data parallelism, compiled against eager, and the
bytes the attention moves per step against the analytic count.

configs/qwen3_tiny.yaml at a 512-token sequence, 2 samples per step in one micro-batch: DP 2 (each rank a
whole sample) against CP 2 (each rank half of both samples) with the ring (contiguous and zig-zag chunks) and
with Ulysses; ZeRO-1 everywhere, so the weights' collectives are the same in every variant. The variants' steps
alternate round by round in one launch (the machine is shared: each round sees the same load); ratios are medians
of per-round ratios. DP 2 and CP 2 compile their forward and backward (``fast_step``; CP's ring steps and
Ulysses exchanges as all-reduces in the graph), the "eager" variants nothing (``fast_step.compile`` false);
"DP 2, whole step compiled" also its gradient reduction, clip and AdamW (``fast_step.compile_reduction``).

Bytes are counted where the eager CPU collectives receive them (``gather_list``: what every member gets from the
others), so for the eager variants only; the attention's are an eager CP variant's per-step count minus DP's
(all-reduces are not counted: both variants run the same ones). Analytic, per rank and step over the layers and
micro-batches, with one K/V block = batch × kv groups × s × (k dim + v dim) × 4 bytes (s = this rank's tokens):
- ring of R: the forward passes R−1 K/V blocks on, the backward R−1 (block, its gradient so far) pairs and
  one gradient home: (3R−2) blocks. CPU's ring step is an all-gather, which brings R−1 blocks, not one;
  at R = 2 the two counts agree.
- Ulysses of u: q, K/V and the output each switch sequence parts for head parts, forward and backward; a
  native all-to-all receives (u−1)/u of each, the CPU one (all-gather, then a pick) u−1 whole tensors, u
  times as much.
A smoke run: one layer, 32 tokens, one round, every variant eager (benchmarks.SMOKE_EAGER). Run by msrun:
``python -m benchmarks.context_parallel OUT SHARD ROUNDS SEQ [MODEL OVERRIDE ...]``.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import SMOKE_EAGER
from benchmarks.contention import LoadWatch
from benchmarks.suite import Bench

PROJECT_ROOT = Path(__file__).resolve().parent.parent
SEQ, ROUNDS = 512, 5
SMOKE_SEQ, SMOKE_ROUNDS = 32, 1
SMOKE_MODEL = ["model.num_hidden_layers=1", SMOKE_EAGER]  # the sequence is the worker's SEQ argument
# the same global batch of 2 samples, one micro-batch per step: DP 2 reads one sample per rank, CP 2 both (halves)
CP2 = ["parallelism.context_parallel=2", "training.local_batch_size=2"]
EAGER = ["fast_step.compile=false"]
VARIANTS = {"DP 2": ["training.local_batch_size=1"],
            "DP 2, whole step compiled": ["training.local_batch_size=1", "fast_step.compile_reduction=true"],
            "CP 2 ring": CP2,
            "CP 2 ring, eager": [*CP2, *EAGER],
            "CP 2 ring zig-zag": [*CP2, "kiln.parallelism.context_parallel_load_balance=true"],
            "CP 2 Ulysses": [*CP2, "parallelism.context_parallel_method=ulysses"],
            "CP 2 Ulysses, eager": [*CP2, "parallelism.context_parallel_method=ulysses", *EAGER]}


def _config(shard: str, overrides: list[str], rounds: int, seq: int, model: list[str]):
    from resources.tokenizer import SPECIAL_IDS
    from training.config import load_config

    data = "train_dataset.dataloader.config"
    return load_config(PROJECT_ROOT / "configs/qwen3_tiny.yaml", [
        f"{data}.data_path=[1.0, '{shard}']", f"{data}.eod={SPECIAL_IDS['eos']}", f"{data}.pad={SPECIAL_IDS['pad']}",
        f"{data}.seq_length={seq}", f"model.seq_length={seq}", f"{data}.split='100,0,0'",
        "training.global_batch_size=2", f"training.steps={rounds + 1}",
        "parallelism.data_parallel_shard_strategy=optim", "checkpoint.enable_save=false", *overrides, *model])


def kv_block_bytes(config) -> int:
    """One layer's K/V on one rank: batch × kv groups × this rank's tokens × (k dim + v dim), float32."""
    m = config.model
    seq = config.train_dataset.dataloader.config.seq_length
    return config.training.local_batch_size * m["num_key_value_heads"] * (seq // 2) * 2 * m["head_dim"] * 4


def analytic_bytes(variant: str, config, accumulation: int) -> float:
    """The attention's bytes received per rank and step by a native ring / all-to-all (see the docstring)."""
    m = config.model
    kv = kv_block_bytes(config)
    if "ring" in variant:
        per_layer = (3 * 2 - 2) * kv
    else:  # Ulysses, u = 2: half of q, K/V and the output (q and the output: every head, k's dim), both ways
        q = out = kv * m["num_attention_heads"] // m["num_key_value_heads"] // 2
        per_layer = 2 * (q + kv + out) / 2
    return per_layer * m["num_hidden_layers"] * accumulation


def worker(out: str, shard: str, rounds: str, seq: str, *model: str) -> None:
    """One msrun worker: every variant's trainer, their steps alternating round by round. ``model``: overrides of
    the config's size (none: as shipped), given after the variant's."""
    rounds, seq = int(rounds), int(seq)
    import numpy as np
    from mindspore import Tensor

    from training.parallel import comm
    from training.parallel.mesh import init_world
    from training.reporting import Reporter
    from training.step import configure_runtime
    from training.trainer import Trainer

    configure_runtime(_config(shard, [], rounds, seq, model))
    world = init_world()
    received = [0, 0]  # bytes, calls
    gather_list = comm._CpuBackend.gather_list

    def counting(self, x, group):
        received[0] += int(x.nbytes) * (group.size - 1)
        received[1] += 1
        return gather_list(self, x, group)
    comm._CpuBackend.gather_list = counting
    trainers = {name: Trainer(_config(shard, overrides, rounds, seq, model), world, Path(out) / name,
                              Reporter(None, enabled=False))
                for name, overrides in VARIANTS.items()}
    times = {name: [] for name in VARIANTS}
    cpu = {name: [] for name in VARIANTS}
    counted = {}
    for round_ in range(rounds + 1):
        for name, trainer in trainers.items():
            received[:] = [0, 0]
            started, cpu_started = time.perf_counter(), time.process_time()
            trainer.train_step()
            if round_:  # the first round compiles kernels
                times[name].append(time.perf_counter() - started)
                cpu[name].append(time.process_time() - cpu_started)
            counted[name] = list(received)
    ring = trainers["CP 2 ring"].parallel.context_parallel.ring_group
    block = Tensor(np.zeros(kv_block_bytes(trainers["CP 2 ring"].config) // 4, np.float32))
    gather_s = []
    for _ in range(rounds * 2):
        started = time.perf_counter()
        comm.ring_shift(block, ring).asnumpy()
        gather_s.append(time.perf_counter() - started)
    if world.is_main:
        figures = {name: {"times": times[name], "cpu": cpu[name], "received": counted[name][0],
                          "collectives": counted[name][1],
                          "analytic": analytic_bytes(name, trainers[name].config, trainers[name].accumulation)
                          if name.startswith("CP") else 0.0}
                   for name in VARIANTS}
        figures["gather_s"] = statistics.median(gather_s)
        (Path(out) / "figures.json").write_text(json.dumps(figures))


def measure(bench: Bench, shard: Path, rounds: int, seq: int, model: list[str] = ()) -> None:
    from training.launch import run_on_local_workers

    with tempfile.TemporaryDirectory(prefix="kiln-bench-cp-") as tmp, LoadWatch(cores=2) as watch:
        run_on_local_workers(["-m", "benchmarks.context_parallel", tmp, shard, rounds, seq, *model], Path(tmp) / "log",
                             2)
        figures = json.loads((Path(tmp) / "figures.json").read_text())
        gather_s = figures.pop("gather_s")
        for name, f in figures.items():
            for seconds in f["cpu"]:
                watch.cpu(name, seconds)  # rank 0's
    dp = figures["DP 2"]

    def paired(name: str, reference: str) -> float:
        """The median over rounds of ``name``'s step time over ``reference``'s in the same round."""
        return statistics.median(a / b for a, b in zip(figures[name]["times"], figures[reference]["times"]))
    for name, f in figures.items():
        step_s = statistics.median(f["times"])
        bench.report(f"{name} step, {seq} tokens", step_s * 1000, "ms", paired(name, "DP 2"),
                     "DP 2's step, paired per round", watch=watch)
        if name.startswith("CP") and name.endswith("eager"):
            compiled = name.removesuffix(", eager")
            bench.report(f"{compiled} compiled vs eager", statistics.median(figures[compiled]["times"]) * 1000, "ms",
                         paired(compiled, name), "the eager step, paired", watch=watch)
            attention = f["received"] - dp["received"]
            bench.report(f"{name} attention bytes per step", attention / 2**20, "MiB per rank",
                         attention / f["analytic"], "the analytic count")
            # what the step's extra time is: the attention's collectives at the measured latency of one
            extra = f["collectives"] - dp["collectives"]
            bench.report(f"{name} attention collectives per step", extra, f"x {gather_s * 1000:.0f} ms",
                         extra * gather_s / (step_s - statistics.median(dp["times"])), "the step's time over DP's",
                         watch=watch)


def run(bench: Bench) -> None:
    if bench.smoke:
        measure(bench, bench.shard(), SMOKE_ROUNDS, SMOKE_SEQ, SMOKE_MODEL)
    else:
        measure(bench, bench.shard(), ROUNDS, SEQ)


if __name__ == "__main__":
    os.environ.setdefault("MS_DEV_HOST_BLOCKING_RUN", "1")  # before MindSpore loads: single-threaded dispatch
    worker(*sys.argv[1:])
