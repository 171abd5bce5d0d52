"""The scheduled batch path: one run from raw corpora to a training run.

The job mixes source-partitioned assets (raw_corpus, token_shards) with unpartitioned ones. Its run
covers the whole partition range (every source): those two assets have a single-run backfill policy
and build every source of the range in one step, so raw → tokenizer → shards → manifest → training
run in order inside one run, checks included.
"""
import dagster as dg

from assets.data import blend_manifest, raw_corpus, source_partitions, token_shards, tokenizer
from assets.training import training_run

preprocess_then_train = dg.define_asset_job(
    "preprocess_then_train", selection=dg.AssetSelection.assets(raw_corpus, tokenizer, token_shards, blend_manifest,
                                                                training_run),
    description="Re-ingest every source, retrain the tokenizer, re-shard, re-blend and train.",
    # the chain is strictly sequential: one process spares a subprocess start (and the imports) per step
    executor_def=dg.in_process_executor)


def all_sources_tags() -> dict[str, str]:
    """The tags of a run over every source partition (what a single-run backfill of all of them sets)."""
    keys = source_partitions.get_partition_keys()
    return {"dagster/asset_partition_range_start": keys[0], "dagster/asset_partition_range_end": keys[-1]}


def nightly_schedule(run_config: dict | None = None, cron: str = "0 2 * * *") -> dg.ScheduleDefinition:
    """`preprocess_then_train` every night; ships STOPPED: turn it on in the UI (Automation)."""

    @dg.schedule(name="nightly_preprocess_then_train", job=preprocess_then_train, cron_schedule=cron,
                 default_status=dg.DefaultScheduleStatus.STOPPED)
    def _schedule(context: dg.ScheduleEvaluationContext) -> dg.RunRequest:
        tick = context.scheduled_execution_time
        return dg.RunRequest(run_key=f"nightly:{tick.isoformat() if tick else 'manual'}",
                             run_config=run_config or {}, tags=all_sources_tags())

    return _schedule
