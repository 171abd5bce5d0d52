"""python -m benchmarks.compile_time [--layers 2 8 16] — how long the first compiled step takes as the model deepens,
with the decoder's layers sharing one compiled graph (``TransformerLayer.graph_key``, MindSpore's lazy_inline) vs.
each layer parsed and inferred on its own, and the peak memory of each.

configs/qwen3_tiny.yaml on mock data at seq 512, the whole step compiled, synchronous dispatch, one process per
(depth, variant), the two variants of a depth back to back. Each worker reports the seconds of its first step (the
compile), its peak RSS and its losses of 3 steps, which must be equal between the variants. MoE layers compile
apart (their routing statistics are per-layer state outside the graph's inputs), so DeepSeek-V3's MoE layers gain
nothing here.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parent.parent
CONFIG = "configs/qwen3_tiny.yaml"
STEPS = 3
VARIANTS = ("shared layer graphs", "a graph per layer")


def worker(layers: int, variant: str) -> dict:
    from benchmarks.throughput import load
    from training.model.transformer import TransformerLayer
    from training.parallel.mesh import World
    from training.reporting import Reporter
    from training.trainer import Trainer, configure_runtime

    if variant == "a graph per layer":  # the layer's __init__ without lazy_inline: no graph_key, no reuse
        TransformerLayer.__init__ = TransformerLayer.__init__.__wrapped__
    config = load(CONFIG, [f"model.num_hidden_layers={layers}", "fast_step.compile=true", f"training.steps={STEPS}"])
    configure_runtime(config)
    trainer = Trainer(config, World(rank=0, size=1), Path(os.environ["KILN_BENCH_DIR"]), Reporter(None, enabled=False))
    assert trainer.step_mode.startswith("whole step compiled"), trainer.step_mode
    started = time.perf_counter()
    losses = [trainer.train_step()["loss"]]
    first_step_s = time.perf_counter() - started
    losses += [trainer.train_step()["loss"] for _ in range(STEPS - 1)]
    return {"first_step_s": first_step_s, "losses": losses,
            "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}


def measure(layers: int, variant: str, run_dir: Path) -> dict:
    env = {**os.environ, "MS_DEV_HOST_BLOCKING_RUN": "1", "KILN_BENCH_DIR": str(run_dir)}
    done = subprocess.run([sys.executable, "-m", "benchmarks.compile_time", "--worker", str(layers), variant],
                          cwd=PROJECT_ROOT, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{variant} at {layers} layers failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def run(report, layers=(2, 8, 16)) -> None:
    """Each depth's two variants back to back (which goes first alternating by depth), through ``report``."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="kiln-bench-compile-time-") as tmp:
        for i, depth in enumerate(layers):
            order = VARIANTS if i % 2 == 0 else VARIANTS[::-1]
            results = {variant: measure(depth, variant, Path(tmp) / f"{depth}-{n}") for n, variant in enumerate(order)}
            if results[VARIANTS[0]]["losses"] != results[VARIANTS[1]]["losses"]:
                raise AssertionError(f"the variants' losses differ at {depth} layers: {results}")
            apart = results[VARIANTS[1]]
            for variant, r in results.items():
                report(f"{depth} layers, {variant}: first step", r["first_step_s"], "s",
                       r["first_step_s"] / apart["first_step_s"], "a graph per layer")
                report(f"{depth} layers, {variant}: peak RSS", r["peak_rss_gb"], "GB",
                       r["peak_rss_gb"] / apart["peak_rss_gb"], "a graph per layer")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 8, 16])
    parser.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(int(args.worker[0]), args.worker[1])), flush=True)
        return
    from benchmarks.__main__ import report

    print(f"{CONFIG}, whole step compiled; the losses of both variants equal at every depth")
    run(report, args.layers)


if __name__ == "__main__":
    main()
