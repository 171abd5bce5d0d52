"""The real webserver + daemon: launch the chain through GraphQL, as the UI's Materialize does."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from dagster_graphql import DagsterGraphQLClient

from conftest import MICRO_CONFIG, PROJECT_ROOT
from pipelines.chain import config_for
from resources.msrun import free_port

pytestmark = pytest.mark.ui
SOURCES = ["stdlib_code", "stdlib_docs"]


@pytest.fixture
def dagster_dev(tmp_path, micro_sources):
    home = tmp_path / "dagster_home"
    home.mkdir()
    (home / "dagster.yaml").write_text("telemetry:\n  enabled: false\n")
    port = free_port()
    env = {**os.environ, "DAGSTER_HOME": str(home), "KILN_DATA_ROOT": str(tmp_path / "data"),
           "KILN_RUNS_ROOT": str(tmp_path / "runs"), "KILN_SOURCES": str(micro_sources)}
    dagster = Path(sys.executable).parent / "dagster"

    def restore_signals():  # a background shell starts children with SIGINT ignored
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)

    proc = subprocess.Popen([str(dagster), "dev", "-w", "workspace.yaml", "-h", "127.0.0.1", "-p", str(port)],
                            cwd=PROJECT_ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                            preexec_fn=lambda: (restore_signals(), os.setsid()))
    client = DagsterGraphQLClient("127.0.0.1", port_number=port)
    deadline = time.time() + 120
    while True:
        try:
            client._execute("{ version }")
            break
        except Exception:
            if time.time() > deadline or proc.poll() is not None:
                proc.kill()
                pytest.fail("dagster dev did not come up within 120 s")
            time.sleep(1)
    yield client, tmp_path
    os.killpg(proc.pid, signal.SIGINT)
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)


def wait_for(client, run_id, timeout=300):
    from dagster import DagsterRunStatus
    deadline = time.time() + timeout
    while time.time() < deadline:
        status = client.get_run_status(run_id)
        if status in (DagsterRunStatus.SUCCESS, DagsterRunStatus.FAILURE, DagsterRunStatus.CANCELED):
            return status
        time.sleep(1)
    pytest.fail(f"run {run_id} did not finish in {timeout} s")


def test_chain_materializes_through_the_webserver(dagster_dev):
    from dagster import DagsterRunStatus
    client, tmp_path = dagster_dev
    run_config = {
        "resources": {"tokenizer_settings": {"config": {"vocab_size": 512, "sample_lines": 20000}}},
        "ops": {"training_run": {"config": {"config_path": MICRO_CONFIG, "run_name": "ui"}},
                "blend_manifest": {"config": {"seq_length": 32}}},
    }
    plan = [("raw_corpus", SOURCES), ("tokenizer", [None]), ("token_shards", SOURCES), ("blend_manifest", [None]),
            ("training_run", [None])]
    for key, partitions in plan:
        for partition in partitions:
            run_id = client.submit_job_execution(
                "__ASSET_JOB", repository_location_name="kiln", asset_selection=[key],
                run_config=config_for(key, run_config),
                tags={"dagster/partition": partition} if partition else {})
            assert wait_for(client, run_id) == DagsterRunStatus.SUCCESS, f"{key}[{partition}] failed"
    assert (tmp_path / "runs/ui/checkpoints/iteration_00000006/common.json").exists()
