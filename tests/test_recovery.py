"""Which training_run failures are retried: a worker's error a retry would meet again is marked in its log and
ends the asset with the reason; a config refused before launch is not retried either. (A killed worker, retried
and resumed under materialize(): test_resume.)"""
import dagster as dg
import numpy as np
import pytest

from conftest import MICRO_CONFIG, PROJECT_ROOT
from pipelines.definitions import ALL_ASSETS, resources
from resources.msrun import MsrunResource
from resources.storage import KilnStorage
from test_resume import storage_for_shard
from training.checkpoint import CheckpointError
from training.config import ConfigError
from training.data.indexed import IndexedDatasetError
from training.failures import NOT_RETRIABLE, log_sizes, not_retriable, not_retriable_cause
from training.optim import NonFiniteStepError
from training.run import main as train_main


def test_only_the_lines_a_launch_appended_count(tmp_path):
    (tmp_path / "worker_0.log").write_text(f"{NOT_RETRIABLE} ConfigError: from an earlier launch\n")
    (tmp_path / "worker_1.log").write_text("step 1\n")
    before = log_sizes(tmp_path)
    assert not_retriable_cause(tmp_path, before) is None
    with open(tmp_path / "worker_1.log", "a") as log:
        log.write(f"Traceback ...\n{NOT_RETRIABLE} NonFiniteStepError: step 5: loss nan\n")
    assert not_retriable_cause(tmp_path, before) == "worker_1.log: NonFiniteStepError: step 5: loss nan"
    (tmp_path / "worker_0.log").write_text("started again\n")  # msrun truncated it: read from its start
    assert not_retriable_cause(tmp_path, before) == "worker_1.log: NonFiniteStepError: step 5: loss nan"


def test_config_data_checkpoint_and_nan_errors_are_not_retriable():
    assert not_retriable(ConfigError("x")) and not_retriable(NonFiniteStepError("step 3: loss nan"))
    assert not_retriable(IndexedDatasetError("x.bin: size does not match")) and not_retriable(CheckpointError("x"))
    assert not not_retriable(RuntimeError("the collective timed out")) and not not_retriable(OSError(104, "reset"))


def test_a_worker_stopped_by_a_config_error_is_not_retried_for_its_one_line(tmp_path, shard, capsys):
    code = train_main(["--config", str(PROJECT_ROOT / MICRO_CONFIG), "--output-dir", str(tmp_path / "run"),
                       "--set", f"train_dataset.dataloader.config.data_path=['{shard}']",
                       "--set", "train_dataset.dataloader.config.eod=2", "--set", "kiln.training.eval_interval=2",
                       "--set", f"checkpoint.save_path={tmp_path / 'run/checkpoints'}"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("config error: kiln.training.eval_iters = 100 global batches")
    log = tmp_path / "worker_0.log"
    log.write_text(err)
    assert not_retriable_cause(tmp_path, {}) == f"worker_0.log: {err.splitlines()[0]}"


@pytest.mark.parametrize("refused", ["config", "missing manifest"])
def test_a_training_run_refused_before_launch_is_not_retried_and_says_why(tmp_path, shard, monkeypatch, refused):
    launched = []
    monkeypatch.setattr(MsrunResource, "run", lambda *args, **kwargs: launched.append(args))
    if refused == "config":
        storage = storage_for_shard(tmp_path, shard)
        overrides, why = ["training.max_norm=0"], "training.max_norm must be > 0"
    else:  # a data root where blend_manifest was never materialized
        storage = KilnStorage(data_root=str(tmp_path / "data"), runs_root=str(tmp_path / "runs"))
        overrides, why = [], f"{storage.manifest_path()}: unreadable manifest"
    with dg.instance_for_test() as instance:
        result = dg.materialize(ALL_ASSETS, selection=["training_run"], instance=instance, raise_on_error=False,
                                resources=resources(storage=storage, msrun=MsrunResource()),
                                run_config={"ops": {"training_run": {"config": {
                                    "config_path": MICRO_CONFIG, "run_name": "refused", "retry_delay_s": 0,
                                    "overrides": overrides}}}})
    kinds = [e.event_type_value for e in result.all_events]
    assert not result.success and "STEP_UP_FOR_RETRY" not in kinds and not launched
    (failure,) = [e for e in result.all_events if e.event_type_value == "STEP_FAILURE"]
    assert why in failure.event_specific_data.error.message


def test_a_run_retry_resumes_and_lists_the_attempt_its_killed_run_lost(tmp_path):
    """Dagster's run retry of a run whose run worker died (a new run, tagged dagster/retry_number, in the first
    run's group): it resumes whatever start the run had, and numbers its attempt after the one the dead run
    started and never ended, which the history lists as lost."""
    from types import SimpleNamespace

    from assets.training import (TrainingRunConfig, attempt_config, attempts_table, finish_attempt,
                                 run_group_attempts, start_attempt)
    from training.checkpoint import save_checkpoint
    from training.parallel.comm import Collectives
    from training.parallel.mesh import World

    storage = KilnStorage(data_root=str(tmp_path / "data"), runs_root=str(tmp_path / "runs"))
    run_dir = storage.run_dir("r")
    world = World(rank=0, size=1)  # the checkpoint the killed run saved before it died
    save_checkpoint(save_path=run_dir / "checkpoints", step=4, model={"w": np.ones(3, np.float32)}, optim={},
                    common={"global_step": 4, "consumed_samples": 16, "global_batch_size": 4}, lineage={},
                    prefix="checkpoint", save_max=1, world=world, collectives=Collectives(world))
    train_config = SimpleNamespace(checkpoint=SimpleNamespace(load_path="", no_load_optim=False))

    def context(run_id: str, root_run_id: str | None, tags: dict) -> SimpleNamespace:
        return SimpleNamespace(retry_number=0, run=SimpleNamespace(run_id=run_id, root_run_id=root_run_id, tags=tags))

    fresh = TrainingRunConfig(run_name="r", start="fresh")
    first = context("A", None, {})
    assert attempt_config(first, fresh, storage).start == "fresh"  # not a retry: a fresh start is refused later
    start_attempt(first, run_dir, train_config, run_dir / "metrics.jsonl")  # its run worker is then killed
    start_attempt(context("X", None, {}), run_dir, train_config, run_dir / "metrics.jsonl")  # another run group

    retry = context("B", "A", {"dagster/retry_number": "1", "dagster/parent_run_id": "A"})
    assert attempt_config(retry, fresh, storage).start == "resume"
    attempt = start_attempt(retry, run_dir, train_config, run_dir / "metrics.jsonl")
    assert attempt["attempt"] == 2
    attempts = finish_attempt(run_dir, attempt, "succeeded", "")
    assert [(a["run_id"], a["attempt"], a["outcome"]) for a in attempts] == [("A", 1, "lost"), ("B", 2, "succeeded")]
    assert "| 1 | 0 | lost | its step process or run worker was killed |" in attempts_table(attempts)
    assert [a["outcome"] for a in run_group_attempts(run_dir, "X")] == ["lost"]


def test_a_lost_process_is_retried_with_the_run_configs_delay_until_max_retries_is_used_up(tmp_path):
    from types import SimpleNamespace

    from assets.training import TrainingRunConfig, retry_or_fail, start_attempt

    config = TrainingRunConfig(run_name="r", max_retries=2, retry_delay_s=7.5)
    train_config = SimpleNamespace(checkpoint=SimpleNamespace(load_path="", no_load_optim=False))
    failure = dg.Failure("msrun exited with code -9; worker_1.log ends with: ...")
    warnings = []
    outcomes = []
    for retry_number in range(3):
        context = SimpleNamespace(retry_number=retry_number, log=SimpleNamespace(warning=warnings.append),
                                  run=SimpleNamespace(run_id="A", root_run_id=None, tags={}))
        attempt = start_attempt(context, tmp_path, train_config, tmp_path / "metrics.jsonl")
        outcomes.append(retry_or_fail(context, config, tmp_path, attempt, failure, not_retriable=None))
    first, second, last = outcomes
    assert isinstance(first, dg.RetryRequested) and isinstance(second, dg.RetryRequested)
    assert (first.max_retries, first.seconds_to_wait) == (2, 7.5)
    assert warnings[0] == ("attempt 1 failed (msrun exited with code -9); retrying in 7.5 s from the newest complete "
                           "checkpoint (2 retries left)")
    assert isinstance(last, dg.Failure) and not last.allow_retries
    assert last.description.startswith("not retried: max_retries (2) used up\n\nmsrun exited with code -9")
    assert last.metadata["attempt_history"].value.splitlines()[2:] == [
        "| 1 | 0 | retried | msrun exited with code -9 |", "| 2 | 0 | retried | msrun exited with code -9 |",
        "| 3 | 0 | failed | msrun exited with code -9 |"]
