"""Which of Kiln's CPU collectives run inside ``mindspore.jit`` (graph compilation in PyNative mode), forward
and backward: a probe, run under msrun on 2 or 4 workers, each case's outcome and error printed by rank 0.

``python -m benchmarks.compiled_collectives_probe [--workers 2|4]`` launches it. On 4 workers it tries a proper
sub-group (ranks {0, 1} / {2, 3}, as a tp or cp group of a 4-rank mesh); on 2 the group is the world. Every
case checks its values against numpy, so "works" means right, not just compiled; a gradient case checks the
loss too, since a graph prunes a forward collective that the gradient alone does not need. A failed
collective can leave the communicator unusable, so the cases run in the order least likely to break it.

Measured (MindSpore 2.10.0 CPU, 2026-12-05; graph = jit's default "ast" capture):
- ``ops.AllReduce`` works in a graph on the world and on sub-groups: forward, its own backward, and inside a
  Cell with a hand-written ``bprop``.
- ``ops.AllGather`` works in a graph on the world group only (sub-group: "AllGather only support
  mccl_world_group on CPU", as in PyNative), so a sub-group all-gather in a graph must be an all-reduce of a
  zero-padded buffer.
- ``mint.distributed`` (the list-form all_gather, broadcast) cannot be parsed in a graph: "The name 'hccl' is
  not defined, or not supported in graph mode".
- ``comm``'s per-call functions, when they made a Cell per call around two lambdas, did not parse ("The object is
  not callable"); a graph needs a Cell built beforehand. Its Cells built once (``comm.AllReduce``, ``CopyToGroup``, ``ReduceFromGroup``, ``AllGather``,
  ``ReduceScatter``), after ``comm.for_graph``, work forward and backward on sub-groups: the all-gather as an
  all-reduce of a zero-padded buffer, the reduce-scatter as an all-reduce and a Slice (2026-12-05, 4 workers).
  Tensor parallelism compiles with them.
- "trace" capture (measured before the Cells existed) ran ``comm.all_reduce`` forward and backward; the list-form
  all-gather failed to trace forward ("DistCommAllGather's input 0 should be a Parameter or a Tensor, but got
  List").
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parent.parent


def _reference_cells(group):
    """The collectives written directly with MindSpore's primitives and ``mint.distributed``, as Cells: graph mode
    ("ast", jit's default) parses each construct's source, and cannot parse a lambda passed inline."""
    import mindspore.mint.distributed as dist
    from mindspore import nn, ops

    rank = group.rank
    all_reduce = ops.AllReduce(ops.ReduceOp.SUM, group.backend_name)

    class Primitive(nn.Cell):
        def __init__(self, op):
            super().__init__()
            self.op = op

        def construct(self, t):
            return self.op(t)

    class ReduceWithBprop(nn.Cell):  # a Cell built outside the graph, its backward hand-written
        def construct(self, t):
            return all_reduce(t)

        def bprop(self, t, out, dout):
            return (all_reduce(dout),)

    class GatherWithBprop(nn.Cell):  # all-gather along dim 0 whose backward is all-reduce + this rank's rows
        def __init__(self):
            super().__init__()
            self.gather = ops.AllGather(group.backend_name)

        def construct(self, t):
            return self.gather(t)

        def bprop(self, t, out, dout):
            return (ops.narrow(all_reduce(dout), 0, rank * t.shape[0], t.shape[0]),)

    class ListGather(nn.Cell):  # the list form, the only sub-group all-gather in PyNative on CPU
        def construct(self, t):
            parts = [ops.zeros_like(t), ops.zeros_like(t)]
            dist.all_gather(parts, t, group=group.backend_name)
            return ops.cat(parts)

    return Primitive, ReduceWithBprop, GatherWithBprop, ListGather, all_reduce


def _runners(group, x):
    """``forward(cell)``: the cell compiled on this rank's ``x``; ``gradient(fn)``: the loss sum(fn(w * x)) *
    (global rank + 1), summed over ranks, and its gradient in w (x * sum(rank + 1) for all-reduce and all-gather),
    compiled. The loss is returned too, or a graph prunes a forward collective the gradient does not read (seen:
    a sub-group AllGather that fails forward "passed" as a gradient alone)."""
    import mindspore as ms
    import numpy as np
    from mindspore import Tensor, nn

    class WeightedSum(nn.Cell):
        def __init__(self, fn):
            super().__init__()
            self.fn = fn
            self.weight = ms.Parameter(Tensor(np.ones((2, 3), np.float32)), name="w")
            self.scale = float(group.global_rank + 1)

        def construct(self, t):
            return (self.fn(self.weight * t) * self.scale).sum()

    def gradient(fn, capture_mode="ast"):
        loss = WeightedSum(fn)
        value, grads = ms.jit(ms.value_and_grad(loss, None, loss.trainable_params()), capture_mode=capture_mode)(x)
        return np.append(grads[0].asnumpy(), value.asnumpy())

    def forward(cell, capture_mode="ast"):
        return ms.jit(cell, capture_mode=capture_mode)(x).asnumpy()

    return forward, gradient


def _expected(group, xs) -> tuple:
    """Numpy's sum and concatenation of every member's ``xs``, and each gradient case's expected gradient and
    loss."""
    import numpy as np

    rank, x_np = group.rank, xs[group.rank]
    total, gathered = sum(xs), np.concatenate(xs)
    scale = group.global_rank + 1
    every_scale = sum(r + 1 for r in group.ranks)
    # reduce-scatter: each member keeps its rows of the sum, so row block j of the gradient carries member j's scale
    own_rows = np.split(total, group.size)[rank]
    row_scales = np.repeat([r + 1.0 for r in group.ranks], x_np.shape[0] // group.size)[:, None]
    grad = {"all_reduce": np.append(x_np * every_scale, scale * total.sum()),
            "copy": np.append(x_np * every_scale, scale * x_np.sum()),
            "reduce": np.append(x_np * scale, scale * total.sum()),
            "all_gather": np.append(x_np * every_scale, scale * gathered.sum()),
            "reduce_scatter": np.append(x_np * row_scales, scale * own_rows.sum())}
    return total, gathered, grad


def _cases(group):
    """name -> a function returning (got, expected) numpy arrays, on this rank."""
    import numpy as np
    from mindspore import Tensor, ops

    from training.parallel import comm

    xs = [np.arange(6, dtype=np.float32).reshape(2, 3) + 10 * r for r in group.ranks]
    forward, gradient = _runners(group, Tensor(xs[group.rank]))
    Primitive, ReduceWithBprop, GatherWithBprop, ListGather, all_reduce = _reference_cells(group)
    total, gathered, grad = _expected(group, xs)

    def graph_ready(cell):  # comm's collective Cells as a compiled step uses them
        comm.for_graph(cell)
        return cell

    return {
        "AllReduce primitive, forward": lambda: (forward(Primitive(all_reduce)), total),
        "AllReduce primitive, its own backward": lambda: (gradient(Primitive(all_reduce)), grad["all_reduce"]),
        "AllReduce in a Cell with hand-written bprop, backward": lambda: (
            gradient(ReduceWithBprop()), grad["all_reduce"]),
        "AllGather primitive, forward": lambda: (forward(Primitive(ops.AllGather(group.backend_name))), gathered),
        "AllGather in a Cell with hand-written bprop (all-reduce + slice), backward": lambda: (
            gradient(GatherWithBprop()), grad["all_gather"]),
        "mint.distributed.all_gather list form, forward": lambda: (forward(ListGather()), gathered),
        "comm.AllReduce, backward": lambda: (gradient(graph_ready(comm.AllReduce(group))), grad["all_reduce"]),
        "comm.CopyToGroup (identity forward), backward": lambda: (
            gradient(graph_ready(comm.CopyToGroup(group))), grad["copy"]),
        "comm.ReduceFromGroup, backward": lambda: (gradient(graph_ready(comm.ReduceFromGroup(group))), grad["reduce"]),
        "comm.AllGather after for_graph (all-reduce of a zero-padded buffer), forward": lambda: (
            forward(graph_ready(comm.AllGather(group, 0))), gathered),
        "comm.AllGather after for_graph, backward": lambda: (
            gradient(graph_ready(comm.AllGather(group, 0))), grad["all_gather"]),
        "comm.ReduceScatter after for_graph (all-reduce + slice), backward": lambda: (
            gradient(graph_ready(comm.ReduceScatter(group, 0))), grad["reduce_scatter"]),
    }


def worker(out: str) -> None:
    sys.path.insert(0, str(PROJECT_ROOT))
    import mindspore as ms
    import numpy as np

    from training.parallel.mesh import DeviceMesh, ParallelDims, init_world, world_group

    ms.set_context(mode=ms.PYNATIVE_MODE)
    ms.set_device("CPU")
    world = init_world()
    if world.size == 4:  # pairs {0, 1} and {2, 3}: the tp groups of a 2 x 2 mesh
        group = DeviceMesh(ParallelDims(world=4, dp_shard=2, tp=2), world.rank).group("tp")
    else:
        group = world_group(world)
    results = {}
    for name, case in _cases(group).items():
        try:
            got, expected = case()
            right = bool(np.allclose(got, expected, rtol=1e-6, atol=0))
            results[name] = "works" if right else f"WRONG VALUES: got {got.tolist()}, expected {expected.tolist()}"
        except Exception as error:  # noqa: BLE001 - the probe records every failure and goes on
            lines = [l for l in traceback.format_exception_only(type(error), error)[-1].splitlines() if l.strip()]
            results[name] = f"FAILS: {type(error).__name__}: {' '.join(lines)[:400]}"
    (Path(out) / f"rank{world.rank}.json").write_text(json.dumps(results))
    os._exit(0)  # measured: after a failed collective the process can hang in MindSpore's exit; the results are out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2, choices=(2, 4))
    args = parser.parse_args(argv)
    sys.path.insert(0, str(PROJECT_ROOT))
    from training.launch import MsrunSettings, free_port, msrun_command, msrun_environment

    with tempfile.TemporaryDirectory(prefix="kiln-probe-") as tmp:
        settings = MsrunSettings(worker_num=args.workers, local_worker_num=args.workers, master_port=free_port(),
                                 log_dir=str(Path(tmp) / "log"), cluster_time_out=300)
        done = subprocess.run(msrun_command(settings, [__file__, tmp]), cwd=PROJECT_ROOT,
                              env=msrun_environment(os.environ, one_machine=settings.one_machine),
                              capture_output=True, text=True)
        ranks = sorted(Path(tmp).glob("rank*.json"))
        if not ranks:
            print(done.stdout[-2000:], done.stderr[-2000:])
            for log in sorted((Path(tmp) / "log").glob("worker_*.log")):
                print(f"--- {log.name}\n{log.read_text()[-3000:]}")
            return 1
        results = {p.stem: json.loads(p.read_text()) for p in ranks}
    where = "sub-group {0,1}/{2,3}" if args.workers == 4 else "world group"
    for name, outcome in results["rank0"].items():
        others = {r: res[name] for r, res in results.items() if res.get(name) != outcome}
        print(f"{name} [{args.workers} workers, {where}]: {outcome}" + (f" (differs on {others})" if others else ""))
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 2 and not sys.argv[1].startswith("-"):
        os.environ.setdefault("MS_DEV_HOST_BLOCKING_RUN", "1")
        worker(sys.argv[1])
    else:
        sys.exit(main())
