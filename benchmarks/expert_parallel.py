"""Expert parallelism vs data parallelism on 2 msrun workers (CPU): step time, and the bytes the all-to-all
dispatch moves per step against the analytic count.

configs/deepseek_v3_tiny.yaml (8 routed experts, top-2, 2 MoE decoder layers + 1 MTP layer) trains eagerly under
DP (ZeRO-3 over 2 ranks, every rank all experts) and EP2 (ZeRO-3 over 2 ranks, each rank 4 experts, tokens sent
to their experts' rank by all-to-all) in the same processes, one step of each in turn so both see the same
moments of the shared machine; the first step of each is dropped (kernel compilation).

Compiled against eager: EP2 under ZeRO-1 twice in the same rounds,
eagerly (``fast_step.compile=false``: the all-to-all dispatch, splits counted on the host) and compiled (forward
and backward in one mindspore.jit graph with the all-gather token dispatch, ``AllGatherDispatcher``), reported as
the median of the per-round ratios.

The transport a compiled dispatch could use, timed alone in a graph (forward and backward, one MoE layer's
micro-batch): the all-gather dispatch's against a capacity-padded all-to-all that drops no token (why the
compiled step uses the former).

Bytes: each EP step's dispatches count the rows they send to the other rank (``AllToAllDispatcher.
rows_sent_away``); the combine returns as many rows, and the backward sends the gradients of both back the
same way, so the step moves 4 × rows × hidden × 4 bytes. The analytic count assumes uniform routing: each
MoE layer of each micro-batch sends (tokens · top_k + experts, the safe tokens) · (ep − 1)/ep rows away. (On
CPU the all-to-all is built from an all-gather, which moves ep × the longest rank's rows instead: that is the
backend's cost, not the dispatch's.) A smoke run: a dense and a MoE layer, no MTP, 32 tokens, a sample per
rank, one round, every layout eager (benchmarks.SMOKE_EAGER). Run by msrun:
``python -m benchmarks.expert_parallel OUT SHARD ROUNDS [MODEL OVERRIDE ...]``.
"""
from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import SMOKE_EAGER, smoke_model
from benchmarks.contention import LoadWatch
from benchmarks.suite import Bench

PROJECT_ROOT = Path(__file__).resolve().parent.parent
EP2 = "parallelism.expert_parallel=2"
ZERO1 = "parallelism.data_parallel_shard_strategy=optim"
EAGER = "fast_step.compile=false"  # the all-to-all dispatch, whose rows the byte count reads
LAYOUTS = {"DP": [EAGER], "EP2": [EP2, EAGER], "EP2 ZeRO-1 eager": [EP2, ZERO1, EAGER],
           "EP2 ZeRO-1 compiled": [EP2, ZERO1, "fast_step.compile=true"]}
ROUNDS, SMOKE_ROUNDS = 4, 1
SMOKE_MODEL = [*smoke_model(2), "model.num_nextn_predict_layers=0", "training.local_batch_size=1",
               "training.global_batch_size=2", SMOKE_EAGER]
BYTES_PER_VALUE = 4  # float32 activations


def _config(shard: str, overrides: list[str], rounds: int, model: list[str]):
    from benchmarks import blend_settings
    from resources.tokenizer import SPECIAL_IDS
    from training.config import load_config

    return load_config(PROJECT_ROOT / "configs/deepseek_v3_tiny.yaml", [
        f"train_dataset.dataloader.config.data_path=[1.0, '{shard}']",
        f"train_dataset.dataloader.config.eod={SPECIAL_IDS['eos']}",
        f"train_dataset.dataloader.config.pad={SPECIAL_IDS['pad']}", *blend_settings(),
        f"training.steps={rounds + 1}", "checkpoint.enable_save=false", *overrides, *model])


def _dispatchers(trainer) -> list:
    return [layer.token_dispatcher for _, layer in trainer.model.moe_layers() if layer.token_dispatcher]


def _transport_times(group, tokens: int, hidden: int, top_k: int, repeats: int) -> dict[str, float]:
    """Seconds one MoE layer's token transport takes in a graph, forward and backward (comm's Cells after
    comm.for_graph, as in a compiled step), medians: the all-gather dispatch's (gather the tokens and their
    routing, reduce-scatter the sums back) and a capacity-padded all-to-all's that drops no token (each rank
    sends every other rank a block of tokens·top_k rows, the most its experts could be sent, and the combine
    returns as many)."""
    import mindspore as ms
    import numpy as np
    from mindspore import Tensor, nn

    from benchmarks.compiled_parallel import _median_seconds
    from training.parallel import comm

    class AllGatherTransport(nn.Cell):
        def __init__(self):
            super().__init__()
            self.gather, self.combine = comm.AllGather(group, 0), comm.ReduceScatter(group, 0)

        def construct(self, rows, routing):
            return self.combine(self.gather(rows)).sum() + self.gather(routing).sum()

    class PaddedAllToAllTransport(nn.Cell):
        def __init__(self):
            super().__init__()
            self.exchange = comm.AllToAll(group, 0, 0)

        def construct(self, blocks):
            return self.exchange(self.exchange(blocks)).sum()

    def timed(cell, *inputs):
        comm.for_graph(cell)
        step = ms.jit(ms.grad(cell, grad_position=tuple(range(len(inputs)))))
        return _median_seconds(lambda: [g.asnumpy() for g in step(*inputs)], repeats)

    ones = lambda *shape: Tensor(np.ones(shape, np.float32))  # noqa: E731
    return {"all-gather": timed(AllGatherTransport(), ones(tokens, hidden), ones(tokens, 2 * top_k)),
            "padded all-to-all": timed(PaddedAllToAllTransport(), ones(group.size * tokens * top_k, hidden))}


def worker(out: str, shard: str, rounds: str, *model: str) -> None:
    """One msrun worker: the layouts, a step of each in turn; the first step of each dropped. ``model``: overrides
    of the config's size (none: as shipped), given after the layout's."""
    rounds = int(rounds)
    from training.parallel.mesh import init_world
    from training.reporting import Reporter
    from training.step import configure_runtime
    from training.trainer import Trainer

    configure_runtime(_config(shard, [], rounds, model))
    world = init_world()
    trainers = {name: Trainer(_config(shard, overrides, rounds, model), world, Path(out) / name,
                              Reporter(None, enabled=False))
                for name, overrides in LAYOUTS.items()}
    times = {name: [] for name in LAYOUTS}
    cpu = {name: [] for name in LAYOUTS}
    rows_away = []
    for _ in range(rounds + 1):
        for name, trainer in trainers.items():
            dispatchers = _dispatchers(trainer)
            for d in dispatchers:
                d.rows_sent_away = 0
            started, cpu_started = time.perf_counter(), time.process_time()
            trainer.train_step()
            times[name].append(time.perf_counter() - started)
            cpu[name].append(time.process_time() - cpu_started)
            if name == "EP2":
                rows_away.append(sum(d.rows_sent_away for d in dispatchers))
    ep = trainers["EP2"]
    config, dims = ep.config, ep.mesh.dims
    layer = ep.model.moe_layers()[0][1]
    moe_layers = len(ep.model.moe_layers())
    tokens = config.training.local_batch_size * ep.seq_length
    uniform_rows = ep.accumulation * moe_layers * (tokens * layer.top_k + layer.num_experts) * (dims.ep - 1) / dims.ep
    step_bytes = 4 * ep.model.config.hidden_size * BYTES_PER_VALUE  # dispatch + combine, forward + backward
    compiled, eager = times["EP2 ZeRO-1 compiled"][1:], times["EP2 ZeRO-1 eager"][1:]
    transport = _transport_times(ep.mesh.group("ep"), tokens, ep.model.config.hidden_size, layer.top_k, 2 * rounds)
    figures = {"step_s": {name: statistics.median(t[1:]) for name, t in times.items()},
               "cpu_s": {name: statistics.median(c[1:]) for name, c in cpu.items()},
               "compiled_speed": statistics.median(e / c for e, c in zip(eager, compiled)),
               "modes": {name: trainer.step_mode for name, trainer in trainers.items()}, "transport_s": transport,
               "bytes": statistics.mean(rows_away) * step_bytes, "analytic_bytes": uniform_rows * step_bytes}
    if world.is_main:
        (Path(out) / "expert_parallel.json").write_text(json.dumps(figures))


def measure(bench: Bench, shard: Path, rounds: int, model: list[str] = ()) -> None:
    from training.launch import run_on_local_workers

    with tempfile.TemporaryDirectory(prefix="kiln-bench-ep-") as tmp, LoadWatch(cores=2) as watch:
        run_on_local_workers(["-m", "benchmarks.expert_parallel", tmp, shard, rounds, *model], Path(tmp) / "log", 2)
        figures = json.loads((Path(tmp) / "expert_parallel.json").read_text())
        for name, seconds in figures["cpu_s"].items():
            watch.cpu(name, seconds)  # rank 0's
    step = figures["step_s"]
    bench.report("EP2 step, 2 ranks", step["EP2"] * 1000, "ms", step["EP2"] / step["DP"], "DP's step", watch=watch)
    bench.report("EP2 all-to-all per step", figures["bytes"] / 2**20, "MiB per rank",
                 figures["bytes"] / figures["analytic_bytes"], "uniform-routing count")
    for name in ("EP2 ZeRO-1 eager", "EP2 ZeRO-1 compiled"):
        print(f"  {name}: {figures['modes'][name][:150]}")
    bench.report("EP2 ZeRO-1 compiled step", step["EP2 ZeRO-1 compiled"] * 1000, "ms", figures["compiled_speed"],
                 "EP2 ZeRO-1 eager's speed, paired per round", watch=watch)
    transport = figures["transport_s"]
    for name, seconds in transport.items():
        bench.report(f"one MoE layer's transport in a graph, {name}", seconds * 1000, "ms",
                     seconds / transport["all-gather"], "the all-gather dispatch's", watch=watch)


def run(bench: Bench) -> None:
    measure(bench, bench.shard(), SMOKE_ROUNDS, SMOKE_MODEL) if bench.smoke else measure(bench, bench.shard(), ROUNDS)


if __name__ == "__main__":
    worker(*sys.argv[1:])
