"""Whether other processes competed with a benchmark's measurement, so that its ratios are trusted or refused.

A paired benchmark times variants against each other in turn; another job on the same cores slows the variants
unequally (PyTorch eager slowed 4x under contention where MindSpore did not: issue 38), so a ratio measured then
is not a measurement. ``LoadWatch`` brackets the measurement and records:
- the CPU the other processes of the machine used, as average busy cores: all CPU time /proc/stat counts, minus
  this process tree's (this process, its reaped children, its live descendants), over ``QUIET_CHECK_SECONDS``
  just before the measurement and over the measurement;
- the machine's 1-minute load average before and after (printed only);
- each variant's CPU seconds per step (``cpu`` for what a worker measured itself, ``time`` to run and measure
  a variant here: this process tree's CPU, so pools and subprocesses count).
Competed means: other processes keeping more than ``SLACK`` cores busy beyond the cores the run leaves free,
just before the measurement or over it. Load averages are not judged: they lag by minutes and count the run's
own runnable threads, and MindSpore keeps more of them than it has cores. The throughput benchmark's rounds
(qwen3_bench, 2026-12-07) ended at load 2.9-3.0 on 2 cores while a sampler of each process's CPU every 2 s saw its
workers take turns at 2.0 cores in all and every other process at 0.01; and `python -m benchmarks --only
context_parallel pipeline_bubble expert_parallel` started expert_parallel at load 3.8, pipeline_bubble's, with its
processes gone (others 0.01 cores). What load others add, they add as CPU the kernel shares with them. Figures
measured under a watch that saw competition are printed as not valid (benchmarks/suite.py), whatever their value.
"""
from __future__ import annotations

import dataclasses
import os
import resource
import statistics
import time
from pathlib import Path

# half a core: a load average wobbles by that much around a run's own threads, and short system work
# (page cache writeback, a cron job) stays under it
SLACK = 0.5
# how long a watch samples the other processes' CPU before the measurement starts: a job busy then is caught even
# when the measurement is long enough to average its share below SLACK
QUIET_CHECK_SECONDS = 1.0
_TICK = os.sysconf("SC_CLK_TCK")


def machine_cores() -> int:
    return len(os.sched_getaffinity(0))


def _machine_busy_seconds() -> float:
    """CPU seconds every core of the machine spent busy since boot (/proc/stat's first line, idle and iowait
    left out)."""
    with open("/proc/stat") as stat:
        fields = [int(v) for v in stat.readline().split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    return (user + nice + system + irq + softirq + steal) / _TICK


def tree_cpu_seconds() -> float:
    """CPU seconds of this process, its reaped descendants and its live descendants (a live one's reaped
    children included: they are in its cutime until it is reaped itself)."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    reaped = resource.getrusage(resource.RUSAGE_CHILDREN)
    total = own.ru_utime + own.ru_stime + reaped.ru_utime + reaped.ru_stime
    children: dict[int, list[tuple[int, float]]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # exited meanwhile
            continue
        # after the name: state, ppid (index 1), ..., utime, stime, cutime, cstime (indices 11-14)
        children.setdefault(int(fields[1]), []).append((int(stat.parent.name),
                                                        sum(int(v) for v in fields[11:15]) / _TICK))
    todo = [os.getpid()]
    while todo:
        for pid, seconds in children.get(todo.pop(), []):
            total += seconds
            todo.append(pid)
    return total


@dataclasses.dataclass
class Load:
    """What a LoadWatch saw; plain data, so a figure carries it into the run's figures file."""
    cores: int            # the cores the measured run uses
    machine_cores: int
    load_before: float    # 1-minute load averages
    load_after: float
    others_cores: float   # average cores other processes kept busy during the watch
    seconds: float
    cpu_per_step: dict[str, float]  # variant -> median CPU seconds per step
    others_before: float = 0.0  # the same over QUIET_CHECK_SECONDS before it (0 in figures recorded before it was)

    @property
    def competed(self) -> bool:
        free = self.machine_cores - self.cores
        return max(self.others_before, self.others_cores) > free + SLACK

    def describe(self) -> str:
        cpu = ", ".join(f"{variant} {seconds:.3g}" for variant, seconds in self.cpu_per_step.items())
        verdict = ("OTHER PROCESSES COMPETED: the ratios are not valid" if self.competed
                   else "no other process competed")
        return (f"other processes {self.others_before:.2f} cores busy before, {self.others_cores:.2f} over "
                f"{self.seconds:.0f} s, of {self.machine_cores} cores, the run uses {self.cores}; load "
                f"{self.load_before:.1f} before, {self.load_after:.1f} after (1 min)"
                + (f"; CPU s per step: {cpu}" if cpu else "") + f" — {verdict}")

    def short(self) -> str:
        """What ``competed`` judged: the other processes' busy cores before and during the measurement."""
        return f"others {self.others_before:.1f} before, {self.others_cores:.1f} during, of {self.machine_cores} cores"


def _others_cores(machine_busy: float, ours: float, seconds: float) -> float:
    """Average cores the machine's other processes kept busy: its busy CPU seconds less this tree's, per second."""
    return max(0.0, (machine_busy - ours) / max(seconds, 1e-9))


class LoadWatch:
    """``with LoadWatch(cores) as watch:`` around a measurement; ``watch.load`` after it."""

    def __init__(self, cores: int | None = None):
        self.cores = min(cores or machine_cores(), machine_cores())
        self._cpu: dict[str, list[float]] = {}
        self.load: Load | None = None

    def __enter__(self) -> LoadWatch:
        self._load_before = os.getloadavg()[0]
        busy, ours, started = _machine_busy_seconds(), tree_cpu_seconds(), time.perf_counter()
        time.sleep(QUIET_CHECK_SECONDS)
        self._started = time.perf_counter()
        self._busy, self._ours = _machine_busy_seconds(), tree_cpu_seconds()
        self._others_before = _others_cores(self._busy - busy, self._ours - ours, self._started - started)
        return self

    def cpu(self, variant: str, cpu_seconds: float, steps: int = 1) -> None:
        """A variant's CPU seconds over ``steps`` steps, as a worker measured them."""
        self._cpu.setdefault(variant, []).append(cpu_seconds / steps)

    def call(self, variant: str, run, steps: int = 1):
        """Run ``run()`` (``steps`` steps of ``variant``); its wall seconds and what it returned. This process
        tree's CPU seconds meanwhile go to the variant."""
        cpu = tree_cpu_seconds()
        started = time.perf_counter()
        result = run()
        seconds = time.perf_counter() - started
        self.cpu(variant, tree_cpu_seconds() - cpu, steps)
        return seconds, result

    def time(self, variant: str, run, steps: int = 1) -> float:
        """``call``'s wall seconds."""
        return self.call(variant, run, steps)[0]

    def alternate(self, variants: dict, rounds: int) -> dict[str, list[float]]:
        """Each round runs every variant (name -> its step) once, in reverse order every other round, so that a
        drift of the machine's speed falls on all alike; each variant's wall seconds, round by round."""
        seconds = {name: [] for name in variants}
        for round_index in range(rounds):
            for name in (list(variants) if round_index % 2 == 0 else list(variants)[::-1]):
                seconds[name].append(self.time(name, variants[name]))
        return seconds

    def __exit__(self, *exc) -> None:
        seconds = time.perf_counter() - self._started
        others = _others_cores(_machine_busy_seconds() - self._busy, tree_cpu_seconds() - self._ours, seconds)
        self.load = Load(cores=self.cores, machine_cores=machine_cores(), load_before=self._load_before,
                         load_after=os.getloadavg()[0], others_cores=others, seconds=seconds,
                         cpu_per_step={v: statistics.median(s) for v, s in self._cpu.items()},
                         others_before=self._others_before)
        if exc[0] is None:
            print(f"   {self.load.describe()}", flush=True)
