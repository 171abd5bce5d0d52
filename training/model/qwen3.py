"""Qwen3 (dense): GQA with per-head q/k RMSNorm and RoPE, SwiGLU MLP, RMSNorm; one layer spec for
every layer. Weight layouts (MindFormers reference §7.4):
  * ``linear_qkv`` rows are grouped per KV group: [q heads of group 0, k0, v0, q heads of group 1, k1, v1, …];
  * ``linear_fc1`` rows interleave gate and up: output reshaped to [..., ffn, 2] is (gate, up).
"""
from __future__ import annotations

from dataclasses import dataclass

from training.config import require
from training.model.attention import SelfAttention
from training.model.gpt import GPTConfig, GPTModel
from training.model.layers import DTYPES, RotaryEmbedding
from training.model.spec import ModuleSpec
from training.model.transformer import MLP, TransformerLayer


@dataclass
class Qwen3Config(GPTConfig):
    """Hugging Face Qwen3 field names (plus MindFormers' ``seq_length`` and dtypes)."""
    head_dim: int = 128
    attention_bias: bool = False

    @classmethod
    def from_dict(cls, data: dict, path: str = "model") -> "Qwen3Config":
        """Strict parse: unknown keys name the dotted path and nearest key; types and consistency checked."""
        return super().from_dict(data, path)

    def check(self, path: str) -> None:
        require(self.hidden_act == "silu", f"{path}.hidden_act = {self.hidden_act!r}: Qwen3 uses 'silu' (SwiGLU)")
        super().check(path)
        require(self.head_dim > 0, f"{path}.head_dim must be > 0, got {self.head_dim}")
        require(self.num_attention_heads % self.num_key_value_heads == 0,
                f"{path}.num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"{path}.num_key_value_heads ({self.num_key_value_heads})")
        require(self.head_dim % 2 == 0, f"{path}.head_dim must be even for rotary embeddings, got {self.head_dim}")

    def decoder_layer_specs(self) -> list[ModuleSpec]:
        layer = ModuleSpec(TransformerLayer, {"self_attention": ModuleSpec(SelfAttention), "mlp": ModuleSpec(MLP)})
        return [layer] * self.num_hidden_layers

    def rotary_embedding(self) -> RotaryEmbedding:
        return RotaryEmbedding(self.head_dim, self.rope_theta, self.max_position_embeddings, self.dtype("rotary_dtype"))

    def mask_repeats(self) -> int:
        return SelfAttention.mask_repeats(self)

    def attention_dims(self) -> tuple[int, int, int]:
        return self.num_attention_heads, self.head_dim, self.head_dim


__all__ = ["DTYPES", "GPTModel", "Qwen3Config"]
