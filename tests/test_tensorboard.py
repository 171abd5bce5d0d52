"""monitor.tensorboard: event files hold every scalar of the step records, by step and by consumed samples,
every log_interval steps, as TensorBoard's own reader reads them. End to end (training.run writing them while
it trains): test_chain's single-process run calls assert_tensorboard_matches."""
import json
import sys
from pathlib import Path

import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from training.config import TensorboardConfig
from training.monitor import TensorBoardWriter, _summary_writer_class
from training.reporting import Reporter

# the record's keys under MindFormers' names where it has one, else their own (dashed)
NAMES = {"loss": "loss", "learning-rate": "lr", "grad-norm": "grad_norm", "iteration-time": "step_time_s",
         "throughput": "tflops_per_device", "tokens-per-s": "tokens_per_s", "samples-per-s": "samples_per_s",
         "consumed-samples": "consumed_samples", "tokens-seen": "tokens_seen"}


def assert_tensorboard_matches(events: Path, records: list[dict], interval: int, global_batch_size: int) -> None:
    """The event files in ``events`` hold, for every ``interval``-th record, each scalar against its step and
    against its consumed samples, and the resolved config at step 0."""
    logged = [r for r in records if r["step"] % interval == 0]
    assert logged
    reader = EventAccumulator(str(events), size_guidance={"scalars": 0, "tensors": 0})
    reader.Reload()
    tags = set(reader.Tags()["scalars"])
    assert {*NAMES, "batch-size"} <= tags and {f"{name}_vs_samples" for name in NAMES} <= tags
    for name, key in NAMES.items():
        assert [(e.step, e.value) for e in reader.Scalars(name)] == [
            (r["step"], pytest.approx(r[key], rel=1e-6)) for r in logged]
        assert [(e.step, e.value) for e in reader.Scalars(f"{name}_vs_samples")] == [
            (r["consumed_samples"], pytest.approx(r[key], rel=1e-6)) for r in logged]
    assert [e.value for e in reader.Scalars("batch-size")] == [global_batch_size] * len(logged)
    (config,) = reader.Tensors("config/text_summary")
    assert config.step == 0 and f"global_batch_size: {global_batch_size}".encode() in config.tensor_proto.string_val[0]


def test_every_log_interval_th_record_is_written_with_each_scalar(tmp_path):
    events = tmp_path / "tensorboard"
    writer = TensorBoardWriter(TensorboardConfig(output_dir=str(events), log_interval=2, queue_size=3), 8,
                               "training:\n  global_batch_size: 8\n")
    reporter = Reporter(tmp_path / "metrics.jsonl", enabled=True, log_interval=2, sinks=[writer])
    for step in range(1, 6):
        # a step record as the trainer makes it; flags and the monitor's collections are not scalars to plot
        reporter.step({"step": step, "loss": 8.0 - step / 3, "lr": 1e-3 * step, "skipped": False,
                       "grad_norm": 1.5 / step, "consumed_samples": 8 * step, "tokens_seen": 256 * step,
                       "step_time_s": 0.25, "tokens_per_s": 1024.0, "samples_per_s": 32.0,
                       "tflops_per_device": 1e-4, "mtp_1_loss": 9.0 - step,
                       "device_norm": {"embedding.word_embeddings.weight": 0.5}}, f"step {step}")
    reporter.close()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert_tensorboard_matches(events, records, interval=2, global_batch_size=8)
    reader = EventAccumulator(str(events), size_guidance={"scalars": 0})
    reader.Reload()
    assert [(e.step, e.value) for e in reader.Scalars("mtp-1-loss")] == [(2, 7.0), (4, 5.0)]
    assert not {tag for tag in reader.Tags()["scalars"] if "norm" in tag} - {"grad-norm", "grad-norm_vs_samples"}


def test_the_writer_is_imported_without_torch(monkeypatch):
    """tensorboardX's writer module tries ``import torch`` (to accept torch tensors as values); with the interop
    extra installed that loaded torch into every process writing TensorBoard, training ones included. Here
    tensorboardX is imported afresh, as by a training process that has not loaded torch."""
    for name in [name for name in sys.modules if name.split(".")[0] in ("torch", "tensorboardX")]:
        monkeypatch.delitem(sys.modules, name)
    writer_class = _summary_writer_class()
    assert "torch" not in sys.modules and sys.modules["tensorboardX.writer"].numpy_compatible is np.ndarray
    assert writer_class is sys.modules["tensorboardX"].SummaryWriter
