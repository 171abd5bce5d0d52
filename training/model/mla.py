"""Multi-head latent attention (DeepSeek-V3) and YaRN rotary scaling.

Weights (MindFormers' pynative MLA): ``linear_qkv`` is one fused down-projection with rows
[q latent (q_lora_rank) ; kv latent (kv_lora_rank) ; shared k rope part (qk_rope_head_dim)] — without
q_lora_rank its first rows are the full per-head queries (heads·(nope+rope)) and there is no
``q_layernorm``/``linear_qb``. ``linear_qb`` rows: per head [nope ; rope]; ``linear_kvb`` rows: per head
[k nope ; v]. RoPE (rotate-half) acts on the rope sub-dimension only; HF's DeepSeek-V3 checkpoints
store those rope rows interleaved (HF de-interleaves them at run time), so a converter permutes them.
"""
from __future__ import annotations

import math

import numpy as np
from mindspore import Tensor, nn, ops

from training.model import ascend
from training.model.attention import SelfAttention
from training.model.layers import (Init, Linear, MaxLogitTracker, RMSNorm, Softmax, apply_rotary, heads_first,
                                   merge_heads)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_parameters(dim: int, base: float, factor: float, original_max_positions: int, beta_fast: float,
                    beta_slow: float, mscale: float, mscale_all_dim: float) -> tuple[np.ndarray, float]:
    """(inverse frequencies [dim/2], cos/sin magnitude) of YaRN: frequencies that turn fewer than
    ``beta_slow`` times over the original context are interpolated (÷ factor), those turning more than
    ``beta_fast`` times are kept, a linear ramp in between (HF's ``_compute_yarn_parameters``)."""
    def correction_dim(rotations: float) -> float:
        return dim * math.log(original_max_positions / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction_dim(beta_fast)), 0)
    high = min(math.ceil(correction_dim(beta_slow)), dim - 1)
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / ((high - low) or 0.001), 0, 1)
    extrapolation = 1.0 / base ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    keep = 1 - ramp
    inv_freq = extrapolation / factor * (1 - keep) + extrapolation * keep
    if mscale and mscale_all_dim:
        magnitude = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
    else:
        magnitude = yarn_mscale(factor)
    return inv_freq, magnitude


def split_heads(x: Tensor, widths: list[int], heads: int) -> tuple[Tensor, ...]:
    """[batch, seq, heads·sum(widths)], each head's features being parts of ``widths`` → one [batch, heads, seq,
    width] tensor per part (``layers.heads_first``, then split)."""
    return ops.split(heads_first(x.reshape(*x.shape[:-1], heads, sum(widths))), widths, axis=-1)


class MLASelfAttention(nn.Cell):
    """Queries and keys/values go through low-rank latents (each RMS-normed); keys share one rope part
    across heads. Activations [batch, heads, seq, dim]; the mask is [seq, seq] (``mask_repeats`` 1). Attention itself
    is GQA's (``SelfAttention._causal_attention``) with one query head per group."""

    def __init__(self, init: Init, config):
        super().__init__()
        self.num_heads = heads = config.num_attention_heads
        self.nope, self.rope, self.v_dim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.q_lora, self.kv_lora = config.q_lora_rank, config.kv_lora_rank
        q_rows = self.q_lora or heads * (self.nope + self.rope)
        self.split_sizes = [q_rows, self.kv_lora, self.rope]
        norm_dtype = config.dtype("layernorm_compute_dtype")
        self.linear_qkv = Linear(init, config.hidden_size, sum(self.split_sizes))
        # the latents' norms exist with model.qk_layernorm (MindFormers: IdentityOp otherwise)
        norms = config.qk_layernorm
        if self.q_lora:
            self.q_layernorm = RMSNorm(self.q_lora, config.rms_norm_eps, norm_dtype) if norms else None
            self.linear_qb = Linear(init, self.q_lora, heads * (self.nope + self.rope))
        else:
            self.q_layernorm = self.linear_qb = None
        self.k_layernorm = RMSNorm(self.kv_lora, config.rms_norm_eps, norm_dtype) if norms else None
        self.linear_kvb = Linear(init, self.kv_lora, heads * (self.nope + self.v_dim))
        self.linear_proj = Linear(init, heads * self.v_dim, config.hidden_size)
        self.scale = config.softmax_scale()
        self.softmax = Softmax()
        self.softmax_dtype = config.dtype("softmax_compute_dtype")
        self.logit_tracker = MaxLogitTracker()
        # tensor parallelism: this rank's heads in ``num_heads``, and the collective that brings the shared
        # rope key (computed on the sequence shard) to every head of the whole sequence
        self.rope_key_comm = None
        # context parallelism: (q, k, v) -> out over the tokens of every cp rank (ContextAttention), or None
        self.context_attention = None
        self.flash_attention = ascend.flash_attention(config)

    def construct(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor) -> Tensor:
        heads = self.num_heads
        q, kv_latent, k_rope = ops.split(self.linear_qkv(x), self.split_sizes, axis=-1)
        if self.rope_key_comm is not None:
            k_rope = self.rope_key_comm(k_rope)
        if self.q_layernorm is not None:
            q = self.q_layernorm(q)
        if self.q_lora:
            q = self.linear_qb(q)
        batch, seq, _ = q.shape  # the whole sequence, also when x is a sequence shard (tensor parallel)
        q_nope, q_rope = split_heads(q, [self.nope, self.rope], heads)
        if self.k_layernorm is not None:
            kv_latent = self.k_layernorm(kv_latent)
        k_nope, v = split_heads(self.linear_kvb(kv_latent), [self.nope, self.v_dim], heads)
        k_rope = apply_rotary(k_rope.reshape(batch, 1, seq, self.rope), cos, sin)
        q = ops.cat((q_nope, apply_rotary(q_rope, cos, sin)), axis=-1) * self.scale
        k = ops.cat((k_nope, ops.broadcast_to(k_rope, (batch, heads, seq, self.rope))), axis=-1)
        q = q.expand_dims(2)  # one query head per group, in GQA's layout
        if self.context_attention is not None:
            out = self.context_attention(q, k, v).squeeze(2)
        elif self.flash_attention is not None and not self.logit_tracker.enabled:
            out = self.flash_attention(q, k, v, mask).squeeze(2)
        else:
            out = self._causal_attention(q, k, v, mask).squeeze(2)
        return self.linear_proj(merge_heads(out))

    @staticmethod
    def check_tensor_parallel(config, tp) -> None:
        tp.require_divisible(config.num_attention_heads, "model.num_attention_heads", "MLA splits the heads")
        if not config.q_lora_rank:
            tp.refuse("model.q_lora_rank is unset: tensor-parallel MLA needs the query compression (linear_qb "
                      "splits the heads), as in MindFormers")

    def parallelize_tensor(self, tp) -> None:
        """Tensor parallelism splits the heads: ``linear_qb`` and ``linear_kvb`` column-parallel, ``linear_proj``
        row-parallel; the fused down-projection and the latent norms run whole where the activations are, and the
        shared rope key (computed on a sequence shard) comes to every head of the whole sequence."""
        tp.column_parallel(self.linear_qb)
        tp.column_parallel(self.linear_kvb)
        self.rope_key_comm = tp.enter
        self.num_heads //= tp.size
        self.logit_tracker.heads_comm = tp.gather_heads()
        tp.row_parallel(self.linear_proj)

    def parallelize_context(self, cp) -> None:
        """Context parallelism: the attention core over the cp ranks' tokens, one query head per group."""
        self.context_attention = cp.attention(self.softmax_dtype, 1)

    # GQA's causal attention, query block by query block (attention.query_blocks): each block scores only the keys
    # up to its end, 62% of the score square at seq 512: less CPU compiled and less eager peak memory on
    # deepseek_v3_bench's MLA (figures: docs/training.md, The model's ops)
    _causal_attention = SelfAttention._causal_attention
