"""The scheduled batch path: one run from raw corpora to a training run.

The job mixes chunk-partitioned assets (raw_corpus, token_shards) with unpartitioned ones. Its run
covers the whole partition range (every chunk of every source): those two assets have a single-run
backfill policy (raw_corpus ingests the range in one step, clean_corpus cleans it in one step with one dedup,
token_shards in a step per chunk), so raw → clean →
tokenizer → shards → manifest → training run in order inside one run, checks included.
"""
import dagster as dg

from assets.chunks import register_source_chunks, source_chunks
from assets.cleaning import clean_corpus
from assets.data import blend_manifest, raw_corpus, token_shards, tokenizer
from assets.training import training_run
from resources.storage import KilnStorage

preprocess_then_train = dg.define_asset_job(
    "preprocess_then_train", selection=dg.AssetSelection.assets(raw_corpus, clean_corpus, tokenizer, token_shards,
                                                                blend_manifest, training_run),
    description="Re-ingest every source, retrain the tokenizer, re-shard, re-blend and train.",
    # the chain is strictly sequential: one process spares a subprocess start (and the imports) per step
    executor_def=dg.in_process_executor)


# A step per group of contiguous chunks (token_shards' chunks_of_run: step_mib, 512 raw MiB by default), as many at
# once as there are cores (the multiprocess executor's default max_concurrent); forkserver, so a step starts by
# forking a process that has imported what a step needs instead of importing it again in a fresh interpreter
# (spawn, the default). That is Kiln's Definitions and, as much again
# (~1 s per step on this machine, 500 modules: SQLAlchemy, Alembic, rich...), what each step's process imports to
# open the instance and to capture its compute logs, and the filesystem IO manager's paths. Preloading those too
# cut a 16-chunk backfill of tiny chunks from 24.4 to 13.7 CPU-seconds (0.56 s per step; benchmarks/
# chunked_preprocess.py --corpus-mib 16, 2 rounds each, the same to 0.1 s). Dagster's private module names:
# tests/test_chunks.py imports each, so a Dagster upgrade that moves one fails there, not silently here.
STEP_PRELOAD_MODULES = ["pipelines.definitions", "dagster._core.instance.factory",
                        "dagster._core.storage.sqlite_storage", "dagster._core.storage.local_compute_log_manager",
                        "dagster._core.storage.migration.utils", "dagster._core.secrets.env_file",
                        "upath.implementations.local"]
CHUNK_EXECUTION = {"execution": {"config": {"start_method": {"forkserver": {"preload_modules": STEP_PRELOAD_MODULES}}}}}

shard_chunks = dg.define_asset_job(
    "shard_chunks", selection=dg.AssetSelection.assets(token_shards), executor_def=dg.multiprocess_executor,
    config=CHUNK_EXECUTION,
    description="Tokenize the chunks of the run's partition range, a step per group of contiguous chunks "
                "(token_shards.chunks_of_run's step_mib), side by side (backfill token_shards from this job's "
                "Partitions tab: a single run over the range).")


def all_sources_tags(instance: dg.DagsterInstance, storage: KilnStorage) -> dict[str, str]:
    """The tags of a run over every chunk of every source (what a single-run backfill of all of them sets),
    registering the chunks first."""
    register_source_chunks(instance, storage)
    keys = instance.get_dynamic_partitions(source_chunks.name)  # a range follows the instance's order
    return {"dagster/asset_partition_range_start": keys[0], "dagster/asset_partition_range_end": keys[-1]}


def nightly_schedule(run_config: dict | None = None, cron: str = "0 2 * * *") -> dg.ScheduleDefinition:
    """`preprocess_then_train` every night; ships STOPPED: turn it on in the UI (Automation)."""

    @dg.schedule(name="nightly_preprocess_then_train", job=preprocess_then_train, cron_schedule=cron,
                 default_status=dg.DefaultScheduleStatus.STOPPED)
    def _schedule(context: dg.ScheduleEvaluationContext, storage: KilnStorage) -> dg.RunRequest:
        tick = context.scheduled_execution_time
        return dg.RunRequest(run_key=f"nightly:{tick.isoformat() if tick else 'manual'}",
                             run_config=run_config or {}, tags=all_sources_tags(context.instance, storage))

    return _schedule
