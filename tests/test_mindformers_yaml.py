"""A MindFormers user's ``model:`` section means the same model here: MindFormers' shipped PyNative DeepSeek-V3
YAML builds what it describes, every MindFormers key is taken, logged as inert or refused with its reason, and
hidden dropout is MindFormers' (embedding, attention and MLP outputs; training only), reproducible across a
resume."""
import json
import logging
from pathlib import Path

import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor

from training.config import ConfigError, load_config
from training.model import build_model, model_config
from training.model.mindformers_keys import FIXED, INERT
from test_deepseek_v3 import numpy_deepseek_loss, random_ids

ms.set_context(mode=ms.PYNATIVE_MODE)
ms.set_device("CPU")

CONFIGS = Path(__file__).parent / "configs"
MINDFORMERS_DEEPSEEK3 = CONFIGS / "mindformers_deepseek3_pynative.yaml"
QWEN3 = dict(model_type="qwen3", architectures="Qwen3ForCausalLM", vocab_size=128, hidden_size=32,
             intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
             seq_length=16, max_position_embeddings=64, compute_dtype="float32")


def test_mindformers_deepseek3_pynative_yaml_builds_the_model_it_describes():
    config = load_config(MINDFORMERS_DEEPSEEK3)
    assert config.parallelism.sequence_parallel  # accepted at tensor_parallel 1, as MindFormers does
    model = build_model(config.model, seed=3)
    shapes = {name: tuple(p.shape) for name, p in model.parameters_and_names()}
    attention = "decoder.layers.1.self_attention"
    assert shapes[f"{attention}.linear_qkv.weight"] == (24 + 16 + 4, 32)   # q latent ; kv latent ; k rope
    assert shapes[f"{attention}.q_layernorm.weight"] == (24,)              # qk_layernorm: True
    assert shapes[f"{attention}.linear_qb.weight"] == (2 * (8 + 4), 24)
    assert shapes[f"{attention}.linear_kvb.weight"] == (2 * (8 + 8), 16)
    assert shapes["decoder.layers.0.mlp.linear_fc1.weight"] == (2 * 64, 32)  # first_k_dense_replace: 1
    assert shapes["decoder.layers.1.mlp.experts.weight1"] == (8, 32, 2 * 16)
    assert shapes["decoder.layers.1.mlp.shared_experts.linear_fc1.weight"] == (2 * 16, 32)
    assert shapes["mtp.layers.0.eh_proj.weight"] == (32, 64)
    assert "output_layer.weight" in shapes

    # MindFormers' YaRN: factor rotary_scaling_factor (default 40: the YAML's scaling_factor is dropped), the
    # original context max_position_embeddings, mscale = mscale_all_dim = 1 as the YAML sets them
    weights = {name: p.asnumpy().astype(np.float64) for name, p in model.parameters_and_names()}
    ids, labels = random_ids(seed=1), random_ids(seed=2)
    mask = np.ones(ids.shape, np.float32)
    reference = {**config.model, "rope_scaling": dict(factor=40.0, original_max_position_embeddings=64, mscale=1.0,
                                                      mscale_all_dim=1.0)}
    lm, depths, aux = numpy_deepseek_loss(weights, ids, labels, mask, reference)
    parts = model.named_parts(model.loss_and_parts(Tensor(ids), Tensor(labels), Tensor(mask))[1])
    assert parts["lm_loss"] == pytest.approx(lm, rel=1e-4)
    assert parts["mtp_1_loss"] == pytest.approx(depths[0], rel=1e-4)
    assert parts["load_balancing_loss"] == pytest.approx(aux, rel=1e-4)


def test_a_qwen3_section_with_every_accepted_key_builds(caplog):
    section = {**QWEN3, **{key: value for key, (value, _) in FIXED["qwen3"].items()},
               "num_layers": 2, "kv_channels": 8, "layernorm_epsilon": 1e-6, "rotary_base": 1e6, "rope_theta": 1e6,
               "hidden_dropout": 0.0, "use_flash_attention": True, "attention_dropout": 0.0, "qk_layernorm": True}
    with caplog.at_level(logging.INFO, logger="training.model.mindformers_keys"):
        model = build_model(section, seed=0)
    assert model.config.head_dim == 8 and model.config.rope_theta == 1e6
    shapes = {name: tuple(p.shape) for name, p in model.parameters_and_names()}
    assert shapes["decoder.layers.0.self_attention.linear_qkv.weight"] == (2 * (2 + 2) * 8, 32)
    assert shapes["decoder.layers.0.mlp.linear_fc1.weight"] == (2 * 48, 32)


def test_a_key_mindformers_drops_is_accepted_and_logged_with_why(caplog):
    from training.model import mindformers_keys

    mindformers_keys._logged.discard(("deepseek_v3", "router_dense_type"))
    with caplog.at_level(logging.INFO, logger="training.model.mindformers_keys"):
        model_config({**load_config(MINDFORMERS_DEEPSEEK3).model, "router_dense_type": "float32"})
    assert "model.router_dense_type = 'float32' has no effect" in caplog.text
    assert INERT["deepseek_v3"]["router_dense_type"] in caplog.text


@pytest.mark.parametrize("first, second", [("num_hidden_layers", "num_layers"), ("rope_theta", "rotary_base"),
                                           ("head_dim", "kv_channels")])
def test_two_spellings_that_disagree_are_an_error_naming_both(first, second):
    with pytest.raises(ConfigError, match=rf"model\.{first} = .* and model\.{second} = .*disagree"):
        model_config({**QWEN3, first: 2, second: 4})


def test_a_value_kiln_does_not_implement_is_refused_with_the_reason():
    with pytest.raises(ConfigError, match=r"model\.add_bias_linear = True: only False is supported \(linear-layer"):
        model_config({**QWEN3, "add_bias_linear": True})


def test_mindformers_default_bfloat16_on_cpu_names_the_field_and_the_fix():
    section = {k: v for k, v in QWEN3.items() if k != "compute_dtype"}
    with pytest.raises(ConfigError, match=r"model\.compute_dtype = 'bfloat16' \(MindFormers' default\) cannot run on "
                                          r"CPU.*set model\.compute_dtype: float32"):
        model_config(section)


def test_hugging_face_and_mindformers_yarn_spellings_together_are_an_error():
    section = load_config(MINDFORMERS_DEEPSEEK3).model
    with pytest.raises(ConfigError, match=r"model\.rope_scaling .* model\.beta_fast"):
        model_config({**section, "rope_scaling": {"type": "yarn", "factor": 2.0}})


def _loss(model, seed=5):
    ids, labels = random_ids(seed=seed), random_ids(seed=seed + 1)
    return float(model(Tensor(ids), Tensor(labels), Tensor(np.ones(ids.shape, np.float32))).asnumpy())


def test_hidden_dropout_changes_the_training_loss_reproducibly_and_not_evaluation():
    plain = build_model({**QWEN3, "hidden_dropout": 0.0}, seed=0)
    dropped = build_model({**QWEN3, "hidden_dropout": 0.3}, seed=0)
    again = build_model({**QWEN3, "hidden_dropout": 0.3}, seed=0)
    assert _loss(dropped) == _loss(plain)  # evaluation (set_train(False), the default): no dropout
    for model in (plain, dropped, again):
        model.set_train(True)
    first = _loss(dropped)
    assert first == _loss(again)  # the same seed, the same masks
    assert first != _loss(plain)
    assert _loss(plain) == _loss(plain)  # p = 0 draws nothing


def test_dropout_gradients_match_finite_differences():
    model = build_model({**QWEN3, "hidden_dropout": 0.3}, seed=0)
    model.set_train(True)
    ids, labels = random_ids(seed=5), random_ids(seed=6)
    mask = Tensor(np.ones(ids.shape, np.float32))
    weight = next(p for p in model.trainable_params() if p.name == "decoder.layers.0.mlp.linear_fc2.weight")
    start = model.dropout_masks.state()

    def loss():
        model.dropout_masks.set_state(start)  # the same masks for every evaluation
        return model(Tensor(ids), Tensor(labels), mask)

    grad = ms.grad(lambda *_: loss(), grad_position=None, weights=[weight])()[0].asnumpy()
    base = weight.asnumpy().copy()
    # central differences of an fp32 loss near 5 over 2·eps carry ~5e-5 of rounding: checked where the gradient
    # stands well above that, its largest entries (a backward without the masks is off there by far more)
    largest = np.argsort(np.abs(grad), axis=None)[-3:]
    for index in zip(*np.unravel_index(largest, grad.shape)):
        eps = 1e-2
        shifted = base.copy()
        shifted[index] += eps
        weight.set_data(Tensor(shifted))
        up = float(loss().asnumpy())
        shifted[index] -= 2 * eps
        weight.set_data(Tensor(shifted))
        down = float(loss().asnumpy())
        weight.set_data(Tensor(base))
        assert grad[index] == pytest.approx((up - down) / (2 * eps), rel=2e-2, abs=5e-5)


def test_a_run_with_dropout_resumed_from_a_checkpoint_repeats_the_uninterrupted_losses(tmp_path, shard):
    from test_trainer import losses, make_trainer

    dropout = "model.hidden_dropout=0.2"
    plain = make_trainer(tmp_path, shard, "plain", "training.steps=4", "model.hidden_dropout=0.0")
    plain.train()
    full = make_trainer(tmp_path, shard, "full", "training.steps=4", "checkpoint.save_interleaved_steps=2", dropout)
    full.train()
    uninterrupted = losses(tmp_path / "full")
    assert uninterrupted != losses(tmp_path / "plain")  # the masks are drawn in training

    state = json.loads((tmp_path / "full/checkpoints/iteration_00000002/kiln_state.json").read_text())
    assert state["rng"]["dropout_masks"]["bit_generator"] == "Philox"
    resumed = make_trainer(tmp_path, shard, "resumed", "training.steps=4", dropout,
                           f"checkpoint.load_path={tmp_path / 'full/checkpoints/iteration_00000002'}")
    resumed.train()
    after_resume = losses(tmp_path / "resumed")
    assert sorted(after_resume) == [3, 4]
    assert all(after_resume[s] == uninterrupted[s] for s in after_resume), (after_resume, uninterrupted)


def test_sequence_parallel_is_accepted_at_tensor_parallel_1_and_required_above_as_in_mindformers():
    assert load_config(MINDFORMERS_DEEPSEEK3, ["parallelism.sequence_parallel=true"]).parallelism.sequence_parallel
    assert load_config(MINDFORMERS_DEEPSEEK3, ["parallelism.tensor_parallel=2"]).parallelism.tensor_parallel == 2
    with pytest.raises(ConfigError, match=r"parallelism\.tensor_parallel = 2 needs parallelism\.sequence_parallel"):
        load_config(MINDFORMERS_DEEPSEEK3, ["parallelism.tensor_parallel=2", "parallelism.sequence_parallel=false"])


def test_a_device_without_its_runtime_is_one_line_naming_context_device_target():
    from training.run import require_device_runtime

    require_device_runtime("CPU")
    with pytest.raises(ConfigError, match=r"^context\.device_target = 'Ascend' \(the default when the YAML has no "
                                          r"context section\): MindSpore finds no Ascend runtime"):
        require_device_runtime("Ascend")
