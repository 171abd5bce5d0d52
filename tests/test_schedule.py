"""The nightly schedule's tick runs raw → tokenizer → shards → manifest → training as one real run."""
import dataclasses
import datetime

import dagster as dg
import pytest

from assets.training import TrainingRunConfig, render_training_config
from conftest import MICRO_CONFIG
from pipelines.audit import DagsterEvents, cross_check
from pipelines.definitions import build_definitions, resources
from resources.msrun import MsrunResource
from resources.storage import KilnStorage
from resources.tokenizer import TokenizerSettings
from training.data.manifest import load_manifest
from training.lineage import audit_checkpoint

pytestmark = pytest.mark.msrun
RUN_CONFIG = {"ops": {"training_run": {"config": {"config_path": MICRO_CONFIG, "run_name": "nightly"}},
                      "blend_manifest": {"config": {"seq_length": 32}}}}


def test_schedule_ships_stopped_and_its_tick_runs_the_whole_chain(tmp_path, micro_sources):
    storage = KilnStorage(data_root=str(tmp_path / "data"), runs_root=str(tmp_path / "runs"),
                          sources_config=str(micro_sources))
    defs = build_definitions(resources(
        storage=storage,
        tokenizer_settings=TokenizerSettings(vocab_size=512, sample_lines=20_000),
        msrun=MsrunResource(worker_num=2, local_worker_num=2)), schedule_run_config=RUN_CONFIG)
    schedule = defs.resolve_schedule_def("nightly_preprocess_then_train")
    assert schedule.default_status == dg.DefaultScheduleStatus.STOPPED
    with dg.instance_for_test() as instance:
        tick = datetime.datetime(2026, 1, 2, 2, 0, tzinfo=datetime.timezone.utc)
        (request,) = schedule.evaluate_tick(
            # the tick registers the sources' chunks (partitions) with the storage resource, as the daemon's does
            dg.build_schedule_context(instance=instance, scheduled_execution_time=tick,
                                      resources={"storage": storage})).run_requests
        result = defs.resolve_job_def(schedule.job_name).execute_in_process(
            run_config=request.run_config, tags=request.tags, instance=instance)
        assert result.success
        done = {(m.asset_key.to_user_string(), m.partition) for m in result.get_asset_materialization_events()
                for m in [m.event_specific_data.materialization]}
        assert {("raw_corpus", "stdlib_code"), ("raw_corpus", "stdlib_docs"), ("tokenizer", None),
                ("token_shards", "stdlib_code"), ("token_shards", "stdlib_docs"), ("blend_manifest", None),
                ("training_run", None), ("checkpoint", "nightly/iteration_00000003"),
                ("checkpoint", "nightly/iteration_00000006")} <= done
        # the checkpoint audit is one unpartitioned check, each evaluation naming its checkpoint
        checks = {(e.asset_key.to_user_string(), e.check_name, e.partition,
                   e.metadata["checkpoint"].value if "checkpoint" in e.metadata else None): e.passed
                  for e in result.get_asset_check_evaluations()}
        assert checks == {("clean_corpus", "clean_removals_within_limit", None, None): True,
                          ("token_shards", "shards_are_well_formed", None, None): True,
                          ("blend_manifest", "manifest_shards_match", None, None): True,
                          ("checkpoint", "audit", None, "nightly/iteration_00000003"): True,
                          ("checkpoint", "audit", None, "nightly/iteration_00000006"): True}
        # a run over several sources still says what each source held
        raw = instance.fetch_materializations(dg.AssetRecordsFilter(
            asset_key=dg.AssetKey("raw_corpus"), asset_partitions=["stdlib_docs"]), limit=1).records[0]
        metadata = raw.asset_materialization.metadata
        assert metadata["docs/stdlib_docs"].value > 0 and metadata["docs/stdlib_code"].value > 0

        # and the audit finds every link of the checkpoint's lineage among this run's records, the
        # per-source links included (one step built both sources, so their hashes are per-source metadata)
        final = tmp_path / "runs/nightly/checkpoints/iteration_00000006"
        links = cross_check(DagsterEvents(instance, "the test instance"), final, audit_checkpoint(final)[0])
        assert {r.asset: (r.status, r.run_id) for r in links} == {
            name: ("recorded", result.run_id) for name in [
                "raw_corpus[stdlib_code]", "raw_corpus[stdlib_docs]", "tokenizer", "token_shards[stdlib_code]",
                "token_shards[stdlib_docs]", "blend_manifest", "checkpoint[nightly/iteration_00000006]"]}
        # every link was made by the code here; a link whose asset code has changed since says so
        assert all(r.code_version and r.code_version == r.code_version_now for r in links)
        assert "its code changed since: code version now 0123" in dataclasses.replace(
            links[0], code_version_now="0123").line()

        # progress is live: step lines reach the run's log through Pipes, and the first checkpoint is
        # materialized while msrun still trains (before the step logs msrun's exit)
        logs = instance.all_logs(result.run_id)
        step_lines = [e for e in logs if "step:[" in (e.user_message or "")]
        assert len(step_lines) >= 6
        first_checkpoint = next(e.timestamp for e in logs
                                if e.is_dagster_event and e.dagster_event.is_step_materialization
                                and e.dagster_event.partition == "nightly/iteration_00000003")
        msrun_exit = next(e.timestamp for e in logs if (e.user_message or "").startswith("[msrun] exited with code 0"))
        assert step_lines[0].timestamp < first_checkpoint < msrun_exit

    # how the next materialization of the run would start
    def start(mode, run_name="nightly", init_from=""):
        rendered, _ = render_training_config(TrainingRunConfig(config_path=MICRO_CONFIG, run_name=run_name,
                                                               start=mode, init_from=init_from), storage, "CPU",
                                             load_manifest(storage.manifest_path(), storage.root))
        return rendered["checkpoint"]["load_path"], rendered["checkpoint"]["no_load_optim"]

    save_path = tmp_path / "runs/nightly/checkpoints"
    assert start("resume") == (str(save_path), False)
    # starts at step 0 write a new history, never into a save path whose checkpoints they would replace
    for mode in ("fresh", "weights_only"):
        with pytest.raises(dg.Failure, match="choose another run_name"):
            start(mode, init_from="nightly" if mode == "weights_only" else "")
    assert start("fresh", run_name="nightly-2") == ("", False)
    assert start("weights_only", run_name="nightly-w", init_from="nightly") == (
        str(save_path / "iteration_00000006"), True)
    with pytest.raises(dg.Failure, match="needs init_from"):
        start("weights_only", run_name="nightly-w")
    with pytest.raises(dg.Failure, match="no complete checkpoint"):
        start("weights_only", run_name="nightly-w", init_from="nightly-2")
    with pytest.raises(dg.Failure, match="applies to start: weights_only only"):
        start("resume", init_from="nightly")
    with pytest.raises(dg.Failure, match="'again' is not one of"):
        start("again")
