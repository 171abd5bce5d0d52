"""Every benchmark `make bench` runs, at its smallest size (``python -m benchmarks --smoke --only NAME``): it runs
through and reports finite figures. A benchmark joins by being in ``benchmarks.SUITE`` (benchmarks/__init__.py);
its figures are not judged here (a test is no place for timings). Below: the summary's verdicts and the load
accounting that refuses ratios under contention."""
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks import LAUNCHES_PROCESSES, SUITE
from benchmarks.contention import QUIET_CHECK_SECONDS, Load, LoadWatch
from benchmarks.suite import Bench, Figure, at_least, at_most, finite, read_figures, summary

PROJECT_ROOT = Path(__file__).resolve().parent.parent


def _smoke_params():
    """One test per benchmark, each its own xdist group (tests/conftest.py): they spread over the workers."""
    for name in SUITE:
        marks = [pytest.mark.xdist_group(f"benchmark-{name}"), pytest.mark.slow]
        if name in LAUNCHES_PROCESSES:
            marks.append(pytest.mark.msrun)
        yield pytest.param(name, marks=marks, id=name)


@pytest.fixture(scope="session")
def bench_work(tmp_path_factory) -> Path:
    """The benchmarks' data (the tokenized shard the training ones read), built once per pytest worker."""
    return tmp_path_factory.mktemp("bench_work")


@pytest.mark.parametrize("name", _smoke_params())
def test_benchmark_smoke(name, tmp_path, bench_work):
    figures = tmp_path / "figures.jsonl"
    done = subprocess.run([sys.executable, "-m", "benchmarks", "--smoke", "--only", name, "--figures", str(figures),
                           "--work", str(bench_work)], cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, f"{name} failed:\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
    reported = read_figures(figures)
    assert reported, f"{name} reported no figure:\n{done.stdout[-3000:]}"
    assert {f.benchmark for f in reported} == {name}
    assert [f.name for f in reported if not finite(f)] == []
    for figure in reported:  # every timing carries the load it was measured under, and CPU seconds per variant
        if figure.load is not None:
            assert figure.load.seconds > 0 and figure.load.machine_cores >= figure.load.cores >= 1
    assert f"{len(reported)} figures (" in done.stdout and "0 benchmark(s) failed" in done.stdout  # the summary


def _load(**changes) -> Load:
    quiet = dict(cores=2, machine_cores=2, load_before=1.2, load_after=1.9, others_cores=0.1, seconds=30.0,
                 cpu_per_step={"kiln": 1.2, "torch eager": 2.3})
    return Load(**{**quiet, **changes})


@pytest.mark.parametrize("changes, competed", [
    ({}, False),
    ({"others_cores": 1.5, "load_after": 9.5}, True),  # six other sessions on two cores take their share
    ({"load_after": 3.0}, False),  # the run's own threads: MindSpore keeps more runnable than it has cores
    ({"load_before": 3.8}, False),  # the benchmark before's load: its processes are gone, the average lags
    ({"others_before": 1.5}, True),  # a job busy as the measurement started, however long the measurement
    ({"others_cores": 0.8}, True),  # load averages lag; the CPU others used meanwhile does not
    ({"cores": 1, "others_cores": 0.8, "load_after": 1.4}, False),  # a one-core run leaves a core to the others
])
def test_load_competed(changes, competed):
    assert _load(**changes).competed is competed


def test_figures_under_competition_are_not_valid(tmp_path, capsys):
    bench = Bench("example", tmp_path, tmp_path / "figures.jsonl")
    quiet, loaded = LoadWatch(), LoadWatch()
    quiet.load, loaded.load = _load(), _load(load_after=9.5, others_cores=1.5)
    bench.report("kiln vs torch eager", 1.07, "×", target=at_least(1.0, of="value"), watch=quiet)
    bench.report("kiln vs torch compile", 0.93, "×", target=at_least(1.0, of="value"), watch=quiet)
    bench.report("async stall", 0.5, "s", 0.04, "sync save", target=at_most(0.10), watch=loaded)
    bench.report("ZeRO-3 weights", 1.0, "MiB", 0.5, "DP's")  # bytes: no load can move them
    printed = capsys.readouterr().out
    assert "ratio NOT VALID" in printed and "0.04 × sync save measured" in printed
    verdicts = [f.verdict() for f in read_figures(tmp_path / "figures.jsonl")]
    assert verdicts == ["met", "MISSED", "NOT VALID (others 0.0 before, 1.5 during, of 2 cores)", "no target"]
    table = summary(read_figures(tmp_path / "figures.jsonl"), {"broken": "CheckpointError: step 3 is already there"})
    assert "4 figures (1 not valid under load), 3 with a target: 1 met, 1 missed, 1 not valid under load; " \
           "1 benchmark(s) failed" in table
    assert "FAILED: CheckpointError" in table


def test_report_inside_its_watch_is_refused(tmp_path):
    bench = Bench("example", tmp_path, tmp_path / "figures.jsonl")
    with LoadWatch() as watch, pytest.raises(RuntimeError, match="inside its LoadWatch"):
        bench.report("step", 1.0, "s", watch=watch)


def test_a_target_on_the_ratio_of_a_figure_without_one_is_refused(tmp_path):
    """A paired ratio reported as the figure's value (unit ×) with its target on the missing ratio was judged
    MISSED whatever it measured (throughput's "kiln vs torch eager" 2.31 × against >= 0.5)."""
    bench = Bench("example", tmp_path, tmp_path / "figures.jsonl")
    with pytest.raises(ValueError, match="kiln vs torch eager: a target on the ratio of a figure reported without"):
        bench.report("kiln vs torch eager", 2.31, "×", target=at_least(0.5))
    assert not (tmp_path / "figures.jsonl").exists()


def test_load_watch_counts_its_own_processes_and_the_others(tmp_path):
    """A child's CPU is the variant's, not another process's; a process outside this tree (started in the
    background by a shell that exits at once, so no longer a descendant) is another's, whatever else the machine
    runs."""
    done = tmp_path / "done"
    burner = tmp_path / "burn.py"
    burner.write_text("import sys, time\nwhile time.process_time() < float(sys.argv[1]): pass\n"
                      "if len(sys.argv) > 2: open(sys.argv[2], 'w').close()\n")
    with LoadWatch() as watch:
        watch.time("child", lambda: subprocess.run([sys.executable, burner, "0.4"], check=True))
        subprocess.run(["sh", "-c", f"'{sys.executable}' '{burner}' 0.6 '{done}' &"], check=True)
        deadline = time.monotonic() + 120
        while not done.exists():
            assert time.monotonic() < deadline, "the orphaned burner did not finish"
            time.sleep(0.05)
    assert watch.load.cpu_per_step["child"] >= 0.4
    assert watch.load.others_cores * watch.load.seconds >= 0.5  # the burner's 0.6 CPU-s, counted as another's
    assert Figure("x", "y", 1.0, "s", load=watch.load).to_json()


def test_load_watch_sees_a_job_busy_before_the_measurement(tmp_path):
    """Another process's CPU in the second before the measurement is ``others_before`` (a burner of 1.5 CPU-s
    started in the background just before the watch, outside this process tree)."""
    burner = tmp_path / "burn.py"
    burner.write_text("import time\nwhile time.process_time() < 1.5: pass\n")
    subprocess.run(["sh", "-c", f"'{sys.executable}' '{burner}' &"], check=True)
    time.sleep(0.2)  # the burner's interpreter started
    with LoadWatch() as watch:
        pass
    assert watch.load.others_before * QUIET_CHECK_SECONDS >= 0.5


def test_alternate_reverses_the_order_every_other_round_and_records_each_variants_cpu():
    calls = []
    with LoadWatch() as watch:
        seconds = watch.alternate({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, rounds=3)
    assert calls == ["a", "b", "b", "a", "a", "b"]
    assert [len(s) for s in seconds.values()] == [3, 3] and set(watch.load.cpu_per_step) == {"a", "b"}
