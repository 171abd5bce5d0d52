"""Data ablations as a job: ``ablation_run`` (one partition per blend variant of the ablation spec) trains the
proxy model on the variant for each seed and scores it on the downstream tasks (training/ablation.py, in a
process of its own under the training pool's device lease, as checkpoint_eval runs kiln eval);
``ablation_ranking`` ranks the variants with the spread over seeds. The ``data_ablation`` job runs the variants,
``weekly_data_ablation`` (off until turned on) requests every variant, and the ranking follows by its automation
condition once a variant's run lands.
"""
import json
import os
import sys
from pathlib import Path

import dagster as dg

from assets.data import blend_manifest
from assets.evaluation import run_leased
from assets.training import TRAINING_POOL
from assets.versions import versioned_asset
from resources.msrun import MsrunResource
from resources.storage import PROJECT_ROOT, KilnStorage
from training.ablation import ABLATION_DIR, AblationSpec, rank, ranking_table

ABLATION_SPEC = os.environ.get("KILN_ABLATION_SPEC", str(PROJECT_ROOT / "configs" / "ablation.yaml"))
ablation_variants = dg.StaticPartitionsDefinition(list(AblationSpec.load(ABLATION_SPEC).variants))


@versioned_asset(partitions_def=ablation_variants, deps=[blend_manifest], group_name="ablation",
                 kinds={"mindspore"}, owners=["team:kiln"], tags={"stage": "evaluate"}, pool=TRAINING_POOL)
def ablation_run(context: dg.AssetExecutionContext, storage: KilnStorage, msrun: MsrunResource
                 ) -> dg.MaterializeResult:
    """The proxy model trained on one blend variant for the spec's tokens, once per seed, each run's last
    checkpoint scored on the spec's tasks; the per-seed scores and their mean."""
    command = [sys.executable, "-m", "training.ablation", ABLATION_SPEC, context.partition_key,
               "--data-root", str(storage.root), "--runs-root", str(Path(storage.runs_root).resolve())]
    run_leased(context, msrun, command, f"ablation of {context.partition_key}")
    result = json.loads(_result_path(storage, context.partition_key).read_text())
    (row,) = rank([result])
    return dg.MaterializeResult(metadata={
        "tasks_bpb": dg.MetadataValue.float(row["tasks_bpb"]),
        "tasks_primary": dg.MetadataValue.float(row["tasks_primary"]),
        "seeds": dg.MetadataValue.md(_seed_table(result["seeds"])),
        "weights": dg.MetadataValue.json(result["weights"]), "manifest": dg.MetadataValue.path(result["manifest"])})


def _seed_table(seeds: list[dict]) -> str:
    rows = "\n".join(f"| {s['seed']} | {s['steps']} | {s['final_loss']:.4f} | {s['tasks_bpb']:.4f} | "
                     f"{s['tasks_primary']:.4f} |" for s in seeds)
    return "| seed | steps | final loss | tasks bpb | tasks primary |\n|---|---|---|---|---|\n" + rows


def _result_path(storage: KilnStorage, variant: str) -> Path:
    return Path(storage.runs_root).resolve() / ABLATION_DIR / variant / "result.json"


@versioned_asset(deps=[ablation_run], group_name="ablation", kinds={"python"}, owners=["team:kiln"],
                 tags={"stage": "evaluate"}, automation_condition=dg.AutomationCondition.eager())
def ablation_ranking(context: dg.AssetExecutionContext, storage: KilnStorage) -> dg.MaterializeResult:
    """The variants ranked by the tasks' mean bits per byte (mean over seeds, spread = max - min), with the mean
    primary score and each task's; the variants not yet run are listed."""
    results, missing = [], []
    for variant in ablation_variants.get_partition_keys():
        path = _result_path(storage, variant)
        (results.append(json.loads(path.read_text())) if path.is_file() else missing.append(variant))
    if not results:
        raise dg.Failure(f"no variant has been run yet: materialize ablation_run ({', '.join(missing)})",
                         allow_retries=False)
    rows = rank(results)
    context.log.info(ranking_table(rows))
    return dg.MaterializeResult(metadata={
        "ranking": dg.MetadataValue.md(ranking_table(rows)), "best": dg.MetadataValue.text(rows[0]["variant"]),
        "not_run": dg.MetadataValue.text(", ".join(missing) or "none")})


data_ablation = dg.define_asset_job("data_ablation", selection=[ablation_run], partitions_def=ablation_variants)


@dg.schedule(job=data_ablation, cron_schedule="0 3 * * 6", default_status=dg.DefaultScheduleStatus.STOPPED)
def weekly_data_ablation(context: dg.ScheduleEvaluationContext):
    """Every variant once a week (Saturday 03:00), one run each; the ranking follows them."""
    stamp = context.scheduled_execution_time.isoformat() if context.scheduled_execution_time else "manual"
    return [dg.RunRequest(run_key=f"{stamp}/{variant}", partition_key=variant)
            for variant in ablation_variants.get_partition_keys()]
