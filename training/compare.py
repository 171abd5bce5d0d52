"""Runs side by side (`kiln compare`, the run_comparison asset): training loss, validation loss and bits per byte,
and downstream task scores of several runs against the tokens each had seen, as a table and a plot.

Tokens seen, not steps: runs with other batch sizes or sequence lengths line up by how much data they read.
Loss per token depends on the tokenizer; bits per byte and task scores do not, so they are what compares runs
trained on different data or tokenizers. A run is a directory under the runs root: its ``metrics.jsonl``
(step records with ``tokens_seen``, validation records) and its checkpoints' ``eval.json``.

The plot is SVG written here (one panel per metric, one line per run), inside an HTML page with the table: no
plotting library is installed in Kiln's environment, and a few polylines do not need one.
"""
from __future__ import annotations

import html
import json
from dataclasses import dataclass, field
from pathlib import Path

from training.reporting import read_records

COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf")


@dataclass
class RunCurves:
    """One run's curves, each a list of (tokens seen, value)."""
    name: str
    path: Path
    curves: dict[str, list[tuple[int, float]]] = field(default_factory=dict)

    def add(self, metric: str, tokens: int, value: float | None) -> None:
        if value is not None:
            self.curves.setdefault(metric, []).append((tokens, float(value)))

    def last(self, metric: str) -> float | None:
        points = self.curves.get(metric)
        return points[-1][1] if points else None


def find_run(run: str, runs_root: str | Path) -> Path:
    """``run`` as a directory, else as a run name under ``runs_root``; one holding no metrics.jsonl is a
    ValueError naming where it looked."""
    for candidate in (Path(run), Path(runs_root) / run):
        if (candidate / "metrics.jsonl").is_file():
            return candidate
    raise ValueError(f"run {run!r}: no metrics.jsonl in {run} or {Path(runs_root) / run}")


def read_run(path: Path) -> RunCurves:
    """The run's loss per training record, validation loss / bpb, and each evaluated checkpoint's held-out loss,
    bpb and task scores, by tokens seen (a step's tokens from the training record of that step)."""
    run = RunCurves(path.name, path)
    tokens_at: dict[int, int] = {}
    for record in read_records(path / "metrics.jsonl"):
        if "tokens_seen" in record and "loss" in record:
            tokens_at[record["step"]] = record["tokens_seen"]
            run.add("loss", record["tokens_seen"], record["loss"])
        elif "val_loss" in record and record["step"] in tokens_at:
            run.add("val_loss", tokens_at[record["step"]], record["val_loss"])
            run.add("val_bpb", tokens_at[record["step"]], record.get("val_bpb"))
    evaluations = sorted(path.glob("checkpoints/iteration_*/eval.json"))
    for sidecar in evaluations:
        record = json.loads(sidecar.read_text())
        step = record["checkpoint"]["step"]
        tokens = tokens_at.get(step, step * record["global_batch_size"] * record["seq_length"])
        run.add("eval_loss", tokens, record["loss"])
        run.add("eval_bpb", tokens, record.get("bpb"))
        for name, scores in (record.get("tasks") or {}).items():
            run.add(f"task {name}", tokens, scores["primary"])
        if record.get("tasks"):
            run.add("tasks mean", tokens, record["tasks_mean"]["primary"])
            run.add("tasks mean bpb", tokens, record["tasks_mean"]["bpb"])
    for points in run.curves.values():
        points.sort()
    return run


def metrics_of(runs: list[RunCurves]) -> list[str]:
    """Every metric any run has, the losses first, the tasks last."""
    order = ["loss", "val_loss", "val_bpb", "eval_loss", "eval_bpb", "tasks mean", "tasks mean bpb"]
    names = {m for run in runs for m in run.curves}
    return [m for m in order if m in names] + sorted(names - set(order))


def table(runs: list[RunCurves]) -> str:
    """Markdown: a row per metric, a column per run, each run's last value (at its most tokens)."""
    header = "| metric | " + " | ".join(run.name for run in runs) + " |"
    rows = [header, "|---|" + "---|" * len(runs),
            "| tokens seen | " + " | ".join(f"{max((t for c in run.curves.values() for t, _ in c), default=0):,}"
                                          for run in runs) + " |"]
    for metric in metrics_of(runs):
        rows.append(f"| {metric} | " + " | ".join("" if run.last(metric) is None else f"{run.last(metric):.4f}"
                                                  for run in runs) + " |")
    return "\n".join(rows)


def svg_panel(metric: str, runs: list[RunCurves], width: int = 360, height: int = 220) -> str:
    """One metric's lines, one per run, on axes of tokens seen and the metric."""
    series = [(i, run.curves[metric]) for i, run in enumerate(runs) if run.curves.get(metric)]
    xs = [t for _, points in series for t, _ in points]
    ys = [v for _, points in series for _, v in points]
    left, right, top, bottom = 52, 10, 22, 30
    x0, x1 = min(xs), max(xs)
    y0, y1 = min(ys), max(ys)
    x1, y1 = (x1 if x1 > x0 else x0 + 1), (y1 if y1 > y0 else y0 + abs(y0) * 0.01 + 1e-6)

    def at(t, v):
        return (left + (t - x0) / (x1 - x0) * (width - left - right),
                top + (y1 - v) / (y1 - y0) * (height - top - bottom))

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" '
             f'font-size="10"><rect width="100%" height="100%" fill="white"/>',
             f'<text x="{left}" y="14" font-size="12">{html.escape(metric)}</text>',
             f'<line x1="{left}" y1="{height - bottom}" x2="{width - right}" y2="{height - bottom}" stroke="#888"/>',
             f'<line x1="{left}" y1="{top}" x2="{left}" y2="{height - bottom}" stroke="#888"/>',
             f'<text x="{left}" y="{height - 8}">{x0:,}</text>',
             f'<text x="{width - right}" y="{height - 8}" text-anchor="end">{x1:,} tokens</text>',
             f'<text x="{left - 4}" y="{top + 4}" text-anchor="end">{y1:.3g}</text>',
             f'<text x="{left - 4}" y="{height - bottom}" text-anchor="end">{y0:.3g}</text>']
    for index, points in series:
        color = COLORS[index % len(COLORS)]
        coords = " ".join(f"{x:.1f},{y:.1f}" for x, y in (at(t, v) for t, v in points))
        parts.append(f'<polyline fill="none" stroke="{color}" stroke-width="1.5" points="{coords}"/>')
        if len(points) == 1:
            x, y = at(*points[0])
            parts.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="3" fill="{color}"/>')
    parts.append("</svg>")
    return "".join(parts)


def legend(runs: list[RunCurves]) -> str:
    return " ".join(f'<span style="color:{COLORS[i % len(COLORS)]}">&#9632; {html.escape(run.name)}</span>'
                    for i, run in enumerate(runs))


def write_html(runs: list[RunCurves], path: Path) -> Path:
    """The page: the legend, a panel per metric, and the table (written whole or not at all)."""
    from training.atomic import write_atomic

    rows = table(runs).splitlines()
    cells = [[c.strip() for c in row.strip("|").split("|")] for row in rows if not row.startswith("|---")]
    body = "".join("<tr>" + "".join(f"<{'th' if i == 0 else 'td'}>{html.escape(c)}</{'th' if i == 0 else 'td'}>"
                                    for c in row) + "</tr>" for i, row in enumerate(cells))
    page = (f"<!doctype html><html><head><meta charset='utf-8'><title>kiln compare</title></head><body>"
            f"<p>{legend(runs)}</p><div>{''.join(svg_panel(m, runs) for m in metrics_of(runs))}</div>"
            f"<table border='1' cellspacing='0' cellpadding='3'>{body}</table></body></html>")
    write_atomic(path, lambda stream: stream.write(page.encode()))
    return path


def compare_runs(runs: list[str], runs_root: str | Path) -> list[RunCurves]:
    if len(runs) < 1:
        raise ValueError("name at least one run")
    return [read_run(find_run(run, runs_root)) for run in runs]
