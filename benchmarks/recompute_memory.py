"""Activation memory and step time of activation recompute (training/recompute.py) on configs/qwen3_bench.yaml.

Each variant trains a few steps in a process of its own (one process's peak RSS is its own): no recompute, full
recompute (every layer) and selective (every layer's attention core). The activation memory of a variant is its
peak RSS over the steps minus its RSS once the model, its weights and the optimizer state are built (what the step
adds: activations, gradients and what MindSpore's pool keeps); the step time is the median of the steps after the
first. Recompute runs eagerly (``training.recompute.RECOMPUTE_IS_EAGER``), so every variant runs the eager step
and the ratios compare like with like. Targets (issue 38): full ≤ 0.4× the activation memory without recompute, its
step time ≤ 1.35×. The step times are taken under benchmarks/contention.py's LoadWatch: under competition from other
processes they are reported as not valid (the memory is not).

A smoke run: one layer, 64 tokens, one sample, 2 steps per variant.

``python -m benchmarks.recompute_memory [--seq 2048] [--batch 4] [--steps 3] [--layers N]``
"""
from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.contention import LoadWatch
from benchmarks.suite import Bench, at_most, standalone

PROJECT_ROOT = Path(__file__).resolve().parent.parent
VARIANTS = {"none": [],
            "full": ["recompute.mode=full", "recompute.full_recompute_layer=true"],
            "selective": ["recompute.mode=select", "recompute.select_module={self_attention.core_attention: true}"]}
TARGETS = {"full": (at_most(0.4), at_most(1.35))}  # activation memory, step time: multiples of no recompute's
SMOKE = {"seq": 64, "batch": 1, "steps": 2, "layers": 1}


def _rss_bytes() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS"))


def worker(variant: str, seq: int, batch: int, steps: int, layers: int | None, out: str) -> None:
    """Train ``steps`` steps of the variant (``layers``: None as configured); write its RSS before the first step,
    its peak and its step times."""
    from training.config import load_config
    from training.parallel.mesh import World
    from training.reporting import Reporter
    from training.step import configure_runtime
    from training.trainer import Trainer

    config = load_config(PROJECT_ROOT / "configs/qwen3_bench.yaml", [
        f"train_dataset.dataloader.config.seq_length={seq}", f"model.max_position_embeddings={seq}",
        f"training.local_batch_size={batch}", f"training.global_batch_size={batch}", f"training.steps={steps}",
        "fast_step.compile=false", *([f"model.num_hidden_layers={layers}"] if layers else []), *VARIANTS[variant]])
    configure_runtime(config)
    with tempfile.TemporaryDirectory() as run_dir:
        trainer = Trainer(config, World(0, 1), Path(run_dir), Reporter(Path(run_dir) / "metrics.jsonl", enabled=False))
        built = _rss_bytes()
        times, cpu, losses = [], [], []
        for _ in range(steps):
            start, cpu_start = time.perf_counter(), time.process_time()
            losses.append(trainer.train_step()["loss"])
            times.append(time.perf_counter() - start)
            cpu.append(time.process_time() - cpu_start)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    Path(out).write_text(json.dumps({"built": built, "peak": peak, "times": times, "cpu": cpu, "losses": losses}))


def measure(variant: str, seq: int, batch: int, steps: int, layers: int | None) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        subprocess.run([sys.executable, "-m", "benchmarks.recompute_memory", "--worker", variant, "--seq", str(seq),
                        "--batch", str(batch), "--steps", str(steps), *(["--layers", str(layers)] if layers else []),
                        "--out", out.name], cwd=PROJECT_ROOT, check=True)
        return json.loads(Path(out.name).read_text())


def compare(bench: Bench, seq: int, batch: int, steps: int, layers: int | None = None) -> None:
    with LoadWatch() as watch:  # the variants one after another, each a process of its own
        results = {variant: measure(variant, seq, batch, steps, layers) for variant in VARIANTS}
        for variant, result in results.items():
            for seconds in result["cpu"][1:] or result["cpu"]:
                watch.cpu(variant, seconds)
    print(f"qwen3_bench{f' at {layers} layers' if layers else ''}, seq {seq} x batch {batch}, eager, {steps} steps "
          "per variant", flush=True)
    base = results["none"]
    base_activations = base["peak"] - base["built"]
    base_time = statistics.median(base["times"][1:] or base["times"])
    for variant, result in results.items():
        if result["losses"] != base["losses"]:
            raise AssertionError(f"{variant}: the losses differ from no recompute's: {result['losses']} vs "
                                 f"{base['losses']}")
        activations = result["peak"] - result["built"]
        step = statistics.median(result["times"][1:] or result["times"])
        memory_target, time_target = TARGETS.get(variant, ((), ()))
        bench.report(f"{variant} recompute activation memory", activations / 2**20, "MiB",
                     None if variant == "none" else activations / base_activations, "no recompute's",
                     target=memory_target)
        bench.report(f"{variant} recompute step", step, "s", None if variant == "none" else step / base_time,
                     "no recompute's", target=time_target, watch=watch)
    print("the losses of every variant were equal", flush=True)


def run(bench: Bench) -> None:
    compare(bench, **SMOKE) if bench.smoke else compare(bench, seq=2048, batch=4, steps=3)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--layers", type=int, help="decoder layers (default: as configured)")
    parser.add_argument("--worker", choices=VARIANTS)
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.worker, args.seq, args.batch, args.steps, args.layers, args.out)
        return 0
    with standalone("recompute_memory") as bench:
        compare(bench, args.seq, args.batch, args.steps, args.layers)
    return 0


if __name__ == "__main__":
    sys.exit(main())
