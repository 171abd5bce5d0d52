"""What a benchmark of the suite gets (``Bench``), the figures it reports, their targets and the summary table.

Every figure goes to the run's figures file (JSON lines), from which ``python -m benchmarks`` prints the summary
and the smoke test (tests/test_benchmarks_smoke.py) checks that each benchmark reported finite figures.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import operator
import tempfile
from pathlib import Path

from benchmarks.contention import Load, LoadWatch


@dataclasses.dataclass(frozen=True)
class Target:
    """A bound an issue or a doc states for a figure: on its ratio to the reference (``of="ratio"``) or on its
    value."""
    relation: str  # ">=" or "<="
    bound: float
    of: str = "ratio"

    def met(self, figure: Figure) -> bool:
        number = figure.ratio if self.of == "ratio" else figure.value
        return number is not None and {">=": operator.ge, "<=": operator.le}[self.relation](number, self.bound)

    def __str__(self) -> str:
        return f"{'' if self.of == 'ratio' else 'value '}{self.relation} {self.bound:g}"


def at_least(bound: float, of: str = "ratio") -> Target:
    return Target(">=", bound, of)


def at_most(bound: float, of: str = "ratio") -> Target:
    return Target("<=", bound, of)


@dataclasses.dataclass
class Figure:
    benchmark: str
    name: str
    value: float
    unit: str
    ratio: float | None = None
    reference: str = ""
    targets: tuple[Target, ...] = ()
    load: Load | None = None  # the watch its timings were taken under; None for what load cannot move (bytes)

    @property
    def valid(self) -> bool:
        return self.load is None or not self.load.competed

    def verdict(self) -> str:
        if not self.valid:
            return f"NOT VALID ({self.load.short()})"
        if not self.targets:
            return "no target"
        return "met" if all(t.met(self) for t in self.targets) else "MISSED"

    def line(self) -> str:
        digits = 2 if self.unit == "×" else 1  # a ratio's second decimal is what a target such as 0.95 x is judged by
        goal = "; target " + " and ".join(map(str, self.targets)) if self.targets else ""
        if not self.valid and self.ratio is None:
            suffix = "  (NOT VALID, other processes competed)"
        elif self.ratio is None:
            suffix = f"  (target {' and '.join(map(str, self.targets))})" if self.targets else ""
        elif self.valid:
            suffix = f"  ({self.ratio:.2f} × {self.reference}{goal})"
        else:
            suffix = f"  (ratio NOT VALID, other processes competed: {self.ratio:.2f} × {self.reference} measured)"
        return f"{self.name:<34} {self.value:>14,.{digits}f} {self.unit}{suffix}"

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, line: str) -> Figure:
        data = json.loads(line)
        data["targets"] = tuple(Target(**t) for t in data["targets"])
        data["load"] = Load(**data["load"]) if data["load"] else None
        return cls(**data)


class Bench:
    """One benchmark's handle on the run: ``report`` its figures, ``smoke`` (run at the smallest size that still
    runs every code path), ``work`` (a directory shared by the run's benchmarks), ``shard()``."""

    def __init__(self, benchmark: str, work: Path, figures_path: Path, smoke: bool = False):
        self.benchmark, self.work, self.figures_path, self.smoke = benchmark, work, figures_path, smoke

    def report(self, name: str, value: float, unit: str, ratio: float | None = None, reference: str = "", *,
               target: Target | tuple[Target, ...] = (), watch: LoadWatch | None = None) -> None:
        """Print and record one figure. ``watch``: the LoadWatch its timings were taken under (required for a
        time or a ratio of times; a figure under a watch that saw competition is printed as not valid)."""
        if watch is not None and watch.load is None:
            raise RuntimeError(f"{name}: reported inside its LoadWatch; report after the measurement")
        targets = target if isinstance(target, tuple) else (target,)
        if ratio is None and any(t.of == "ratio" for t in targets):
            # such a target could never be met: the summary would print MISSED whatever was measured
            raise ValueError(f"{name}: a target on the ratio of a figure reported without one; a figure that is "
                             f"itself a ratio takes its target on its value (of='value')")
        figure = Figure(self.benchmark, name, float(value), unit, None if ratio is None else float(ratio), reference,
                        targets, watch.load if watch else None)
        print(figure.line(), flush=True)
        with open(self.figures_path, "a") as out:
            out.write(figure.to_json() + "\n")

    def recorded(self, benchmark: str, name: str) -> float | None:
        """The value of a figure an earlier benchmark of this run reported, or None."""
        for figure in read_figures(self.figures_path):
            if (figure.benchmark, figure.name) == (benchmark, name):
                return figure.value
        return None

    def shard(self) -> Path:
        """The built-in source code corpus tokenized with Kiln's default tokenizer (as the demo chain does), built
        once per run in ``work``: the data the training benchmarks train on."""
        from benchmarks import builtin_shard
        from resources.tokenizer import TokenizerSettings

        prefix = self.work / "shard" / "shard_text_document"
        if not prefix.with_suffix(".idx").exists():
            # a smoke run's: 100 KB, enough samples for its few short steps, and a vocabulary its small corpus
            # fills, whose ids suit every model config (the test ones have 512)
            smoke = TokenizerSettings(vocab_size=512, sample_lines=2_000)
            builtin_shard(prefix.parent, 100_000 if self.smoke else 3_000_000, smoke if self.smoke else None)
        return prefix


@contextlib.contextmanager
def standalone(benchmark: str, smoke: bool = False):
    """A Bench for one benchmark run by itself (``python -m benchmarks.<name>``), in a temporary directory; the
    summary of its figures at the end."""
    with tempfile.TemporaryDirectory(prefix=f"kiln-bench-{benchmark}-") as tmp:
        bench = Bench(benchmark, Path(tmp), Path(tmp) / "figures.jsonl", smoke)
        yield bench
        print("\n" + summary(read_figures(bench.figures_path), {}), flush=True)


def read_figures(path: Path) -> list[Figure]:
    if not path.exists():
        return []
    return [Figure.from_json(line) for line in path.read_text().splitlines() if line.strip()]


def summary(figures: list[Figure], failed: dict[str, str]) -> str:
    """One table: every figure, its ratio, its target and whether it met it (or why it is not judged)."""
    rows = [("benchmark", "figure", "value", "ratio", "target", "verdict")]
    for f in figures:
        rows.append((f.benchmark, f.name, f"{f.value:,.{2 if f.unit == '×' else 1}f} {f.unit}",
                     "" if f.ratio is None else f"{f.ratio:.2f} × {f.reference}",
                     " and ".join(map(str, f.targets)) or "no target", f.verdict()))
    rows += [(name, "(did not run through)", "", "", "", f"FAILED: {reason}") for name, reason in failed.items()]
    caps = (18, 52, 22, 48, 22, 60)
    cells = [[cell if len(cell) <= cap else cell[:cap - 1] + "…" for cell, cap in zip(row, caps)] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(caps))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    judged = [f for f in figures if f.targets]
    counts = {v: sum(f.verdict().startswith(v) for f in judged) for v in ("met", "MISSED", "NOT VALID")}
    invalid = sum(not f.valid for f in figures)
    lines.append(f"{len(figures)} figures ({invalid} not valid under load), {len(judged)} with a target: "
                 f"{counts['met']} met, {counts['MISSED']} missed, {counts['NOT VALID']} not valid under load; "
                 f"{len(failed)} benchmark(s) failed")
    return "\n".join(lines)


def finite(figure: Figure) -> bool:
    return math.isfinite(figure.value) and (figure.ratio is None or math.isfinite(figure.ratio))
