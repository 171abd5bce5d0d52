"""python -m benchmarks.compile_time [--layers 2 8 16] — how long the first compiled step takes as the model deepens,
with the decoder's layers sharing one compiled graph (``TransformerLayer.graph_key``, MindSpore's lazy_inline) vs.
each layer parsed and inferred on its own, and the peak memory of each.

configs/qwen3_tiny.yaml on mock data at seq 512, the whole step compiled, synchronous dispatch, one process per
(depth, variant), the two variants of a depth back to back. Each worker reports the seconds of its first step (the
compile), its peak RSS and its losses of 3 steps, which must be equal between the variants. MoE layers of one
construction share one graph as well (their routing statistics leave it as outputs: ``transformer.run_layer``).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.contention import LoadWatch
from benchmarks.suite import Bench, standalone

PROJECT_ROOT = Path(__file__).resolve().parent.parent
CONFIG = "configs/qwen3_tiny.yaml"
STEPS = 3
DEPTHS = (2, 8, 16)
SMOKE_DEPTHS = (1,)
VARIANTS = ("shared layer graphs", "a graph per layer")


def worker(layers: int, variant: str, run_dir: Path) -> dict:
    from benchmarks.throughput import load
    from training.model.transformer import TransformerLayer
    from training.parallel.mesh import World
    from training.reporting import Reporter
    from training.step import configure_runtime
    from training.trainer import Trainer

    if variant == "a graph per layer":  # the layer's __init__ without lazy_inline: no graph_key, no reuse
        TransformerLayer.__init__ = TransformerLayer.__init__.__wrapped__
    config = load(CONFIG, [f"model.num_hidden_layers={layers}", "fast_step.compile=true", f"training.steps={STEPS}"])
    configure_runtime(config)
    trainer = Trainer(config, World(rank=0, size=1), run_dir, Reporter(None, enabled=False))
    assert trainer.step_mode.startswith("whole step compiled"), trainer.step_mode
    started, cpu_started = time.perf_counter(), time.process_time()
    losses = [trainer.train_step()["loss"]]
    first_step_s, first_step_cpu_s = time.perf_counter() - started, time.process_time() - cpu_started
    losses += [trainer.train_step()["loss"] for _ in range(STEPS - 1)]
    return {"first_step_s": first_step_s, "first_step_cpu_s": first_step_cpu_s, "losses": losses,
            "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}


def measure(layers: int, variant: str, run_dir: Path) -> dict:
    done = subprocess.run([sys.executable, "-m", "benchmarks.compile_time", "--worker", str(layers), variant, run_dir],
                          cwd=PROJECT_ROOT, env={**os.environ, "MS_DEV_HOST_BLOCKING_RUN": "1"},
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{variant} at {layers} layers failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure_depths(bench: Bench, layers) -> None:
    """Each depth's two variants back to back (which goes first alternating by depth); raises if their losses
    differ."""
    with tempfile.TemporaryDirectory(prefix="kiln-bench-compile-time-") as tmp:
        for i, depth in enumerate(layers):
            order = VARIANTS if i % 2 == 0 else VARIANTS[::-1]
            with LoadWatch(cores=1) as watch:  # the first step compiles on one thread
                results = {variant: measure(depth, variant, Path(tmp) / f"{depth}-{n}")
                           for n, variant in enumerate(order)}
                for variant, result in results.items():
                    watch.cpu(variant, result["first_step_cpu_s"])
            shared, apart = results[VARIANTS[0]], results[VARIANTS[1]]
            if shared["losses"] != apart["losses"]:
                raise AssertionError(f"the variants' losses differ at {depth} layers: {results}")
            for figure, label, unit in (("first_step_s", "first step", "s"), ("peak_rss_gb", "peak RSS", "GB")):
                timed = watch if figure == "first_step_s" else None
                bench.report(f"{depth} layers, {VARIANTS[1]}: {label}", apart[figure], unit, watch=timed)
                bench.report(f"{depth} layers, {VARIANTS[0]}: {label}", shared[figure], unit,
                             shared[figure] / apart[figure], VARIANTS[1], watch=timed)
        print("the losses of both variants were equal at every depth", flush=True)


def run(bench: Bench) -> None:
    measure_depths(bench, SMOKE_DEPTHS if bench.smoke else DEPTHS)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, nargs="+", default=list(DEPTHS))
    parser.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        layers, variant, run_dir = args.worker
        print(json.dumps(worker(int(layers), variant, Path(run_dir))), flush=True)
        return
    print(f"{CONFIG}, whole step compiled")
    with standalone("compile_time") as bench:
        measure_depths(bench, args.layers)


if __name__ == "__main__":
    main()
