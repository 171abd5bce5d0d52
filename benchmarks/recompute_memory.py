"""Activation memory and step time of activation recompute (training/recompute.py) on configs/qwen3_bench.yaml.

Each variant trains a few steps in a process of its own (one process's peak RSS is its own): no recompute, full
recompute (every layer) and selective (every layer's attention core). The activation memory of a variant is its
peak RSS over the steps minus its RSS once the model, its weights and the optimizer state are built (what the step
adds: activations, gradients and what MindSpore's pool keeps); the step time is the median of the steps after the
first. Recompute runs eagerly (``training.recompute.RECOMPUTE_IS_EAGER``), so every variant runs the eager step
and the ratios compare like with like. Targets (issue 38): full ≤ 0.4× the activation memory without recompute, its
step time ≤ 1.35×. The load average before and after is printed; when it exceeds the machine's cores, other
processes compete and the ratios are printed as not valid.

``python -m benchmarks.recompute_memory [--seq 2048] [--batch 4] [--steps 3]``
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parent.parent
VARIANTS = {"none": [],
            "full": ["recompute.mode=full", "recompute.full_recompute_layer=true"],
            "selective": ["recompute.mode=select", "recompute.select_module={self_attention.core_attention: true}"]}
TARGETS = {"full": (0.4, 1.35)}  # activation memory, step time: at most these multiples of no recompute


def _rss_bytes() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS"))


def worker(variant: str, seq: int, batch: int, steps: int, out: str) -> None:
    """Train ``steps`` steps of the variant; write its RSS before the first step, its peak and its step times."""
    sys.path.insert(0, str(PROJECT_ROOT))
    from training.config import load_config
    from training.parallel.mesh import World
    from training.reporting import Reporter
    from training.step import configure_runtime
    from training.trainer import Trainer

    config = load_config(PROJECT_ROOT / "configs/qwen3_bench.yaml", [
        f"train_dataset.dataloader.config.seq_length={seq}", f"model.max_position_embeddings={seq}",
        f"training.local_batch_size={batch}", f"training.global_batch_size={batch}", f"training.steps={steps}",
        "fast_step.compile=false", *VARIANTS[variant]])
    configure_runtime(config)
    with tempfile.TemporaryDirectory() as run_dir:
        trainer = Trainer(config, World(0, 1), Path(run_dir), Reporter(Path(run_dir) / "metrics.jsonl", enabled=False))
        built = _rss_bytes()
        times, losses = [], []
        for _ in range(steps):
            start = time.perf_counter()
            losses.append(trainer.train_step()["loss"])
            times.append(time.perf_counter() - start)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    Path(out).write_text(json.dumps({"built": built, "peak": peak, "times": times, "losses": losses}))


def measure(variant: str, seq: int, batch: int, steps: int) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        subprocess.run([sys.executable, "-m", "benchmarks.recompute_memory", "--worker", variant, "--seq", str(seq),
                        "--batch", str(batch), "--steps", str(steps), "--out", out.name], cwd=PROJECT_ROOT, check=True)
        return json.loads(Path(out.name).read_text())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--worker", choices=VARIANTS)
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.worker, args.seq, args.batch, args.steps, args.out)
        return 0
    cores = os.cpu_count() or 1
    load_before = os.getloadavg()[0]
    results = {variant: measure(variant, args.seq, args.batch, args.steps) for variant in VARIANTS}
    load_after = os.getloadavg()[0]
    contended = max(load_before, load_after) > cores
    print(f"qwen3_bench, seq {args.seq} x batch {args.batch}, eager, {args.steps} steps per variant; load average "
          f"{load_before:.1f} before, {load_after:.1f} after, {cores} cores")
    base = results["none"]
    base_activations = base["peak"] - base["built"]
    base_time = statistics.median(base["times"][1:] or base["times"])
    for variant, result in results.items():
        activations = result["peak"] - result["built"]
        step = statistics.median(result["times"][1:] or result["times"])
        same = "losses equal" if result["losses"] == base["losses"] else f"LOSSES DIFFER: {result['losses']}"
        line = (f"{variant:<10} activations {activations / 2**20:8,.0f} MiB (peak {result['peak'] / 2**20:,.0f}, "
                f"built {result['built'] / 2**20:,.0f}), step {step:7.2f} s, {same}")
        if variant != "none":
            memory_ratio, time_ratio = activations / base_activations, step / base_time
            target = TARGETS.get(variant)
            line += f"; {memory_ratio:.2f}x the activation memory"
            line += f" (target <= {target[0]}x)" if target else ""
            if contended:
                line += f"; step time {time_ratio:.2f}x NOT VALID (load above {cores} cores: other processes compete)"
            else:
                line += f"; step time {time_ratio:.2f}x" + (f" (target <= {target[1]}x)" if target else "")
        print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
