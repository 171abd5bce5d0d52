"""DeepSeek-V3 (MLA with q/kv latents, group-limited MoE with expert bias and a shared expert, YaRN, one MTP
depth) ↔ Hugging Face transformers' DeepseekV3ForCausalLM: logits match Kiln's within 1e-4 both ways.
transformers' forward has no MTP, so the exported MTP depth (model.layers.{num_hidden_layers}.*, DeepSeek's
layout) is run through transformers' modules the way DeepSeek's weights are used, against Kiln's MTP loss."""
from __future__ import annotations

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from interop.hf_helpers import (TOLERANCE, hf_logits, kiln_logits, kiln_model, load_hf,
                                model_section, random_ids, randomize_hf)
from training.hf import (HFConversionError, hf_to_kiln_model_section, hf_to_kiln_state, kiln_to_hf_config,
                         kiln_to_hf_state, write_hf_dir)

CONFIG = "tests/configs/deepseek_v3_micro.yaml"
MTP = "model.layers.2."  # the micro model has 2 decoder layers, so its MTP depth is HF layer 2


@pytest.fixture
def section():
    # 8 experts in 2 groups of 4, one group kept: a group's score (its top-2 sum) is not its total, and
    # the top-2 pick inside the kept group matters
    section = model_section(CONFIG, n_routed_experts=8)
    assert (section["n_group"], section["topk_group"], section["num_experts_per_tok"]) == (2, 1, 2)
    assert section["rope_scaling"]["factor"] > 1 and section["num_nextn_predict_layers"] == 1
    assert section["q_lora_rank"] and section["n_routed_experts"] > section["num_experts_per_tok"]
    return section


@pytest.mark.parametrize("q_latent", [True, False], ids=["q_lora", "no_q_lora"])
def test_export_matches_transformers(section, tmp_path, q_latent, transformers):
    """Without q_lora_rank, queries come straight from the fused down-projection (HF's q_proj)."""
    section = section if q_latent else {**section, "q_lora_rank": None}
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


def test_import_from_transformers_matches(section, tmp_path, transformers):
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
    with pytest.raises(HFConversionError, match="model.moe_shared_expert_intermediate_size = 48"):
        kiln_to_hf_config({**section, "moe_shared_expert_intermediate_size": 48})
    with pytest.raises(HFConversionError, match="model.rope_scaling.factor"):
        kiln_to_hf_config({**section, "rope_scaling": {**section["rope_scaling"], "factor": 4.0}})


def test_missing_mtp_depth_is_named(section, tmp_path, transformers):
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


def test_mtp_depth_matches_deepseeks_formulation_on_transformers_modules(section, tmp_path, transformers):
    """transformers runs no MTP, so the exported MTP tensors are run here through transformers' own modules
    the way DeepSeek's released weights are used (vLLM, SGLang, Megatron): h' = eh_proj([enorm(emb(t_{i+1}));
    hnorm(h_i)]) with h the main model's final-normed hidden state, then model.layers.{N} (a full decoder
    layer), shared_head.norm and shared_head.head. Its loss must equal Kiln's mtp_1_loss."""
    import torch
    from mindspore import Tensor

    model, weights = kiln_model(section, seed=9)
    exported = kiln_to_hf_state(weights, section)
    n = section["num_hidden_layers"]
    # read as a model one layer deeper, the directory's layer N is the MTP depth's decoder layer
    write_hf_dir(tmp_path / "hf", exported, {**kiln_to_hf_config(section), "num_hidden_layers": n + 1})
    hf_model, info = transformers.DeepseekV3ForCausalLM.from_pretrained(
        tmp_path / "hf", output_loading_info=True, attn_implementation="eager")
    assert not info["missing_keys"]
    hf_model.eval()
    hf_state = {name: torch.from_numpy(a) for name, a in exported.items()}

    ids = random_ids(section["vocab_size"], seed=10)
    labels = random_ids(section["vocab_size"], seed=11)
    mask = np.ones(ids.shape, np.float32)
    mask[0, 5] = 0
    _, parts = model.loss_and_parts(Tensor(ids.astype(np.int32)), Tensor(labels.astype(np.int32)), Tensor(mask))
    kiln_parts = model.named_parts(parts)
    kiln_mtp_loss = kiln_parts["mtp_1_loss"]

    def rms(x, weight):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + section.get("rms_norm_eps", 1e-6)) * weight

    def shifted(a):  # one position left, the freed last position 0 (and out of the loss)
        return np.concatenate([a[:, 1:], np.zeros_like(a[:, :1])], axis=1)

    core, seq = hf_model.model, ids.shape[1]
    causal = torch.triu(torch.full((seq, seq), torch.finfo(torch.float32).min), 1)[None, None]
    positions = torch.arange(seq)[None]
    with torch.no_grad():
        x = core.embed_tokens(torch.from_numpy(ids))
        rope = core.rotary_emb(x, positions)
        for layer in core.layers[:n]:
            x = layer(x, attention_mask=causal, position_ids=positions, position_embeddings=rope)
        h = core.norm(x)
        p = f"model.layers.{n}."
        e = core.embed_tokens(torch.from_numpy(shifted(ids)))
        x = torch.cat([rms(e, hf_state[p + "enorm.weight"]), rms(h, hf_state[p + "hnorm.weight"])], -1)
        x = core.layers[n](x @ hf_state[p + "eh_proj.weight"].T, attention_mask=causal, position_ids=positions,
                           position_embeddings=rope)
        logits = rms(x, hf_state[p + "shared_head.norm.weight"]) @ hf_state[p + "shared_head.head.weight"].T
        token_loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                       torch.from_numpy(shifted(labels)).reshape(-1), reduction="none")
        weight = torch.from_numpy(shifted(mask)).reshape(-1)
        reference = float((token_loss * weight).sum() / weight.sum())
    assert kiln_mtp_loss == pytest.approx(reference, rel=1e-5)
    assert abs(kiln_mtp_loss - kiln_parts["lm_loss"]) > 1e-3  # a different prediction, not a copy


def test_fp8_checkpoint_is_dequantized_with_its_block_scales(section, tmp_path):
    """DeepSeek publishes its weights as float8 e4m3 with one fp32 scale per 128x128 block
    (<name>_scale_inv); here 16x16 blocks so the tiny matrices have several."""
    import json

    import torch
    from safetensors.torch import save_file as save_torch

    _, weights = kiln_model(section, seed=13)
    write_hf_dir(tmp_path / "hf", kiln_to_hf_state(weights, section), kiln_to_hf_config(section))
    tensors = {n: torch.from_numpy(a) for n, a in load_file(tmp_path / "hf" / "model.safetensors").items()}
    block, expected = 16, {}
    for name in [n for n in tensors if n.endswith("proj.weight")]:
        w = tensors[name]
        blocks = w.reshape(w.shape[0] // block, block, w.shape[1] // block, block)
        scale = blocks.abs().amax(dim=(1, 3)) / 448
        expanded = scale.repeat_interleave(block, 0).repeat_interleave(block, 1)
        tensors[name] = (w / expanded).to(torch.float8_e4m3fn)
        tensors[name + "_scale_inv"] = scale
        expected[name] = (tensors[name].float() * expanded).numpy()
    save_torch(tensors, tmp_path / "hf" / "model.safetensors")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [block, block]}
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))

    state = hf_to_kiln_state(tmp_path / "hf", section)
    kiln_w = state["decoder.layers.0.self_attention.linear_kvb.weight"]
    np.testing.assert_array_equal(kiln_w, expected["model.layers.0.self_attn.kv_b_proj.weight"])
    assert not np.array_equal(kiln_w, weights["decoder.layers.0.self_attention.linear_kvb.weight"])  # fp8 is lossy
    np.testing.assert_allclose(kiln_w, weights["decoder.layers.0.self_attention.linear_kvb.weight"], atol=0.05)
    expert = state["decoder.layers.1.mlp.experts.weight2"][3]
    np.testing.assert_array_equal(expert, expected["model.layers.1.mlp.experts.3.down_proj.weight"].T)

    tensors.pop("model.layers.1.self_attn.o_proj.weight_scale_inv")
    save_torch(tensors, tmp_path / "hf" / "model.safetensors")
    with pytest.raises(HFConversionError, match=r"FP8 tensor model\.layers\.1\.self_attn\.o_proj\.weight has no "):
        hf_to_kiln_state(tmp_path / "hf", section)
