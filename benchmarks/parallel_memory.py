"""Per-rank memory and step time of each data-parallel strategy at 1, 2 and 4 ranks (msrun on CPU).

For configs/qwen3_tiny.yaml widened (hidden 256, 4 layers), each of replicated data parallelism (DP), ZeRO-1,
ZeRO-2 and ZeRO-3 trains a few steps per world size; rank 0 reports the bytes it holds of weights, of gradients
(the larger of what the backward hands back and what the reduction leaves), and of optimizer state, against
DP's at the same world size (ZeRO-3 at N ranks should hold about 1/N of each), and the median step time
against DP's. ZeRO-2's reduce-scatter runs after the backward here, so its gradients are whole until then, as
ZeRO-1's; only ZeRO-3's backward yields chunks. "ZeRO-3 never" keeps each unit's gathered weights until its
backward instead of gathering them again there: its step time shows what re-gathering costs. A smoke run: one layer,
32 tokens, 2 samples a step, at 2 ranks (one msrun launch: a world of one runs the same worker in one process).
Run as a script by msrun:
``python -m benchmarks.parallel_memory OUT SHARD STEPS [MODEL OVERRIDE ...]`` (default: WIDER).
"""
from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import smoke_model
from benchmarks.contention import LoadWatch
from benchmarks.suite import Bench

PROJECT_ROOT = Path(__file__).resolve().parent.parent
STRATEGIES = {"DP": ["parallelism.data_parallel_shard=1"],
              "ZeRO-1": ["parallelism.data_parallel_shard_strategy=optim"],
              "ZeRO-2": ["parallelism.data_parallel_shard_strategy=optim_grads"],
              "ZeRO-3": ["parallelism.data_parallel_shard_strategy=optim_grads_params"],
              # weights kept gathered from forward to backward: one all-gather per unit less, more memory at the peak
              "ZeRO-3 never": ["parallelism.data_parallel_shard_strategy=optim_grads_params",
                               "parallelism.reshard_after_forward_policy=never"]}
WIDER = ["model.hidden_size=256", "model.intermediate_size=768", "model.num_hidden_layers=4", "model.head_dim=64",
         "model.num_attention_heads=4", "model.num_key_value_heads=2", "training.local_batch_size=1",
         "training.global_batch_size=4"]
# eager steps: a compiled step keeps its gradients inside the graph, where no hook sees their bytes (with one rank
# the whole step compiles, and reduce_gradients is never called from the host)
EAGER = "fast_step.compile=false"
STEPS = 4
WORLDS = (1, 2, 4)
SMOKE_STEPS, SMOKE_WORLDS = 2, (2,)
SMOKE_MODEL = [*smoke_model(1), "training.local_batch_size=1", "training.global_batch_size=2"]


def _config(shard: str, overrides: list[str], steps: int = STEPS, model: list[str] = WIDER):
    """configs/qwen3_tiny.yaml at ``model``'s size (default: WIDER) on ``shard``, never saving."""
    from benchmarks import blend_settings
    from resources.tokenizer import SPECIAL_IDS
    from training.config import load_config

    return load_config(PROJECT_ROOT / "configs/qwen3_tiny.yaml", [
        f"train_dataset.dataloader.config.data_path=[1.0, '{shard}']",
        f"train_dataset.dataloader.config.eod={SPECIAL_IDS['eos']}",
        f"train_dataset.dataloader.config.pad={SPECIAL_IDS['pad']}", *blend_settings(), *model,
        f"training.steps={steps}", "checkpoint.enable_save=false", *overrides])


def _measure(trainer, steps: int) -> dict:
    """Train ``steps`` steps; the bytes this rank holds, the median step time and CPU seconds after the first."""
    reduce = trainer.parallel.reduce_gradients
    held = {}

    def keep(grads):
        reduced = reduce(grads)
        held["gradients"] = max(sum(int(g.nbytes) for g in gs) for gs in (grads, reduced))
        return reduced
    trainer.parallel.reduce_gradients = keep
    times, cpu = [], []
    for _ in range(steps):
        started, cpu_started = time.perf_counter(), time.process_time()
        trainer.train_step()
        times.append(time.perf_counter() - started)
        cpu.append(time.process_time() - cpu_started)
    return {"weights": sum(int(p.nbytes) for p in trainer.params), "gradients": held["gradients"],
            "optimizer": sum(a.nbytes for a in trainer.optimizer.state_dict().values()),
            "step_s": statistics.median(times[1:]), "cpu_s": statistics.median(cpu[1:])}


def worker(out: str, shard: str, steps: str, *model: str) -> None:
    """One msrun worker (or a single process): every strategy in turn, at ``model``'s size (none given: WIDER)."""
    from training.parallel.mesh import init_world
    from training.reporting import Reporter
    from training.step import configure_runtime
    from training.trainer import Trainer

    model = list(model) or WIDER
    configure_runtime(_config(shard, [], model=model))
    world = init_world()
    figures = {}
    for name, overrides in STRATEGIES.items():
        trainer = Trainer(_config(shard, [*overrides, EAGER], int(steps), model), world, Path(out) / name,
                          Reporter(None, enabled=False))
        figures[name] = _measure(trainer, int(steps))
    if world.is_main:
        (Path(out) / f"world{world.size}.json").write_text(json.dumps(figures))


def measure(bench: Bench, shard: Path, worlds, steps: int, model: list[str] = WIDER) -> None:
    from training.launch import run_on_local_workers

    with tempfile.TemporaryDirectory(prefix="kiln-bench-parallel-") as tmp:
        for world in worlds:
            command = ["-m", "benchmarks.parallel_memory", tmp, str(shard), str(steps), *model]
            with LoadWatch(cores=world) as watch:
                if world == 1:
                    subprocess.run([sys.executable, *command], check=True, cwd=PROJECT_ROOT)
                else:
                    run_on_local_workers(command, Path(tmp) / f"log{world}", world)
                figures = json.loads((Path(tmp) / f"world{world}.json").read_text())
                for name, f in figures.items():
                    watch.cpu(name, f["cpu_s"])  # rank 0's
            dp = figures["DP"]
            for name, f in figures.items():
                for kind in ("weights", "gradients", "optimizer"):  # bytes: the load does not move them
                    bench.report(f"{name} {kind}, {world} rank(s)", f[kind] / 2**20, "MiB per rank",
                                 f[kind] / dp[kind], "DP's")
                bench.report(f"{name} step, {world} rank(s)", f["step_s"] * 1000, "ms", f["step_s"] / dp["step_s"],
                             "DP's step", watch=watch)


def run(bench: Bench) -> None:
    if bench.smoke:
        measure(bench, bench.shard(), SMOKE_WORLDS, SMOKE_STEPS, SMOKE_MODEL)
    else:
        measure(bench, bench.shard(), WORLDS, STEPS)


if __name__ == "__main__":
    worker(*sys.argv[1:])
