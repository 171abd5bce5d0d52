"""Lineage token shares, reverse lineage (`kiln lineage --consumers`), `kiln audit` without Dagster and the
Dagster cross-check (`python -m pipelines.audit`) on hand-built lineages (tests/test_postgres.py cross-checks a
real chain against a Dagster instance)."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import PROJECT_ROOT
from pipelines.audit import main as audit_with_dagster
from training.cli import main as kiln
from training.data.hashing import sha256_file
from training.data.manifest import build_manifest
from training.lineage import AuditCache, audit_checkpoint, lineage_inputs, record_in_index, store_lineage_inputs


def write_manifest(root, weights):
    """Source a: one shard of 100 tokens, two raw files (300 and 100 bytes); source b: shards of 50 and 150."""
    def shard(name, tokens):
        return {"prefix": str(root / "shards" / name), "tokens": tokens, "bin_sha256": name[0] * 64,
                "idx_sha256": name[0].upper() * 64}

    sources = [{"name": "a", "weight": weights[0], "shards": [shard("a0", 100)],
                "raw_files": [{"path": "raw/a/part-00000.jsonl", "sha256": "1" * 64, "bytes": 300},
                              {"path": "raw/a/part-00001.jsonl", "sha256": "2" * 64, "bytes": 100}]},
               {"name": "b", "weight": weights[1], "shards": [shard("b0", 50), shard("b1", 150)],
                "raw_files": [{"path": "raw/b/part-00000.jsonl", "sha256": "3" * 64, "bytes": 10}]}]
    manifest = build_manifest(sources=sources, tokenizer={"path": str(root / "tokenizer/kiln.model"),
                                                          "sha256": "t" * 64},
                              seq_length=32, split="98,2,0", seed=1, data_root=root)
    path = root / "blend/manifest.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(manifest))
    return path


def write_checkpoint(runs, run, step, inputs, config):
    directory = runs / run / "checkpoints" / f"iteration_{step:08d}"
    directory.mkdir(parents=True)
    (directory / "common.json").write_text(json.dumps({"global_step": step}))
    lineage = {**inputs, "checkpoint": {"step": step, "files": [], "common": {"global_step": step}},
               "run": {"config_path": str(config), "config_sha256": sha256_file(config), "world_size": 1,
                       "started_at": "2026-12-03T00:00:00Z", "resumed_from": None}}
    (directory / "lineage.json").write_text(json.dumps(lineage))
    return directory


def test_lineage_records_each_files_share_of_the_blend(tmp_path):
    inputs = lineage_inputs(write_manifest(tmp_path, (3, 1)), tmp_path)
    shares = {r["path"]: r["token_share"] for r in inputs["shards"]}
    assert shares == pytest.approx({"shards/a0.bin": 0.75, "shards/a0.idx": 0.75, "shards/b0.bin": 0.0625,
                                    "shards/b0.idx": 0.0625, "shards/b1.bin": 0.1875, "shards/b1.idx": 0.1875})
    raw = {r["path"]: r["token_share"] for r in inputs["raw_files"]}
    assert raw == pytest.approx({"raw/a/part-00000.jsonl": 0.5625, "raw/a/part-00001.jsonl": 0.1875,
                                 "raw/b/part-00000.jsonl": 0.25})


def test_consumers_lists_every_checkpoint_with_its_share(tmp_path, capsys):
    config = tmp_path / "config.yaml"
    config.write_text("training: {}\n")
    runs = tmp_path / "runs"
    blend_a = lineage_inputs(write_manifest(tmp_path / "data1", (3, 1)), tmp_path / "data1")
    blend_b = lineage_inputs(write_manifest(tmp_path / "data2", (1, 1)), tmp_path / "data2")
    pointer = store_lineage_inputs(runs, blend_a)
    assert store_lineage_inputs(runs, blend_a) == pointer  # stored once, shared
    assert [p.name for p in (runs / "lineage").iterdir()] == [f"{pointer['inputs']['sha256']}.json"]
    for step in (2, 4):  # as training saves them: a pointer in lineage.json and a line in the index
        write_checkpoint(runs, "first", step, pointer, config)
        record_in_index(runs / "first/checkpoints", step, pointer)
    write_checkpoint(runs, "second", 10, blend_b, config)  # a lineage from before the store: records inline

    def consumers(target):
        assert kiln(["lineage", "--consumers", target, "--runs-root", str(runs), "--json"]) == 0
        return [(c["run"], c["step"], round(c["token_share"], 4))
                for c in json.loads(capsys.readouterr().out)["consumers"]]

    assert consumers("b") == [("first", 2, 0.25), ("first", 4, 0.25), ("second", 10, 0.5)]
    assert consumers("shards/b1") == [("first", 2, 0.1875), ("first", 4, 0.1875), ("second", 10, 0.375)]
    assert consumers("/anywhere/data/raw/a/part-00001.jsonl") == [
        ("first", 2, 0.1875), ("first", 4, 0.1875), ("second", 10, 0.125)]
    # a name no lineage records is a typo until shown otherwise: exit 1, and the recorded names nearest it
    assert kiln(["lineage", "--consumers", "raw/c/part-00000.jsonl", "--runs-root", str(runs)]) == 1
    assert ("records 'raw/c/part-00000.jsonl' as a source, chunk, file or shard; did you mean "
            "'raw/b/part-00000.jsonl', 'raw/a/part-00000.jsonl'") in capsys.readouterr().err
    assert kiln(["lineage", "--consumers", "shards/a0.bin", "--runs-root", str(runs)]) == 0
    assert "run second step 10: shards/a0.bin, 50.0% of the run's tokens" in capsys.readouterr().out

    # a line a crash cut short ends the index: the lines before it are read all the same; a directory being
    # saved (no common.json yet, not indexed) is not a checkpoint
    with open(runs / "first/checkpoints/lineage_index.jsonl", "a") as index:
        index.write('{"step": 6, "inp')
    (runs / "first/checkpoints/iteration_00000006").mkdir()
    assert consumers("b") == [("first", 2, 0.25), ("first", 4, 0.25), ("second", 10, 0.5)]

    # indexed checkpoints are not read one by one (only the store entry is); a rotated one is not listed
    (runs / "first/checkpoints/iteration_00000002/lineage.json").write_text("{")
    shutil.rmtree(runs / "first/checkpoints/iteration_00000004")
    assert consumers("b") == [("first", 2, 0.25), ("second", 10, 0.5)]
    (runs / "second/checkpoints/iteration_00000010/lineage.json").write_text("{")
    assert kiln(["lineage", "--consumers", "b", "--runs-root", str(runs)]) == 2
    assert "second/checkpoints/iteration_00000010/lineage.json: unreadable lineage" in capsys.readouterr().err


def test_a_copied_checkpoint_audits_with_the_store_entry_copied_along(tmp_path, capsys):
    config = tmp_path / "config.yaml"
    config.write_text("training: {}\n")
    runs = tmp_path / "runs"
    pointer = store_lineage_inputs(runs, lineage_inputs(write_manifest(tmp_path / "data", (3, 1)), tmp_path / "data"))
    checkpoint = write_checkpoint(runs, "run", 1, pointer, config)
    entry = runs / "lineage" / f"{pointer['inputs']['sha256']}.json"
    assert kiln(["audit", str(checkpoint)]) == 3  # in place: the entry is found; the fake shards are not on disk
    assert "missing   raw file    raw/a/part-00000.jsonl" in capsys.readouterr().out

    copy = tmp_path / "elsewhere" / checkpoint.name
    shutil.copytree(checkpoint, copy)
    moved = tmp_path / "moved_store"
    shutil.move(runs / "lineage", moved)
    assert kiln(["audit", str(copy)]) == 3  # its own files and config still verified
    out = capsys.readouterr().out
    assert f"missing   inputs      lineage store entry {entry.name}" in out and "pass --lineage-store DIR" in out
    assert "raw file" not in out
    assert kiln(["audit", str(copy), "--lineage-store", str(moved)]) == 3
    assert "missing   raw file    raw/a/part-00000.jsonl" in capsys.readouterr().out
    (moved / entry.name).write_text((moved / entry.name).read_text().replace("part-00000", "part-00009"))
    assert kiln(["audit", str(copy), "--lineage-store", str(moved)]) == 2
    assert "lineage store entry changed" in capsys.readouterr().err


def test_kiln_audit_verifies_the_files_and_names_the_dagster_cross_check(tmp_path, capsys):
    config = tmp_path / "config.yaml"
    config.write_text("training: {}\n")
    checkpoint = write_checkpoint(tmp_path / "runs", "run", 1, {}, config)
    assert kiln(["audit", str(checkpoint)]) == 0
    assert (f"To also check each link against a Dagster instance's records: python -m pipelines.audit {checkpoint} "
            f"[--dagster-home DIR]") in capsys.readouterr().out
    assert kiln(["audit", str(checkpoint), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["exit_code"] == 0

    config.write_text("training: {steps: 2}\n")
    assert kiln(["audit", str(checkpoint)]) == 1
    assert f"run config  {config} changed since training" in capsys.readouterr().out


# imports of these raise ImportError in the child: training/ must run where Dagster and Kiln's Dagster code are not
BLOCK_DAGSTER = """
import importlib.abc, sys
BLOCKED, ATTEMPTS = ("dagster", "pipelines", "assets", "resources"), []
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            ATTEMPTS.append(name)  # an import that fails softly (except ImportError) counts too
            raise ImportError(f"{name} is blocked: training/ must run without it")
sys.meta_path.insert(0, Block())
"""


def test_training_imports_neither_dagster_nor_kilns_dagster_code(tmp_path):
    """Every module of training/ imported, and `kiln audit` run, with dagster, pipelines, assets and resources
    unimportable (dagster_pipes stays allowed: rank 0 reports through it)."""
    config = tmp_path / "config.yaml"
    config.write_text("training: {}\n")
    checkpoint = write_checkpoint(tmp_path / "runs", "run", 1, {}, config)
    script = BLOCK_DAGSTER + f"""
import importlib, pkgutil, training
for module in pkgutil.walk_packages(training.__path__, "training."):
    importlib.import_module(module.name)
from training.cli import main
code = main(["audit", {str(checkpoint)!r}])
sys.exit(f"imports tried: {{ATTEMPTS}}" if ATTEMPTS else code)
"""
    # with an instance at hand, as where `kiln audit` once tried the cross-check itself
    done = subprocess.run([sys.executable, "-c", script], cwd=PROJECT_ROOT, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "DAGSTER_HOME": str(tmp_path)})
    assert done.returncode == 0, done.stderr
    assert "python -m pipelines.audit" in done.stdout
    # the hook does block: the cross-check's module is Dagster code
    blocked = subprocess.run([sys.executable, "-c", BLOCK_DAGSTER + "import pipelines.audit"], cwd=PROJECT_ROOT,
                             capture_output=True, text=True, timeout=60)
    assert "ImportError: pipelines is blocked: training/ must run without it" in blocked.stderr


def test_the_dagster_cross_check_reports_each_link_and_refuses_bad_input(tmp_path, capsys, monkeypatch):
    config = tmp_path / "config.yaml"
    config.write_text("training: {}\n")
    checkpoint = write_checkpoint(tmp_path / "runs", "run", 1,
                                  lineage_inputs(write_manifest(tmp_path, (3, 1)), tmp_path), config)
    home = tmp_path / "dagster_home"
    home.mkdir()
    monkeypatch.delenv("DAGSTER_HOME", raising=False)
    assert audit_with_dagster([str(checkpoint)]) == 2
    assert "no Dagster instance given: pass --dagster-home DIR or set DAGSTER_HOME" in capsys.readouterr().err
    assert audit_with_dagster([str(checkpoint), "--dagster-home", str(tmp_path / "nowhere")]) == 2
    assert f"--dagster-home {tmp_path / 'nowhere'} is not a directory" in capsys.readouterr().err

    # an instance that never ran this chain: every link looked up, none recorded; the exit code judges the files
    # (the manifest's shards and raw files are not on disk here: 3, nothing changed but files not found)
    assert audit_with_dagster([str(checkpoint), "--dagster-home", str(home), "--json"]) == 3
    report = json.loads(capsys.readouterr().out)
    assert report["exit_code"] == 3 and report["dagster_cross_check"]["instance"] == f"the instance in {home}"
    assert {link["asset"]: link["status"] for link in report["dagster_cross_check"]["links"]} == {
        "raw_corpus[a]": "NOT RECORDED", "raw_corpus[b]": "NOT RECORDED", "tokenizer": "NOT RECORDED",
        "token_shards[a]": "NOT RECORDED", "token_shards[b]": "NOT RECORDED", "blend_manifest": "NOT RECORDED",
        "checkpoint[run/iteration_00000001]": "NOT RECORDED"}
    assert audit_with_dagster([str(checkpoint), "--dagster-home", str(home)]) == 3
    assert "NOT RECORDED in the instance: raw_corpus[a]" in capsys.readouterr().out


def test_the_dagster_cross_check_names_a_missing_sources_config(tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text("training: {}\n")
    checkpoint = write_checkpoint(tmp_path / "runs", "run", 1, {}, config)
    (tmp_path / "home").mkdir()
    missing = tmp_path / "sources.yaml"
    done = subprocess.run([sys.executable, "-m", "pipelines.audit", str(checkpoint), "--dagster-home",
                           str(tmp_path / "home")], cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "KILN_SOURCES": str(missing)})
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert (f"python -m pipelines.audit: raw_corpus's code version (assets/versions.py, ASSET_PARTS['raw_corpus'], "
            f"'$KILN_SOURCES'): {missing} (named by KILN_SOURCES or its default) is not a file; set KILN_SOURCES and "
            f"KILN_TRAIN_CONFIG as the chain ran with") in done.stderr


def test_copied_checkpoint_verifies_the_config_its_lineage_carries(tmp_path, capsys):
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({"training": {"steps": 2, "lr": 3.0e-3}}, sort_keys=False))
    checkpoint = write_checkpoint(tmp_path / "runs", "run", 1, {}, config)
    lineage_path = checkpoint / "lineage.json"
    lineage = json.loads(lineage_path.read_text())
    lineage["run"]["config"] = {"training": {"steps": 2, "lr": 3.0e-3}}
    lineage_path.write_text(json.dumps(lineage))
    config.unlink()  # the checkpoint directory alone, as on another machine
    assert kiln(["audit", str(checkpoint)]) == 0
    assert "ok        run config  lineage.json run.config (config file not found)" in capsys.readouterr().out

    lineage["run"]["config"]["training"]["steps"] = 3
    lineage_path.write_text(json.dumps(lineage))
    assert kiln(["audit", str(checkpoint)]) == 1
    assert "MISMATCH  run config  lineage.json run.config (config file not found) changed since training" in \
        capsys.readouterr().out


NEWER_BLENDS = 12  # each stored event costs ~20 ms (~140 ms at load 16): a few pages of SEARCH_PAGE 5


def record_links(tmp_path, instance):
    """A checkpoint's lineage and, in ``instance``, a run recording its links in each form the cross-check
    meets: a manifest with NEWER_BLENDS materializations after it (the cross-check once stopped at the newest
    200), a chunk's version kept as per-source metadata, a wiped asset. Returns (checkpoint, lineage)."""
    import dagster as dg

    from pipelines.audit import expected_versions

    config = tmp_path / "config.yaml"
    config.write_text("training: {}\n")
    checkpoint = write_checkpoint(tmp_path / "runs", "run", 1,
                                  lineage_inputs(write_manifest(tmp_path, (3, 1)), tmp_path), config)
    lineage = json.loads((checkpoint / "lineage.json").read_text())
    version = {(key, partition): v for key, partition, v in expected_versions(checkpoint, lineage)}

    @dg.op
    def record(context):  # one run logging them all: a run per event would take 50 ms each
        def log(key, data_version, partition=None, metadata=None, code_version="c1"):
            context.log_event(dg.AssetMaterialization(key, partition=partition, metadata=metadata, tags={
                "dagster/data_version": data_version, "dagster/code_version": code_version}))
        for data_version in [version["blend_manifest", None], *(f"{i:064x}" for i in range(NEWER_BLENDS))]:
            log("blend_manifest", data_version)
        log("raw_corpus", version["raw_corpus", "b"], "b", code_version="c2")
        log("tokenizer", version["tokenizer", None])
        # a step over several chunks: the chunk's version in its metadata, the step's in the tag
        log("token_shards", "e" * 64, "a", {"data_version/a": dg.MetadataValue.text(version["token_shards", "a"]),
                                            "data_version/b": dg.MetadataValue.text("d" * 64)})
        log("token_shards", "f" * 64, "a")

    assert dg.GraphDefinition("record", node_defs=[record]).to_job().execute_in_process(instance=instance).success
    instance.wipe_assets([dg.AssetKey("tokenizer")])
    return checkpoint, lineage


def check_recorded_links(results, lineage):
    """What record_links recorded, as the cross-check must report it."""
    assert {r.asset: (r.status, r.code_version, (r.latest_data_version or "")[:2]) for r in results} == {
        "raw_corpus[a]": ("NOT RECORDED", None, ""), "tokenizer": ("NOT RECORDED", None, ""),
        "raw_corpus[b]": ("recorded", "c2", results[1].data_version[:2]), "token_shards[a]": ("superseded", "c1", "ff"),
        "token_shards[b]": ("NOT RECORDED", None, ""), "blend_manifest": ("superseded", "c1", "00"),
        "checkpoint[run/iteration_00000001]": ("NOT RECORDED", None, "")}
    assert results[1].run_id and all(r.run_id in (None, results[1].run_id) for r in results)


def test_the_cross_check_finds_a_link_however_many_materializations_came_after(tmp_path, monkeypatch):
    """On an instance Dagster wrote: its SQLite index read directly and Dagster's API find the same links
    (tests/test_audit_postgres.py compares the two on PostgreSQL)."""
    import dagster as dg

    import pipelines.audit
    from pipelines.audit import DagsterEvents, SqlEvents, cross_check, cross_check_instance, cross_check_report

    with dg.instance_for_test() as instance:
        checkpoint, lineage = record_links(tmp_path, instance)
        home = instance.root_directory
        through_sql, read_through = cross_check_instance(home, checkpoint, lineage)
        assert read_through == f"SQLite, {home}/history/runs/index.db"
        check_recorded_links(through_sql, lineage)
        monkeypatch.setattr(pipelines.audit, "SEARCH_PAGE", 5)  # the blend's history over several pages
        assert cross_check(DagsterEvents(instance, "the test instance"), checkpoint, lineage) == through_sql

        # Dagster's API pages as far as SEARCH_LIMIT: beyond it, said so, never "NOT RECORDED"; SQL sees it all
        monkeypatch.setattr(pipelines.audit, "SEARCH_LIMIT", NEWER_BLENDS)
        results = cross_check(DagsterEvents(instance, "the test instance"), checkpoint, lineage)
        (blend,) = [r for r in results if r.asset == "blend_manifest"]
        assert blend.status == "outside the searched history"
        report = cross_check_report(results, "the test instance")
        assert (f"outside the searched history (older than the newest {NEWER_BLENDS} materializations): "
                "blend_manifest") in report
        assert "NOT RECORDED in the instance: raw_corpus[a]" in report
        assert cross_check_instance(home, checkpoint, lineage)[0] == through_sql
        assert isinstance(pipelines.audit.open_events(home), SqlEvents)


def test_the_cross_check_imports_no_dagster(tmp_path):
    """The SQL reader and the code versions hashed from the files: the whole command without importing Dagster
    or Kiln's definitions."""
    import dagster as dg

    from assets.versions import current_code_versions
    from pipelines.audit import checkpoint_version

    config = tmp_path / "config.yaml"
    config.write_text("training: {}\n")
    checkpoint = write_checkpoint(tmp_path / "runs", "run", 1, {}, config)
    version = checkpoint_version(checkpoint, json.loads((checkpoint / "lineage.json").read_text()))
    versions = current_code_versions()  # the definitions' (tests/test_code_versions.py)
    with dg.instance_for_test() as instance:
        instance.report_runless_asset_event(dg.AssetMaterialization("checkpoint", partition="run/iteration_00000001",
                                                                    tags={"dagster/data_version": version,
                                                                          "dagster/code_version": "c9"}))
        home = instance.root_directory
        script = f"""
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("dagster", "sqlalchemy") or name == "pipelines.definitions":
            raise ImportError(f"{{name}} imported")
sys.meta_path.insert(0, Block())
import pipelines.audit as audit
sys.exit(audit.main([{str(checkpoint)!r}, "--dagster-home", {home!r}, "--json"]))
"""
        done = subprocess.run([sys.executable, "-c", script], cwd=PROJECT_ROOT, capture_output=True, text=True,
                              timeout=120)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)["dagster_cross_check"]
    assert report["read_through"] == f"SQLite, {home}/history/runs/index.db"
    (link,) = report["links"]
    assert (link["status"], link["code_version"], link["code_version_now"]) == (
        "recorded", "c9", versions["training_run"])


def test_a_training_steps_audits_hash_what_each_save_adds_and_reuse_the_upstream(tmp_path, monkeypatch):
    import training.lineage

    config = tmp_path / "config.yaml"
    config.write_text("training: {}\n")
    runs, data = tmp_path / "runs", tmp_path / "data"
    pointer = store_lineage_inputs(runs, lineage_inputs(write_manifest(data, (3, 1)), data))
    raw = data / "raw/a/part-00000.jsonl"
    raw.parent.mkdir(parents=True)
    raw.write_text("one\n")
    checkpoints = [write_checkpoint(runs, "run", step, pointer, config) for step in (1, 2, 3)]
    hashed = []
    monkeypatch.setattr(training.lineage, "sha256_file",
                        lambda path, real=training.lineage.sha256_file: hashed.append(Path(path).name) or real(path))
    cache = AuditCache()

    def raw_check(checkpoint):
        _, checks = audit_checkpoint(checkpoint, cache=cache)
        return next(c for c in checks if c.path == "raw/a/part-00000.jsonl")

    first = raw_check(checkpoints[0])
    assert "part-00000.jsonl" in hashed and first.status == "MISMATCH"  # the fake manifest's sha256 is "1" * 64
    hashed.clear()
    raw.write_text("two\n")
    assert raw_check(checkpoints[1]) == first and "part-00000.jsonl" not in hashed  # the upstream reused
    cache.recheck_s = 0  # past the window: verified again, and the change is seen
    again = raw_check(checkpoints[2])
    assert "part-00000.jsonl" in hashed and again.actual != first.actual
    # the audit without a cache (kiln audit, the check run from the UI) verifies every link every time
    _, checks = audit_checkpoint(checkpoints[0])
    assert next(c for c in checks if c.path == "raw/a/part-00000.jsonl").actual == again.actual
