"""Two checkouts of Kiln, one training step against the other, on the same machine at the same time: how a code
change moves the step's time and peak memory.

``python -m benchmarks.paired_step BASE [NEW] [--config CONFIG] [--rounds 8] [--steps 2] [OVERRIDE ...]``

BASE and NEW are Kiln checkouts (NEW: this one), typically ``git worktree add --detach /tmp/base <commit>``. Each
side is one warm process, its own checkout first on ``sys.path``, that builds ``benchmarks.throughput.KilnWorker``
from ``--config`` and the overrides and compiles (2 steps). Then the sides take turns, ``--steps`` steps a turn for
``--rounds`` rounds, the order reversed every other round, so a drift of the machine's speed falls on both alike.
Printed: each side's median wall and CPU seconds per step, its peak RSS (``ru_maxrss``) and its losses, and the
new/base ratios. The ratios are taken under benchmarks/contention.py's LoadWatch: when other processes compete
for the cores they are printed as not valid (the memory is not). A change meant to keep the values shows the same
losses on both sides.

Not part of `make bench` (it measures a change, not Kiln); docs/training.md's table of the model's ops quotes
figures it reproduces.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parent.parent
WARM_STEPS = 2


def serve(config: str, overrides: list[str]) -> None:
    """A side's process: build and warm up, then per line of stdin (a step count) train that many steps and answer
    one JSON line: wall and CPU seconds, peak RSS in MiB, the losses."""
    from benchmarks.throughput import KilnWorker

    worker = KilnWorker(config, overrides)
    worker.steps(WARM_STEPS)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cpu = time.process_time()
        wall = worker.steps(int(line))
        print(json.dumps({"wall": wall, "cpu": time.process_time() - cpu,
                          "peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                          "losses": worker.losses}), flush=True)


class Side:
    """One checkout's serving process."""

    def __init__(self, name: str, checkout: Path, config: str, overrides: list[str]):
        self.name = name
        env = dict(os.environ, PYTHONPATH=str(checkout), MS_DEV_HOST_BLOCKING_RUN="1")
        # this file run as a script, so a base checkout from before it existed serves too; the checkout's own
        # benchmarks.throughput and training come first on the path
        self.process = subprocess.Popen([sys.executable, __file__, "--serve", config, *overrides], cwd=checkout,
                                        env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.turns: list[dict] = []

    def answer(self) -> dict:
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.name}: its process ended (exit status {self.process.wait()}); its error is "
                               f"above")
        return json.loads(line)

    def train(self, steps: int) -> dict:
        self.process.stdin.write(f"{steps}\n")
        self.process.stdin.flush()
        turn = self.answer()
        self.turns.append(turn)
        return turn

    def median(self, key: str, steps: int) -> float:
        return statistics.median(turn[key] / steps for turn in self.turns)

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait()


def compare(base: Path, new: Path, config: str, overrides: list[str], rounds: int, steps: int) -> dict:
    """Both sides' figures and the new/base ratios (``valid``: no other process competed)."""
    from benchmarks.contention import LoadWatch

    sides = [Side("base", base, config, overrides), Side("new", new, config, overrides)]
    try:
        for side in sides:
            side.answer()  # built and warm
        with LoadWatch() as watch:
            for round_index in range(rounds):
                for side in (sides if round_index % 2 == 0 else sides[::-1]):
                    watch.cpu(side.name, side.train(steps)["cpu"], steps)
    finally:
        for side in sides:
            side.close()
    figures = {side.name: {"wall_per_step": side.median("wall", steps), "cpu_per_step": side.median("cpu", steps),
                           "peak_mib": side.turns[-1]["peak_mib"], "losses": side.turns[-1]["losses"]}
               for side in sides}
    old, now = figures["base"], figures["new"]
    return {**figures, "wall_ratio": now["wall_per_step"] / old["wall_per_step"],
            "cpu_ratio": now["cpu_per_step"] / old["cpu_per_step"], "valid": not watch.load.competed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("base", type=Path, help="the checkout to compare against")
    parser.add_argument("new", type=Path, nargs="?", default=PROJECT_ROOT, help="default: this checkout")
    parser.add_argument("--config", default="configs/qwen3_bench.yaml", help="relative to each checkout")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--steps", type=int, default=2, help="steps per turn")
    args, overrides = parser.parse_known_args()
    for checkout in (args.base, args.new):
        if not (checkout / "benchmarks/throughput.py").is_file():
            parser.error(f"{checkout} is not a Kiln checkout (no benchmarks/throughput.py)")
    result = compare(args.base.resolve(), args.new.resolve(), args.config, overrides, args.rounds, args.steps)
    for name in ("base", "new"):
        side = result[name]
        print(f"{name:4}  wall {side['wall_per_step']:.3f} s/step  CPU {side['cpu_per_step']:.3f} s/step  "
              f"peak RSS {side['peak_mib']:,.0f} MiB  losses {' '.join(f'{x:.7g}' for x in side['losses'])}")
    verdict = "" if result["valid"] else "  (NOT VALID: other processes competed)"
    print(f"new/base  wall {result['wall_ratio']:.3f}x  CPU {result['cpu_ratio']:.3f}x{verdict}")
    print("losses: " + ("the same" if result["base"]["losses"] == result["new"]["losses"] else "DIFFERENT"))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve"]:
        sys.path.pop(0)  # this file's directory: its modules' names must not shadow installed ones
        serve(sys.argv[2], sys.argv[3:])
    else:
        main()
