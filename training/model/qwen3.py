"""Qwen3 dense decoder for MindSpore PyNative, read top to bottom.

token embedding → N × [RMSNorm → GQA self-attention (QK-norm, RoPE, causal) → residual
                       → RMSNorm → SwiGLU MLP → residual] → final RMSNorm → output layer (or tied).

Parameter names follow MindFormers' pynative Megatron-style layout (no prefix, global layer indices),
so checkpoints look like theirs: ``decoder.layers.{i}.self_attention.linear_qkv.weight`` etc. Two
fused layouts matter for anyone converting weights (MindFormers reference §7.4):
  * ``linear_qkv`` rows are grouped per KV group: [q heads of group 0, k0, v0, q heads of group 1, k1, v1, …];
  * ``linear_fc1`` rows interleave gate and up: output reshaped to [..., ffn, 2] is (gate, up).
Activations are [batch, seq, hidden]. Linear weights are stored [out, in].
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor, nn, ops

from training.config import Section, require

DTYPES = {"float32": ms.float32, "bfloat16": ms.bfloat16, "float16": ms.float16}
DTYPE_FIELDS = ("compute_dtype", "params_dtype", "layernorm_compute_dtype", "softmax_compute_dtype", "rotary_dtype")


@dataclass
class Qwen3Config(Section):
    """Hugging Face Qwen3 field names (plus MindFormers' ``seq_length`` and dtypes)."""
    vocab_size: int = 151936
    hidden_size: int = 4096
    intermediate_size: int = 22016
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int = 32
    head_dim: int = 128
    hidden_act: str = "silu"
    max_position_embeddings: int = 32768
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e6
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    initializer_range: float = 0.02
    seq_length: int = 4096
    # MindFormers' precision fields: matmuls run in compute_dtype, the rest where named
    compute_dtype: str = "float32"
    params_dtype: str = "float32"
    layernorm_compute_dtype: str = "float32"
    softmax_compute_dtype: str = "float32"
    rotary_dtype: str = "float32"

    @classmethod
    def from_dict(cls, data: dict, path: str = "model") -> "Qwen3Config":
        """Strict parse: unknown keys name the dotted path and nearest key; types and consistency checked."""
        return super().from_dict(data, path)

    def check(self, path: str) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings",
                     "seq_length"):
            require(getattr(self, name) > 0, f"{path}.{name} must be > 0, got {getattr(self, name)}")
        for name in ("rms_norm_eps", "rope_theta", "initializer_range"):
            require(getattr(self, name) > 0, f"{path}.{name} must be > 0, got {getattr(self, name)}")
        require(self.num_attention_heads % self.num_key_value_heads == 0,
                 f"{path}.num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                 f"{path}.num_key_value_heads ({self.num_key_value_heads})")
        require(self.head_dim % 2 == 0, f"{path}.head_dim must be even for rotary embeddings, got {self.head_dim}")
        require(self.seq_length <= self.max_position_embeddings,
                 f"{path}.seq_length ({self.seq_length}) exceeds {path}.max_position_embeddings "
                 f"({self.max_position_embeddings})")
        require(self.hidden_act == "silu", f"{path}.hidden_act = {self.hidden_act!r}: Qwen3 uses 'silu' (SwiGLU)")
        for name in DTYPE_FIELDS:
            value = getattr(self, name)
            require(value in DTYPES, f"{path}.{name} = {value!r}: expected one of {', '.join(DTYPES)}")
        if ms.get_context("device_target") == "CPU":
            for name in DTYPE_FIELDS:  # float16 kernels exist on CPU (MindSpore 2.10), bfloat16 ones do not
                require(getattr(self, name) != "bfloat16",
                        f"{path}.{name} = 'bfloat16' is not supported on CPU (MindSpore's CPU MatMul, Softmax "
                        "and reductions have no bfloat16 kernels); use float32 or float16")

    def dtype(self, name: str):
        """The MindSpore dtype of the precision field ``name``."""
        return DTYPES[getattr(self, name)]


# ---- building blocks -------------------------------------------------------------------------------

class Init:
    """Deterministic parameter initializer: every tensor comes from one seeded numpy RandomState,
    drawn in construction order, so a seed gives the same weights in every process."""

    def __init__(self, seed: int, std: float):
        self.rng = np.random.RandomState(seed)
        self.std = std

    def normal(self, *shape: int) -> Parameter:
        return Parameter(Tensor(self.rng.normal(0.0, self.std, shape).astype(np.float32)))

    @staticmethod
    def ones(*shape: int) -> Parameter:
        return Parameter(Tensor(np.ones(shape, np.float32)))

    @staticmethod
    def zeros(*shape: int) -> Parameter:
        return Parameter(Tensor(np.zeros(shape, np.float32)))


def _cast(x: Tensor, dtype) -> Tensor:
    return x if x.dtype == dtype else x.astype(dtype)


_matmul_transpose_b = ops.MatMul(transpose_b=True)


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """x @ weight.T (+ bias) for weight [out, in]. Flattened to 2-D: MindSpore's CPU MatMul with
    transpose_b is about twice as fast as ops.dense on a 3-D input."""
    out = _matmul_transpose_b(x.reshape(-1, x.shape[-1]), _cast(weight, x.dtype))
    if bias is not None:
        out = out + _cast(bias, x.dtype)
    return out.reshape(*x.shape[:-1], weight.shape[0])


class Linear(nn.Cell):
    def __init__(self, init: Init, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.weight = init.normal(out_features, in_features)
        self.bias = init.zeros(out_features) if bias else None

    def construct(self, x: Tensor) -> Tensor:
        return linear(x, self.weight, self.bias)


class RMSNorm(nn.Cell):
    """RMSNorm over the last axis, computed in ``dtype`` (model.layernorm_compute_dtype) and returned in the
    input's dtype. Built from rsqrt/mean: CPU has no rms_norm kernel. float16 is honoured but fragile: the
    rsqrt backward overflows for small activations, which is why MindFormers' configs keep norms in fp32."""

    def __init__(self, dim: int, eps: float, dtype=ms.float32):
        super().__init__()
        self.weight = Init.ones(dim)
        self.eps = eps
        self.dtype = dtype

    def construct(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, self.eps, self.dtype)


def rms_norm(x: Tensor, weight: Tensor, eps: float, dtype) -> Tensor:
    """x / rms(x) · weight over the last axis, computed in ``dtype``, returned in x's dtype; ``weight``
    broadcasts against x's trailing axes."""
    xc = _cast(x, dtype)
    normed = xc * ops.rsqrt((xc * xc).mean(axis=-1, keep_dims=True) + eps)
    return _cast(normed * _cast(weight, dtype), x.dtype)


class VocabEmbedding(nn.Cell):
    def __init__(self, init: Init, vocab_size: int, hidden_size: int):
        super().__init__()
        self.weight = init.normal(vocab_size, hidden_size)

    def construct(self, input_ids: Tensor) -> Tensor:
        return ops.gather(self.weight, input_ids, 0)


class LanguageModelEmbedding(nn.Cell):
    """Holds ``word_embeddings`` so the table is named ``embedding.word_embeddings.weight`` as in Megatron."""

    def __init__(self, init: Init, vocab_size: int, hidden_size: int):
        super().__init__()
        self.word_embeddings = VocabEmbedding(init, vocab_size, hidden_size)

    def construct(self, input_ids: Tensor) -> Tensor:
        return self.word_embeddings(input_ids)


class RotaryEmbedding:
    """cos/sin tables for RoPE in HF's rotate-half convention (frequencies duplicated across both halves).

    HF computes x·cos + rotate_half(x)·sin with rotate_half(x) = [-x2, x1]; the sign is baked into the
    first half of the sin table here, so applying it needs only [x2, x1] (one op fewer per call)."""

    def __init__(self, head_dim: int, theta: float, max_positions: int, dtype=ms.float32):
        """Tables are computed in float64 and stored in ``dtype`` (model.rotary_dtype), the dtype
        ``apply_rotary`` then works in."""
        inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
        angles = np.outer(np.arange(max_positions, dtype=np.float64), inv_freq)  # [positions, head_dim/2]
        self.cos = _cast(Tensor(np.cos(np.concatenate([angles, angles], axis=-1)).astype(np.float32)), dtype)
        self.signed_sin = _cast(Tensor(np.sin(np.concatenate([-angles, angles], axis=-1)).astype(np.float32)), dtype)

    def tables(self, seq_len: int, position_ids: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """[seq, head_dim] for positions 0..seq-1, or [batch, 1, seq, head_dim] for explicit per-sample
        ``position_ids`` [batch, seq] (positions restarting at document boundaries)."""
        if position_ids is None:
            return self.cos[:seq_len], self.signed_sin[:seq_len]
        return (ops.gather(self.cos, position_ids, 0).expand_dims(1),
                ops.gather(self.signed_sin, position_ids, 0).expand_dims(1))


def apply_rotary(x: Tensor, cos: Tensor, signed_sin: Tensor) -> Tensor:
    """x: [..., seq, head_dim]; cos/signed_sin: [seq, head_dim] from RotaryEmbedding. Done in the tables'
    dtype (model.rotary_dtype), returned in x's."""
    xr = _cast(x, cos.dtype)
    first, second = ops.chunk(xr, 2, axis=-1)
    return _cast(xr * cos + ops.cat((second, first), axis=-1) * signed_sin, x.dtype)


def causal_mask(seq_len: int, repeats: int = 1) -> Tensor:
    """Additive mask, 0 where a query may attend (itself and earlier positions) and a huge negative for
    future positions: [seq, seq], stacked ``repeats`` times along the query axis → [repeats·seq, seq]."""
    future = np.triu(np.ones((seq_len, seq_len), dtype=bool), k=1)
    mask = np.where(future, np.finfo(np.float32).min, 0.0).astype(np.float32)
    return Tensor(np.tile(mask, (repeats, 1)))


def additive_mask(attention_mask: Tensor, repeats: int = 1) -> Tensor:
    """Per-sample masks as the dataset gives them ([batch, 1, seq, seq], 1 = masked, e.g. block-causal
    at document ends) → additive [batch, 1, repeats·seq, seq], stacked like ``causal_mask``."""
    additive = _cast(attention_mask, ms.float32) * float(np.finfo(np.float32).min)
    return ops.tile(additive, (1, 1, repeats, 1))


class MaxLogitTracker:
    """Running per-head maximum of an attention layer's scaled QKᵀ over unmasked positions (masked
    scores sit near float32 min, and every query sees at least itself), for MaxLogits monitoring.
    A plain object, not a Cell attribute tensor, so it stays out of the graph and the gradients."""

    def __init__(self):
        self.enabled = False
        self.running_max: Tensor | None = None

    def update(self, scores: Tensor) -> None:
        """scores: [batch, groups, heads_per_group, ...] → max per head (group-major, as HF numbers heads)."""
        heads = ops.stop_gradient(scores).amax(axis=(0, 3)).reshape(-1)
        self.running_max = heads if self.running_max is None else ops.maximum(self.running_max, heads)

    def pop(self) -> np.ndarray | None:
        out = None if self.running_max is None else self.running_max.asnumpy()
        self.running_max = None
        return out


_bmm = ops.BatchMatMul()
_bmm_transpose_b = ops.BatchMatMul(transpose_b=True)


class SelfAttention(nn.Cell):
    """Grouped-query attention with a fused, per-group ``linear_qkv`` and per-head RMSNorm on q and k.

    GQA without copying K/V: the q heads of one KV group are stacked along the query axis
    ([batch, groups, heads_per_group·seq, dim]), so one batched matmul per group serves all its heads;
    the causal mask is stacked the same way."""

    def __init__(self, init: Init, config: Qwen3Config):
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
        self.logit_tracker = MaxLogitTracker()

    def _qk_normed(self, qkv: Tensor) -> Tensor:
        """q_layernorm on every q head and k_layernorm on every k head, as one RMSNorm over the whole
        contiguous [batch, seq, groups, per_group + 2, dim] tensor (the v slot gets weight 1 and is not used):
        on CPU, norms of the split q and k views measured ~3x slower than this one pass."""
        per_group, norm = self.heads_per_group, self.q_layernorm
        weights = ops.cat((ops.tile(norm.weight.expand_dims(0), (per_group, 1)),
                           self.k_layernorm.weight.expand_dims(0), ops.ones((1, self.head_dim), norm.weight.dtype)))
        return rms_norm(qkv, weights, norm.eps, norm.dtype)

    def construct(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor) -> Tensor:
        """x: [batch, seq, hidden]; cos/sin from RotaryEmbedding.tables; mask: causal_mask(seq,
        heads_per_group) or additive_mask(attention_mask, heads_per_group)."""
        batch, seq, _ = x.shape
        groups, per_group, dim = self.num_groups, self.heads_per_group, self.head_dim
        qkv = self.linear_qkv(x).reshape(batch, seq, groups, per_group + 2, dim)
        q, k, _ = ops.split(self._qk_normed(qkv), [per_group, 1, 1], axis=3)  # q head g·per_group + j: KV group g
        _, _, v = ops.split(qkv, [per_group, 1, 1], axis=3)
        q = q.transpose(0, 2, 3, 1, 4)                                     # [batch, groups, per_group, seq, dim]
        k = k.squeeze(3).transpose(0, 2, 1, 3)                             # [batch, groups, seq, dim]
        v = v.squeeze(3).transpose(0, 2, 1, 3)
        # per-sample tables are [batch, 1, seq, dim] (k's layout); q has one more head axis
        q_cos, q_sin = (cos, sin) if cos.ndim == 2 else (cos.expand_dims(1), sin.expand_dims(1))
        q = apply_rotary(q, q_cos, q_sin).reshape(batch, groups, per_group * seq, dim) * self.scale
        k = apply_rotary(k, cos, sin)

        # [batch, groups, per_group·seq, seq]; in float16 the mask's float32 minimum becomes -inf: still 0 weight
        scores = _cast(_bmm_transpose_b(q, k), self.softmax_dtype) + _cast(mask, self.softmax_dtype)
        if self.logit_tracker.enabled:
            self.logit_tracker.update(scores.reshape(batch, groups, per_group, seq * seq))
        probs = _cast(ops.softmax(scores, axis=-1), v.dtype)
        out = _bmm(probs, v).reshape(batch, groups, per_group, seq, dim)
        out = out.transpose(0, 3, 1, 2, 4).reshape(batch, seq, self.num_heads * dim)
        return self.linear_proj(out)


class MLP(nn.Cell):
    """SwiGLU: fc2(silu(gate) * up), with gate/up interleaved in the rows of ``linear_fc1``."""

    def __init__(self, init: Init, config: Qwen3Config):
        super().__init__()
        self.ffn = config.intermediate_size
        self.linear_fc1 = Linear(init, config.hidden_size, 2 * self.ffn)
        self.linear_fc2 = Linear(init, self.ffn, config.hidden_size)

    def construct(self, x: Tensor) -> Tensor:
        gate_up = self.linear_fc1(x).reshape(*x.shape[:-1], self.ffn, 2)
        gate, up = gate_up[..., 0], gate_up[..., 1]
        return self.linear_fc2(ops.silu(gate) * up)


class TransformerLayer(nn.Cell):
    def __init__(self, init: Init, config: Qwen3Config):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.dtype("layernorm_compute_dtype"))
        self.self_attention = SelfAttention(init, config)
        self.pre_mlp_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps,
                                         config.dtype("layernorm_compute_dtype"))
        self.mlp = MLP(init, config)

    def construct(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor) -> Tensor:
        x = x + self.self_attention(self.input_layernorm(x), cos, sin, mask)
        return x + self.mlp(self.pre_mlp_layernorm(x))


class TransformerBlock(nn.Cell):
    def __init__(self, init: Init, config: Qwen3Config):
        super().__init__()
        self.layers = nn.CellList([TransformerLayer(init, config) for _ in range(config.num_hidden_layers)])
        self.final_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.dtype("layernorm_compute_dtype"))

    def construct(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor) -> Tensor:
        for layer in self.layers:
            x = layer(x, cos, sin, mask)
        return self.final_layernorm(x)


def token_cross_entropy(logits: Tensor, labels: Tensor) -> Tensor:
    """Per-token -log p(label) for logits [tokens, vocab] and labels [tokens].

    log_softmax + gather: on CPU, MindSpore 2.10's ops.cross_entropy is ~14x slower forward and ~5x
    slower backward than this for a 4,096-token vocabulary (measured), and mint's has no CPU kernel."""
    log_probs = ops.log_softmax(logits, -1)
    return -ops.gather_elements(log_probs, 1, labels.reshape(-1, 1)).reshape(-1)


# ---- the model -------------------------------------------------------------------------------------

class GPTModel(nn.Cell):
    """Qwen3 causal LM. ``construct(input_ids, labels, loss_mask[, position_ids, attention_mask])`` returns
    the masked mean token loss."""

    def __init__(self, config: Qwen3Config, seed: int | None = None):
        super().__init__()
        self.config = config
        self.compute_dtype = DTYPES[config.compute_dtype]
        if seed is None:  # follow mindspore.set_seed (the trainer sets it); unseeded runs still init the same
            seed = ms.get_seed() or 0
        init = Init(seed, config.initializer_range)
        self.embedding = LanguageModelEmbedding(init, config.vocab_size, config.hidden_size)
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta, config.max_position_embeddings,
                                      config.dtype("rotary_dtype"))
        self.decoder = TransformerBlock(init, config)
        self.output_layer = None if config.tie_word_embeddings else Linear(init, config.hidden_size, config.vocab_size)
        # drawn in fp32 (the same seeded stream for every dtype), then stored as model.params_dtype; AdamW
        # updates low-precision params through fp32 masters
        for param in self.get_parameters():
            param.set_dtype(config.dtype("params_dtype"))

    def logits(self, input_ids: Tensor, position_ids: Tensor | None = None,
               attention_mask: Tensor | None = None) -> Tensor:
        """[batch, seq] token ids → [batch, seq, vocab] fp32 logits. Without ``position_ids`` positions
        are 0..seq-1; without ``attention_mask`` ([batch, 1, seq, seq], 1 = masked) attention is causal."""
        seq = input_ids.shape[1]
        if seq > self.config.max_position_embeddings:
            raise ValueError(f"sequence length {seq} exceeds model.max_position_embeddings "
                             f"({self.config.max_position_embeddings})")
        cos, sin = self.rotary.tables(seq, position_ids)
        hidden = _cast(self.embedding(input_ids), self.compute_dtype)
        heads_per_group = self.config.num_attention_heads // self.config.num_key_value_heads
        mask = (causal_mask(seq, heads_per_group) if attention_mask is None
                else additive_mask(attention_mask, heads_per_group))
        hidden = self.decoder(hidden, cos, sin, mask)
        if self.output_layer is None:
            logits = linear(hidden, self.embedding.word_embeddings.weight)
        else:
            logits = self.output_layer(hidden)
        return _cast(logits, ms.float32)

    def construct(self, input_ids: Tensor, labels: Tensor, loss_mask: Tensor, position_ids: Tensor | None = None,
                  attention_mask: Tensor | None = None) -> Tensor:
        logits = self.logits(input_ids, position_ids, attention_mask)
        token_loss = token_cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
        mask = _cast(loss_mask.reshape(-1), ms.float32)
        return (token_loss * mask).sum() / mask.sum().clamp(min=1.0)

    def track_max_attention_logits(self, enabled: bool) -> None:
        """Record each layer's per-head max attention logit from now on (costs one reduction per layer)."""
        for layer in self.decoder.layers:
            layer.self_attention.logit_tracker.enabled = enabled

    def pop_max_attention_logits(self) -> np.ndarray | None:
        """[layers, heads] maxima since the last pop (None if nothing was tracked); resets them."""
        maxima = [layer.self_attention.logit_tracker.pop() for layer in self.decoder.layers]
        return None if any(m is None for m in maxima) else np.stack(maxima)

    def num_parameters(self) -> int:
        return sum(int(np.prod(p.shape)) for p in self.trainable_params())

    def flops_per_token(self, seq_length: int) -> float:
        """Training FLOPs per token, Megatron/PaLM style: 6·N for the weight matmuls (forward + backward)
        plus 12·layers·heads·head_dim·seq for QKᵀ and attention·V (no discount for the causal mask).
        N excludes the input embedding table unless it is also the (tied) output matmul."""
        c = self.config
        matmul_params = self.num_parameters()
        if not c.tie_word_embeddings:
            matmul_params -= c.vocab_size * c.hidden_size
        attention = 12 * c.num_hidden_layers * c.num_attention_heads * c.head_dim * seq_length
        return float(6 * matmul_params + attention)
