"""The shipped model configs, each materialized as a `training_run` through Dagster on the built-in
corpus (msrun, 2 CPU workers): the model the YAML describes trains and its loss falls.

Only the run length is shortened (the models, batch sizes, sequence length and optimizer are the files'
own), so a config that stops validating or training fails here, not in a user's first run. DeepSeek-V3 tiny
trains uncompiled: compiling its step costs more CPU than its four steps (tests/test_deepseek_v3.py compares
the compiled DeepSeek-V3 step with the eager one)."""
import json

import dagster as dg
import pytest

from pipelines.chain import config_for, materialize_chain
from pipelines.definitions import ALL_ASSETS
from test_chain import chain_resources

pytestmark = pytest.mark.msrun

SHORT_RUN = ["training.steps=4", "checkpoint.save_interleaved_steps=4", "lr_scheduler.warmup_steps=2"]


def training_run_config(config_path: str, run_name: str, *overrides: str) -> dict:
    return {"ops": {"training_run": {"config": {"config_path": config_path, "run_name": run_name,
                                                "overrides": [*SHORT_RUN, *overrides]}},
                    "blend_manifest": {"config": {"seq_length": 128}}}}


def step_metrics(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_qwen3_and_deepseek_v3_tiny_configs_train_as_training_run_partitions(tmp_path, micro_sources):
    res = chain_resources(tmp_path, micro_sources)
    with dg.instance_for_test() as instance:
        materialize_chain(instance, res, training_run_config("configs/deepseek_v3_tiny.yaml", "deepseek_v3_tiny",
                                                             "fast_step.compile=false"))
        qwen3 = dg.materialize(ALL_ASSETS, selection=["training_run"], instance=instance, resources=res,
                               run_config=config_for("training_run",
                                                     training_run_config("configs/qwen3_tiny.yaml", "qwen3_tiny")))
        assert qwen3.success
        assert sorted(instance.get_dynamic_partitions("checkpoints")) == [
            "deepseek_v3_tiny/iteration_00000004", "qwen3_tiny/iteration_00000004"]

    deepseek = step_metrics(tmp_path / "runs/deepseek_v3_tiny")
    assert [m["step"] for m in deepseek] == [1, 2, 3, 4]
    assert deepseek[-1]["lm_loss"] < deepseek[0]["lm_loss"] - 0.5
    # the MoE, MTP and balancing parts of the config are live: each has its own term in the step log
    assert all(m["mtp_1_loss"] > 0 and m["load_balancing_loss"] > 0 for m in deepseek)
    common = json.loads((tmp_path / "runs/deepseek_v3_tiny/checkpoints/iteration_00000004/common.json").read_text())
    assert common["global_step"] == 4

    dense = step_metrics(tmp_path / "runs/qwen3_tiny")
    assert [m["step"] for m in dense] == [1, 2, 3, 4]
    assert dense[-1]["loss"] < dense[0]["loss"] - 0.5
