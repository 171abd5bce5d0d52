"""Kiln's one Definitions object, loaded by workspace.yaml."""
import dagster as dg

from assets.ablation import ablation_ranking, ablation_run, data_ablation, weekly_data_ablation
from assets.checks import checkpoint_audit, manifest_shards_match, shards_are_well_formed
from assets.cleaning import clean_corpus, clean_removals_within_limit
from assets.data import blend_manifest, raw_corpus, token_shards, tokenizer
from assets.evaluation import checkpoint_eval, run_comparison
from assets.training import checkpoint, training_run
from pipelines.jobs import nightly_schedule, preprocess_then_train, shard_chunks
from pipelines.sensors import kiln_automation, raw_files_sensor
from resources.msrun import MsrunResource
from resources.storage import KilnStorage
from resources.tokenizer import TokenizerSettings

ALL_ASSETS = [raw_corpus, clean_corpus, tokenizer, token_shards, blend_manifest, training_run, checkpoint,
              checkpoint_eval, run_comparison, ablation_run, ablation_ranking]
ALL_CHECKS = [clean_removals_within_limit, shards_are_well_formed, manifest_shards_match, checkpoint_audit]


def resources(**overrides) -> dict:
    """Kiln's resources with their defaults; tests and the demo override single ones."""
    return {"storage": KilnStorage(), "tokenizer_settings": TokenizerSettings(), "msrun": MsrunResource(),
            **overrides}


def build_definitions(resources: dict, schedule_run_config: dict | None = None) -> dg.Definitions:
    return dg.Definitions(assets=ALL_ASSETS, asset_checks=ALL_CHECKS,
                          jobs=[preprocess_then_train, shard_chunks, data_ablation],
                          schedules=[nightly_schedule(schedule_run_config), weekly_data_ablation],
                          sensors=[raw_files_sensor, kiln_automation], resources=resources)


defs = build_definitions(resources())


def shard_chunks_job() -> dg.JobDefinition:
    """`shard_chunks` for ``dg.reconstructable``: run under the multiprocess executor without a code server
    (the chunk backfill's test and benchmark), each step process loads it from here."""
    return defs.resolve_job_def("shard_chunks")
