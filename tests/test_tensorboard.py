"""monitor.tensorboard: event files written during training hold every scalar of the step records, by step and
by consumed samples, every log_interval steps, as TensorBoard's own reader reads them."""
import json

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from conftest import MICRO_CONFIG, PROJECT_ROOT
from training.run import main as train_main


def test_tensorboard_holds_every_logged_scalar_by_step_and_by_samples(tmp_path, shard):
    events = tmp_path / "tensorboard"
    assert train_main(["--config", str(PROJECT_ROOT / MICRO_CONFIG), "--output-dir", str(tmp_path / "run"),
                       *[arg for setting in (
                           f"train_dataset.dataloader.config.data_path=[{shard}]", "train_dataset.dataloader.config.eod=2",
                           "checkpoint.enable_save=false", "training.steps=2", f"monitor.tensorboard.output_dir={events}",
                           "monitor.tensorboard.log_interval=2", "monitor.tensorboard.queue_size=3")
                         for arg in ("--set", setting)]]) == 0
    records = [json.loads(line) for line in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    logged = [r for r in records if r["step"] % 2 == 0]
    assert [r["step"] for r in logged] == [2]

    reader = EventAccumulator(str(events), size_guidance={"scalars": 0, "tensors": 0})
    reader.Reload()
    # MindFormers' names where it has one, the record's own key (dashed) for the rest
    by_name = {"loss": "loss", "learning-rate": "lr", "grad-norm": "grad_norm", "iteration-time": "step_time_s",
               "throughput": "tflops_per_device", "tokens-per-s": "tokens_per_s", "samples-per-s": "samples_per_s",
               "consumed-samples": "consumed_samples", "tokens-seen": "tokens_seen"}
    tags = set(reader.Tags()["scalars"])
    assert {*by_name, "batch-size"} <= tags and {f"{name}_vs_samples" for name in by_name} <= tags
    for name, key in by_name.items():
        assert [(e.step, e.value) for e in reader.Scalars(name)] == [
            (r["step"], pytest.approx(r[key], rel=1e-6)) for r in logged]
        assert [(e.step, e.value) for e in reader.Scalars(f"{name}_vs_samples")] == [
            (r["consumed_samples"], pytest.approx(r[key], rel=1e-6)) for r in logged]
    assert [e.value for e in reader.Scalars("batch-size")] == [4]
    # the resolved config, as text at step 0
    (config,) = reader.Tensors("config/text_summary")
    assert config.step == 0 and b"global_batch_size: 4" in config.tensor_proto.string_val[0]
