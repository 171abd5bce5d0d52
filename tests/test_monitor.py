"""Monitoring: the step log, monitor.train_state records, health_checkpoint marking, the profiler window,
and the numbers Dagster plots."""
import json

import numpy as np
import pytest

from test_trainer import make_trainer
from training.config import ConfigError, HealthCheckpointConfig, ProfilerConfig, TrainStateConfig
from training.monitor import ABNORMAL, NORMAL, HealthMonitor, select_names
from training.profiling import ProfilerError

NAMES = ["embedding.word_embeddings.weight", "decoder.layers.0.self_attention.linear_qkv.weight",
         "decoder.layers.0.mlp.linear_fc1.weight", "decoder.layers.1.mlp.linear_fc1.weight", "output_layer.weight"]
ALL_ON = ["monitor.train_state.local_norm=true", "monitor.train_state.device_norm=true",
          "kiln.train_state.param_norm=true", "monitor.train_state.local_loss=true",
          "monitor.train_state.device_loss=true", "kiln.train_state.max_attention_logit=true"]


def records(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("selector,expected", [
    (True, NAMES), (False, []), ("", []), ([], []),
    ("embedding", NAMES[:1]),                                    # substring, as MindFormers
    (["linear_qkv", "output_layer"], [NAMES[1], NAMES[4]]),
    ("decoder.layers.*.mlp.*", NAMES[2:4]),                      # wildcards match the whole name
    ("layers.1", NAMES[3:4]),
])
def test_parameter_selectors(selector, expected):
    assert select_names(NAMES, selector) == expected


def test_every_train_state_option_lands_in_the_step_record(tmp_path, shard):
    trainer = make_trainer(tmp_path, shard, "on", "training.steps=2", "checkpoint.enable_save=false", *ALL_ON)
    trainer.train()
    plain = make_trainer(tmp_path, shard, "off", "training.steps=2", "checkpoint.enable_save=false")
    plain.train()
    on, off = records(tmp_path / "on"), records(tmp_path / "off")
    assert [r["loss"] for r in on] == [r["loss"] for r in off]  # watching does not change training
    monitored = {"local_norm", "device_norm", "param_norm", "local_loss", "device_loss", "max_attention_logit"}
    assert not monitored & set(off[0])

    last = on[-1]
    names = [p.name for p in trainer.params]
    # micro config: local_batch_size 2, global 4, one rank -> 2 accumulated micro-batches
    assert np.array(last["local_loss"]).shape == (1, 2)
    assert np.mean(last["local_loss"]) == pytest.approx(last["loss"], rel=1e-5)
    assert last["device_loss"] == last["loss"]
    assert set(last["local_norm"]) == set(last["device_norm"]) == set(last["param_norm"]) == set(names)
    # the step gradient's per-parameter norms make up the global norm the log reports
    assert np.sqrt(sum(v ** 2 for v in last["device_norm"].values())) == pytest.approx(last["grad_norm"], rel=1e-4)
    for name in names:  # the step gradient is the mean of the micro-batch gradients
        assert np.array(last["local_norm"][name]).shape == (1, 2)
        assert last["device_norm"][name] <= np.mean(last["local_norm"][name]) * (1 + 1e-5)
    params = {p.name: p.asnumpy() for p in trainer.params}
    assert last["param_norm"][names[0]] == pytest.approx(np.linalg.norm(params[names[0]]), rel=1e-5)
    logits = np.array(last["max_attention_logit"])
    assert logits.shape == (2, 4) and np.all(np.isfinite(logits))  # [layers, heads]

    line = trainer._log_line(last)
    assert "samples_per_s: " in line and "tokens_per_s: " in line
    assert "max_attention_logit per layer: [" in line.splitlines()[1]


def test_the_step_log_line_reports_throughput(tmp_path, shard):
    trainer = make_trainer(tmp_path, shard, "log", "checkpoint.enable_save=false")
    m = trainer.train_step()
    assert m["samples_per_s"] == pytest.approx(4 / m["step_time_s"])
    assert m["tokens_per_s"] == pytest.approx(m["samples_per_s"] * trainer.seq_length)
    flops = trainer.model.flops_per_token(trainer.seq_length) * m["tokens_per_s"]
    assert m["tflops_per_device"] == pytest.approx(flops / 1e12)
    line = trainer._log_line(m)
    assert line.startswith("{ step:[    1/    6], consumed_samples: 4, global_batch_size: 4, loss:")
    assert "\n" not in line  # no monitoring, no second line


def test_a_filter_selects_parameters(tmp_path, shard):
    trainer = make_trainer(tmp_path, shard, "filtered", "checkpoint.enable_save=false",
                           "monitor.train_state.device_norm=[embedding, 'decoder.layers.1.*']")
    assert trainer.model.pop_max_attention_logits() is None
    m = trainer.train_step()
    assert set(m["device_norm"]) == {p.name for p in trainer.params
                                     if "embedding" in p.name or p.name.startswith("decoder.layers.1.")}
    assert "local_norm" not in m and "max_attention_logit" not in m


def test_health_monitor_semantics():
    health = HealthMonitor(HealthCheckpointConfig(embedding_local_norm_threshold=5.0,
                                                  global_norm_skip_threshold=10.0, global_norm_skip_time=3))
    assert health.observe(1, 1.0, 4.9) == [] and health.checkpoint_status() == NORMAL
    assert health.observe(2, 1.0, 5.0)[0].startswith("embedding gradient norm 5")
    assert health.checkpoint_status() == ABNORMAL
    assert health.checkpoint_status() == NORMAL  # each save starts a new window
    # two spikes, a healthy step, then three in a row (NaN counts as a spike)
    verdicts = [bool(health.observe(s, norm, 0.0)) for s, norm in
                enumerate([11.0, 12.0, 1.0, 10.0, float("nan"), 50.0, 60.0, 1.0], start=3)]
    assert verdicts == [False, False, False, False, False, True, True, False]
    assert health.checkpoint_status() == ABNORMAL


def test_an_unhealthy_step_marks_the_next_checkpoint(tmp_path, shard):
    healthy = make_trainer(tmp_path, shard, "healthy", "training.steps=3")
    healthy.train()
    common = json.loads((tmp_path / "healthy/checkpoints/iteration_00000003/common.json").read_text())
    assert common["ckpt_status"] == NORMAL

    sick = make_trainer(tmp_path, shard, "sick", "training.steps=3",
                        "monitor.health_checkpoint.embedding_local_norm_threshold=1.0e-9")
    sick.train()
    common = json.loads((tmp_path / "sick/checkpoints/iteration_00000003/common.json").read_text())
    assert common["ckpt_status"] == ABNORMAL
    assert all("embedding gradient norm" in r["abnormal"][0] for r in records(tmp_path / "sick"))


def test_profiler_runs_over_its_window_on_rank_0(tmp_path, shard):
    trainer = make_trainer(tmp_path, shard, "prof", "training.steps=4", "checkpoint.enable_save=false",
                           "profiler.enable_profiling=true", "profiler.start_step=2", "profiler.end_step=3")
    calls = []
    profile = trainer.profiler._profile
    for method in ("start", "stop"):
        original = getattr(profile, method)
        setattr(profile, method, lambda original=original, method=method: (calls.append((method, trainer.step)),
                                                                             original()))
    trainer.train()
    # started before step 2 ran (1 step done), stopped once step 3 was done
    assert calls == [("start", 1), ("stop", 3)]
    rank_dir = tmp_path / "prof/profile/rank_0"
    traces = list(rank_dir.glob("*/ASCEND_PROFILER_OUTPUT/trace_view.json"))
    assert len(traces) == 1
    ops_seen = list(rank_dir.glob("*/FRAMEWORK/cpu_op_execute_timestamp_*.txt"))
    assert ops_seen and ops_seen[0].stat().st_size > 0


def test_profiler_rank_and_cpu_errors(tmp_path, shard):
    other_rank = make_trainer(tmp_path, shard, "r1", "profiler.enable_profiling=true", "profiler.profiler_rank=[1]")
    assert other_rank.profiler is None
    with pytest.raises(ProfilerError, match="profiler.profile_cpu = false leaves nothing to profile"):
        make_trainer(tmp_path, shard, "nocpu", "profiler.enable_profiling=true", "profiler.profile_cpu=false")


@pytest.mark.parametrize("section,data,message", [
    (ProfilerConfig, {"profiler_level": 3}, r"profiler\.profiler_level must be 0, 1 or 2"),
    (ProfilerConfig, {"start_step": 3, "end_step": 2}, r"need 0 < start_step <= end_step"),
    (HealthCheckpointConfig, {"global_norm_skip_time": 0}, r"health_checkpoint\.global_norm_skip_time must be >= 1"),
    (HealthCheckpointConfig, {"embedding_local_norm_threshold": -1}, r"embedding_local_norm_threshold must be > 0"),
    (TrainStateConfig, {"local_norm": 3}, r"train_state\.local_norm: expected"),
])
def test_config_errors_name_the_field(section, data, message):
    path = {ProfilerConfig: "profiler", HealthCheckpointConfig: "monitor.health_checkpoint",
            TrainStateConfig: "monitor.train_state"}[section]
    with pytest.raises(ConfigError, match=message):
        section.from_dict(data, path)


def test_checkpoint_materialization_carries_what_the_ui_shows_per_checkpoint():
    from assets.training import checkpoint_event

    message = {"step": 50, "path": "/runs/x/checkpoints/iteration_00000050", "loss": 5.5, "lr": 1e-3,
               "tokens_seen": 51200, "consumed_samples": 400, "grad_norm": 0.75, "tokens_per_s": 612.5,
               "samples_per_s": 4.8, "ckpt_status": 0,
               "files": [{"name": "common.json", "bytes": 10, "sha256": "ab" * 32}]}
    event = checkpoint_event(message, "x/iteration_00000050", "train-v1", "passed")
    assert event.partition == "x/iteration_00000050"
    # the loss plots over the partitions, the step is the partition key's; the other scalars are on
    # training_run's observations
    assert {k: v.value for k, v in event.metadata.items()} == {"loss": 5.5, "audit": "passed"}
    assert event.tags["dagster/code_version"] == "train-v1"


def test_step_scalars_reach_training_run_as_an_observation_every_log_interval(tmp_path):
    from types import SimpleNamespace

    from assets.training import step_observation
    from training.reporting import Reporter

    reporter = Reporter(tmp_path / "metrics.jsonl", enabled=True, log_interval=2)
    sent = []
    reporter._pipes = SimpleNamespace(report_custom_message=sent.append, log=SimpleNamespace(info=lambda line: None))
    for step in range(1, 5):
        # flags and the monitor's per-parameter collections are not curves
        reporter.step({"step": step, "loss": 8.0 / step, "lr": 1e-3, "skipped": False, "consumed_samples": 8 * step,
                       "device_norm": {"embedding.word_embeddings.weight": 0.5}}, f"step {step}")
    assert sent == [{"event": "metrics", "step": s, "loss": 8.0 / s, "lr": 1e-3, "consumed_samples": 8.0 * s}
                    for s in (2, 4)]
    observation = step_observation(sent[1])
    assert observation.asset_key.to_user_string() == "training_run"
    assert {k: v.value for k, v in observation.metadata.items()} == {"step": 4, "loss": 2.0, "lr": 1e-3,
                                                                      "consumed_samples": 32.0}
    assert {type(v).__name__ for k, v in observation.metadata.items() if k != "step"} == {"FloatMetadataValue"}
