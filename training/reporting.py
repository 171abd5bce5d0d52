"""Where rank 0 reports progress: stdout, ``metrics.jsonl`` and, when Dagster launched the run, Pipes.

Only rank 0 of the workers opens Pipes (one writer per session); ``dagster_pipes`` is optional so the
engine runs on a cluster without Dagster installed.
"""
from __future__ import annotations

import json
import os
import sys
from contextlib import ExitStack
from pathlib import Path

CHECKPOINT_MESSAGE = "checkpoint"
# every line rank 0 reports starts with one of these (Reporter.info/warning: "[kiln] ", steps: "{ step:[")
_REPORT_PREFIXES = ("[kiln] ", "{ step:[")


METRICS_MESSAGE = "metrics"


def scalar_metrics(metrics: dict) -> dict[str, float]:
    """The numbers of a step's record (loss, lr, grad_norm, throughput, loss terms...), without the step
    itself, flags, and the per-parameter or per-layer collections of the monitor."""
    return {k: float(v) for k, v in metrics.items()
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}


def is_report_line(line: str) -> bool:
    """A line of rank 0's reports (as echoed from its log), which a Dagster launch also gets through Pipes."""
    return line.startswith(_REPORT_PREFIXES)


def drop_partial_line(path: Path) -> None:
    """Cut a last line with no newline (a record a killed run was writing), so the next record starts a line
    of its own instead of merging into it."""
    if not path.exists():
        return
    with open(path, "rb+") as stream:
        size = stream.seek(0, os.SEEK_END)
        tail = 0
        while tail < size:  # scan back for the last newline, a block at a time
            block = min(1 << 16, size - tail)
            stream.seek(size - tail - block)
            data = stream.read(block)
            if tail == 0 and data.endswith(b"\n"):
                return
            newline = data.rfind(b"\n")
            if newline >= 0:
                stream.truncate(size - tail - block + newline + 1)
                return
            tail += block
        stream.truncate(0)


def is_step_record(record: dict) -> bool:
    """A training step's record of metrics.jsonl, not a validation result (``{"step", "val_loss", "val_ppl"}``)."""
    return "loss" in record


def read_records(path: Path, offset: int = 0) -> list[dict]:
    """The JSON records of ``metrics.jsonl`` from byte ``offset`` on; a partial last line is not one."""
    if not path.exists():
        return []
    with open(path, "rb") as stream:
        stream.seek(offset)
        lines = stream.read().split(b"\n")[:-1]  # what follows the last newline is incomplete
    return [json.loads(line) for line in lines]


class Reporter:
    """Rank 0's reports. Every ``log_interval`` steps, a Dagster launch also gets the step's scalars as a
    ``metrics`` message (training_run records them as an observation: a live curve in the UI); ``sinks`` get
    every step's record (TensorBoard) and are closed with the reporter."""

    def __init__(self, metrics_path: Path | None, enabled: bool, log_interval: int = 1, sinks=()):
        self.enabled = enabled
        self.log_interval = log_interval
        self._stack = ExitStack()
        self._pipes = None
        self._metrics = None
        self._sinks = list(sinks)
        for sink in self._sinks:
            self._stack.callback(sink.close)
        if not enabled:
            return
        if metrics_path is not None:
            metrics_path.parent.mkdir(parents=True, exist_ok=True)
            drop_partial_line(metrics_path)
            self._metrics = self._stack.enter_context(open(metrics_path, "a", buffering=1))
        if "DAGSTER_PIPES_CONTEXT" in os.environ:
            from dagster_pipes import open_dagster_pipes

            self._pipes = self._stack.enter_context(open_dagster_pipes())

    def info(self, message: str) -> None:
        if not self.enabled:
            return
        print(message, flush=True)
        if self._pipes:
            self._pipes.log.info(message)

    def warning(self, message: str) -> None:
        """A warning Dagster shows as one (Pipes log level WARNING)."""
        if not self.enabled:
            return
        print(f"[kiln] WARNING: {message}", flush=True)
        if self._pipes:
            self._pipes.log.warning(message)

    def step(self, metrics: dict, line: str) -> None:
        """A training step's record; its scalars join the UI's curve every ``log_interval`` steps."""
        on_curve = metrics["step"] % self.log_interval == 0
        self._record(metrics, line, lambda sink: sink(metrics),
                     {"step": metrics["step"], **scalar_metrics(metrics)} if on_curve else None)

    def evaluation(self, record: dict, line: str) -> None:
        """A validation result ``{"step", "val_loss", "val_ppl"}``: a metrics.jsonl record of its own, and a
        point of the curve at every evaluation, whatever ``log_interval``."""
        self._record(record, line, lambda sink: sink.evaluation(record), record)

    def _record(self, record: dict, line: str, to_sink, curve_point: dict | None) -> None:
        """One record to every place rank 0 reports: metrics.jsonl, the log, the sinks, and Pipes' curve."""
        if not self.enabled:
            return
        if self._metrics:
            self._metrics.write(json.dumps(record) + "\n")
        self.info(line)
        for sink in self._sinks:
            to_sink(sink)
        if self._pipes and curve_point is not None:
            self._pipes.report_custom_message({"event": METRICS_MESSAGE, **curve_point})

    def checkpoint(self, payload: dict) -> None:
        if self.enabled and self._pipes:
            self._pipes.report_custom_message({"event": CHECKPOINT_MESSAGE, **payload})

    def close(self, exc: BaseException | None = None) -> None:
        if exc is not None:
            self._stack.__exit__(type(exc), exc, exc.__traceback__)
        else:
            self._stack.close()


def warn(message: str) -> None:
    print(f"[kiln] WARNING: {message}", file=sys.stderr, flush=True)
