"""Hugging Face interop: Kiln's Megatron-style weights ↔ a Hugging Face model directory (config.json +
safetensors), for Qwen3 and DeepSeek-V3. numpy and safetensors only (no torch).

Each family's layout is a list of ``Group``s: a few Kiln tensors ↔ a few HF tensors, with the shapes
both sides must have and the two transforms, so export and import come from one definition and every
tensor is shape-checked by name. What the groups encode:
  * Qwen3 ``linear_qkv`` rows are per KV group [q heads, k, v] ↔ HF q_proj/k_proj/v_proj;
  * dense ``linear_fc1`` rows interleave gate/up ↔ HF gate_proj/up_proj;
  * MLA ``linear_qkv`` = [q_a_proj (or q_proj) ; kv_a_proj_with_mqa]; ``q_layernorm``/``k_layernorm`` ↔
    q_a_layernorm/kv_a_layernorm; ``linear_qb``/``linear_kvb`` ↔ q_b_proj/kv_b_proj. HF (DeepSeek's own
    layout) keeps the rope part of q and k in interleaved pairs (x0,x1),(x2,x3)… and de-interleaves at run
    time (``rope_interleave``); Kiln rotates halves, so those rows are permuted [evens, odds] on import;
  * MoE ``experts.weight1`` [E, hidden, 2·ffn] (gate | up) and ``weight2`` [E, ffn, hidden] ↔ per-expert
    mlp.experts.{e}.gate_proj/up_proj/down_proj; ``router.weight``/``expert_bias`` ↔ mlp.gate.weight/
    e_score_correction_bias; ``tokens_per_expert`` (a training counter) has no HF tensor: zeros on import;
  * MTP depth k ↔ model.layers.{num_hidden_layers + k}.* (DeepSeek's checkpoint layout): enorm, hnorm,
    eh_proj, shared_head.norm (Kiln's final_layernorm), the layer's own attention/MLP, and copies of the
    shared embedding (embed_tokens) and output layer (shared_head.head), written on export, read from the
    main model's tensors on import.
"""
from __future__ import annotations

import json
import re
import shutil
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from training.atomic import default_mode, write_atomic, write_json_atomic
from training.checkpoint_files import inside, read_hashed, recorded_files
from training.data.hashing import sha256_file
from training.safetensors_io import SafetensorsFile, SafetensorsFileError

HF_WEIGHTS = "model.safetensors"
HF_INDEX = "model.safetensors.index.json"
# what export_hf writes beside the model: the checkpoint it came from and every file's sha256, which a load of
# the directory (import-hf, checkpoint.load_path) verifies; a directory from elsewhere has none
EXPORT_RECORD = "kiln_export.json"
# tensors some HF checkpoints carry that are not weights
_IGNORED_HF = re.compile(r".*\.rotary_emb\.inv_freq$")


class HFConversionError(ValueError):
    """Bad input for a conversion; the message names the tensor and file (or the config field)."""


# ---- tensor groups ----------------------------------------------------------------------------------

Shape = tuple[int, ...]


@dataclass
class Group:
    """Kiln tensors ↔ HF tensors (name → shape on each side). ``to_hf`` maps the Kiln arrays (in ``kiln``
    order) to the HF arrays (in ``hf`` order), ``to_kiln`` the reverse. ``hf_optional``: HF tensors
    accepted and ignored on import (copies of shared weights), still written on export."""
    kiln: dict[str, Shape]
    hf: dict[str, Shape]
    to_hf: Callable[[list[np.ndarray]], list[np.ndarray]]
    to_kiln: Callable[[list[np.ndarray]], list[np.ndarray]]
    hf_optional: tuple[str, ...] = ()


def same(kiln: str, hf: str, shape: Shape, copies: tuple[str, ...] = ()) -> Group:
    """One tensor under another name; ``copies``: more HF names holding the same tensor (export only)."""
    return Group({kiln: shape}, {hf: shape, **{c: shape for c in copies}},
                 to_hf=lambda a: a * (1 + len(copies)), to_kiln=lambda a: a[:1], hf_optional=copies)


def rows(kiln: str, parts: dict[str, int], cols: tuple[int, ...], order: np.ndarray | None = None) -> Group:
    """Kiln rows = the HF tensors' rows stacked in ``parts`` order, then reordered by ``order``
    (kiln row i = stacked row order[i])."""
    total = sum(parts.values())
    order = np.arange(total) if order is None else order
    inverse = np.argsort(order)
    bounds = np.cumsum(list(parts.values()))[:-1]

    def to_kiln(arrays):
        return [np.concatenate(arrays, axis=0)[order]]

    def to_hf(arrays):
        return list(np.split(arrays[0][inverse], bounds, axis=0))

    return Group({kiln: (total, *cols)}, {name: (n, *cols) for name, n in parts.items()}, to_hf, to_kiln)


def grouped_qkv(kiln: str, q: str, k: str, v: str, groups: int, per_group: int, dim: int, hidden: int) -> Group:
    """Qwen3's fused ``linear_qkv``: rows per KV group [its q heads, k, v]."""
    def to_kiln(arrays):
        qa, ka, va = arrays
        stacked = np.concatenate([qa.reshape(groups, per_group, dim, hidden), ka.reshape(groups, 1, dim, hidden),
                                  va.reshape(groups, 1, dim, hidden)], axis=1)
        return [stacked.reshape(-1, hidden)]

    def to_hf(arrays):
        grouped = arrays[0].reshape(groups, per_group + 2, dim, hidden)
        return [grouped[:, :per_group].reshape(-1, hidden), grouped[:, per_group].reshape(-1, hidden),
                grouped[:, per_group + 1].reshape(-1, hidden)]

    return Group({kiln: (groups * (per_group + 2) * dim, hidden)},
                 {q: (groups * per_group * dim, hidden), k: (groups * dim, hidden), v: (groups * dim, hidden)},
                 to_hf, to_kiln)


def gate_up(kiln: str, gate: str, up: str, ffn: int, hidden: int) -> Group:
    """Dense SwiGLU ``linear_fc1``: row 2j is gate unit j, row 2j+1 up unit j."""
    return Group({kiln: (2 * ffn, hidden)}, {gate: (ffn, hidden), up: (ffn, hidden)},
                 to_hf=lambda a: [a[0][0::2], a[0][1::2]],
                 to_kiln=lambda a: [np.stack(a, axis=1).reshape(2 * ffn, hidden)])


def experts_fc1(kiln: str, hf_prefix: str, experts: int, hidden: int, ffn: int) -> Group:
    """weight1 [E, hidden, 2·ffn], input-major with gate | up halves ↔ per-expert gate_proj/up_proj [ffn, hidden]."""
    names = [f"{hf_prefix}.{e}.{proj}.weight" for e in range(experts) for proj in ("gate_proj", "up_proj")]

    def to_kiln(arrays):
        return [np.stack([np.concatenate([g.T, u.T], axis=1) for g, u in zip(arrays[0::2], arrays[1::2])])]

    def to_hf(arrays):
        return [half.T for w in arrays[0] for half in (w[:, :ffn], w[:, ffn:])]

    return Group({kiln: (experts, hidden, 2 * ffn)}, {n: (ffn, hidden) for n in names}, to_hf, to_kiln)


def experts_fc2(kiln: str, hf_prefix: str, experts: int, hidden: int, ffn: int) -> Group:
    """weight2 [E, ffn, hidden] ↔ per-expert down_proj [hidden, ffn]."""
    names = [f"{hf_prefix}.{e}.down_proj.weight" for e in range(experts)]
    return Group({kiln: (experts, ffn, hidden)}, {n: (hidden, ffn) for n in names},
                 to_hf=lambda a: [w.T for w in a[0]], to_kiln=lambda a: [np.stack([w.T for w in a])])


def kiln_only(kiln: str, shape: Shape) -> Group:
    """A Kiln buffer with no HF counterpart: dropped on export, zeros on import."""
    return Group({kiln: shape}, {}, to_hf=lambda a: [], to_kiln=lambda a: [np.zeros(shape, np.float32)])


# ---- configs ----------------------------------------------------------------------------------------

def model_settings(model_section: dict):
    """The family config (Qwen3Config / DeepseekV3Config) of a YAML ``model:`` section, validated as
    ``build_model`` would (without building the model)."""
    from training.config import ConfigError
    from training.model import model_config  # the model package imports MindSpore: load it lazily

    try:
        config = model_config(model_section)
    except ConfigError as exc:
        raise HFConversionError(str(exc)) from None
    return model_section["model_type"], config


def hf_compatible_settings(model_section: dict):
    """``model_settings``, refusing what Hugging Face's classes compute differently."""
    model_type, c = model_settings(model_section)
    if c.attention_bias:
        raise HFConversionError("model.attention_bias: Kiln biases linear_qkv only; Hugging Face's Qwen3 would "
                                "also bias o_proj, so the two models would differ")
    if model_type == "qwen3":
        return model_type, c
    if not c.qk_layernorm:
        raise HFConversionError("model.qk_layernorm = false: Hugging Face's DeepSeek-V3 always normalises the q and "
                                "kv latents (q_a_layernorm, kv_a_layernorm)")
    if c.rope_scaling is None and (c.position_embedding_type == "yarn" or c.softmax_scale() != c.plain_softmax_scale):
        raise HFConversionError(
            f"model.position_embedding_type = {c.position_embedding_type!r}, model.rotary_scaling_factor = "
            f"{c.rotary_scaling_factor}, model.mscale = {c.mscale}: MindFormers' YaRN (its original context is "
            "max_position_embeddings; its softmax scale grows by mscale(rotary_scaling_factor, mscale)^2 even "
            "without YaRN) has no Hugging Face equivalent; describe the scaling with model.rope_scaling, or set "
            "model.rotary_scaling_factor: 1.0 for none")
    if c.moe_layer_freq != 1:
        raise HFConversionError(f"model.moe_layer_freq = {c.moe_layer_freq!r}: Hugging Face's DeepSeek-V3 makes "
                                "every layer from first_k_dense_replace on an MoE layer (moe_layer_freq 1)")
    if c.shared_expert_size != c.moe_intermediate_size * c.n_shared_experts:
        raise HFConversionError(f"model.moe_shared_expert_intermediate_size = {c.moe_shared_expert_intermediate_size}: "
                                "Hugging Face's DeepSeek-V3 sizes the shared experts moe_intermediate_size x "
                                f"n_shared_experts ({c.moe_intermediate_size * c.n_shared_experts})")
    if c.moe_router_score_function != "sigmoid":
        raise HFConversionError("model.moe_router_score_function: Hugging Face's DeepSeek-V3 router uses sigmoid, "
                                f"not {c.moe_router_score_function!r}")
    return model_type, c


_COMMON_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "hidden_act", "max_position_embeddings", "rms_norm_eps", "rope_theta",
                  "tie_word_embeddings", "initializer_range", "attention_bias")
_FAMILY_FIELDS = {
    "qwen3": ("head_dim",),
    "deepseek_v3": ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                    "moe_intermediate_size", "n_routed_experts", "n_shared_experts", "num_experts_per_tok",
                    "n_group", "topk_group", "norm_topk_prob", "routed_scaling_factor", "first_k_dense_replace",
                    "num_nextn_predict_layers"),
}
_ROPE_SCALING_FIELDS = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale",
                        "mscale_all_dim")


def kiln_to_hf_config(model_section: dict) -> dict:
    """config.json for a Kiln ``model:`` section (fp32 weights). Fields HF cannot express are errors."""
    model_type, c = hf_compatible_settings(model_section)
    config = {"architectures": [c.__class__.__name__.replace("Config", "ForCausalLM")], "model_type": model_type,
              **{name: getattr(c, name) for name in _COMMON_FIELDS + _FAMILY_FIELDS[model_type]},
              "torch_dtype": "float32"}
    if model_type == "qwen3":
        config["use_sliding_window"] = False
        return config
    config.update(scoring_func="sigmoid", topk_method="noaux_tc", rope_interleave=True)
    if c.rope_scaling is not None:
        s = c.rope_scaling
        original = s.original_max_position_embeddings or c.max_position_embeddings  # Kiln's default, made explicit
        if abs(c.max_position_embeddings / original - s.factor) > 1e-9:
            # transformers 4.x takes the YaRN factor from this ratio whenever the original length is given
            # (5.x only when factor is missing): only a consistent pair means the same model everywhere
            raise HFConversionError(
                f"model.rope_scaling.factor ({s.factor}) must equal model.max_position_embeddings / "
                f"model.rope_scaling.original_max_position_embeddings ({c.max_position_embeddings}/{original}) "
                "for Hugging Face's YaRN to match")
        config["rope_scaling"] = {"type": "yarn", "rope_type": "yarn",
                                  **{k: getattr(s, k) for k in _ROPE_SCALING_FIELDS},
                                  "original_max_position_embeddings": original}
    return config


def hf_to_kiln_model_section(hf_config: dict, where: str = "config.json") -> dict:
    """The Kiln ``model:`` section for an HF config.json (HF field names are Kiln's)."""
    from training.model import SUPPORTED

    model_type = hf_config.get("model_type")
    if model_type not in SUPPORTED:
        raise HFConversionError(f"{where}: model_type {model_type!r} is not supported ({', '.join(SUPPORTED)})")
    # MindFormers' defaults that Hugging Face's models do not share: bf16 compute (no CPU kernels; HF computes
    # in the checkpoint's dtype, imported as fp32), Qwen3's hidden dropout 0.1, DeepSeek-V3 without latent norms
    # and with MLA's softmax scale grown by mscale(rotary_scaling_factor 40, mscale)^2 (factor 1: unscaled)
    section = {"model_type": model_type, "architectures": SUPPORTED[model_type][0], "compute_dtype": "float32",
               "hidden_dropout": 0.0}
    if model_type == "deepseek_v3":
        section["qk_layernorm"] = True
    max_positions = hf_config.get("max_position_embeddings")
    if isinstance(max_positions, int):  # HF has no training sequence length: Kiln's default, capped to fit
        section["seq_length"] = min(SUPPORTED[model_type][1].seq_length, max_positions)
    for name in _COMMON_FIELDS + _FAMILY_FIELDS[model_type]:
        if name in hf_config and (hf_config[name] is not None or name == "q_lora_rank"):  # null q_lora: no q latent
            section[name] = hf_config[name]
    rope = hf_config.get("rope_parameters") or {}  # transformers 5 keeps rope_theta and scaling here
    if "rope_theta" not in section and "rope_theta" in rope:
        section["rope_theta"] = rope["rope_theta"]
    scaling = hf_config.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
    if scaling:
        kind = scaling.get("rope_type") or scaling.get("type")
        if kind != "yarn":
            raise HFConversionError(f"{where}: rope scaling {kind!r} is not supported (only yarn)")
        section["rope_scaling"] = {"type": "yarn", **{k: scaling[k] for k in _ROPE_SCALING_FIELDS if k in scaling}}
    elif model_type == "deepseek_v3":
        section["rotary_scaling_factor"] = 1.0
    if model_type == "deepseek_v3":
        if hf_config.get("rope_interleave", True) is not True:
            raise HFConversionError(f"{where}: rope_interleave false is not supported (Kiln reads DeepSeek's "
                                    "interleaved rope layout)")
        if hf_config.get("scoring_func", "sigmoid") != "sigmoid":
            raise HFConversionError(f"{where}: scoring_func {hf_config['scoring_func']!r}: only sigmoid is supported")
    return section


# ---- layouts ----------------------------------------------------------------------------------------

def _attention_qwen3(c, k: str, h: str) -> list[Group]:
    heads, d, hidden = c.num_attention_heads, c.head_dim, c.hidden_size
    groups = c.num_key_value_heads
    return [grouped_qkv(f"{k}.linear_qkv.weight", f"{h}.q_proj.weight", f"{h}.k_proj.weight", f"{h}.v_proj.weight",
                        groups, heads // groups, d, hidden),
            same(f"{k}.q_layernorm.weight", f"{h}.q_norm.weight", (d,)),
            same(f"{k}.k_layernorm.weight", f"{h}.k_norm.weight", (d,)),
            same(f"{k}.linear_proj.weight", f"{h}.o_proj.weight", (hidden, heads * d))]


def rope_deinterleave(rope: int) -> np.ndarray:
    """Row order turning interleaved rope pairs (x0,x1),(x2,x3)… into rotate-half halves [x0,x2,…; x1,x3,…]."""
    return np.concatenate([np.arange(0, rope, 2), np.arange(1, rope, 2)])


def _attention_mla(c, k: str, h: str) -> list[Group]:
    heads, nope, rope, hidden = c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.hidden_size
    per_head = np.concatenate([np.arange(nope), nope + rope_deinterleave(rope)])
    q_order = (np.arange(heads)[:, None] * (nope + rope) + per_head).reshape(-1)
    kv_down = c.kv_lora_rank + rope
    kv_order = np.concatenate([np.arange(c.kv_lora_rank), c.kv_lora_rank + rope_deinterleave(rope)])
    out = []
    if c.q_lora_rank:
        q_parts, q_order_in_qkv = {f"{h}.q_a_proj.weight": c.q_lora_rank}, np.arange(c.q_lora_rank)
        out += [same(f"{k}.q_layernorm.weight", f"{h}.q_a_layernorm.weight", (c.q_lora_rank,)),
                rows(f"{k}.linear_qb.weight", {f"{h}.q_b_proj.weight": heads * (nope + rope)}, (c.q_lora_rank,),
                     q_order)]
    else:
        q_parts, q_order_in_qkv = {f"{h}.q_proj.weight": heads * (nope + rope)}, q_order
    q_rows = len(q_order_in_qkv)
    out += [rows(f"{k}.linear_qkv.weight", {**q_parts, f"{h}.kv_a_proj_with_mqa.weight": kv_down}, (hidden,),
                 np.concatenate([q_order_in_qkv, q_rows + kv_order])),
            same(f"{k}.k_layernorm.weight", f"{h}.kv_a_layernorm.weight", (c.kv_lora_rank,)),
            same(f"{k}.linear_kvb.weight", f"{h}.kv_b_proj.weight", (heads * (nope + c.v_head_dim), c.kv_lora_rank)),
            same(f"{k}.linear_proj.weight", f"{h}.o_proj.weight", (hidden, heads * c.v_head_dim))]
    return out


def _mlp(c, k: str, h: str, ffn: int) -> list[Group]:
    return [gate_up(f"{k}.linear_fc1.weight", f"{h}.gate_proj.weight", f"{h}.up_proj.weight", ffn, c.hidden_size),
            same(f"{k}.linear_fc2.weight", f"{h}.down_proj.weight", (c.hidden_size, ffn))]


def _moe(c, k: str, h: str) -> list[Group]:
    experts, hidden, ffn = c.n_routed_experts, c.hidden_size, c.moe_intermediate_size
    out = [same(f"{k}.router.weight", f"{h}.gate.weight", (experts, hidden)),
           same(f"{k}.expert_bias", f"{h}.gate.e_score_correction_bias", (experts,)),
           kiln_only(f"{k}.tokens_per_expert", (experts,)),
           experts_fc1(f"{k}.experts.weight1", f"{h}.experts", experts, hidden, ffn),
           experts_fc2(f"{k}.experts.weight2", f"{h}.experts", experts, hidden, ffn)]
    if c.shared_expert_size:
        out += _mlp(c, f"{k}.shared_experts", f"{h}.shared_experts", c.shared_expert_size)
    return out


def _layer(model_type: str, c, k: str, h: str, moe: bool) -> list[Group]:
    hidden = (c.hidden_size,)
    attention = _attention_qwen3 if model_type == "qwen3" else _attention_mla
    return (attention(c, f"{k}.self_attention", f"{h}.self_attn")
            + [same(f"{k}.input_layernorm.weight", f"{h}.input_layernorm.weight", hidden),
               same(f"{k}.pre_mlp_layernorm.weight", f"{h}.post_attention_layernorm.weight", hidden)]
            + (_moe(c, f"{k}.mlp", f"{h}.mlp") if moe else _mlp(c, f"{k}.mlp", f"{h}.mlp", c.intermediate_size)))


def layout(model_type: str, c) -> list[Group]:
    """Every Kiln tensor of the model, grouped with its HF tensors."""
    moe = [model_type == "deepseek_v3" and c.is_moe_layer(i) for i in range(c.num_hidden_layers)]
    n, vocab_shape = c.num_hidden_layers, (c.vocab_size, c.hidden_size)
    mtp = range(c.num_mtp_layers)
    groups = [same("embedding.word_embeddings.weight", "model.embed_tokens.weight", vocab_shape,
                   copies=tuple(f"model.layers.{n + d}.embed_tokens.weight" for d in mtp))]
    for i in range(n):
        groups += _layer(model_type, c, f"decoder.layers.{i}", f"model.layers.{i}", moe[i])
    groups.append(same("decoder.final_layernorm.weight", "model.norm.weight", (c.hidden_size,)))
    if c.tie_word_embeddings:
        groups[0].hf_optional += ("lm_head.weight",)  # some tied checkpoints still store it
    else:
        groups.append(same("output_layer.weight", "lm_head.weight", vocab_shape,
                           copies=tuple(f"model.layers.{n + d}.shared_head.head.weight" for d in mtp)))
    for d in mtp:  # MTP layers reuse the last decoder layer's kind
        k, h = f"mtp.layers.{d}", f"model.layers.{n + d}"
        groups += [same(f"{k}.enorm.weight", f"{h}.enorm.weight", (c.hidden_size,)),
                   same(f"{k}.hnorm.weight", f"{h}.hnorm.weight", (c.hidden_size,)),
                   same(f"{k}.eh_proj.weight", f"{h}.eh_proj.weight", (c.hidden_size, 2 * c.hidden_size)),
                   same(f"{k}.final_layernorm.weight", f"{h}.shared_head.norm.weight", (c.hidden_size,))]
        groups += _layer(model_type, c, f"{k}.transformer_layer", h, moe[-1])
    return groups


# ---- reading HF safetensors (bf16 included, which numpy cannot hold) ---------------------------------------
# The safetensors library reads bf16 and FP8 only into torch (its numpy path refuses them) and names no tensor
# when it refuses a header, so HF files are read here: header validated as the format requires (every tensor's
# data_offsets inside the file, sized for its shape and dtype, the tensors tiling the data), then memory-mapped.

SCALE_SUFFIX = "_scale_inv"  # DeepSeek's FP8 checkpoints: <name>.weight_scale_inv, one fp32 scale per block


def _e4m3_values() -> np.ndarray:
    """float32 value of every float8 e4m3fn byte (bias 7, no infinities, S.1111.111 is NaN)."""
    byte = np.arange(256)
    exponent, mantissa = (byte >> 3) & 0xF, (byte & 7).astype(np.float64)
    magnitude = np.where(exponent == 0, mantissa / 8 * 2.0**-6, (1 + mantissa / 8) * 2.0 ** (exponent - 7))
    magnitude[(exponent == 15) & (mantissa == 7)] = np.nan
    return np.where(byte >> 7, -magnitude, magnitude).astype(np.float32)


_E4M3 = _e4m3_values()


def _export_record(hf_dir: Path) -> dict[str, dict] | None:
    """file name -> {"bytes", "sha256"} of a directory export_hf wrote; None for one from elsewhere."""
    path = inside(hf_dir, EXPORT_RECORD)
    return recorded_files(_read_json(path).get("files"), path) if path.exists() else None


class HFWeights:
    """The tensors of an HF model directory: ``model.safetensors.index.json`` when present, else every
    ``*.safetensors`` file. Each file is read once, hashed as it is read (verified when the directory is a Kiln
    export: ``EXPORT_RECORD``), never through a symlink out of the directory; bfloat16 is widened to float32,
    and FP8 (e4m3) weights are dequantized with their ``weight_scale_inv`` blocks (``block`` rows × columns)."""

    def __init__(self, hf_dir: Path, block: tuple[int, int] = (128, 128)):
        self.dir = Path(hf_dir)
        self.block = block
        self.recorded = _export_record(self.dir)
        self.sha256: dict[str, str] = {}  # file name -> the sha256 of the bytes read
        index = self.dir / HF_INDEX
        if index.exists():
            weight_map = _read_json(index).get("weight_map")
            if not isinstance(weight_map, dict):
                raise HFConversionError(f"{index}: no weight_map")
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(p.name for p in self.dir.glob("*.safetensors"))
        if not files:
            raise HFConversionError(f"{self.dir}: no *.safetensors files")
        self.entries: dict[str, SafetensorsFile] = {}  # name -> the file holding it
        for file_name in files:
            path = inside(self.dir, file_name)
            if self.recorded is not None and file_name not in self.recorded:
                raise HFConversionError(f"{path}: not among the files {EXPORT_RECORD} recorded when it was exported")
            data, self.sha256[file_name] = read_hashed(path, (self.recorded or {}).get(file_name), EXPORT_RECORD)
            with _named_errors():
                reader = SafetensorsFile(path, data)
            for name in reader.names():
                if name in self.entries:
                    raise HFConversionError(f"{reader.path}: tensor {name} also in {self.entries[name].path.name}")
                self.entries[name] = reader

    def origin(self) -> dict:
        """What a run or checkpoint made from these weights records of them (cf. CheckpointFiles.origin)."""
        return {"path": str(self.dir.resolve()), "hugging_face": True, "verified": self.recorded is not None,
                "files_read": dict(sorted(self.sha256.items()))}

    def file_of(self, name: str) -> Path:
        return self.entries[name].path

    def shape(self, name: str) -> Shape:
        return self.entries[name].shape(name)

    def is_scale(self, name: str) -> bool:
        """A dequantization scale of another tensor in the directory (read with it, not on its own)."""
        return name.endswith(SCALE_SUFFIX) and name[:-len(SCALE_SUFFIX)] in self.entries

    def get(self, name: str) -> np.ndarray:
        reader = self.entries[name]
        with _named_errors():
            if reader.dtype(name) == "F8_E4M3":
                return self._dequantize(name, _E4M3[reader.raw(name)])
            return reader.get(name)

    def _dequantize(self, name: str, values: np.ndarray) -> np.ndarray:
        scale_name = name + SCALE_SUFFIX
        if scale_name not in self.entries:
            raise HFConversionError(f"{self.file_of(name)}: FP8 tensor {name} has no {scale_name}")
        rows, cols = self.block
        blocks = (-(-values.shape[0] // rows), -(-values.shape[1] // cols))
        scale = self.get(scale_name)
        if values.ndim != 2 or scale.shape != blocks:
            raise HFConversionError(f"{self.file_of(scale_name)}: tensor {scale_name} has shape {list(scale.shape)}, "
                                    f"expected {list(blocks)} for {name} {list(values.shape)} in {rows}x{cols} blocks")
        expanded = np.repeat(np.repeat(scale, rows, axis=0), cols, axis=1)
        return values * expanded[:values.shape[0], :values.shape[1]]


def _read_json(path: Path) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise HFConversionError(f"{path}: unreadable JSON ({exc})") from None


@contextmanager
def _named_errors() -> Iterator[None]:
    """The reader's errors (they name the file and tensor) as this module's."""
    try:
        yield
    except SafetensorsFileError as exc:
        raise HFConversionError(str(exc)) from None


# ---- conversions ------------------------------------------------------------------------------------

def _check_config_matches(hf_config: dict, c, where: Path) -> None:
    """config.json must describe the model the training YAML builds: name the first field that differs."""
    hf_section = hf_to_kiln_model_section(hf_config, str(where))
    for name, value in hf_section.items():
        if name in ("model_type", "architectures", "initializer_range", "seq_length"):
            continue
        mine = getattr(c, name, None)
        if name == "num_nextn_predict_layers":  # Kiln may train fewer MTP depths than the checkpoint has
            if mine > value:
                raise HFConversionError(f"{where}: {name} = {value}, fewer than model.{name} = {mine}")
            continue
        if name == "rope_scaling":
            value = None if value is None else {k: v for k, v in value.items() if k != "type"}
            mine = None if mine is None else {k: getattr(mine, k) for k in value or {}}
        if value != mine and not (isinstance(value, float) and np.isclose(value, mine, rtol=1e-6, atol=0)):
            raise HFConversionError(f"{where}: {name} = {value!r}, but model.{name} = {mine!r}")
    if getattr(c, "rope_scaling", None) is not None and "rope_scaling" not in hf_section:
        raise HFConversionError(f"{where}: no rope scaling, but model.rope_scaling is set")


def hf_to_kiln_state(hf_dir: Path, model_config: dict) -> dict[str, np.ndarray]:
    """``load_hf_weights``' arrays."""
    return load_hf_weights(hf_dir, model_config)[0]


def load_hf_weights(hf_dir: Path, model_config: dict) -> tuple[dict[str, np.ndarray], dict]:
    """Kiln parameter name → array for the model the YAML ``model:`` section ``model_config`` describes,
    from the HF model directory ``hf_dir`` (weights only), and what was read (``HFWeights.origin``). Every
    tensor is checked: a missing, extra or misshaped one is an error naming it and its file. Arrays come in
    model.params_dtype (MoE buffers fp32)."""
    hf_dir = Path(hf_dir)
    model_type, c = hf_compatible_settings(model_config)
    config_path = inside(hf_dir, "config.json")
    if not config_path.exists():
        raise HFConversionError(f"{hf_dir}: no config.json")
    data, _ = read_hashed(config_path, (_export_record(hf_dir) or {}).get("config.json"), EXPORT_RECORD)
    try:
        hf_config = json.loads(bytes(data))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise HFConversionError(f"{config_path}: unreadable JSON ({exc})") from None
    _check_config_matches(hf_config, c, config_path)
    block = (hf_config.get("quantization_config") or {}).get("weight_block_size") or (128, 128)
    weights = HFWeights(hf_dir, tuple(block))
    layers = c.num_hidden_layers  # MTP depths beyond the model's are checkpoint layers it does not use
    unused_depths = range(layers + c.num_mtp_layers, layers + hf_config.get("num_nextn_predict_layers", 0))
    unused = re.compile(rf"model\.layers\.({'|'.join(map(str, unused_depths))})\.") if unused_depths else None
    groups = layout(model_type, c)
    used = set()
    state: dict[str, np.ndarray] = {}
    for group in groups:
        for name, shape in group.hf.items():
            if name in group.hf_optional:
                continue
            if name not in weights.entries:
                raise HFConversionError(f"{hf_dir}: tensor {name} is missing (needed for Kiln's "
                                        f"{', '.join(group.kiln)})")
            if weights.shape(name) != shape:
                raise HFConversionError(f"{weights.file_of(name)}: tensor {name} has shape "
                                        f"{list(weights.shape(name))}, expected {list(shape)} from the model config")
        needed = [name for name in group.hf if name not in group.hf_optional]
        used.update(group.hf, group.hf_optional)
        arrays = group.to_kiln([weights.get(name) for name in needed])
        state.update(zip(group.kiln, arrays))
    extra = sorted(name for name in weights.entries if name not in used and not _IGNORED_HF.match(name)
                   and not weights.is_scale(name) and not (unused and unused.match(name)))
    if extra:
        raise HFConversionError(f"{weights.file_of(extra[0])}: tensor {extra[0]} has no place in the model"
                                + (f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""))
    params_dtype = np.dtype(c.params_dtype)
    return {name: a.astype(np.float32 if name.endswith(("expert_bias", "tokens_per_expert")) else params_dtype)
            for name, a in state.items()}, weights.origin()


def kiln_to_hf_state(state: dict[str, np.ndarray], model_section: dict, where: str = "checkpoint"
                     ) -> dict[str, np.ndarray]:
    """HF tensor name → array for Kiln weights ``state``; missing, extra or misshaped tensors name ``where``."""
    model_type, c = hf_compatible_settings(model_section)
    groups = layout(model_type, c)
    expected = {name: shape for g in groups for name, shape in g.kiln.items()}
    for name, shape in expected.items():
        if name not in state:
            raise HFConversionError(f"{where}: tensor {name} is missing")
        if tuple(state[name].shape) != shape:
            raise HFConversionError(f"{where}: tensor {name} has shape {list(state[name].shape)}, "
                                    f"expected {list(shape)} from the model config")
    extra = sorted(set(state) - set(expected))
    if extra:
        raise HFConversionError(f"{where}: tensor {extra[0]} has no place in the model"
                                + (f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""))
    out = {}
    for group in groups:
        arrays = group.to_hf([np.asarray(state[n], dtype=np.float32) for n in group.kiln])
        out.update(zip(group.hf, (np.ascontiguousarray(a) for a in arrays)))
    return out


# ---- directories ------------------------------------------------------------------------------------

def checkpoint_model_section(checkpoint_dir: Path) -> dict:
    """The ``model:`` section a Kiln checkpoint was built with (lineage.json: run.config.model for a trained
    one, model for one ``import_hf`` wrote)."""
    if not (Path(checkpoint_dir) / "lineage.json").is_file():
        raise HFConversionError(f"{checkpoint_dir} has no lineage.json (a MindFormers checkpoint?): pass the model "
                                f"section (--config), and --allow-unverified to export files that cannot be verified")
    lineage = _read_json(Path(checkpoint_dir) / "lineage.json")
    section = lineage.get("model") or (lineage.get("run") or {}).get("config", {}).get("model")
    if not isinstance(section, dict):
        raise HFConversionError(f"{checkpoint_dir}/lineage.json: no run.config.model; pass the model section "
                                "(--config)")
    return section


def shard_names(sizes: dict[str, int], max_shard_bytes: int) -> dict[str, list[str]]:
    """File name → tensor names, in order, each file at most ``max_shard_bytes`` (a larger tensor alone);
    one ``model.safetensors`` when everything fits, else HF's ``model-0000i-of-0000n.safetensors``."""
    shards: list[list[str]] = [[]]
    used = 0
    for name, size in sizes.items():
        if shards[-1] and used + size > max_shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += size
    if len(shards) == 1:
        return {HF_WEIGHTS: shards[0]}
    return {f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors": names for i, names in enumerate(shards)}


def write_hf_dir(out_dir: Path, hf_state: dict[str, np.ndarray], hf_config: dict,
                 max_shard_bytes: int = 5 * 10**9, source: dict | None = None,
                 extra_files: dict[str, bytes] | None = None) -> None:
    """Write config.json and the weights (sharded with an index past ``max_shard_bytes``, HF's default
    5 GB) into ``out_dir`` (new or empty), with ``extra_files`` (name -> bytes: the tokenizer's) and, given
    ``source`` (what was exported), EXPORT_RECORD (it and every file's sha256), all or nothing: everything goes
    to a temporary sibling directory renamed into place at the end."""
    from safetensors.numpy import save_file

    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()):
        raise HFConversionError(f"{out_dir}: exists and is not empty")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    staging.chmod(default_mode(directory=True))
    try:
        files = shard_names({name: a.nbytes for name, a in hf_state.items()}, max_shard_bytes)
        for file_name, names in files.items():
            save_file({name: hf_state[name] for name in names}, staging / file_name, metadata={"format": "pt"})
        if len(files) > 1:
            write_json_atomic(staging / HF_INDEX, {
                "metadata": {"total_size": sum(a.nbytes for a in hf_state.values())},
                "weight_map": {name: file_name for file_name, names in files.items() for name in names}})
        write_json_atomic(staging / "config.json", hf_config)
        for name, data in (extra_files or {}).items():
            write_atomic(inside(staging, name), lambda stream, data=data: stream.write(data))
        if source is not None:
            write_json_atomic(staging / EXPORT_RECORD, {"source": source, "files": [
                {"name": p.name, "bytes": p.stat().st_size, "sha256": sha256_file(p)}
                for p in sorted(staging.iterdir()) if not p.name.startswith(".")]})
        if out_dir.exists():
            out_dir.rmdir()
        staging.rename(out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def export_hf(checkpoint_dir: Path, out_dir: Path, model_section: dict | None = None,
              max_shard_bytes: int = 5 * 10**9, allow_unverified: bool = False, tokenizer_model: Path | None = None,
              data_root: Path | None = None) -> tuple[dict, str | None]:
    """A Kiln step checkpoint (iteration dir or save root) → an HF model directory, its files verified as they
    are read (``allow_unverified``: one without lineage.json), with the tokenizer it trained with (its lineage's,
    verified, under ``data_root`` when the data moved; or ``tokenizer_model``). Returns config.json and, when no
    tokenizer was written, why."""
    from training.checkpoint import load_checkpoint, resolve_load_path
    from training.hf_tokenizer import TokenizerExportError, hf_tokenizer_files

    path = resolve_load_path(checkpoint_dir)
    section = model_section or checkpoint_model_section(path)
    hf_config = kiln_to_hf_config(section)
    tokenizer, model_bytes = _exported_tokenizer(path, tokenizer_model, data_root)
    try:
        tokenizer_files = hf_tokenizer_files(model_bytes, tokenizer["path"]) if model_bytes else {}
    except TokenizerExportError as exc:
        raise HFConversionError(str(exc)) from None
    loaded = load_checkpoint(path, load_optim=False, allow_unverified=allow_unverified)
    write_hf_dir(out_dir, kiln_to_hf_state(loaded.model, section, where=str(path)), hf_config, max_shard_bytes,
                 source={**loaded.origin, "tokenizer": tokenizer}, extra_files=tokenizer_files)
    return hf_config, tokenizer.get("missing")


def _exported_tokenizer(checkpoint_dir: Path, tokenizer_model: Path | None, data_root: Path | None
                        ) -> tuple[dict, bytes | None]:
    """The sentencepiece model to export with the weights (read once, verified against the sha256 the checkpoint's
    lineage recorded when it comes from there) and its record, or a record saying why there is none."""
    from training.lineage import read_lineage

    if tokenizer_model is not None:
        data, sha256 = read_hashed(Path(tokenizer_model), None, "")
        return {"path": str(Path(tokenizer_model).resolve()), "sha256": sha256, "given": True}, bytes(data)
    lineage = read_lineage(checkpoint_dir)[0] if (checkpoint_dir / "lineage.json").is_file() else {}
    record = lineage.get("tokenizer")
    if not record:
        return {"missing": "the checkpoint's lineage names no tokenizer (trained without --lineage): pass "
                           "--tokenizer-model FILE, the sentencepiece model its data was tokenized with"}, None
    file = Path(data_root or lineage.get("data_root") or ".") / record["path"]
    if not file.is_file():
        raise HFConversionError(f"{file}: the tokenizer {checkpoint_dir} trained with is not there (the data root "
                                f"moved? pass --data-root DIR, or --tokenizer-model FILE)")
    data, _ = read_hashed(file, {"sha256": record["sha256"]}, f"{checkpoint_dir}'s lineage")
    return {"path": record["path"], "sha256": record["sha256"]}, bytes(data)


def import_hf(hf_dir: Path, save_path: Path, model_section: dict | None = None) -> tuple[Path, dict]:
    """An HF model directory → a Kiln step checkpoint ``save_path/iteration_00000000`` (weights only, for
    ``checkpoint.load_path`` with ``no_load_optim``). The model section defaults to the one config.json
    describes. Returns (the iteration directory, the model section)."""
    from training.checkpoint import save_checkpoint
    from training.parallel.comm import Collectives
    from training.parallel.mesh import World

    hf_dir, save_path = Path(hf_dir), Path(save_path)
    if save_path.exists() and any(save_path.iterdir()):
        raise HFConversionError(f"{save_path}: exists and is not empty")
    section = model_section or hf_to_kiln_model_section(_read_json(hf_dir / "config.json"), str(hf_dir / "config.json"))
    state, origin = load_hf_weights(hf_dir, section)
    world = World(rank=0, size=1)
    common = {"epoch_num": 0, "step_num": 0, "global_step": 0, "consumed_samples": 0, "global_batch_size": 0,
              "loss_scale": 1.0, "ckpt_status": 0}
    lineage = {"model": section, "hugging_face": origin}
    saved = save_checkpoint(save_path=save_path, step=0, model=state, optim=None, common=common,
                            lineage=lineage, prefix=None, save_max=1, world=world, collectives=Collectives(world))
    return saved.path, section
