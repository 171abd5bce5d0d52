"""Cancelling a training run: msrun and every worker end within seconds, the last checkpoint stays valid.

The run executes in its own ``dagster job execute`` process (multiprocess executor: the training step is a
child process running msrun under Pipes). Terminating it the way the run launcher does — an interrupt to
the run worker (SIGTERM, which Dagster maps to SIGINT) — must take down the whole process tree.
"""
import os
import signal
import subprocess
import time
from pathlib import Path

import dagster as dg
import pytest

from conftest import PROJECT_ROOT, write_random_documents
from training.checkpoint import load_checkpoint, tracked_step

pytestmark = pytest.mark.msrun


def descendants(pid: int) -> set[int]:
    """Every live process below ``pid`` (msrun starts workers in new sessions, but they stay its children)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def command_line(pid: int) -> str:
    """The command ``pid`` runs; empty once it has ended (or is a zombie, whose command line is empty)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.2)


def test_terminating_the_run_ends_msrun_and_every_worker(tmp_path):
    home = tmp_path / "dagster_home"
    home.mkdir()
    shard = write_random_documents(tmp_path / "shards/random")
    run_dir = tmp_path / "run"
    config = tmp_path / "run_config.yaml"
    config.write_text(f"ops:\n  long_training:\n    config:\n      shard: '{shard}'\n      run_dir: '{run_dir}'\n")
    env = {**os.environ, "DAGSTER_HOME": str(home),
           "PYTHONPATH": os.pathsep.join([str(PROJECT_ROOT), str(PROJECT_ROOT / "tests")])}
    run = subprocess.Popen(["dagster", "job", "execute", "-f", "tests/cancel_definitions.py", "-j", "train_job",
                            "-c", str(config)], cwd=PROJECT_ROOT, env=env, start_new_session=True,
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        checkpoints = run_dir / "checkpoints"
        wait_for(lambda: (tracked_step(checkpoints) or 0) >= 2 or run.poll() is not None, 240,
                 "the first complete checkpoint")
        assert run.poll() is None, run.stderr.read()[-3000:]
        tree = descendants(run.pid)
        names = [command_line(pid) for pid in tree]
        assert sum("training.run" in n for n in names) >= 3, names  # 2 workers and msrun's scheduler
        assert any("msrun" in n for n in names), names

        # what DefaultRunLauncher.terminate does for the UI's Terminate: mark the run CANCELING, then interrupt
        # its worker process (here over a signal instead of the code server's cancel_execution call)
        with dg.DagsterInstance.from_config(str(home)) as instance:
            (record,) = instance.get_run_records()
            instance.report_run_canceling(record.dagster_run)
        run.send_signal(signal.SIGTERM)
        started = time.monotonic()
        wait_for(lambda: not any(alive(pid) for pid in tree), 20, "msrun and its workers to end")
        ended_in = time.monotonic() - started
        run.wait(timeout=30)
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
    assert ended_in < 20

    with dg.DagsterInstance.from_config(str(home)) as instance:
        assert instance.get_run_by_id(record.dagster_run.run_id).status == dg.DagsterRunStatus.CANCELED
    assert_last_checkpoint_loads(checkpoints)


def assert_last_checkpoint_loads(checkpoints: Path) -> None:
    step = tracked_step(checkpoints)
    loaded = load_checkpoint(checkpoints / f"iteration_{step:08d}")
    assert loaded.common["global_step"] == step and loaded.model


def processes_mentioning(text: str) -> dict[int, str]:
    pids = (int(proc.name) for proc in Path("/proc").glob("[0-9]*"))
    return {pid: line for pid in pids if text in (line := command_line(pid)) and alive(pid)}


@pytest.mark.ui
def test_terminate_from_the_ui_ends_msrun_and_every_worker(tmp_path):
    """The UI's Terminate button is the terminateRun GraphQL mutation, here against a real `dagster dev`."""
    from dagster_dev import dagster_dev

    shard = write_random_documents(tmp_path / "shards/random")
    run_dir = tmp_path / "run"
    workspace = tmp_path / "workspace.yaml"
    workspace.write_text(f"load_from:\n  - python_file:\n      relative_path: {PROJECT_ROOT / 'tests/cancel_definitions.py'}"
                         f"\n      working_directory: {PROJECT_ROOT}\n")
    env = {"PYTHONPATH": os.pathsep.join([str(PROJECT_ROOT), str(PROJECT_ROOT / "tests")])}
    with dagster_dev(tmp_path, env, workspace) as (client, _):
        run_id = client.submit_job_execution(
            "train_job", run_config={"ops": {"long_training": {"config": {"shard": str(shard),
                                                                          "run_dir": str(run_dir)}}}})
        checkpoints = run_dir / "checkpoints"
        ended = (dg.DagsterRunStatus.SUCCESS, dg.DagsterRunStatus.FAILURE, dg.DagsterRunStatus.CANCELED)
        wait_for(lambda: (tracked_step(checkpoints) or 0) >= 2 or client.get_run_status(run_id) in ended, 240,
                 "the first complete checkpoint")
        assert client.get_run_status(run_id) == dg.DagsterRunStatus.STARTED
        training = processes_mentioning(str(run_dir))  # msrun, its scheduler, workers and log tails
        assert sum("training.run" in line for line in training.values()) >= 3, training

        client.terminate_run(run_id)
        wait_for(lambda: not any(alive(pid) for pid in training), 20, "msrun and its workers to end")
        wait_for(lambda: client.get_run_status(run_id) == dg.DagsterRunStatus.CANCELED, 30, "the run to be CANCELED")
    assert_last_checkpoint_loads(checkpoints)
