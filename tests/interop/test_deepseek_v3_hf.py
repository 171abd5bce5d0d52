"""DeepSeek-V3 (MLA with q/kv latents, group-limited MoE with expert bias and a shared expert, YaRN, one MTP
depth) ↔ Hugging Face transformers' DeepseekV3ForCausalLM: logits match Kiln's within 1e-4 both ways.
transformers' forward has no MTP, so the MTP depth is checked as a tensor round trip and through the
exported directory's layout (model.layers.{num_hidden_layers}.*, DeepSeek's)."""
from __future__ import annotations

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from interop.hf_helpers import (TOLERANCE, hf_logits, import_transformers, kiln_logits, kiln_model, load_hf,
                                model_section, random_ids, randomize_hf)
from training.hf import (HFConversionError, hf_to_kiln_model_section, hf_to_kiln_state, kiln_to_hf_config,
                         kiln_to_hf_state, write_hf_dir)

transformers = import_transformers()
CONFIG = "tests/configs/deepseek_v3_micro.yaml"
MTP = "model.layers.2."  # the micro model has 2 decoder layers, so its MTP depth is HF layer 2


@pytest.fixture
def section():
    section = model_section(CONFIG)
    assert section["rope_scaling"]["factor"] > 1 and section["num_nextn_predict_layers"] == 1
    assert section["q_lora_rank"] and section["n_routed_experts"] > section["num_experts_per_tok"]
    return section


def test_export_matches_transformers(section, tmp_path):
    model, weights = kiln_model(section, seed=1)
    write_hf_dir(tmp_path / "hf", kiln_to_hf_state(weights, section), kiln_to_hf_config(section))
    hf_model, info = load_hf(transformers.DeepseekV3ForCausalLM, tmp_path / "hf")
    # transformers' DeepSeek-V3 builds no MTP layer: the MTP depth's tensors are all it leaves unused
    assert info["unexpected_keys"] and all(k.startswith(MTP) for k in info["unexpected_keys"])
    assert hf_model.model.layers[1].mlp.gate.e_score_correction_bias.abs().sum() > 0  # expert bias exported
    ids = random_ids(section["vocab_size"])
    expected = kiln_logits(model, ids)
    assert np.abs(expected).max() > 1.0
    np.testing.assert_allclose(hf_logits(hf_model, ids), expected, rtol=0, atol=TOLERANCE)


def test_import_from_transformers_matches(section, tmp_path):
    """A randomly initialized transformers model, plus an MTP depth as DeepSeek's checkpoints carry it."""
    hf_model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**kiln_to_hf_config(section))).eval()
    randomize_hf(hf_model, seed=2)
    hf_model.save_pretrained(tmp_path / "hf")
    _, kiln_weights = kiln_model(section, seed=3)
    mtp = {n: a for n, a in kiln_to_hf_state(kiln_weights, section).items() if n.startswith(MTP)}
    tensors = load_file(tmp_path / "hf" / "model.safetensors")
    save_file({**tensors, **mtp}, tmp_path / "hf" / "model.safetensors")

    state = hf_to_kiln_state(tmp_path / "hf", section)
    model, _ = kiln_model(section, state)
    ids = random_ids(section["vocab_size"], seed=4)
    np.testing.assert_allclose(kiln_logits(model, ids), hf_logits(hf_model, ids), rtol=0, atol=TOLERANCE)
    for name in ("mtp.layers.0.eh_proj.weight", "mtp.layers.0.transformer_layer.self_attention.linear_qkv.weight",
                 "mtp.layers.0.transformer_layer.mlp.experts.weight1"):
        np.testing.assert_array_equal(state[name], kiln_weights[name])
    np.testing.assert_array_equal(state["decoder.layers.1.mlp.tokens_per_expert"], 0)


def test_round_trip_is_exact_and_rope_rows_are_permuted(section):
    _, weights = kiln_model(section, seed=5)
    hf_state = kiln_to_hf_state(weights, section)
    assert f"{MTP}shared_head.head.weight" in hf_state and f"{MTP}embed_tokens.weight" in hf_state
    heads, nope, rope = section["num_attention_heads"], section["qk_nope_head_dim"], section["qk_rope_head_dim"]
    q_b = hf_state["model.layers.0.self_attn.q_b_proj.weight"].reshape(heads, nope + rope, -1)
    kiln_q_b = weights["decoder.layers.0.self_attention.linear_qb.weight"].reshape(heads, nope + rope, -1)
    # HF's interleaved pair (x0, x1) is Kiln's rotate-half pair (first half row 0, second half row 0)
    np.testing.assert_array_equal(q_b[:, nope + 1], kiln_q_b[:, nope + rope // 2])
    np.testing.assert_array_equal(q_b[:, :nope], kiln_q_b[:, :nope])


def test_config_json_round_trips(section):
    hf_config = kiln_to_hf_config(section)
    assert hf_config["rope_interleave"] is True and hf_config["rope_scaling"]["type"] == "yarn"
    back = hf_to_kiln_model_section(hf_config)
    for name, value in back.items():
        if name not in ("rope_scaling", "seq_length"):  # seq_length: a training setting HF has not
            assert value == section.get(name, value), name


def test_export_refuses_what_transformers_cannot_express(section):
    with pytest.raises(HFConversionError, match="model.moe_layer_freq"):
        kiln_to_hf_config({**section, "num_hidden_layers": 3, "moe_layer_freq": 2})
    with pytest.raises(HFConversionError, match="model.rope_scaling.factor"):
        kiln_to_hf_config({**section, "rope_scaling": {**section["rope_scaling"], "factor": 4.0}})


def test_missing_mtp_depth_is_named(section, tmp_path):
    """An HF directory without the MTP layer (as transformers saves one) cannot fill Kiln's MTP depth."""
    hf_model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**kiln_to_hf_config(section)))
    hf_model.save_pretrained(tmp_path / "hf")
    with pytest.raises(HFConversionError, match=r"tensor model\.layers\.2\.\S+ is missing"):
        hf_to_kiln_state(tmp_path / "hf", section)


def test_fewer_mtp_depths_than_the_checkpoint(section, tmp_path):
    """Kiln may train without the MTP depths a checkpoint carries (their tensors are left out), not with more."""
    _, weights = kiln_model(section, seed=6)
    write_hf_dir(tmp_path / "hf", kiln_to_hf_state(weights, section), kiln_to_hf_config(section))
    state = hf_to_kiln_state(tmp_path / "hf", {**section, "num_nextn_predict_layers": 0})
    assert set(state) == {n for n in weights if not n.startswith("mtp.")}
    with pytest.raises(HFConversionError, match="num_nextn_predict_layers = 1, fewer than model"):
        hf_to_kiln_state(tmp_path / "hf", {**section, "num_nextn_predict_layers": 2})
