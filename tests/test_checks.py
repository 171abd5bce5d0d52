"""Blocking checks: a corrupt shard stops the blend; a changed shard fails the manifest check; audits."""
import json
import shutil
from pathlib import Path

import dagster as dg
import pytest

import assets.data
from assets.chunks import register_source_chunks
from assets.training import (AUDIT_PROBLEMS_SHOWN, CheckpointRecorder, audit_evaluation, audit_summary,
                             checkpoint_dir, forget_rotated_checkpoints, record_unreported_checkpoints)
from dagster._serdes import serialize_value
from pipelines.definitions import ALL_ASSETS, ALL_CHECKS, build_definitions, resources
from resources.storage import KilnStorage
from resources.tokenizer import TokenizerSettings
from training.data.hashing import sha256_file

SOURCES = ["stdlib_code", "stdlib_docs"]


@pytest.fixture
def data_chain(tmp_path, micro_sources):
    storage = KilnStorage(data_root=str(tmp_path / "data"), runs_root=str(tmp_path / "runs"),
                          sources_config=str(micro_sources))
    res = resources(storage=storage, tokenizer_settings=TokenizerSettings(vocab_size=512, sample_lines=5_000))
    defs = build_definitions(res)
    with dg.instance_for_test() as instance:
        register_source_chunks(instance, storage)
        job = defs.resolve_implicit_global_asset_job_def()

        def run(key, partition=None, check=None):
            if check:  # the check alone, as "Execute check" in the UI
                return dg.materialize([*ALL_ASSETS, *ALL_CHECKS], selection=dg.AssetSelection.checks(check),
                                      instance=instance, resources=res, raise_on_error=False)
            return job.execute_in_process(instance=instance, asset_selection=[dg.AssetKey(k) for k in key.split()],
                                          partition_key=partition, raise_on_error=False)

        for key, partition in [("raw_corpus", s) for s in SOURCES] + [("tokenizer", None)]:
            assert run(key, partition).success
        cursor = []

        def automation():  # one tick of the automation sensor, continuing from the previous one
            result = dg.evaluate_automation_conditions(defs=defs, instance=instance,
                                                       cursor=cursor[-1] if cursor else None)
            cursor.append(result.cursor)
            return result

        run.automation = automation
        yield run, storage


def _check(result, name):
    (evaluation,) = [e for e in result.get_asset_check_evaluations() if e.check_name == name]
    return evaluation


def test_truncated_bin_fails_the_blocking_check_and_stops_the_blend(data_chain, monkeypatch):
    run, storage = data_chain
    assert run("token_shards", "stdlib_docs").success
    run.automation()
    real = assets.data.tokenize_to_indexed

    def truncating(*args, **kwargs):
        stats = real(*args, **kwargs)
        bin_path = f"{stats['outputs'][0]['prefix']}.bin"
        with open(bin_path, "r+b") as f:
            f.truncate(f.seek(0, 2) - 2)
        return stats

    monkeypatch.setattr(assets.data, "tokenize_to_indexed", truncating)
    result = run("token_shards blend_manifest", "stdlib_code")
    assert not result.success
    evaluation = _check(result, "shards_are_well_formed")
    assert not evaluation.passed
    problems = evaluation.metadata["problems"].value
    assert "stdlib_code" in problems and "stdlib_code_text_document.bin" in problems
    assert "stdlib_docs" not in problems  # only the run's partition is checked
    assert not [m for m in result.get_asset_materialization_events()
                if m.event_specific_data.materialization.asset_key == dg.AssetKey("blend_manifest")]
    assert not storage.manifest_path().exists()
    # nor does automation after a run of the shards alone (as automation starts it) whose check failed
    assert not _check(run("token_shards", "stdlib_code"), "shards_are_well_formed").passed
    assert run.automation().get_num_requested(dg.AssetKey("blend_manifest")) == 0
    monkeypatch.setattr(assets.data, "tokenize_to_indexed", real)
    assert run("token_shards", "stdlib_code").success
    assert run.automation().get_num_requested(dg.AssetKey("blend_manifest")) == 1


def test_changed_or_missing_shard_fails_the_manifest_check(data_chain):
    run, storage = data_chain
    for source in SOURCES:
        assert run("token_shards", source).success
    result = run("blend_manifest")
    assert result.success and _check(result, "manifest_shards_match").passed

    shard = storage.shard_prefix("stdlib_docs")
    bin_path = shard.with_name(shard.name + ".bin")
    data = bytearray(bin_path.read_bytes())
    data[0] ^= 1
    bin_path.write_bytes(bytes(data))
    shard.with_name(shard.name + ".idx").unlink()
    only_check = run("", check=dg.AssetCheckKey(dg.AssetKey("blend_manifest"), "manifest_shards_match"))
    evaluation = _check(only_check, "manifest_shards_match")
    assert not evaluation.passed
    problems = evaluation.metadata["problems"].value
    assert f"{bin_path} changed since the manifest was written" in problems
    assert f"{shard}.idx is missing" in problems


def test_checkpoint_audit_names_the_checkpoint_and_fails_without_lineage(tmp_path):
    storage = KilnStorage(data_root=str(tmp_path / "data"), runs_root=str(tmp_path / "runs"))
    directory = checkpoint_dir(storage, "tiny/iteration_00000003")
    assert directory == tmp_path / "runs/tiny/checkpoints/iteration_00000003"
    directory.mkdir(parents=True)
    evaluation = audit_evaluation(directory, "tiny/iteration_00000003")
    assert (evaluation.check_name, evaluation.partition, evaluation.passed) == ("audit", None, False)
    assert evaluation.metadata["checkpoint"].value == "tiny/iteration_00000003"
    assert "lineage.json" in evaluation.metadata["error"].value
    assert audit_summary(evaluation).startswith("the audit could not run: ValueError")


def test_a_failed_audit_lists_a_bounded_number_of_problems(tmp_path):
    directory = tmp_path / "run/checkpoints/iteration_00000001"
    directory.mkdir(parents=True)
    files = [{"name": f"model-{i:07d}-0000050.safetensors", "sha256": "0" * 64} for i in range(50)]
    (directory / "lineage.json").write_text(json.dumps({"checkpoint": {"step": 1, "files": files, "common": {}},
                                                        "run": {"config_path": str(tmp_path / "none.yaml"),
                                                                "config_sha256": "1" * 64}}))
    evaluation = audit_evaluation(directory, "run/iteration_00000001")
    assert not evaluation.passed and evaluation.metadata["failed"].value == 52  # 50 files, common.json, config
    problems = evaluation.metadata["problems"].value
    assert problems.count("missing") == AUDIT_PROBLEMS_SHOWN and "... and 32 more" in problems
    assert f"kiln audit {directory}" in problems
    assert audit_summary(evaluation) == "FAILED: 52 link(s) changed or missing, 0 verified (see the audit check)"


def _record_checkpoint(instance, storage, key, on_disk=True):
    directory = checkpoint_dir(storage, key)
    if on_disk:
        directory.mkdir(parents=True)
        (directory / "common.json").write_text("{}")
    instance.add_dynamic_partitions("checkpoints", [key])
    instance.report_runless_asset_event(dg.AssetMaterialization("checkpoint", partition=key))


def test_a_checkpoint_saved_but_never_reported_is_recorded_when_the_run_starts_again(tmp_path):
    """An async save that completed just before its process was killed: on disk and complete, never a partition."""
    storage = KilnStorage(data_root=str(tmp_path / "data"), runs_root=str(tmp_path / "runs"))
    metrics = storage.run_dir("run") / "metrics.jsonl"
    with dg.instance_for_test() as instance:
        _record_checkpoint(instance, storage, "run/iteration_00000002")  # reported by the killed attempt
        lost = checkpoint_dir(storage, "run/iteration_00000004")
        lost.mkdir(parents=True)
        (lost / "common.json").write_text("{}")
        (lost / "lineage.json").write_text(json.dumps({"checkpoint": {"step": 4, "files": [], "common": {}}}))
        metrics.write_text("".join(json.dumps({"step": s, "loss": 5.0 - s / 10}) + "\n" for s in (1, 2, 3, 4)))

        @dg.op
        def start_again(context) -> list:
            return record_unreported_checkpoints(CheckpointRecorder(context, storage, "run", "v1"), metrics)

        result = dg.GraphDefinition("start_again", node_defs=[start_again]).to_job().execute_in_process(
            instance=instance)
        assert result.output_for_node("start_again") == ["run/iteration_00000004"]
        assert sorted(instance.get_dynamic_partitions("checkpoints")) == ["run/iteration_00000002",
                                                                          "run/iteration_00000004"]
        events = instance.fetch_materializations(dg.AssetRecordsFilter(asset_key=dg.AssetKey("checkpoint")),
                                                 limit=5).records
        assert [e.partition_key for e in events] == ["run/iteration_00000004", "run/iteration_00000002"]
        assert events[0].asset_materialization.metadata["loss"].value == pytest.approx(4.6)
        assert "audit" in events[0].asset_materialization.metadata  # its audit, whatever it finds, is on record


def test_rotated_checkpoints_stop_being_partitions_and_the_check_audits_the_newest(tmp_path):
    storage = KilnStorage(data_root=str(tmp_path / "data"), runs_root=str(tmp_path / "runs"))
    with dg.instance_for_test() as instance:
        _record_checkpoint(instance, storage, "other/iteration_00000001", on_disk=False)  # not this run's
        for step in (1, 2, 3):
            _record_checkpoint(instance, storage, f"run/iteration_{step:08d}")
        shutil.rmtree(checkpoint_dir(storage, "run/iteration_00000001"))  # as save_max rotation does
        assert forget_rotated_checkpoints(instance, storage, "run") == ["run/iteration_00000001"]
        assert sorted(instance.get_dynamic_partitions("checkpoints")) == [
            "other/iteration_00000001", "run/iteration_00000002", "run/iteration_00000003"]
        history = instance.fetch_materializations(dg.AssetRecordsFilter(
            asset_key=dg.AssetKey("checkpoint"), asset_partitions=["run/iteration_00000001"]), limit=5)
        assert len(history.records) == 1  # its history stays

        # "Execute check" in the UI: the unpartitioned check audits the newest recorded checkpoint
        result = dg.materialize([*ALL_ASSETS, *ALL_CHECKS], instance=instance, resources=resources(storage=storage),
                                selection=dg.AssetSelection.checks(dg.AssetCheckKey(dg.AssetKey("checkpoint"),
                                                                                    "audit")),
                                raise_on_error=False)
        evaluation = _check(result, "audit")
        assert not evaluation.passed and evaluation.metadata["checkpoint"].value == "run/iteration_00000003"
        assert "iteration_00000003/lineage.json: unreadable lineage" in evaluation.metadata["error"].value


def _saved_checkpoint(storage: KilnStorage, run_name: str, step: int, config) -> dict:
    """A checkpoint directory its audit passes (one weights file, common.json, lineage.json naming them and the
    run config), and rank 0's message for it."""
    directory = checkpoint_dir(storage, f"{run_name}/iteration_{step:08d}")
    directory.mkdir(parents=True)
    weights = directory / "model-0000000-0000001.safetensors"
    weights.write_bytes(bytes([step]) * 64)
    (directory / "common.json").write_text("{}")
    files = [{"name": weights.name, "sha256": sha256_file(weights)}]
    (directory / "lineage.json").write_text(json.dumps({
        "checkpoint": {"step": step, "files": files, "common": {}},
        "run": {"config_path": str(config), "config_sha256": sha256_file(config)}}))
    return {"path": str(directory), "step": step, "loss": 5.0 - step / 10, "files": files}


def test_one_event_per_checkpoint_and_the_audit_check_follows_the_newest(tmp_path):
    """A checkpoint is one small materialization; the check is evaluated for every failed audit at once (a
    failure is on the check as it always was) and otherwise only when its status changes or the attempt ends."""
    storage = KilnStorage(data_root=str(tmp_path / "data"), runs_root=str(tmp_path / "runs"))
    config = tmp_path / "config.yaml"
    config.write_text("training: {steps: 6}\n")
    run_name = "qwen3_7b_pretraining_2026_12"  # a long name: the partition key is in the event twice
    audit_key = dg.AssetCheckKey(dg.AssetKey("checkpoint"), "audit")

    @dg.op
    def train(context) -> None:
        # three attempts: the second's one audit fails; the third's first message, failing, is retried after
        # its second (the instance refused it once)
        for steps, corrupted in [(range(1, 7), {3}), ([7], {7}), ([9, 8], {8})]:
            recorder = CheckpointRecorder(context, storage, run_name, "v1")
            for step in steps:
                if step == 7:  # save_max rotation deleted the oldest: its partition goes with the next record
                    shutil.rmtree(checkpoint_dir(storage, f"{run_name}/iteration_00000001"))
                message = _saved_checkpoint(storage, run_name, step, config)
                if step in corrupted:  # changed after its save hashed it
                    (Path(message["path"]) / message["files"][0]["name"]).write_bytes(b"torn")
                recorder.record(message)
            recorder.finish()
            checks.append(instance.get_latest_asset_check_evaluation_record(audit_key).event.dagster_event)

    with dg.instance_for_test() as instance:
        checks = []  # the check's latest evaluation after each attempt
        result = dg.GraphDefinition("train", node_defs=[train]).to_job().execute_in_process(instance=instance)
        events = [e.event_specific_data.materialization for e in result.get_asset_materialization_events()]
        assert [e.partition for e in events] == [f"{run_name}/iteration_{s:08d}" for s in [*range(1, 8), 9, 8]]
        assert all(sorted(e.metadata) == ["audit", "loss"] for e in events)
        assert [e.metadata["audit"].value.split(":")[0] for e in events] == \
            ["passed"] * 2 + ["FAILED"] + ["passed"] * 3 + ["FAILED", "passed", "FAILED"]
        # the first of the attempt, the failure, the recovery, the newest when the attempt ended; then a failure;
        # then the first of the third attempt, the older checkpoint's failure, and the newest's pass again
        logged = [(e.metadata["checkpoint"].value[-2:], e.passed) for e in result.get_asset_check_evaluations()]
        assert logged == [("01", True), ("03", False), ("04", True), ("06", True), ("07", False), ("09", True),
                          ("08", False), ("09", True)]
        assert "model-0000000-0000001.safetensors" in result.get_asset_check_evaluations()[1].metadata["problems"].value
        assert sorted(instance.get_dynamic_partitions("checkpoints")) == [
            f"{run_name}/iteration_{s:08d}" for s in range(2, 10)]
        # the check's status is the newest checkpoint's audit: a failed audit leaves it failed, as before
        assert [(c.event_specific_data.passed, c.event_specific_data.metadata["checkpoint"].value[-2:])
                for c in checks] == [(True, "06"), (False, "07"), (True, "09")]

        # two events to a 4 KB page (docs/long-runs.md): measured on SQLite, an event of 1,874 bytes with a
        # 32-character partition key packs two to a page and one of 1,889 does not; the key is in the row twice
        (record,) = instance.fetch_materializations(dg.AssetRecordsFilter(
            asset_key=dg.AssetKey("checkpoint"), asset_partitions=[f"{run_name}/iteration_00000006"]), limit=1).records
        assert len(serialize_value(record.event_log_entry)) + len(record.partition_key) < 1_850
