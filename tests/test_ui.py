"""The real webserver + daemon: launch the chain through GraphQL, as the UI's Materialize does."""
import pytest

from conftest import MICRO_CONFIG
from dagster_dev import dagster_dev, wait_for_run
from pipelines.chain import config_for

pytestmark = pytest.mark.ui
SOURCES = ["stdlib_code", "stdlib_docs"]


def test_chain_materializes_through_the_webserver(tmp_path, micro_sources):
    from dagster import DagsterRunStatus
    run_config = {
        "resources": {"tokenizer_settings": {"config": {"vocab_size": 512, "sample_lines": 20000}}},
        "ops": {"training_run": {"config": {"config_path": MICRO_CONFIG, "run_name": "ui"}},
                "blend_manifest": {"config": {"seq_length": 32}}},
    }
    plan = [("raw_corpus", SOURCES), ("tokenizer", [None]), ("token_shards", SOURCES), ("blend_manifest", [None]),
            ("training_run", [None])]
    # automation off: this test launches every step itself
    with dagster_dev(tmp_path, {"KILN_SOURCES": str(micro_sources), "KILN_AUTOMATION": "off"}) as (client, _):
        for key, partitions in plan:
            for partition in partitions:
                run_id = client.submit_job_execution(
                    "__ASSET_JOB", repository_location_name="kiln", asset_selection=[key],
                    run_config=config_for(key, run_config),
                    tags={"dagster/partition": partition} if partition else {})
                assert wait_for_run(client, run_id) == DagsterRunStatus.SUCCESS, f"{key}[{partition}] failed"
    assert (tmp_path / "runs/ui/checkpoints/iteration_00000006/common.json").exists()
