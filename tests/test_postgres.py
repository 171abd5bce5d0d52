"""The scale-out instance: deploy/dagster-postgres.yaml against a real PostgreSQL server on loopback.

The server is Debian's (tests/setup/postgres.sh installs it), started as the unprivileged ``postgres``
user on a temporary directory and a free port, and stopped at the end.
"""
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import dagster as dg
import pytest

from conftest import PROJECT_ROOT
from pipelines.audit import main as audit_with_dagster
from pipelines.chain import materialize_chain
from test_chain import chain_resources, training_config
from training.cli import main as kiln
from training.launch import free_port

pytestmark = pytest.mark.msrun


def postgres_bin() -> Path:
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/pg_ctl"))
    assert found, "PostgreSQL is not installed: run tests/setup/postgres.sh (make test does)"
    return found[-1].parent


def as_postgres(*command: str) -> None:
    """The server refuses to run as root; run it as Debian's postgres user when we are root."""
    prefix = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
    subprocess.run([*prefix, *command], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


@pytest.fixture
def postgres():
    bin_dir = postgres_bin()
    # not under pytest's temp root: that is private to root (0700), and the server runs as postgres
    data = Path(tempfile.mkdtemp(prefix="kiln-pgdata-"))
    if os.geteuid() == 0:
        shutil.chown(data, "postgres")
    port = free_port()
    as_postgres(str(bin_dir / "initdb"), "-D", str(data), "-U", "kiln", "--auth=trust")
    as_postgres(str(bin_dir / "pg_ctl"), "-D", str(data), "-w", "-l", str(data / "server.log"), "start",
                "-o", f"-h 127.0.0.1 -p {port} -k {data}")
    try:
        as_postgres(str(bin_dir / "createdb"), "-h", "127.0.0.1", "-p", str(port), "-U", "kiln", "dagster")
        yield {"KILN_PG_HOST": "127.0.0.1", "KILN_PG_PORT": str(port), "KILN_PG_USER": "kiln",
               "KILN_PG_PASSWORD": "", "KILN_PG_DB": "dagster"}
    finally:
        as_postgres(str(bin_dir / "pg_ctl"), "-D", str(data), "-m", "fast", "-w", "stop")
        shutil.rmtree(data, ignore_errors=True)


def test_chain_materializes_against_postgres_and_audits(tmp_path, micro_sources, postgres, monkeypatch, capsys):
    for name, value in postgres.items():
        monkeypatch.setenv(name, value)
    home = tmp_path / "dagster_home"
    home.mkdir()
    shutil.copy(PROJECT_ROOT / "deploy/dagster-postgres.yaml", home / "dagster.yaml")
    with dg.DagsterInstance.from_config(str(home)) as instance:
        assert type(instance.run_storage).__name__ == "PostgresRunStorage"
        chain = materialize_chain(instance, chain_resources(tmp_path, micro_sources), training_config(),
                                  log=lambda line: None)
        assert chain.metadata("training_run")["final_step"] == 6
    # a second instance (another machine would be the same) reads the chain back from the database
    with dg.DagsterInstance.from_config(str(home)) as reader:
        assert sorted(reader.get_dynamic_partitions("checkpoints")) == [
            "micro/iteration_00000003", "micro/iteration_00000006"]
        for key in ("raw_corpus", "tokenizer", "token_shards", "blend_manifest", "training_run", "checkpoint"):
            assert reader.fetch_materializations(dg.AssetKey(key), limit=1).records, key
        runs = reader.get_run_records()
        assert runs and all(r.dagster_run.status == dg.DagsterRunStatus.SUCCESS for r in runs)
        training_run_id = reader.fetch_materializations(dg.AssetKey("training_run"), limit=1).records[0].run_id

    # the Dagster cross-check finds every link of the checkpoint's lineage among the records in the database
    checkpoint = tmp_path / "runs/micro/checkpoints/iteration_00000006"
    capsys.readouterr()
    assert audit_with_dagster([str(checkpoint), "--dagster-home", str(home), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    links = {link["asset"]: link for link in report["dagster_cross_check"]["links"]}
    assert set(links) == {
        "raw_corpus[stdlib_code]", "raw_corpus[stdlib_docs]", "tokenizer", "token_shards[stdlib_code]",
        "token_shards[stdlib_docs]", "blend_manifest", "checkpoint[micro/iteration_00000006]"}
    assert {k: (v["status"], bool(v["code_version"])) for k, v in links.items()} == {
        k: ("recorded", True) for k in links}
    assert links["checkpoint[micro/iteration_00000006]"]["run_id"] == training_run_id

    # reverse lineage: both checkpoints consumed the code source, with its blend weight as their token share
    assert kiln(["lineage", "--consumers", "stdlib_code", "--runs-root", str(tmp_path / "runs"), "--json"]) == 0
    consumers = json.loads(capsys.readouterr().out)["consumers"]
    assert [(c["run"], c["step"]) for c in consumers] == [("micro", 3), ("micro", 6)]
    assert all(c["token_share"] == pytest.approx(0.6) for c in consumers)
    assert kiln(["lineage", "--consumers", "data/raw/stdlib_docs/part-00000.jsonl",
                 "--runs-root", str(tmp_path / "runs")]) == 0
    out = capsys.readouterr().out
    assert "run micro step 6: raw/stdlib_docs/part-00000.jsonl, 40.0% of the run's tokens" in out
