"""Activation memory and step time of activation recompute (training/recompute.py) on configs/qwen3_bench.yaml.

Each variant trains a few steps in a process of its own (one process's peak RSS is its own): no recompute, full
recompute (every layer) and selective (every layer's attention core), with the eager step; then no recompute and full
recompute with the compiled step (``fast_step.compile``; selective recompute steps eagerly there). The activation
memory of a variant is its peak RSS over the steps minus its RSS once the model, its weights and the optimizer state
are built (what the step adds: activations, gradients, what MindSpore's pool keeps and, compiled, what compiling
holds); the step time is the median of the steps after the first. Each ratio compares a variant with no recompute in
the same step mode. Targets (issue 38): full ≤ 0.4× the activation memory without recompute, its step time ≤ 1.35×.
The step times are taken under benchmarks/contention.py's LoadWatch: under competition from other processes they are
reported as not valid (the memory is not).

A smoke run: one layer, 64 tokens, one sample, 2 steps per variant, the eager step only.

``python -m benchmarks.recompute_memory [--seq 2048] [--batch 4] [--steps 3] [--layers N] [--modes eager|compiled]``
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
# the variants each step mode runs: a compiled run asking for selective recompute steps eagerly (training.recompute)
MODES = {"eager": tuple(VARIANTS), "compiled": ("none", "full")}
TARGETS = {"full": (at_most(0.4), at_most(1.35))}  # activation memory, step time: multiples of no recompute's
SMOKE = {"seq": 64, "batch": 1, "steps": 2, "layers": 1}


def _rss_bytes() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS"))


def worker(variant: str, mode: str, seq: int, batch: int, steps: int, layers: int | None, out: str) -> None:
    """Train ``steps`` steps of the variant in step ``mode`` (``layers``: None as configured); write its RSS before
    the first step, its peak and its step times."""
    from training.config import load_config
    from training.parallel.mesh import World
    from training.reporting import Reporter
    from training.step import configure_runtime
    from training.trainer import Trainer

    config = load_config(PROJECT_ROOT / "configs/qwen3_bench.yaml", [
        f"train_dataset.dataloader.config.seq_length={seq}", f"model.max_position_embeddings={seq}",
        f"training.local_batch_size={batch}", f"training.global_batch_size={batch}", f"training.steps={steps}",
        f"fast_step.compile={str(mode == 'compiled').lower()}", *VARIANTS[variant],
        *([f"model.num_hidden_layers={layers}"] if layers else [])])
    configure_runtime(config)
    with tempfile.TemporaryDirectory() as run_dir:
        trainer = Trainer(config, World(0, 1), Path(run_dir), Reporter(Path(run_dir) / "metrics.jsonl", enabled=False))
        if (mode == "compiled") != (" compiled" in trainer.step_mode.split(",")[0]):
            raise RuntimeError(f"{mode} {variant}: the trainer chose another step: {trainer.step_mode}")
        built = _rss_bytes()
        times, cpu, losses = [], [], []
        for _ in range(steps):
            start, cpu_start = time.perf_counter(), time.process_time()
            losses.append(trainer.train_step()["loss"])
            times.append(time.perf_counter() - start)
            cpu.append(time.process_time() - cpu_start)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    Path(out).write_text(json.dumps({"built": built, "peak": peak, "times": times, "cpu": cpu, "losses": losses}))


def measure(variant: str, mode: str, seq: int, batch: int, steps: int, layers: int | None) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        subprocess.run([sys.executable, "-m", "benchmarks.recompute_memory", "--worker", variant, "--mode", mode,
                        "--seq", str(seq),
                        "--batch", str(batch), "--steps", str(steps), *(["--layers", str(layers)] if layers else []),
                        "--out", out.name], cwd=PROJECT_ROOT, check=True)
        return json.loads(Path(out.name).read_text())


def compare(bench: Bench, seq: int, batch: int, steps: int, layers: int | None = None,
            modes: tuple[str, ...] = tuple(MODES)) -> None:
    for mode in modes:
        with LoadWatch() as watch:  # the variants one after another, each a process of its own
            results = {variant: measure(variant, mode, seq, batch, steps, layers) for variant in MODES[mode]}
            for variant, result in results.items():
                for seconds in result["cpu"][1:] or result["cpu"]:
                    watch.cpu(f"{mode} {variant}", seconds)
        print(f"qwen3_bench{f' at {layers} layers' if layers else ''}, seq {seq} x batch {batch}, {mode} step, "
              f"{steps} steps per variant", flush=True)
        report(bench, mode, results, watch)


def report(bench: Bench, mode: str, results: dict[str, dict], watch: LoadWatch) -> None:
    """Each variant's activation memory and step time against no recompute's in the same step ``mode``."""
    base = results["none"]
    base_activations = base["peak"] - base["built"]
    base_time = statistics.median(base["times"][1:] or base["times"])
    for variant, result in results.items():
        if result["losses"] != base["losses"]:
            raise AssertionError(f"{mode} {variant}: the losses differ from no recompute's: {result['losses']} vs "
                                 f"{base['losses']}")
        activations = result["peak"] - result["built"]
        step = statistics.median(result["times"][1:] or result["times"])
        memory_target, time_target = TARGETS.get(variant, ((), ()))
        bench.report(f"{mode} {variant} recompute activation memory", activations / 2**20, "MiB",
                     None if variant == "none" else activations / base_activations, f"{mode} no recompute's",
                     target=memory_target)
        bench.report(f"{mode} {variant} recompute step", step, "s", None if variant == "none" else step / base_time,
                     f"{mode} no recompute's", target=time_target, watch=watch)
    print(f"the losses of every {mode} variant were equal", flush=True)


def run(bench: Bench) -> None:
    compare(bench, **SMOKE, modes=("eager",)) if bench.smoke else compare(bench, seq=2048, batch=4, steps=3)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--layers", type=int, help="decoder layers (default: as configured)")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES), help="step modes (default: both)")
    parser.add_argument("--worker", choices=VARIANTS)
    parser.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.worker, args.mode, args.seq, args.batch, args.steps, args.layers, args.out)
        return 0
    with standalone("recompute_memory") as bench:
        compare(bench, args.seq, args.batch, args.steps, args.layers, tuple(args.modes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
