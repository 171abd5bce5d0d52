"""Training assets: a training run launched through msrun, and its step checkpoints.

``checkpoint`` is an external asset with one dynamic partition per saved step (``<run>/iteration_N``).
Pipes cannot report a partitioned materialization, so rank 0 sends each saved checkpoint as a custom
message and the ``training_run`` step turns it into a partition plus a materialization while training
is still running.
"""

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

import dagster as dg
import yaml
from pydantic import Field

from assets.data import EAGER_AFTER_CHECKS, blend_manifest, combined_hash
from assets.versions import default_training_config, versioned_asset
from resources.msrun import MsrunResource, OrphanedStep
from resources.storage import PROJECT_ROOT, KilnStorage
from training.atomic import write_json_atomic, write_text_atomic
from training.checkpoint import LINEAGE, complete_steps, iteration_dir, latest_complete_checkpoint
from training.config import (ConfigError, TrainConfig, apply_overrides, check_plain_name, load_config, read_config,
                             set_field)
from training.data.hashing import sha256_file
from training.data.manifest import ManifestError, read_manifest, training_data_path
from training.failures import log_sizes, not_retriable_cause
from training.lineage import PROBLEMS, AuditCache, audit_checkpoint, lineage_inputs, store_lineage_inputs
from training.parallel.mesh import ParallelDims
from training.profiling import profile_root
from training.reporting import CHECKPOINT_MESSAGE, METRICS_MESSAGE, drop_partial_line, is_step_record, read_records

checkpoint_partitions = dg.DynamicPartitionsDefinition(name="checkpoints")
checkpoint = dg.AssetSpec(
    "checkpoint", partitions_def=checkpoint_partitions, deps=["training_run"], group_name="training",
    kinds={"safetensors"}, owners=["team:kiln"], tags={"stage": "checkpoint"},
    description="One partition per saved training step, keyed `<run>/iteration_XXXXXXXX`, materialized by "
                "`training_run` as soon as the step's files are complete. Audit one with `kiln audit <dir>`.")

START_MODES = ("resume", "weights_only", "fresh")

class TrainingRunConfig(dg.Config):
    config_path: str = Field(default=default_training_config(),
                             description="training YAML (MindFormers layout), relative to the project root; "
                                         "the default comes from KILN_TRAIN_CONFIG when set")
    run_name: str = Field(default="qwen3_tiny", description="run directory name under the runs root")
    overrides: list[str] = Field(default_factory=list, description="KEY.PATH=VALUE, e.g. training.steps=300")
    start: str = Field(default="resume", description=(
        "resume: from the run's newest complete checkpoint (weights, optimizer, step) when it has one; "
        "weights_only: from step 0 with the weights of run init_from's newest checkpoint and a new optimizer "
        "state; fresh: from scratch. weights_only and fresh write a new history: run_name must have no "
        "checkpoints yet"))
    init_from: str = Field(default="", description="start: weights_only: the run whose newest complete "
                                                   "checkpoint gives the initial weights")
    max_retries: int = Field(default=3, description=(
        "how many times a launch that lost a process (a worker or msrun killed, a node gone) is started again, "
        "resuming from the newest complete checkpoint; a config, data or checkpoint error, or NaN steps past "
        "training.max_consecutive_skipped_steps, is never retried"))
    retry_delay_s: float = Field(default=60.0, description="seconds between a failed launch and its retry")

# the blend manifest is the one place these are set (BlendConfig): the YAML may repeat a value, not change it
FROM_MANIFEST = {"train_dataset.dataloader.config.seq_length": "seq_length",
                 "train_dataset.dataloader.config.split": "split",
                 "train_dataset.dataloader.config.seed": "seed", "model.seq_length": "seq_length"}


def _refuse_manifest_conflicts(source: str, data: dict, overrides: list, manifest: dict, storage: KilnStorage) -> None:
    """A value of FROM_MANIFEST in the YAML or the overrides that differs from the manifest's fails the run, naming
    where it was set and the two ways out."""
    unset = object()
    for where, settings in [(source, data), ("training_run config overrides", apply_overrides({}, overrides))]:
        for key, name in FROM_MANIFEST.items():
            value = settings
            for part in key.split("."):
                value = value.get(part, unset) if isinstance(value, dict) else unset
            if value is not unset and value != manifest[name]:
                raise dg.Failure(
                    f"{where}: {key} is {value!r}, but the blend manifest {storage.manifest_path()} was built with "
                    f"{name} {manifest[name]!r}, and training takes {name} from the manifest: drop {key} from "
                    f"{where}, or re-materialize blend_manifest with config {name}: {value!r}")


def render_training_config(cfg: TrainingRunConfig, storage: KilnStorage, device_target: str, manifest: dict
                           ) -> tuple[dict, Path]:
    """The user's YAML with Kiln's wiring: data, seq_length, split and seed from the blend ``manifest``
    (storage's, as read_manifest read it), save/resume paths from the run dir."""
    try:
        check_plain_name(cfg.run_name, "training_run config run_name")  # its directory, inside the runs root
        if cfg.init_from:
            check_plain_name(cfg.init_from, "training_run config init_from")
    except ValueError as exc:
        raise dg.Failure(str(exc)) from None
    source = (PROJECT_ROOT / cfg.config_path).resolve()
    try:
        data = read_config(source)  # duplicate keys and alias bombs refused, as when training reads it
    except ConfigError as exc:
        raise dg.Failure(str(exc)) from None
    _refuse_manifest_conflicts(str(source), data, cfg.overrides, manifest, storage)
    run_dir = storage.run_dir(cfg.run_name)
    save_path = run_dir / "checkpoints"
    special = manifest["tokenizer"]["special_ids"]
    if cfg.start not in START_MODES:
        raise dg.Failure(f"training_run config start: {cfg.start!r} is not one of {list(START_MODES)}")
    newest = latest_complete_checkpoint(save_path) if save_path.exists() else None
    if cfg.start != "resume" and newest:  # from step 0 again, its saves would collide with the run's own
        raise dg.Failure(f"training_run config start: {cfg.start}, but run {cfg.run_name!r} already has "
                         f"checkpoints in {save_path}; a {cfg.start} start begins a new history at step 0, which "
                         f"needs a new save path: choose another run_name (start: resume continues this one)")
    load_path = str(save_path) if newest else ""
    if cfg.start == "weights_only":
        load_path = str(_init_checkpoint(cfg, storage))
    elif cfg.init_from:
        raise dg.Failure(f"training_run config init_from: {cfg.init_from!r} applies to start: weights_only only, "
                         f"this run has start: {cfg.start}")
    wiring = {
        "train_dataset.dataloader.config.data_path": training_data_path(manifest, storage.root),
        "train_dataset.dataloader.config.eod": special["eod"],
        "train_dataset.dataloader.config.pad": special["pad"],
        **{key: manifest[name] for key, name in FROM_MANIFEST.items()},
        "train_dataset.dataloader.config.path_to_cache": str(run_dir / "index_cache"),
        "checkpoint.save_path": str(save_path),
        "checkpoint.load_path": load_path,
        "checkpoint.no_load_optim": cfg.start == "weights_only",
        "context.device_target": device_target,
        # recorded once: a copy of the project tree trains into itself (training/relocation.py)
        "kiln.roots.runs_root": str(Path(storage.runs_root).resolve()),
        "kiln.roots.data_root": str(storage.root),
    }
    for key, value in wiring.items():
        set_field(data, key, value)
    return apply_overrides(data, cfg.overrides), run_dir


def _init_checkpoint(cfg: TrainingRunConfig, storage: KilnStorage) -> Path:
    """The checkpoint a weights_only start takes its weights from: run ``init_from``'s newest complete one."""
    if not cfg.init_from:
        raise dg.Failure("training_run config start: weights_only needs init_from, the run whose newest complete "
                         "checkpoint gives the weights")
    if cfg.init_from == cfg.run_name:
        raise dg.Failure(f"training_run config init_from: {cfg.init_from!r} is this run; a weights_only start "
                         f"writes a new run: give it another run_name")
    source = storage.run_dir(cfg.init_from) / "checkpoints"
    found = latest_complete_checkpoint(source) if source.exists() else None
    if found is None:
        raise dg.Failure(f"training_run config init_from: run {cfg.init_from!r} has no complete checkpoint "
                         f"in {source}")
    return found


def checkpoint_dir(storage: KilnStorage, partition: str) -> Path:
    """The directory of checkpoint partition `<run>/iteration_N`."""
    run_name, _, iteration = partition.partition("/")
    return storage.run_dir(run_name) / "checkpoints" / iteration


AUDIT_PROBLEMS_SHOWN = 20  # the rest is one `kiln audit <dir>` away: an event stays small at any corpus size


def audit_evaluation(checkpoint_dir: Path, partition: str, cache: AuditCache | None = None
                     ) -> dg.AssetCheckEvaluation:
    """`kiln audit` of one checkpoint as an evaluation of the checkpoint asset's `audit` check, naming the
    checkpoint in its metadata. The check is not partitioned: Dagster rebuilds a partitioned check's status
    with a query per partition on every page load, which at thousands of checkpoints takes the UI tens of
    seconds; each checkpoint's own result is in its materialization's `audit` entry instead. Only the
    problems are listed (at most AUDIT_PROBLEMS_SHOWN), never every file verified. An audit that cannot run
    (an unreadable lineage.json, a malformed record, a file that cannot be read) is a failed check saying
    why, never an exception: this runs while training does."""
    metadata: dict = {"checkpoint": dg.MetadataValue.text(partition),
                      "lineage": dg.MetadataValue.text(lineage_digest(checkpoint_dir))}
    try:
        _, checks = audit_checkpoint(checkpoint_dir, cache=cache)
    except Exception as exc:  # noqa: BLE001 -- reported as the check's result
        metadata["error"] = dg.MetadataValue.text(f"the audit could not run: {type(exc).__name__}: {exc}")
        return dg.AssetCheckEvaluation(asset_key=checkpoint.key, check_name="audit", passed=False, metadata=metadata)
    bad = [c for c in checks if c.status in PROBLEMS]
    metadata.update({"verified": sum(c.status == "ok" for c in checks), "failed": len(bad)})
    if bad:
        more = len(bad) - AUDIT_PROBLEMS_SHOWN
        lines = [c.line().strip() for c in bad[:AUDIT_PROBLEMS_SHOWN]] + ([f"... and {more} more"] if more > 0 else [])
        metadata["problems"] = dg.MetadataValue.md("```\n" + "\n".join(lines) + f"\n```\n`kiln audit {checkpoint_dir}`"
                                                   " prints every link")
    return dg.AssetCheckEvaluation(asset_key=checkpoint.key, check_name="audit", passed=not bad, metadata=metadata)


def audit_summary(evaluation: dg.AssetCheckEvaluation) -> str:
    """One line for the checkpoint's own materialization: its audit, visible on its partition."""
    if "error" in evaluation.metadata:
        return evaluation.metadata["error"].value
    verified, failed = (evaluation.metadata[k].value for k in ("verified", "failed"))
    return f"passed: {verified} file(s) verified" if evaluation.passed else \
        f"FAILED: {failed} link(s) changed or missing, {verified} verified (see the audit check)"


def run_partitions(instance: dg.DagsterInstance, run_name: str) -> set[str]:
    """The partition keys of run ``run_name``'s checkpoints."""
    keys = instance.get_dynamic_partitions(checkpoint_partitions.name)
    return {key for key in keys if key.startswith(f"{run_name}/")}


def forget_rotated_checkpoints(instance: dg.DagsterInstance, storage: KilnStorage, run_name: str,
                               partitions: set[str] | None = None) -> list[str]:
    """Delete the partitions of ``run_name``'s checkpoints that are no longer complete on disk (``save_max``
    rotation removed them), so the UI offers no action on a checkpoint that is gone. Their materializations
    and audits stay in the event log. ``partitions``: the run's partition keys, when the caller keeps them
    (reading every run's keys from the instance after each save grows with the number of checkpoints)."""
    save_path = storage.run_dir(run_name) / "checkpoints"
    # a directory named iteration_N is complete (the save renames it into place): one listing, not a stat each
    on_disk = set(os.listdir(save_path)) if save_path.is_dir() else set()
    if partitions is None:
        partitions = run_partitions(instance, run_name)
    gone = sorted(key for key in partitions if key.partition("/")[2] not in on_disk)
    for key in gone:
        instance.delete_dynamic_partition(checkpoint_partitions.name, key)
    return gone


class CheckpointRecorder:
    """Records a training run's saved checkpoints in the instance: each one's audit, partition and one event.

    The event is a materialization holding the loss and the audit's one-line result, small enough that SQLite
    puts two to a 4 KB page (docs/long-runs.md, growth rule). The audit check's evaluation is logged only when
    the check's status must change or name the newest checkpoint: every failed audit, at once; the first
    passed audit of an attempt and the first after a failure; and, when the attempt ends, the newest
    checkpoint's. So the check's status is always the newest checkpoint's audit, every failure is in its
    history, and a run of 10,000 passing checkpoints logs two evaluations, not 10,000.
    (benchmarks/lineage_scale.py records generated checkpoints through this same class.)"""

    def __init__(self, context: dg.OpExecutionContext, storage: KilnStorage, run_name: str, code_version: str):
        self.context, self.storage, self.run_name, self.code_version = context, storage, run_name, code_version
        self.cache = AuditCache()  # each checkpoint's audit hashes what its save added and reuses the rest
        self.newest: dg.AssetCheckEvaluation | None = None  # the newest recorded checkpoint's audit
        self.newest_logged = True
        self.partitions: set[str] | None = None  # the run's partition keys, read once: one recorder adds them

    def record(self, message: dict) -> str:
        """Rank 0's message for a saved checkpoint: its audit, partition and materialization (and the check's
        evaluation when due); then forget the checkpoints rotation removed. Returns its partition key."""
        path = Path(message["path"])
        key = f"{self.run_name}/{path.name}"
        evaluation = audit_evaluation(path, key, self.cache)
        self.context.instance.add_dynamic_partitions(checkpoint_partitions.name, [key])
        self.context.log_event(checkpoint_event(message, key, self.code_version, audit_summary(evaluation)))
        if self.newest is not None and key < self.newest.metadata["checkpoint"].value:
            # a message retried after newer ones (the instance refused it once): not the newest checkpoint
            if not evaluation.passed:  # shown at once all the same
                self.context.log_event(evaluation)
                if self.newest.passed:  # the check is back to the newest's pass when the attempt ends
                    self.newest_logged = False
        else:
            status_changes = self.newest is None or not (evaluation.passed and self.newest.passed)
            self.newest, self.newest_logged = evaluation, False
            if status_changes:
                self._log_newest()
        if self.partitions is None:
            self.partitions = run_partitions(self.context.instance, self.run_name)
        self.partitions.add(key)
        self.partitions -= set(forget_rotated_checkpoints(self.context.instance, self.storage, self.run_name,
                                                          self.partitions))
        return key

    def finish(self) -> None:
        """At the attempt's end (however it ends): the check names the newest checkpoint, and no partition
        outlives its directory (a message retried after msrun exited may record one rotated meanwhile)."""
        if not self.newest_logged:
            self._log_newest()
        forget_rotated_checkpoints(self.context.instance, self.storage, self.run_name)

    def _log_newest(self) -> None:
        self.context.log_event(self.newest)
        self.newest_logged = True


def lineage_digest(checkpoint_dir: Path) -> str:
    """The sha256 naming the checkpoint's upstream chain in the lineage store (``runs/lineage/<sha256>.json``),
    or why there is none: the audit judges lineage.json, this only names what it points at."""
    try:
        return json.loads((checkpoint_dir / LINEAGE).read_text())["inputs"]["sha256"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"(no lineage store entry: {type(exc).__name__})"


def record_unreported_checkpoints(recorder: CheckpointRecorder, metrics_path: Path) -> list[str]:
    """Record the run's complete checkpoints that never became partitions: an async save that completes in the
    instant before its process is killed is on disk, and a retry resumes from it, but its message never reached
    the step. Its materialization is rebuilt from what the save wrote (lineage.json's files) and the step's record
    in metrics.jsonl, as rank 0 would have sent them. Returns their partition keys."""
    save_path = recorder.storage.run_dir(recorder.run_name) / "checkpoints"
    known = run_partitions(recorder.context.instance, recorder.run_name)
    unreported = [step for step in complete_steps(save_path)
                  if f"{recorder.run_name}/{iteration_dir(save_path, step).name}" not in known]
    if not unreported:  # the usual start: no need to read a long run's metrics.jsonl
        return []
    records = {r["step"]: r for r in read_records(metrics_path) if is_step_record(r)}  # the last attempt's wins
    recorded = []
    for step in unreported:
        if step not in records:
            continue
        directory = iteration_dir(save_path, step)
        try:
            files = saved_files(directory)
        except ValueError as exc:  # recorded all the same: the audit recorded with it fails and says why
            recorder.context.log.warning(str(exc))
            files = []
        recorded.append(recorder.record({**records[step], "path": str(directory), "files": files}))
    return recorded


def saved_files(checkpoint_dir: Path) -> list[dict]:
    """The files a checkpoint's save wrote, with their sha256, as its lineage.json lists them (the checkpoint's
    data version); a ValueError naming the file when it cannot say."""
    path = checkpoint_dir / LINEAGE
    try:
        return json.loads(path.read_text())["checkpoint"]["files"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{path}: no list of the checkpoint's files ({type(exc).__name__}: {exc})") from None


def checkpoint_event(message: dict, key: str, code_version: str, audit: str) -> dg.AssetMaterialization:
    """Only what the UI needs per checkpoint, the loss (plotted over the partitions) and the audit's result:
    the instance keeps every event of every checkpoint, and SQLite gives an event larger than ~1.85 KB a 4 KB
    page of its own, in the run's database and again in the index (docs/long-runs.md). The step is the
    partition key's; the scalars are on training_run's observations; the files with their sha256 and the
    lineage digest in lineage.json, whose directory follows from the partition key."""
    return dg.AssetMaterialization(
        asset_key="checkpoint", partition=key,
        metadata={"loss": dg.MetadataValue.float(message["loss"]), "audit": dg.MetadataValue.text(audit)},
        tags={"dagster/data_version": combined_hash([f["sha256"] for f in message["files"]]),
              "dagster/code_version": code_version},
    )


def step_observation(message: dict) -> dg.AssetObservation:
    """A training step's scalars (rank 0 sends them every monitor.tensorboard.log_interval steps) as an
    observation of training_run: its Plots tab draws loss, lr, grad_norm and throughput while the run trains."""
    return dg.AssetObservation(
        asset_key="training_run", description=f"step {message['step']}",
        metadata={"step": message["step"], **{name: dg.MetadataValue.float(value) for name, value in message.items()
                                              if name not in ("event", "step")}})


# training starts on its own after a new blend only when asked to: a run can take the devices for days
AUTO_TRAIN = os.environ.get("KILN_AUTO_TRAIN") == "1"
TRAINING_POOL = "npu"

# its code version: the engine, the default training YAML and their wiring here (assets/versions.py)
@versioned_asset(deps=[blend_manifest], group_name="training", kinds={"mindspore"}, owners=["team:kiln"],
                 tags={"stage": "train"}, pool=TRAINING_POOL,
                 # an exception of the step itself (not msrun's: those are judged below) gets the defaults
                 retry_policy=dg.RetryPolicy(max_retries=TrainingRunConfig().max_retries,
                                             delay=TrainingRunConfig().retry_delay_s),
                 automation_condition=EAGER_AFTER_CHECKS if AUTO_TRAIN else None)
def training_run(context: dg.AssetExecutionContext, config: TrainingRunConfig, storage: KilnStorage,
                 msrun: MsrunResource) -> dg.MaterializeResult:
    """Train on the blend manifest with msrun (any parallel layout over its workers), saving step checkpoints.

    Re-materializing with more steps (`overrides: [training.steps=N]`) resumes from the newest complete
    checkpoint of the same `run_name`; `start: weights_only` takes only its weights, `start: fresh` trains
    from scratch into a new `run_name`. Only one training step runs per device set at a time (pool `npu`).
    A launch that lost a process is retried (`max_retries`, `retry_delay_s`), resuming where it saved last.
    """
    run = prepare_run(context, config, storage, msrun)
    launched = launch_run(context, config, storage, msrun, run)
    return run_result(run, launched, msrun)


@dataclass
class PreparedRun:
    """A launch's inputs, written and checked before msrun takes the devices."""
    run_dir: Path
    config_file: Path  # the rendered training YAML the workers read
    lineage_file: Path  # the upstream chain every checkpoint's lineage.json points at
    train_config: TrainConfig
    mesh: str  # the layout in one line, for the log and the metadata


@dataclass
class LaunchedRun:
    """What a successful launch did: its msrun command, this attempt and every attempt of its run group, and the
    checkpoints it reported."""
    command: list[str]
    attempt: dict
    attempts: list[dict]
    saved: list[dict]


def prepare_run(context: dg.AssetExecutionContext, config: TrainingRunConfig, storage: KilnStorage,
                msrun: MsrunResource) -> PreparedRun:
    """The training YAML rendered from the user's and the blend manifest, checked as the workers will check it,
    and the lineage inputs stored. A problem here is the run config's or the data's: never retried."""
    try:
        # read once: the rendered config, the tokenizer checked and the lineage all come from this version of it
        manifest, manifest_sha256 = read_manifest(storage.manifest_path(), storage.root)
    except ManifestError as exc:  # a retry would read the same file: blend_manifest must be materialized again
        raise dg.Failure(f"{exc}: materialize blend_manifest", allow_retries=False) from None
    try:
        rendered, run_dir = render_training_config(attempt_config(context, config, storage), storage,
                                                   msrun.device_target, manifest)
    except dg.Failure as exc:  # the run config asks for something impossible: a retry would ask again
        raise dg.Failure(exc.description, metadata=exc.metadata, allow_retries=False) from None
    run_dir.mkdir(parents=True, exist_ok=True)
    config_file = run_dir / "config.yaml"
    write_text_atomic(config_file, yaml.safe_dump(rendered, sort_keys=False))
    train_config, dims = checked_training_config(config_file, config, storage, msrun, manifest)
    lineage_file = run_dir / "lineage_inputs.json"
    # the upstream chain goes to the lineage store once; every checkpoint's lineage.json points at it
    write_json_atomic(lineage_file, store_lineage_inputs(storage.runs_root, lineage_inputs(
        storage.manifest_path(), storage.root, (manifest, manifest_sha256))))
    parallelism = train_config.parallelism
    sharding = f"FSDP {parallelism.data_parallel_shard_strategy}" if dims.dp_shard_enabled else "parameters replicated"
    mesh = f"{dims.describe()}; {sharding}" + (", sequence parallel" if dims.tp_enabled else "")
    context.log.info(f"mesh: {mesh}")
    for warning in train_config.warnings():
        context.log.warning(warning)
    if train_config.checkpoint.load_path:
        what = ("starting from the weights of" if train_config.checkpoint.no_load_optim
                else "resuming from the newest complete checkpoint in")
        context.log.info(f"{what} {train_config.checkpoint.load_path}")
    return PreparedRun(run_dir, config_file, lineage_file, train_config, mesh)


def checked_training_config(config_file: Path, config: TrainingRunConfig, storage: KilnStorage,
                            msrun: MsrunResource, manifest: dict) -> tuple[TrainConfig, ParallelDims]:
    """The rendered config, its model and its layout over msrun's workers checked as the workers will check them;
    a problem is a Failure naming the user's config, never retried."""
    try:
        # model: as the workers will build it, before msrun takes the devices, its problems in the same report;
        # imported here, as the model package imports MindSpore, which loading the definitions does not need
        from training.launch import check_layout
        from training.model import model_config, validate_model_section

        train_config = load_config(config_file, model_check=model_config)
        model = validate_model_section(train_config, storage.root / manifest["tokenizer"]["path"])
        # every parallel layout mistake, as training.run checks it again before any communicator is built
        dims = check_layout(train_config, model, msrun.worker_num)
    except ConfigError as exc:
        raise dg.Failure(f"training config {config.config_path}: {exc}", allow_retries=False) from None
    return train_config, dims


def launch_run(context: dg.AssetExecutionContext, config: TrainingRunConfig, storage: KilnStorage,
               msrun: MsrunResource, run: PreparedRun) -> LaunchedRun:
    """msrun's workers train ``run``: each checkpoint they report is recorded as it lands, each step's scalars
    observed; the attempt is recorded, and a failed launch retried or failed (``retry_or_fail``)."""
    saved: list[dict] = []
    recorder = CheckpointRecorder(context, storage, config.run_name,
                                  context.assets_def.code_versions_by_key[context.asset_key])

    def on_message(message: dict) -> None:
        if message.get("event") == METRICS_MESSAGE:
            context.log_event(step_observation(message))
            return
        if message.get("event") != CHECKPOINT_MESSAGE:
            return
        recorder.record(message)
        saved.append(message)

    metrics_path = run.run_dir / "metrics.jsonl"
    drop_partial_line(metrics_path)  # the workers' reporter does the same: this run's records start here
    attempt = start_attempt(context, run.run_dir, run.train_config, metrics_path)
    for key in record_unreported_checkpoints(recorder, metrics_path):
        context.log.warning(f"checkpoint {key} was saved by an attempt killed before it reported it: recorded now")
    log_dir = run.run_dir / "msrun_logs"
    logged_before = log_sizes(log_dir)
    try:
        command = msrun.run(context, ["-m", "training.run", "--config", str(run.config_file), "--output-dir",
                                      str(run.run_dir), "--lineage", str(run.lineage_file)],
                            log_dir=log_dir, on_custom_message=on_message)
    except OrphanedStep:  # its run is failed already: a run retry resumes, this process must only end
        raise
    except dg.Failure as failure:
        raise retry_or_fail(context, config, run.run_dir, attempt, failure,
                            not_retriable_cause(log_dir, logged_before)) from None
    finally:
        recorder.finish()
    return LaunchedRun(command, attempt, finish_attempt(run.run_dir, attempt, "succeeded", ""), saved)


def run_result(run: PreparedRun, launched: LaunchedRun, msrun: MsrunResource) -> dg.MaterializeResult:
    """The materialization of a trained run: where it is, how it ran, its losses and held-out loss, its attempts;
    its data version is its final checkpoint's files."""
    train_config = run.train_config
    final = latest_complete_checkpoint(Path(train_config.checkpoint.save_path))
    try:
        final_files = saved_files(final) if final else []
    except ValueError as exc:  # its checkpoints are on disk; the run's data version cannot be named
        raise dg.Failure(f"training finished, but its final checkpoint cannot name its files: {exc}",
                         allow_retries=False) from None
    metadata = {
        "run_dir": dg.MetadataValue.path(str(run.run_dir)),
        "config_sha256": dg.MetadataValue.text(sha256_file(run.config_file)),
        "msrun_command": dg.MetadataValue.text(" ".join(launched.command)), "workers": msrun.worker_num,
        "mesh": dg.MetadataValue.text(run.mesh),
        "checkpoints_saved": len(launched.saved),
        "final_checkpoint": dg.MetadataValue.path(str(final) if final else ""),
        # the blend manifest's, as training used them (train_dataset.dataloader.config)
        **{name: getattr(train_config.train_dataset.dataloader.config, name)
           for name in ("seq_length", "split", "seed")},
    }
    if train_config.profiler.enable_profiling:
        metadata["profile"] = dg.MetadataValue.path(str(profile_root(train_config, run.run_dir)))
    attempts = launched.attempts
    # every attempt's records; a step trained again after a retry counts once, as its last attempt logged it
    losses, validation = records_metadata(read_records(run.run_dir / "metrics.jsonl", attempts[0]["metrics_offset"]))
    metadata.update({**losses, "attempts": len(attempts), "resumed_from_step": launched.attempt["resumed_from_step"],
                     "attempt_history": dg.MetadataValue.md(attempts_table(attempts)), **validation})
    return dg.MaterializeResult(metadata=metadata,
                                data_version=dg.DataVersion(combined_hash([f["sha256"] for f in final_files])))


def records_metadata(records: list[dict]) -> tuple[dict, dict]:
    """From the run's records: the losses and throughput of its steps (each step once, as its last attempt logged
    it), and its last held-out loss (kiln.training.eval_interval); each empty when there is none."""
    steps = sorted({r["step"]: r for r in records if is_step_record(r)}.values(), key=lambda r: r["step"])
    validations = [r for r in records if not is_step_record(r)]
    losses, validation = {}, {}
    if steps:
        timed = [s["tokens_per_s"] for s in steps[1:]] or [steps[0]["tokens_per_s"]]
        losses = {"first_step": steps[0]["step"], "final_step": steps[-1]["step"], "first_loss": steps[0]["loss"],
                  "final_loss": steps[-1]["loss"], "tokens_seen": steps[-1]["tokens_seen"],
                  "tokens_per_s": round(sum(timed) / len(timed), 1),
                  "loss_curve": dg.MetadataValue.md(_loss_table(steps))}
    if validations:
        validation = {"validation_step": validations[-1]["step"],
                      "final_val_loss": dg.MetadataValue.float(validations[-1]["val_loss"]),
                      "final_val_ppl": dg.MetadataValue.float(validations[-1]["val_ppl"])}
    return losses, validation


def attempt_config(context: dg.AssetExecutionContext, config: TrainingRunConfig, storage: KilnStorage
                   ) -> TrainingRunConfig:
    """A retry resumes what the failed attempt saved, whichever way that attempt started (a weights_only or
    fresh start's retry would otherwise be refused for the checkpoints its first attempt wrote). A retry is the
    step's (its retry policy, a lost process) or the run's (Dagster's run retries re-execute a run whose run
    worker died)."""
    save_path = storage.run_dir(config.run_name) / "checkpoints"
    retried = context.retry_number or RUN_RETRY_NUMBER_TAG in context.run.tags
    if retried and save_path.exists() and latest_complete_checkpoint(save_path):
        return config.model_copy(update={"start": "resume", "init_from": ""})
    return config


ATTEMPTS = "attempts.jsonl"  # in the run dir: a record when a launch of training_run starts, one when it ends
RUN_RETRY_NUMBER_TAG = "dagster/retry_number"  # set by Dagster on the runs its run retries launch
LOST = "lost"  # an attempt that started and never ended: its step process or its run worker was killed


def start_attempt(context: dg.AssetExecutionContext, run_dir: Path, train_config, metrics_path: Path) -> dict:
    """Record that an attempt starts, numbered after every earlier attempt of its run group (the first run and
    the runs retrying it), so an attempt whose process was killed before it could record its end is listed."""
    load_path = train_config.checkpoint.load_path
    resumed = latest_complete_checkpoint(Path(load_path)) if load_path and Path(load_path).is_dir() else None
    step = re.fullmatch(r"iteration_(\d+)", resumed.name) if resumed else None
    root_run_id = context.run.root_run_id or context.run.run_id
    attempt = {"run_id": context.run.run_id, "root_run_id": root_run_id,
               "attempt": len(run_group_attempts(run_dir, root_run_id)) + 1,
               "resumed_from_step": int(step.group(1)) if step and not train_config.checkpoint.no_load_optim else 0,
               "metrics_offset": metrics_path.stat().st_size if metrics_path.exists() else 0}
    _append_attempt(run_dir, {**attempt, "outcome": "started", "cause": ""})
    return attempt


def finish_attempt(run_dir: Path, attempt: dict, outcome: str, cause: str) -> list[dict]:
    """Record the attempt's outcome; return every attempt of its run group, this one last."""
    _append_attempt(run_dir, {**attempt, "outcome": outcome, "cause": cause})
    return run_group_attempts(run_dir, attempt["root_run_id"])


def _append_attempt(run_dir: Path, record: dict) -> None:
    path = run_dir / ATTEMPTS
    drop_partial_line(path)
    with open(path, "a") as stream:
        stream.write(json.dumps(record) + "\n")


def run_group_attempts(run_dir: Path, root_run_id: str) -> list[dict]:
    """Each attempt of the run group once, as it ended; one that only started was lost with its process."""
    latest: dict[int, dict] = {}
    for record in read_records(run_dir / ATTEMPTS):
        if record.get("root_run_id", record["run_id"]) == root_run_id:
            latest[record["attempt"]] = record
    return [record if record["outcome"] != "started" else
            {**record, "outcome": LOST, "cause": "its step process or run worker was killed"}
            for _, record in sorted(latest.items())]


def retry_or_fail(context: dg.AssetExecutionContext, config: TrainingRunConfig, run_dir: Path, attempt: dict,
                  failure: dg.Failure, not_retriable: str | None) -> Exception:
    """What a failed launch raises: a retry request when it lost a process, a failure saying why not when the
    workers stopped on an error a retry would meet again (or the retries are used up)."""
    cause = not_retriable or failure.description.splitlines()[0].split(";")[0]  # "msrun exited with code N"
    retries_left = config.max_retries - context.retry_number  # this run's; a run retry starts its own count
    retried = not_retriable is None and retries_left > 0
    attempts = finish_attempt(run_dir, attempt, "retried" if retried else "failed", cause)
    metadata = {**failure.metadata, "attempt_history": dg.MetadataValue.md(attempts_table(attempts))}
    if retried:
        context.log.warning(f"attempt {attempt['attempt']} failed ({cause}); retrying in {config.retry_delay_s:g} s "
                            f"from the newest complete checkpoint ({retries_left} retr"
                            f"{'y' if retries_left == 1 else 'ies'} left)")
        return dg.RetryRequested(max_retries=config.max_retries, seconds_to_wait=config.retry_delay_s)
    why = (f"not retried: a worker stopped on an error a retry would meet again ({not_retriable})"
           if not_retriable else f"not retried: max_retries ({config.max_retries}) used up")
    return dg.Failure(f"{why}\n\n{failure.description}", metadata=metadata, allow_retries=False)


def attempts_table(attempts: list[dict]) -> str:
    cell = lambda text: text.replace("|", "\\|") or "-"  # noqa: E731 -- a cause may hold a table's separator
    rows = "\n".join(f"| {a['attempt']} | {a['resumed_from_step']} | {a['outcome']} | {cell(a['cause'])} |"
                     for a in attempts)
    return "| attempt | resumed from step | outcome | cause |\n|---|---|---|---|\n" + rows


def _loss_table(steps: list[dict], rows: int = 10) -> str:
    stride = max(1, len(steps) // rows)
    picked = steps[::stride] + ([steps[-1]] if (len(steps) - 1) % stride else [])
    body = "\n".join(f"| {s['step']} | {s['loss']:.4f} | {s['lr']:.2e} | {s['tokens_per_s']:.0f} |" for s in picked)
    return "| step | loss | lr | tokens/s |\n|---|---|---|---|\n" + body
