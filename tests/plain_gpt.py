"""A third model, defined here and not in training/: training/parallel knows nothing of it, and it trains under
tensor parallelism, ZeRO-3 (eager and compiled) and pipeline parallelism because it declares its own plan (see
training/parallel/parallelize.py for what a model declares; tests/fsdp_cases.py and tests/pipeline_cases.py train
it against one process).

A plain pre-norm GPT: multi-head attention through separate q, k and v projections with biases (no q/k norm),
rotary positions, LayerNorm with a bias (not RMSNorm), and an ungated SiLU MLP whose first projection has a bias.
Built by GPTModel (embedding, decoder, output layer, loss) from this family's layer specs; registered as
``model.model_type: plain_gpt``, ``model.architectures: PlainGPTForCausalLM``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import mindspore as ms
from mindspore import Tensor, nn, ops

from training.config import ConfigError, require
from training.model import register_model
from training.model.dropout import Dropout
from training.model.gpt import GPTConfig
from training.model.layers import Init, Linear, MaxLogitTracker, RotaryEmbedding, apply_rotary, cast
from training.model.spec import ModuleSpec, build_module, check_tensor_parallel


class LayerNorm(nn.Cell):
    """(x - mean) / sqrt(var + eps) · weight + bias over the last axis, in float32. Under ZeRO-3 in a compiled step
    its two vectors are read gathered (``weight_gather``, ``bias_gather``)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = Init.ones(dim)
        self.bias = Init.zeros(dim)
        self.eps = eps
        self.weight_gather = None
        self.bias_gather = None

    def gathered_weights(self, attr: str, gathers) -> dict[str, nn.Cell]:
        return {f"{attr}_gather": gathers.whole()}

    def construct(self, x: Tensor) -> Tensor:
        weight = self.weight if self.weight_gather is None else self.weight_gather(self.weight)
        bias = self.bias if self.bias_gather is None else self.bias_gather(self.bias)
        xf = cast(x, ms.float32)
        centred = xf - xf.mean(-1, keep_dims=True)
        normed = centred / ops.sqrt((centred * centred).mean(-1, keep_dims=True) + self.eps)
        return cast(normed * weight + bias, x.dtype)


class MultiHeadAttention(nn.Cell):
    """softmax(q·kᵀ/√d + mask)·v per head, q, k and v from their own projections (with biases)."""

    def __init__(self, init: Init, config):
        super().__init__()
        self.num_heads, self.head_dim = config.num_attention_heads, config.head_dim
        width = self.num_heads * self.head_dim
        self.linear_q = Linear(init, config.hidden_size, width, bias=True)
        self.linear_k = Linear(init, config.hidden_size, width, bias=True)
        self.linear_v = Linear(init, config.hidden_size, width, bias=True)
        self.linear_proj = Linear(init, width, config.hidden_size)
        self.scale = 1.0 / math.sqrt(self.head_dim)
        self.logit_tracker = MaxLogitTracker()

    def _heads(self, x: Tensor, batch: int, seq: int) -> Tensor:
        return x.reshape(batch, seq, self.num_heads, self.head_dim).transpose(0, 2, 1, 3)

    def construct(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor) -> Tensor:
        q, k, v = self.linear_q(x), self.linear_k(x), self.linear_v(x)  # the whole sequence under tensor parallel
        batch, seq, _ = q.shape
        q, k, v = self._heads(q, batch, seq), self._heads(k, batch, seq), self._heads(v, batch, seq)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        scores = ops.BatchMatMul(transpose_b=True)(q, k) * self.scale
        scores = scores + ops.broadcast_to(cast(mask, scores.dtype), scores.shape)  # [seq, seq] or [batch, 1, ...]
        if self.logit_tracker.enabled:
            self.logit_tracker.update(scores.expand_dims(2).reshape(batch, self.num_heads, 1, -1))
        out = ops.BatchMatMul()(ops.softmax(scores, axis=-1), v)
        return self.linear_proj(out.transpose(0, 2, 1, 3).reshape(batch, seq, self.num_heads * self.head_dim))

    # ---- this model's own parallel plan ----
    @staticmethod
    def check_tensor_parallel(config, tp) -> None:
        tp.require_divisible(config.num_attention_heads, "model.num_attention_heads",
                             "q, k and v are split by whole heads")

    def parallelize_tensor(self, tp) -> None:
        """q, k and v column-parallel (their biases with them), the output projection row-parallel."""
        for projection in (self.linear_q, self.linear_k, self.linear_v):
            tp.column_parallel(projection)
        tp.row_parallel(self.linear_proj)
        self.num_heads //= tp.size
        self.logit_tracker.heads_comm = tp.gather_heads()

    def parallelize_context(self, cp) -> None:
        raise ConfigError("parallelism.context_parallel > 1: plain_gpt's attention has no context-parallel core")


class SiLUMLP(nn.Cell):
    """fc2(silu(fc1(x) + bias)), no gate."""

    def __init__(self, init: Init, config):
        super().__init__()
        self.ffn = config.intermediate_size
        self.linear_fc1 = Linear(init, config.hidden_size, self.ffn, bias=True)
        self.linear_fc2 = Linear(init, self.ffn, config.hidden_size)

    def construct(self, x: Tensor) -> Tensor:
        return self.linear_fc2(ops.silu(self.linear_fc1(x)))

    @staticmethod
    def check_tensor_parallel(config, tp) -> None:
        tp.require_divisible(config.intermediate_size, "model.intermediate_size", "linear_fc1/linear_fc2 split it")

    def parallelize_tensor(self, tp) -> None:
        tp.column_parallel(self.linear_fc1)
        tp.row_parallel(self.linear_fc2)
        self.ffn //= tp.size


class PlainLayer(nn.Cell):
    """x + attention(layernorm(x)), then + mlp(layernorm(x)), each part dropped out before its residual add."""

    def __init__(self, init: Init, config, self_attention: ModuleSpec, mlp: ModuleSpec):
        super().__init__()
        self.input_layernorm = LayerNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attention = build_module(self_attention, init, config)
        self.pre_mlp_layernorm = LayerNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = build_module(mlp, init, config)
        self.hidden_dropout = Dropout(config.hidden_dropout)

    def construct(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor) -> Tensor:
        x = x + self.hidden_dropout(self.self_attention(self.input_layernorm(x), cos, sin, mask))
        return x + self.hidden_dropout(self.mlp(self.pre_mlp_layernorm(x)))

    @staticmethod
    def check_tensor_parallel(config, tp, self_attention: ModuleSpec, mlp: ModuleSpec) -> None:
        check_tensor_parallel(self_attention, config, tp)
        check_tensor_parallel(mlp, config, tp)

    def parallelize_tensor(self, tp) -> None:
        """The norms stay whole; under sequence parallelism they run on the sequence shard."""
        self.self_attention.parallelize_tensor(tp)
        self.mlp.parallelize_tensor(tp)


@dataclass
class PlainGPTConfig(GPTConfig):
    head_dim: int = 16

    def check(self, path: str) -> None:
        super().check(path)
        require(self.num_key_value_heads == self.num_attention_heads,
                f"{path}.num_key_value_heads must equal {path}.num_attention_heads: plain_gpt's attention is "
                f"multi-head")
        require(self.head_dim > 0 and self.head_dim % 2 == 0, f"{path}.head_dim must be even and > 0")

    def decoder_layer_specs(self) -> list[ModuleSpec]:
        layer = ModuleSpec(PlainLayer, {"self_attention": ModuleSpec(MultiHeadAttention), "mlp": ModuleSpec(SiLUMLP)})
        return [layer] * self.num_hidden_layers

    def rotary_embedding(self) -> RotaryEmbedding:
        return RotaryEmbedding(self.head_dim, self.rope_theta, self.max_position_embeddings, self.dtype("rotary_dtype"))

    def mask_repeats(self) -> int:
        return 1

    def attention_dims(self) -> tuple[int, int, int]:
        return self.num_attention_heads, self.head_dim, self.head_dim


register_model("plain_gpt", "PlainGPTForCausalLM", PlainGPTConfig)
PLAIN_CONFIG = "tests/configs/plain_gpt_micro.yaml"
