"""Trainer-side cost of streaming step reports to Dagster through Pipes.

A Dagster asset launches this file as a Pipes subprocess; inside, ``Reporter.step`` (what rank 0 calls once
per training step) is timed with the Pipes session open and with it closed.
"""
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.contention import LoadWatch
from benchmarks.suite import Bench, standalone

PROJECT_ROOT = Path(__file__).resolve().parent.parent
REPORTS, SMOKE_REPORTS = 500, 20
METRICS = {"step": 1, "loss": 5.0, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 800.0, "samples_per_s": 6.0}
LINE = "{ step:[    1/  150], consumed_samples: 8, global_batch_size: 8, loss:   5.000000, ... }"


def _seconds_per_report(pipes: bool, reports: int) -> tuple[float, float]:
    """(wall, CPU) seconds per report."""
    from training.reporting import Reporter

    if not pipes:
        os.environ.pop("DAGSTER_PIPES_CONTEXT", None)
    reporter = Reporter(None, enabled=True)
    stdout, sys.stdout = sys.stdout, open(os.devnull, "w")  # the step line is printed too; not the point here
    try:
        started, cpu_started = time.perf_counter(), time.process_time()
        for _ in range(reports):
            reporter.step(METRICS, LINE)
        return (time.perf_counter() - started) / reports, (time.process_time() - cpu_started) / reports
    finally:
        sys.stdout.close()
        sys.stdout = stdout
        reporter.close()


def measure(bench: Bench, reports: int) -> None:
    import dagster as dg

    with tempfile.TemporaryDirectory(prefix="kiln-bench-pipes-") as tmp:
        out = Path(tmp) / "seconds.json"

        @dg.asset
        def pipes_streaming(context: dg.AssetExecutionContext, client: dg.PipesSubprocessClient):
            return client.run(command=[sys.executable, __file__, str(out), str(reports)], context=context,
                              env={"PYTHONPATH": str(PROJECT_ROOT)}).get_materialize_result()

        with dg.instance_for_test() as instance, LoadWatch(cores=1) as watch:
            dg.materialize([pipes_streaming], instance=instance, resources={"client": dg.PipesSubprocessClient()})
            seconds = json.loads(out.read_text())
            for variant in ("with_pipes", "without_pipes"):
                watch.cpu(variant.replace("_", " "), seconds[variant][1])
    with_pipes, without_pipes = seconds["with_pipes"][0], seconds["without_pipes"][0]
    bench.report("step report with Pipes open", with_pipes * 1e6, "us", with_pipes / without_pipes, "without Pipes",
                 watch=watch)


def run(bench: Bench) -> None:
    measure(bench, SMOKE_REPORTS if bench.smoke else REPORTS)


if __name__ == "__main__":
    if len(sys.argv) == 3:  # the Pipes subprocess: the first timing runs inside its Pipes session
        reports = int(sys.argv[2])
        with_pipes = _seconds_per_report(pipes=True, reports=reports)
        without_pipes = _seconds_per_report(pipes=False, reports=reports)
        Path(sys.argv[1]).write_text(json.dumps({"with_pipes": with_pipes, "without_pipes": without_pipes}))
    else:
        with standalone("pipes_streaming") as bench:
            measure(bench, REPORTS)
