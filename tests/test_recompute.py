"""Activation recompute (training/recompute.py): the same training as without it, eager and compiled, with less kept."""
import json

import numpy as np
import pytest
import yaml

from conftest import MICRO_CONFIG, PROJECT_ROOT, shard_data
from training.config import ConfigError, RecomputeConfig, layer_indices, load_config
from training.model import build_model
from training.parallel.mesh import World
from training.recompute import compiled_recompute_problems
from training.reporting import Reporter
from training.step import configure_runtime
from training.trainer import Trainer

WORLD = World(rank=0, size=1)
FULL = ("recompute.mode=full", "recompute.full_recompute_layer=true")
SELECT = ("recompute.mode=select", "recompute.select_module={self_attention.core_attention: true}")


def make_trainer(tmp_path, shard, name, *overrides, model=MICRO_CONFIG):
    config = load_config(PROJECT_ROOT / model, [
        *shard_data(shard), f"checkpoint.save_path={tmp_path / name / 'checkpoints'}",
        "training.steps=4", "checkpoint.save_interleaved_steps=2", *overrides])
    configure_runtime(config)
    return Trainer(config, WORLD, tmp_path / name, Reporter(tmp_path / name / "metrics.jsonl", enabled=True))


def records(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def assert_bit_identical(tmp_path, a, b):
    """Losses, grad norms and every weight and optimizer state bit-identical."""
    ra, rb = records(tmp_path / a.output_dir.name), records(tmp_path / b.output_dir.name)
    assert [(r["loss"], r["grad_norm"]) for r in ra] == [(r["loss"], r["grad_norm"]) for r in rb]
    for pa, pb in zip(a.params, b.params):
        assert np.array_equal(pa.asnumpy(), pb.asnumpy()), pa.name
    sa, sb = a.optimizer.state_dict(), b.optimizer.state_dict()
    assert all(np.array_equal(sa[k], sb[k]) for k in sa)


def trains_as_without(tmp_path, shard, settings, recompute, name, resume=True):
    """A run with ``recompute`` trains bit-identically to one without it, both with ``settings``; resumed from step 2,
    it goes on as the run without did. Returns the recomputing trainer."""
    plain = make_trainer(tmp_path, shard, f"{name}_plain", *settings)
    plain.train()
    recomputed = make_trainer(tmp_path, shard, name, *settings, *recompute)
    assert recomputed.recomputed, recomputed.recomputed
    recomputed.train()
    assert_bit_identical(tmp_path, plain, recomputed)
    if resume:
        resumed = make_trainer(tmp_path, shard, f"{name}_resumed", *settings, *recompute,
                               f"checkpoint.load_path={tmp_path / name / 'checkpoints/iteration_00000002'}")
        resumed.train()
        assert ([r["loss"] for r in records(tmp_path / f"{name}_resumed")]
                == [r["loss"] for r in records(tmp_path / f"{name}_plain")][2:])
    return recomputed


@pytest.mark.parametrize("recompute", [FULL, SELECT, ("recompute.mode=full", "recompute.full_recompute_layer=['1']"),
                                       ("recompute.mode=select", "recompute.select_module={mlp: ['0']}")],
                         ids=["full", "select", "layer1", "mlp0"])
def test_eager_recompute_trains_bit_identically_with_dropout_and_resumes(tmp_path, shard, recompute):
    # dropout on: the recomputing backward must draw the masks its forward drew
    trains_as_without(tmp_path, shard, ["model.hidden_dropout=0.1"], recompute, "recomputed")


def test_compiled_recompute_trains_bit_identically_and_resumes(tmp_path, shard):
    """The compiled step recomputing whole layers (its own backward, training.recompute.RecomputedLayers), with
    gradient accumulation (2 micro-batches), against the plain compiled step: every layer in the whole-step graph
    (and a resume), the first layer in the forward+backward graph (clip and update eager: local norms read)."""
    compiled = "fast_step.compile=true"
    every = trains_as_without(tmp_path, shard, [compiled], FULL, "every")
    assert every.compiled_step is not None and every.compiled_step.recomputed is not None, every.step_mode
    assert "the first 2 decoder layers recomputed in the backward" in every.step_mode
    first = trains_as_without(tmp_path, shard, [compiled, "monitor.train_state.local_norm=true"],
                              ("recompute.mode=full", "recompute.full_recompute_layer=1"), "first", resume=False)
    assert first.compiled_step is None and "the first 1 decoder layers recomputed" in first.step_mode, first.step_mode


@pytest.mark.parametrize("model, recompute, pp, problem", [
    (MICRO_CONFIG, 1, 1, None),
    (MICRO_CONFIG, ["1"], 1, "recomputes the first n decoder layers"),
    (MICRO_CONFIG, True, 2, "recompute under pipeline parallelism"),
    ("tests/configs/deepseek_v3_micro.yaml", 2, 1, "recompute of MoE layers"),  # layer 0 is dense
    ("tests/configs/deepseek_v3_micro.yaml", True, 1, "(not MTP depths)"),
], ids=["first-n", "not-first", "pipeline", "moe", "mtp"])
def test_what_the_compiled_step_recomputes_and_what_it_leaves_to_the_eager_step(model, recompute, pp, problem):
    section = yaml.safe_load((PROJECT_ROOT / model).read_text())["model"]
    problems = compiled_recompute_problems(build_model(section), RecomputeConfig("full", recompute), pp)
    assert (problems == []) if problem is None else any(problem in p for p in problems), problems


def test_a_compiled_run_asking_for_selective_recompute_recomputes_eagerly_and_says_why(tmp_path, shard):
    trainer = make_trainer(tmp_path, shard, "compiled", "fast_step.compile=true", *SELECT)
    assert trainer.compiled_step is None and trainer.step_mode.startswith("forward+backward eager"), trainer.step_mode
    assert "recompute.mode = 'select': recompute runs eagerly" in trainer.step_mode
    assert trainer.recomputed == ["decoder.layers.0.self_attention.core_attention",
                                  "decoder.layers.1.self_attention.core_attention"]


@pytest.mark.parametrize("override, message", [
    ("recompute={mode: full, full_recompute_layer: ['0-2']}",
     r"recompute\.full_recompute_layer: layer 2 does not exist \(the model has 2 decoder and MTP layers, 0-1\)"),
    ("recompute={mode: select, select_module: {mlp.gate: true}}",
     r"recompute\.select_module\.mlp\.gate: no such module in a decoder layer; expected self_attention\.core_attention"),
])
def test_a_layer_or_module_the_model_lacks_is_refused_naming_the_field(tmp_path, shard, override, message):
    with pytest.raises(ConfigError, match=message):
        make_trainer(tmp_path, shard, "refused", override)


def test_deepseek_v3_recomputing_its_moe_and_mtp_layers_trains_bit_identically(tmp_path, shard):
    """MLA, MoE (token counts and expert biases: the replay's counts dropped) and an MTP depth, recomputed (layer
    num_hidden_layers is the MTP depth); the tokens per expert logged alike."""
    deepseek = "tests/configs/deepseek_v3_micro.yaml"
    plain = make_trainer(tmp_path, shard, "plain", model=deepseek)
    plain.train()
    recomputed = make_trainer(tmp_path, shard, "recomputed", "recompute.mode=full",
                              "recompute.full_recompute_layer=true", model=deepseek)
    assert recomputed.recomputed[-1] == "mtp.layers.0.transformer_layer", recomputed.recomputed
    recomputed.train()
    assert_bit_identical(tmp_path, plain, recomputed)
    assert ([r.get("load_balancing_loss") for r in records(tmp_path / "plain")]
            == [r.get("load_balancing_loss") for r in records(tmp_path / "recomputed")])


@pytest.mark.parametrize("spec, layers", [(True, {0, 1, 2, 3}), (2, {0, 1}), (["0-1", 3], {0, 1, 3}),
                                          (["0-1,3"], {0, 1, 3}), ([2], {2})])
def test_the_layers_a_recompute_field_names(spec, layers):
    """MindFormers' values: true every layer, an int the first n, a list of indices and ranges."""
    assert layer_indices(spec, "recompute.full_recompute_layer", 4) == layers
