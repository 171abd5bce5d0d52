"""Grouped-query self-attention (Qwen3): fused per-group ``linear_qkv``, per-head q/k RMSNorm, RoPE."""
from __future__ import annotations

import math

from mindspore import Tensor, mint, nn, ops

from training.model import ascend
from training.model.layers import (Init, Linear, MaxLogitTracker, RMSNorm, Softmax, _bmm, _bmm_transpose_b,
                                   apply_rotary, cast, expand, heads_first, merge_heads)

# Causal attention in query blocks: block i (of seq/QUERY_BLOCKS queries) multiplies, masks and softmaxes against
# the keys up to its end only, (1+2+3+4)/16 = 62% of the full score square: less CPU per step and less peak memory
# than one block. Blocks of fewer than MIN_QUERY_BLOCK_ROWS queries save less score work than their extra ops cost,
# in the step and in its compile, so short sequences run as one block (figures: docs/training.md, The model's ops).
QUERY_BLOCKS = 4
MIN_QUERY_BLOCK_ROWS = 32


def query_blocks(seq: int) -> int:
    """How many causal query blocks attention over ``seq`` positions runs in."""
    return QUERY_BLOCKS if seq % QUERY_BLOCKS == 0 and seq // QUERY_BLOCKS >= MIN_QUERY_BLOCK_ROWS else 1


class SelfAttention(nn.Cell):
    """Grouped-query attention with a fused, per-group ``linear_qkv`` and per-head RMSNorm on q and k.

    ``linear_qkv`` rows are grouped per KV group: [q heads of group 0, k0, v0, q heads of group 1, k1, v1, …].
    GQA without copying K/V: the q heads of one KV group are stacked along the query axis
    ([batch, groups, heads_per_group·seq, dim]), so one batched matmul per group serves all its heads;
    the causal mask is stacked the same way (``mask_repeats`` = heads per group). Keys after a query's block are
    skipped (``query_blocks``).

    Under tensor parallelism each rank holds whole KV groups: ``num_groups``/``num_heads`` count this rank's."""

    def __init__(self, init: Init, config):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_groups = config.num_key_value_heads
        self.heads_per_group = self.num_heads // self.num_groups
        self.head_dim = config.head_dim
        qkv_rows = self.num_groups * (self.heads_per_group + 2) * self.head_dim
        self.linear_qkv = Linear(init, config.hidden_size, qkv_rows, bias=config.attention_bias)
        self.q_layernorm = RMSNorm(self.head_dim, config.rms_norm_eps, config.dtype("layernorm_compute_dtype"))
        self.k_layernorm = RMSNorm(self.head_dim, config.rms_norm_eps, config.dtype("layernorm_compute_dtype"))
        self.softmax_dtype = config.dtype("softmax_compute_dtype")
        self.linear_proj = Linear(init, self.num_heads * self.head_dim, config.hidden_size)
        self.scale = 1.0 / math.sqrt(self.head_dim)
        self.softmax = Softmax()
        self.logit_tracker = MaxLogitTracker()
        # context parallelism: (q, k, v) -> out over the tokens of every cp rank (ContextAttention); None: this
        # rank holds whole sequences and the plain masked softmax below runs
        self.context_attention = None
        # Ascend's FlashAttentionScore when model.use_flash_attention asks and the device and heads allow it
        self.flash_attention = ascend.flash_attention(config)
        # the compiled step's recompute sets it, for every layer alike (they share one graph): ``_heads_first``
        self.permute_layouts = False

    @staticmethod
    def mask_repeats(config) -> int:
        return config.num_attention_heads // config.num_key_value_heads

    @staticmethod
    def check_tensor_parallel(config, tp) -> None:
        tp.require_divisible(config.num_key_value_heads, "model.num_key_value_heads",
                             "linear_qkv is split by whole query groups")

    def parallelize_tensor(self, tp) -> None:
        """Tensor parallelism: ``linear_qkv`` column-parallel by whole KV groups (its rows are grouped per group),
        ``linear_proj`` row-parallel; the q/k norms stay whole but apply to this rank's heads only."""
        tp.column_parallel(self.linear_qkv)
        self.num_groups //= tp.size
        self.num_heads //= tp.size
        tp.applied_to_local_heads(self.q_layernorm.weight, self.k_layernorm.weight)
        self.logit_tracker.heads_comm = tp.gather_heads()
        tp.row_parallel(self.linear_proj)

    def parallelize_context(self, cp) -> None:
        """Context parallelism: the attention core over the cp ranks' tokens."""
        self.context_attention = cp.attention(self.softmax_dtype, self.heads_per_group)

    def _qk_normed(self, qk: Tensor) -> Tensor:
        """q_layernorm on every q head and k_layernorm on every k head, as one RMSNorm over the [batch, seq,
        groups, per_group + 1, dim] q|k slots of qkv: on CPU, norms of separate q and k views are several times
        slower than one pass (figures: docs/training.md, The model's ops)."""
        per_group, norm = self.heads_per_group, self.q_layernorm
        weights = ops.cat((ops.tile(norm.full_weight().expand_dims(0), (per_group, 1)),
                           self.k_layernorm.full_weight().expand_dims(0)))
        return norm.normalize(qk, weights)

    def construct(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor) -> Tensor:
        """x: [batch, seq, hidden]; cos/sin from RotaryEmbedding.tables; mask: causal_mask(seq,
        heads_per_group) or additive_mask(attention_mask, heads_per_group)."""
        qkv = self.linear_qkv(x)  # the whole sequence, also when x is a sequence shard (tensor parallel)
        batch, seq, _ = qkv.shape
        groups, per_group, dim = self.num_groups, self.heads_per_group, self.head_dim
        # v is split off before the norm: norming it too and splitting afterwards measured slower (its backward
        # adds a zero-filled gradient for the unused normed v to v's own)
        qk, v = ops.split(qkv.reshape(batch, seq, groups, per_group + 2, dim), [per_group + 1, 1], axis=3)
        q, k = ops.split(self._qk_normed(qk), [per_group, 1], axis=3)    # q head g·per_group + j: KV group g
        q = self._heads_first(q.reshape(batch, seq, groups * per_group, dim))
        q = q.reshape(batch, groups, per_group, seq, dim)                  # [batch, groups, per_group, seq, dim]
        k = self._heads_first(k.squeeze(3))                                # [batch, groups, seq, dim]
        v = self._heads_first(v.squeeze(3))
        # per-sample tables are [batch, 1, seq, dim] (k's layout); q has one more head axis. The softmax scale is
        # folded into q's tables: a multiply of [seq, dim] instead of all of q
        q_cos, q_sin = (cos, sin) if cos.ndim == 2 else (cos.expand_dims(1), sin.expand_dims(1))
        q = apply_rotary(q, q_cos * self.scale, q_sin * self.scale)
        k = apply_rotary(k, cos, sin)
        if self.context_attention is not None:
            out = self.context_attention(q, k, v)
        elif self.flash_attention is not None and not self.logit_tracker.enabled:  # the kernel hides the scores
            out = self.flash_attention(q, k, v, mask)
        else:
            out = self._causal_attention(q, k, v, mask)
        return self.linear_proj(self._merge_heads(out.reshape(batch, self.num_heads, seq, -1)))

    def _heads_first(self, x: Tensor) -> Tensor:
        """[batch, seq, heads, dim] → [batch, heads, seq, dim]: unstacked and stacked (``layers.heads_first``), or
        with ``permute_layouts`` by mint.permute; the same values and gradients. Compiled on CPU, neither keeps an
        index map of its output as a Transpose does. mint.permute's kernel ran the step slower (seq 512) but
        held less in the compiled recompute's graph, so only that recompute, which trades time for memory, permutes
        (docs/training.md, "Activation recompute" and the table of the model's ops: the figures)."""
        return mint.permute(x, (0, 2, 1, 3)) if self.permute_layouts else heads_first(x)

    def _merge_heads(self, x: Tensor) -> Tensor:
        """[batch, heads, seq, dim] → [batch, seq, heads·dim] (``_heads_first``' two ways)."""
        if self.permute_layouts:
            return mint.permute(x, (0, 2, 1, 3)).reshape(x.shape[0], x.shape[2], -1)
        return merge_heads(x)

    def _causal_attention(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
        """softmax(q·kᵀ + mask)·v per head: q [batch, groups, per_group, seq, dim], k [batch, groups, seq, dim],
        v [batch, groups, seq, dim_v] (MLA's value heads are narrower than its query-key heads), the result
        [batch, groups, per_group, seq, dim_v]. Query block i reads the keys up to its own end only
        (``query_blocks``), so ``mask`` must mask every later key, as causal_mask and the dataset's block-causal
        masks do."""
        batch, groups, per_group, seq, dim = q.shape
        blocks = query_blocks(seq)
        size = seq // blocks
        mask = mask.reshape(*mask.shape[:-2], per_group, seq, seq)  # unstacked: [..., per_group, seq, seq]
        outs = []
        for i, q_block in enumerate(ops.split(q, size, axis=3)):
            keys = (i + 1) * size
            rows = _block(mask, i * size, size, keys).reshape(*mask.shape[:-3], per_group * size, keys)
            q_block = q_block.reshape(batch, groups, per_group * size, dim)
            # [batch, groups, per_group·size, keys]; in float16 the mask's float32 minimum is -inf: still 0 weight
            scores = cast(_bmm_transpose_b(q_block, _block(k, 0, keys, dim)), self.softmax_dtype)
            scores = scores + expand(cast(rows, self.softmax_dtype), scores)
            if self.logit_tracker.enabled:
                self.logit_tracker.update(scores.reshape(batch, groups, per_group, size * keys))
            probs = cast(self.softmax(scores), v.dtype)
            values = v.shape[-1]  # MLA's value heads are narrower than its query/key heads
            outs.append(_bmm(probs, _block(v, 0, keys, values)).reshape(batch, groups, per_group, size, values))
        return ops.cat(outs, axis=3)


def _block(x: Tensor, first_row: int, rows: int, columns: int) -> Tensor:
    """x[..., first_row:first_row + rows, :columns] as a Slice: indexing compiles to StridedSlice, which on CPU
    takes many times as long for the same block (figures: docs/training.md, The model's ops)."""
    leading = x.shape[:-2]
    return ops.slice(x, (0,) * len(leading) + (first_row, 0), (*leading, rows, columns))
