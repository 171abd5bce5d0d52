"""End to end: every asset of the chain, msrun with 2 CPU workers, checkpoints, resume and audit."""
import json
import re
import shutil

import dagster as dg
import pytest

from conftest import MICRO_CONFIG
from pipelines.chain import config_for, materialize_chain
from pipelines.definitions import ALL_ASSETS, build_definitions, resources
from resources.msrun import MsrunResource
from resources.storage import KilnStorage
from resources.tokenizer import TokenizerSettings
from test_tensorboard import assert_tensorboard_matches
from training.cli import main as kiln
from training.run import main as train_main

# the UI's asset groups: what trains and scores a run, the data ablations, and the data chain (every other asset)
GROUPS = {"training_run": "training", "checkpoint": "training", "checkpoint_eval": "training",
          "run_comparison": "training", "ablation_run": "ablation", "ablation_ranking": "ablation"}

pytestmark = pytest.mark.msrun


def chain_resources(tmp_path, sources):
    return resources(storage=KilnStorage(data_root=str(tmp_path / "data"), runs_root=str(tmp_path / "runs"),
                                         sources_config=str(sources)),
                     tokenizer_settings=TokenizerSettings(vocab_size=512, sample_lines=20_000),
                     msrun=MsrunResource(worker_num=2, local_worker_num=2))


def metric_losses(run_dir):
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def training_config(**extra):
    return {"ops": {"training_run": {"config": {"config_path": MICRO_CONFIG, "run_name": "micro", **extra}},
                    "blend_manifest": {"config": {"seq_length": 32}}}}


def test_chain_trains_checkpoints_resumes_and_audits(tmp_path, micro_sources, capsys, monkeypatch):
    res = chain_resources(tmp_path, micro_sources)
    with dg.instance_for_test() as instance:
        chain = materialize_chain(instance, res, training_config())
        # the console: each step line once (the Dagster log's, not also msrun's echo of worker 0), no MindSpore
        # INFO lines (printed at worker exit whatever GLOG_v says)
        console = capsys.readouterr()
        lines = (console.out + console.err).splitlines()
        assert [sum(f"{{ step:[    {step}/    6]" in line for line in lines) for step in range(1, 7)] == [1] * 6
        assert not [line for line in lines if line.startswith("[INFO] ")]
        run = chain.metadata("training_run")
        assert run["first_step"] == 1 and run["final_step"] == 6
        # MindFormers' default data_parallel_shard -1: the two workers shard the model (ZeRO-3)
        assert run["mesh"] == ("2 workers = pp 1 × dp_replicate 1 × dp_shard 2 × cp 1 × tp 1; "
                               "FSDP optim_grads_params")
        assert run["final_loss"] < run["first_loss"]
        assert sorted(instance.get_dynamic_partitions("checkpoints")) == [
            "micro/iteration_00000003", "micro/iteration_00000006"]
        assert [m.partition for m in chain.materializations["checkpoint"]] == [
            "micro/iteration_00000003", "micro/iteration_00000006"]
        shards = chain.metadata("token_shards", "stdlib_code")
        assert shards["tokens"] > 10_000 and shards["dtype"] == "uint16"
        # what the UI shows: paths as paths, hashes as text, per-file tables, a markdown summary, plottable numbers
        kinds = {(key, name): type(value).__name__ for key, events in chain.materializations.items()
                 for name, value in events[-1].metadata.items()}
        assert {kinds[k] for k in [("raw_corpus", "dir"), ("token_shards", "dir"), ("tokenizer", "model_path"),
                                   ("blend_manifest", "manifest_path"), ("training_run", "run_dir"),
                                   ("raw_corpus", "sidecar"), ("token_shards", "sidecar"),
                                   ("tokenizer", "trained_on")]} == {"PathMetadataValue"}
        # a checkpoint's event holds only its loss and audit: its step and path follow from its partition key
        assert sorted(name for key, name in kinds if key == "checkpoint") == ["audit", "loss"]
        assert {kinds[k] for k in [("tokenizer", "sha256"), ("token_shards", "tokenizer_sha256"),
                                   ("blend_manifest", "sha256"), ("checkpoint", "audit")]} == {"TextMetadataValue"}
        assert {kinds[k] for k in [("raw_corpus", "files"), ("token_shards", "shards"),
                                   ("blend_manifest", "sources")]} == {"TableMetadataValue"}
        # each checkpoint's audit on its own partition: the check itself is unpartitioned (one status, fast UI)
        audits = [m.metadata["audit"].value for m in chain.materializations["checkpoint"]]
        assert len(audits) == 2 and all(re.fullmatch(r"passed: \d+ file\(s\) verified", a) for a in audits), audits
        assert {kinds[k] for k in [("blend_manifest", "summary"), ("training_run", "loss_curve")]} == {
            "MarkdownMetadataValue"}
        assert {kinds[k] for k in [("checkpoint", "loss"),
                                   ("training_run", "final_loss"), ("blend_manifest", "tokens/stdlib_code")]} <= {
            "FloatMetadataValue", "IntMetadataValue"}
        specs = {spec.key.to_user_string(): spec for spec in build_definitions(res).resolve_all_asset_specs()}
        assert {key: (spec.group_name, bool(spec.owners), bool(spec.kinds), "stage" in spec.tags,
                      bool(spec.description)) for key, spec in specs.items()} == {
            key: (GROUPS.get(key, "data"), True, True, True, True) for key in specs}

        # data parallel is exact: one process with gradient accumulation sees the same global batches
        run_dir = tmp_path / "runs/micro"
        single = tmp_path / "single_process"
        assert train_main(["--config", str(run_dir / "config.yaml"), "--output-dir", str(single),
                           "--set", "checkpoint.enable_save=false",
                           "--set", f"monitor.tensorboard.output_dir={single / 'tensorboard'}",
                           "--set", "monitor.tensorboard.log_interval=2"]) == 0
        assert metric_losses(single) == pytest.approx(metric_losses(run_dir), rel=1e-5)
        # and wrote TensorBoard events as it trained: every 2nd step's scalars, as tensorboard's reader reads them
        assert_tensorboard_matches(single / "tensorboard", [json.loads(line) for line in
                                                            (single / "metrics.jsonl").read_text().splitlines()],
                                   interval=2, global_batch_size=4)
        # and a checkpoint written by 2 workers resumes in 1 process (metadata.json names where each tensor is)
        resumed = tmp_path / "single_process_resumed"
        assert train_main(["--config", str(run_dir / "config.yaml"), "--output-dir", str(resumed),
                           "--set", "checkpoint.enable_save=false",
                           "--set", f"checkpoint.load_path={run_dir / 'checkpoints/iteration_00000003'}"]) == 0
        assert metric_losses(resumed) == pytest.approx(metric_losses(run_dir)[3:], rel=1e-5)

        # more steps: resumes from iteration 6 instead of starting over. Bookkeeping that fails while training
        # runs does not stop it: the instance refuses the first checkpoint's partition once (retried when msrun
        # exits) and the audit cannot run at all (a failed check per checkpoint, saying why)
        refusals = []
        add_partitions = type(instance).add_dynamic_partitions

        def flaky_add(self, name, keys):
            if not refusals:
                refusals.append(keys)
                raise RuntimeError("database is locked")
            return add_partitions(self, name, keys)
        monkeypatch.setattr(type(instance), "add_dynamic_partitions", flaky_add)
        monkeypatch.setattr("assets.training.audit_checkpoint", lambda *a, **k: 1 / 0)
        # save_max 2: rotation deletes iterations 3 and 6 from disk, and so their partitions
        again = dg.materialize(ALL_ASSETS, selection=["training_run"], instance=instance, resources=res,
                               run_config=config_for("training_run", training_config(
                                   overrides=["training.steps=12", "checkpoint.save_max=2"])))
        monkeypatch.undo()
        (event,) = [m for m in again.asset_materializations_for_node("training_run")
                    if m.asset_key == dg.AssetKey("training_run")]
        resumed = {k: v.value for k, v in event.metadata.items()}
        assert resumed["first_step"] == 7 and resumed["final_step"] == 12
        assert refusals == [["micro/iteration_00000009"]]
        assert sorted(instance.get_dynamic_partitions("checkpoints")) == [
            "micro/iteration_00000009", "micro/iteration_00000012"]
        assert not (tmp_path / "runs/micro/checkpoints/iteration_00000006").exists()
        # a rotated checkpoint's history stays in the event log
        assert instance.fetch_materializations(dg.AssetRecordsFilter(
            asset_key=dg.AssetKey("checkpoint"), asset_partitions=["micro/iteration_00000003"]), limit=5).records
        audits = [e for e in again.get_asset_check_evaluations() if e.check_name == "audit"]
        assert sorted((e.partition, e.metadata["checkpoint"].value, e.passed) for e in audits) == [
            (None, "micro/iteration_00000009", False), (None, "micro/iteration_00000012", False)]
        assert all("the audit could not run: ZeroDivisionError" in e.metadata["error"].value for e in audits)
        checkpoint_dir = tmp_path / "runs/micro/checkpoints/iteration_00000012"
        lineage = json.loads((checkpoint_dir / "lineage.json").read_text())
        assert lineage["run"]["resumed_from"].endswith("iteration_00000006")

    # the upstream chain stored once for the whole run, each checkpoint pointing at it; the index lists them
    (entry,) = (tmp_path / "runs/lineage").iterdir()
    assert lineage["inputs"]["sha256"] == entry.stem and "raw_files" not in lineage
    capsys.readouterr()
    assert kiln(["lineage", "--consumers", "stdlib_docs", "--runs-root", str(tmp_path / "runs"), "--json"]) == 0
    assert [c["step"] for c in json.loads(capsys.readouterr().out)["consumers"]] == [9, 12]  # 3 and 6 rotated
    assert kiln(["audit", str(checkpoint_dir)]) == 0
    out = capsys.readouterr().out
    assert "ok        tokenizer" in out and "ok        raw file" in out and "OK:" in out

    raw = tmp_path / "data/raw/stdlib_docs/part-00000.jsonl"
    raw.write_text(raw.read_text().replace("a", "b", 1))
    assert kiln(["audit", str(checkpoint_dir)]) == 1
    out = capsys.readouterr().out
    assert "FAILED: raw file raw/stdlib_docs/part-00000.jsonl changed since training" in out

    # the checkpoint alone, copied elsewhere: its own files verify, the rest are reported missing
    copy = tmp_path / "copy" / checkpoint_dir.name
    shutil.copytree(checkpoint_dir, copy)
    assert kiln(["audit", str(copy), "--data-root", str(tmp_path / "gone")]) == 3


def test_failing_worker_fails_the_asset_with_its_log_tail(tmp_path, micro_sources):
    res = chain_resources(tmp_path, micro_sources)
    with dg.instance_for_test() as instance:
        materialize_chain(instance, res, training_config(), through="blend_manifest")
        with pytest.raises(dg.Failure) as failure:
            dg.materialize(ALL_ASSETS, selection=["training_run"], instance=instance, resources=res,
                           run_config=config_for("training_run", training_config(
                               overrides=[f"checkpoint.load_path={tmp_path}/missing"])))
        assert "msrun exited with code" in failure.value.description
        assert "checkpoint.load_path" in failure.value.description and "no such directory" in failure.value.description
        # degrees that do not factorise msrun's workers fail before msrun starts
        def logs():
            return {p.name: p.stat().st_mtime_ns for p in (tmp_path / "runs/micro/msrun_logs").glob("*")}
        logs_before = logs()
        with pytest.raises(dg.Failure, match=r"tensor_parallel 3 × pipeline_parallel 1 × context_parallel 1 = 3 "
                                             r"does not divide the 2 workers"):
            dg.materialize(ALL_ASSETS, selection=["training_run"], instance=instance, resources=res,
                           run_config=config_for("training_run", training_config(
                               overrides=["parallelism.tensor_parallel=3", "parallelism.sequence_parallel=true"])))
        assert logs() == logs_before
