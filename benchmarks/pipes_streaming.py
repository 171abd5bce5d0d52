"""Trainer-side cost of streaming step reports to Dagster through Pipes.

A Dagster asset launches this file as a Pipes subprocess; inside, ``Reporter.step`` (what rank 0 calls once
per training step) is timed with the Pipes session open and with it closed. Run as ``run(report)``.
"""
import json
import os
import sys
import tempfile
import time
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parent.parent
REPORTS = 500
METRICS = {"step": 1, "loss": 5.0, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 800.0, "samples_per_s": 6.0}
LINE = "{ step:[    1/  150], consumed_samples: 8, global_batch_size: 8, loss:   5.000000, ... }"


def _seconds_per_report(pipes: bool) -> float:
    from training.reporting import Reporter

    if not pipes:
        os.environ.pop("DAGSTER_PIPES_CONTEXT", None)
    reporter = Reporter(None, enabled=True)
    stdout, sys.stdout = sys.stdout, open(os.devnull, "w")  # the step line is printed too; not the point here
    try:
        started = time.perf_counter()
        for _ in range(REPORTS):
            reporter.step(METRICS, LINE)
        return (time.perf_counter() - started) / REPORTS
    finally:
        sys.stdout.close()
        sys.stdout = stdout
        reporter.close()


def run(report) -> None:
    import dagster as dg

    with tempfile.TemporaryDirectory(prefix="kiln-bench-pipes-") as tmp:
        out = Path(tmp) / "seconds.json"

        @dg.asset
        def pipes_streaming(context: dg.AssetExecutionContext, client: dg.PipesSubprocessClient):
            return client.run(command=[sys.executable, __file__, str(out)], context=context,
                              env={"PYTHONPATH": str(PROJECT_ROOT)}).get_materialize_result()

        with dg.instance_for_test() as instance:
            dg.materialize([pipes_streaming], instance=instance, resources={"client": dg.PipesSubprocessClient()})
        seconds = json.loads(out.read_text())
    report("step report with Pipes open", seconds["with_pipes"] * 1e6, "us",
           seconds["with_pipes"] / seconds["without_pipes"], "without Pipes")


if __name__ == "__main__":  # the Pipes subprocess: the first timing runs inside its Pipes session
    with_pipes = _seconds_per_report(pipes=True)
    without_pipes = _seconds_per_report(pipes=False)
    Path(sys.argv[1]).write_text(json.dumps({"with_pipes": with_pipes, "without_pipes": without_pipes}))
