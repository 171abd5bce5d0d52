"""`dagster dev` for the UI tests: own DAGSTER_HOME and data, a free port, every process it started killed."""
import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
from dagster_graphql import DagsterGraphQLClient

from conftest import PROJECT_ROOT
from resources.msrun import free_port


def _restore_signals():  # a background shell starts children with SIGINT ignored
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


@contextmanager
def dagster_dev(tmp_path: Path, env: dict, workspace: Path = PROJECT_ROOT / "workspace.yaml"):
    """Yield (GraphQL client, base URL) of a fresh `dagster dev` (webserver, daemon, code server)."""
    home = tmp_path / "dagster_home"
    home.mkdir()
    (home / "dagster.yaml").write_text("telemetry:\n  enabled: false\n")
    env = {**os.environ, "DAGSTER_HOME": str(home), "KILN_DATA_ROOT": str(tmp_path / "data"),
           "KILN_RUNS_ROOT": str(tmp_path / "runs"), **env}
    bin_dir = Path(sys.executable).parent
    # the npu pool is instance state: set it the way `make ui` does
    subprocess.run([str(bin_dir / "python"), "-m", "pipelines.pools"], cwd=PROJECT_ROOT, env=env, check=True,
                   stdout=subprocess.DEVNULL)
    port = free_port()
    log = open(tmp_path / "dagster_dev.log", "w")
    proc = subprocess.Popen([str(bin_dir / "dagster"), "dev", "-w", str(workspace), "-h", "127.0.0.1",
                             "-p", str(port)], cwd=PROJECT_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                            preexec_fn=lambda: (_restore_signals(), os.setsid()))
    try:
        client = DagsterGraphQLClient("127.0.0.1", port_number=port)
        deadline = time.time() + 120
        while True:
            try:
                client._execute("{ version }")
                break
            except Exception:
                if time.time() > deadline or proc.poll() is not None:
                    pytest.fail(f"dagster dev did not come up within 120 s; see {tmp_path / 'dagster_dev.log'}")
                time.sleep(1)
        yield client, f"http://127.0.0.1:{port}"
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            pass
        try:  # whatever of its group is left (code server, daemon, run workers)
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
        log.close()


def wait_for_run(client, run_id, timeout=300):
    from dagster import DagsterRunStatus
    deadline = time.time() + timeout
    while time.time() < deadline:
        status = client.get_run_status(run_id)
        if status in (DagsterRunStatus.SUCCESS, DagsterRunStatus.FAILURE, DagsterRunStatus.CANCELED):
            return status
        time.sleep(1)
    pytest.fail(f"run {run_id} did not finish in {timeout} s")
