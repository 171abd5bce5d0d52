"""Qwen3 ↔ Hugging Face transformers: export → Qwen3ForCausalLM and import ← Qwen3ForCausalLM give the
same logits as Kiln (fp32, within 1e-4); bad HF directories are refused naming the tensor and file."""
from __future__ import annotations

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from interop.hf_helpers import (TOLERANCE, hf_logits, kiln_logits, kiln_model, load_hf,
                                model_section, random_ids, randomize_hf)
from training.hf import HFConversionError, hf_to_kiln_state, kiln_to_hf_config, kiln_to_hf_state, write_hf_dir

CONFIG = "tests/configs/qwen3_micro.yaml"


@pytest.fixture(params=[False, True], ids=["untied", "tied"])
def section(request):
    return model_section(CONFIG, tie_word_embeddings=request.param)


def test_export_matches_transformers(section, tmp_path, transformers):
    model, weights = kiln_model(section, seed=1)
    write_hf_dir(tmp_path / "hf", kiln_to_hf_state(weights, section), kiln_to_hf_config(section))
    hf_model, info = load_hf(transformers.Qwen3ForCausalLM, tmp_path / "hf")
    assert not info["unexpected_keys"]
    ids = random_ids(section["vocab_size"])
    expected = kiln_logits(model, ids)
    assert np.abs(expected).max() > 1.0  # logits big enough that a wrong mapping could not hide under 1e-4
    np.testing.assert_allclose(hf_logits(hf_model, ids), expected, rtol=0, atol=TOLERANCE)


def test_import_from_transformers_matches(section, tmp_path, transformers):
    hf_model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**kiln_to_hf_config(section))).eval()
    randomize_hf(hf_model, seed=2)
    hf_model.save_pretrained(tmp_path / "hf")
    model, _ = kiln_model(section, hf_to_kiln_state(tmp_path / "hf", section))
    ids = random_ids(section["vocab_size"], seed=3)
    np.testing.assert_allclose(kiln_logits(model, ids), hf_logits(hf_model, ids), rtol=0, atol=TOLERANCE)


def test_sharded_export_loads_in_transformers(tmp_path, transformers):
    section = model_section(CONFIG)
    model, weights = kiln_model(section, seed=6)
    write_hf_dir(tmp_path / "hf", kiln_to_hf_state(weights, section), kiln_to_hf_config(section),
                 max_shard_bytes=200_000)
    files = sorted(p.name for p in (tmp_path / "hf").glob("*.safetensors"))
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    hf_model, _ = load_hf(transformers.Qwen3ForCausalLM, tmp_path / "hf")
    ids = random_ids(section["vocab_size"], seed=7)
    np.testing.assert_allclose(hf_logits(hf_model, ids), kiln_logits(model, ids), rtol=0, atol=TOLERANCE)
    state = hf_to_kiln_state(tmp_path / "hf", section)
    assert all(np.array_equal(state[n], weights[n]) for n in weights)


def test_attention_bias_is_refused():
    """HF's Qwen3 attention_bias also biases o_proj, Kiln's only linear_qkv: no faithful export exists."""
    with pytest.raises(HFConversionError, match="model.attention_bias"):
        kiln_to_hf_config(model_section(CONFIG, attention_bias=True))


def test_round_trip_is_exact():
    section = model_section(CONFIG)
    _, weights = kiln_model(section, seed=4)
    hf_state = kiln_to_hf_state(weights, section)
    # fused qkv and interleaved gate/up really are split (not just renamed)
    assert hf_state["model.layers.0.self_attn.q_proj.weight"].shape == (4 * 16, 64)
    np.testing.assert_array_equal(hf_state["model.layers.1.mlp.up_proj.weight"],
                                  weights["decoder.layers.1.mlp.linear_fc1.weight"][1::2])


@pytest.fixture
def hf_dir(tmp_path):
    section = model_section(CONFIG)
    _, weights = kiln_model(section, seed=5)
    write_hf_dir(tmp_path / "hf", kiln_to_hf_state(weights, section), kiln_to_hf_config(section))
    return tmp_path / "hf", section


def _rewrite(hf_dir, change):
    tensors = load_file(hf_dir / "model.safetensors")
    change(tensors)
    save_file(tensors, hf_dir / "model.safetensors")


def test_missing_tensor_is_named(hf_dir):
    path, section = hf_dir
    _rewrite(path, lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"))
    with pytest.raises(HFConversionError, match=r"model\.layers\.1\.self_attn\.k_proj\.weight is missing"):
        hf_to_kiln_state(path, section)


def test_misshaped_tensor_names_file_and_tensor(hf_dir):
    path, section = hf_dir
    _rewrite(path, lambda t: t.update({"model.norm.weight": np.ones(63, np.float32)}))
    with pytest.raises(HFConversionError, match=r"model\.safetensors: tensor model\.norm\.weight has shape \[63\]"):
        hf_to_kiln_state(path, section)


def test_extra_tensor_is_named(hf_dir):
    path, section = hf_dir
    _rewrite(path, lambda t: t.update({"model.layers.2.input_layernorm.weight": np.ones(64, np.float32)}))
    with pytest.raises(HFConversionError, match=r"model\.layers\.2\.input_layernorm\.weight has no place"):
        hf_to_kiln_state(path, section)


def test_config_mismatch_names_the_field(hf_dir):
    path, section = hf_dir
    with pytest.raises(HFConversionError, match=r"config\.json: rope_theta = 1000000\.0, but model\.rope_theta = 10"):
        hf_to_kiln_state(path, {**section, "rope_theta": 10.0})


def test_bfloat16_weights_are_read(hf_dir):
    """Published checkpoints are bf16, which numpy cannot hold: they are widened to fp32 exactly."""
    import torch
    from safetensors.torch import load_file as load_torch, save_file as save_torch

    path, section = hf_dir
    tensors = {n: t.to(torch.bfloat16) for n, t in load_torch(path / "model.safetensors").items()}
    save_torch(tensors, path / "model.safetensors")
    state = hf_to_kiln_state(path, section)
    np.testing.assert_array_equal(state["decoder.final_layernorm.weight"],
                                  tensors["model.norm.weight"].float().numpy())
