"""Does MindSpore's own recompute (``Cell.recompute()`` on each decoder layer) work inside Kiln's compiled step? A
probe: ``python -m benchmarks.graph_recompute_probe [--seq 1024]`` compiles forward+backward of a 4-layer micro Qwen3
(tests/configs/qwen3_micro.yaml's sizes, batch 4) with and without it, each in its own process, and prints for each
how many MatMul/BatchMatMul nodes the executed graph holds (recomputed forwards add theirs), the loss and gradients
(which must be equal), and the peak RSS over the built model's (the step's memory; the step's first run compiles and
the memory pool keeps its peak).

Measured (MindSpore 2.10.0 CPU, 2026-12-06, seq 1024, load ~6 on 2 cores; memory figures, not timings):
- the layers recomputed: 242 MatMul nodes instead of 202 (each layer's products run again in the backward), the
  same loss and gradients: the graph recompute does apply inside a PyNative jit graph (the decoder layers being
  shared lazy_inline graphs);
- but the step's memory does not drop: 757 MB with it, 735 MB without (1.03x), where the eager recompute saves 0.34x;
- ``--stock``, the same sizes in MindSpore's own ops (no Cell with a hand-written backward): 72 -> 92 MatMul nodes,
  equal values, 1,643 -> 1,486 MB (0.90x).
The step memory is the first step's peak over the built model's RSS, and includes what compiling holds.

What the compiled step does instead (``training.recompute.RecomputedLayers``), and what was tried on the way (scratch
scripts, same day, memory figures under load 4-11; micro Qwen3 at batch 8 x seq 2048 unless said):
- a custom-bprop Cell per layer, its weights passed as inputs (as ``fsdp.RegatheredMatrix``): MindSpore refuses it in
  a graph when the bprop's re-forward reads the layer's Parameters ("The user defined 'bprop' function ... does not
  support using Parameter"), so it needs a layer written as a function of its weights. On a toy stack whose layers
  are such functions it saves memory only when the re-forward's input waits on the incoming gradient
  (``ops.depend``); without that the graph runs the re-forward during the forward and keeps it all (8 layers:
  plain 2,835 MB, re-forward with depend 2,349, ``Cell.recompute`` 2,382);
- host-run graphs per layer (each layer's forward and its recomputing backward compiled apart, as the pipeline's
  stages): 4 layers 3,121 -> 2,403 MB (0.77x), the same gradients;
- one graph taking the gradients by hand with stages recomputed under ``value_and_grad`` of output . gradient, the
  re-forward's input waiting on the gradient: 2,412 MB (0.77x), bit-identical gradients; without the depend 3,366 MB
  (more than no recompute). This is Kiln's compiled recompute. qwen3_bench sizes, batch 4 x seq 2048: 5,390 -> 4,143
  MB (0.77x); ``benchmarks.recompute_memory`` reports it against the eager recompute.
Why the ratio stays far above the eager step's: the compiled step's memory is not its live activations alone. What
compiling holds grows with the graph (a re-forward adds nodes), and some CPU kernels hold memory per graph node: a
Transpose node an int64 index map of its output's size (the peak of a chain of n Transposes of a 32 MB tensor grows
64 MB a node; mint.permute's does not), MindSpore's SoftmaxBackward 4x its output (Kiln's Softmax has its own
backward). A decoder layer has 10 Transposes (q, k, v, the output and their gradients), 4 more when recomputed.
Tried: the attention's four layout changes as mint.permute instead (gradients bit-identical to the Transposes',
eager and compiled). qwen3_bench, batch 4 x seq 2048, what a step adds to the built model's RSS
(benchmarks.recompute_memory --modes compiled, load 2-4): no recompute 6,439 -> 4,728 MiB, full recompute 5,133 ->
3,112 MiB (0.66x of no recompute's). But the compiled step is slower with it, 1.65-1.72 s against 1.36-1.43 s a step
(qwen3_bench, seq 512 x batch 4, forward+backward, medians of 8 steps, two rounds alternating, load 1.7-1.9), so
only the compiled recompute, which trades time for memory, takes it (``SelfAttention.permute_layouts``).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parent.parent
MATMUL = re.compile(r"= PrimFunc_(?:Batch)?MatMul(?:Ext)?\(")


def _rss_mb() -> float:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _stock_model(seq: int, hidden: int = 64, heads: int = 4, layers: int = 4):
    """The micro Qwen3's sizes in MindSpore's own ops only (nn.Dense, ops.softmax; no Cell with a hand-written
    backward): whether what the graph recompute leaves kept is Kiln's backward Cells or MindSpore's runtime."""
    from mindspore import nn, ops

    class Layer(nn.Cell):
        def __init__(self):
            super().__init__()
            self.qkv, self.proj = nn.Dense(hidden, 3 * hidden, has_bias=False), nn.Dense(hidden, hidden, has_bias=False)
            self.fc1, self.fc2 = nn.Dense(hidden, 4 * hidden, has_bias=False), nn.Dense(4 * hidden, hidden, has_bias=False)

        def construct(self, x):
            batch = x.shape[0]
            q, k, v = (t.reshape(batch, seq, heads, -1).transpose(0, 2, 1, 3)
                       for t in ops.split(self.qkv(x), hidden, -1))
            probs = ops.softmax(ops.bmm(q, k.transpose(0, 1, 3, 2)) * (hidden // heads) ** -0.5, -1)
            x = x + self.proj(ops.bmm(probs, v).transpose(0, 2, 1, 3).reshape(batch, seq, hidden))
            return x + self.fc2(ops.relu(self.fc1(x)))

    class Stack(nn.Cell):
        def __init__(self):
            super().__init__()
            self.embedding = nn.Embedding(512, hidden)
            self.layers = nn.CellList([Layer() for _ in range(layers)])

        def construct(self, ids, labels, loss_mask):
            x = self.embedding(ids)
            for layer in self.layers:
                x = layer(x)
            return (x * x).mean()

    return Stack()


def worker(recompute: bool, seq: int, ir_dir: str, stock: bool) -> dict:
    os.environ["MS_DEV_SAVE_GRAPHS"] = "1"  # read when MindSpore loads
    os.environ["MS_DEV_SAVE_GRAPHS_PATH"] = ir_dir
    import mindspore as ms
    import numpy as np
    import yaml
    from mindspore import Tensor

    from training.model import Qwen3Config
    from training.model.gpt import GPTModel

    ms.set_context(mode=ms.PYNATIVE_MODE)
    ms.set_device("CPU")
    section = yaml.safe_load((PROJECT_ROOT / "tests/configs/qwen3_micro.yaml").read_text())["model"]
    section = {k: v for k, v in section.items() if k not in ("model_type", "architectures")}
    ms.set_seed(0)
    model = _stock_model(seq) if stock else GPTModel(Qwen3Config.from_dict(
        {**section, "num_hidden_layers": 4, "seq_length": seq, "max_position_embeddings": seq}), seed=0)
    if recompute:
        for layer in (model.layers if stock else model.decoder.layers):
            layer.recompute()
    ids = Tensor(np.random.RandomState(0).randint(0, section["vocab_size"], (4, seq)).astype(np.int32))
    built = _rss_mb()
    loss, grads = ms.jit(ms.value_and_grad(model, None, model.trainable_params()))(
        ids, ids, Tensor(np.ones((4, seq), np.float32)))
    executed = sorted(Path(ir_dir).rglob("*_execute_*.ir"))[-1].read_text()
    return {"matmuls": len(MATMUL.findall(executed)), "loss": float(loss.asnumpy()),
            "grad_abs_sums": [float(np.abs(g.asnumpy()).sum()) for g in grads],
            "step_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10 - built}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--stock", action="store_true", help="the same sizes in MindSpore's own ops only")
    parser.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker[0] == "recompute", args.seq, args.worker[1], args.stock)))
        return
    results = {}
    with tempfile.TemporaryDirectory(prefix="kiln-graph-recompute-") as tmp:
        for variant in ("plain", "recompute"):
            done = subprocess.run([sys.executable, "-m", "benchmarks.graph_recompute_probe", "--seq", str(args.seq),
                                   *(["--stock"] if args.stock else []), "--worker", variant, str(Path(tmp) / variant)], cwd=PROJECT_ROOT,
                                  env={**os.environ, "MS_DEV_HOST_BLOCKING_RUN": "1"}, capture_output=True, text=True)
            if done.returncode != 0:
                raise RuntimeError(f"{variant} failed:\n{done.stderr[-3000:]}")
            results[variant] = json.loads(done.stdout.strip().splitlines()[-1])
    plain, recomputed = results["plain"], results["recompute"]
    model = "stock-ops model of the micro Qwen3's sizes" if args.stock else "micro Qwen3"
    print(f"{model}, 4 layers, batch 4 x seq {args.seq}, compiled forward+backward "
          f"(load {os.getloadavg()[0]:.1f}; memory figures, not timings):")
    for variant, result in results.items():
        print(f"  {variant:9}  MatMul nodes {result['matmuls']:4}  step memory {result['step_mb']:7.0f} MB  "
              f"loss {result['loss']:.7f}")
    same = plain["loss"] == recomputed["loss"] and plain["grad_abs_sums"] == recomputed["grad_abs_sums"]
    print(f"  same loss and gradients: {same}; recompute applied: {recomputed['matmuls'] > plain['matmuls']}; "
          f"memory {recomputed['step_mb'] / plain['step_mb']:.2f}x")


if __name__ == "__main__":
    main()
