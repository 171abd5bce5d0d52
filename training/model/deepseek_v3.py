"""DeepSeek-V3: MLA attention, MoE layers after the first ``first_k_dense_replace`` dense ones (or as
``moe_layer_freq`` says), multi-token prediction, YaRN. Hugging Face field names, plus MindFormers'
Megatron-style names for what HF's config does not carry (router score function, expert bias,
load-balancing loss, MTP loss weight)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Union

from training.config import Section, require
from training.model.gpt import GPTConfig
from training.model.layers import RotaryEmbedding
from training.model.mla import MLASelfAttention, yarn_mscale, yarn_parameters
from training.model.moe import LOAD_BALANCING_TYPES, GroupedExperts, MoELayer, TopKRouter
from training.model.spec import ModuleSpec
from training.model.transformer import MLP, TransformerLayer


@dataclass
class RopeScalingConfig(Section):
    """HF ``rope_scaling`` for YaRN (``type`` or ``rope_type``: yarn)."""
    type: Optional[str] = None
    rope_type: Optional[str] = None
    factor: float = 1.0
    original_max_position_embeddings: Optional[int] = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0

    def check(self, path: str) -> None:
        kind = self.rope_type or self.type
        require(kind == "yarn", f"{path}.rope_type = {kind!r}: only 'yarn' scaling is implemented")
        require(self.factor >= 1, f"{path}.factor must be >= 1, got {self.factor}")
        require(self.beta_fast > self.beta_slow > 0,
                f"{path}.beta_fast ({self.beta_fast}) must exceed {path}.beta_slow ({self.beta_slow}) > 0")
        require(self.original_max_position_embeddings is None or self.original_max_position_embeddings > 0,
                f"{path}.original_max_position_embeddings must be > 0")


@dataclass
class DeepseekV3Config(GPTConfig):
    vocab_size: int = 129280
    hidden_size: int = 7168
    intermediate_size: int = 18432
    num_hidden_layers: int = 61
    num_attention_heads: int = 128
    num_key_value_heads: int = 128
    max_position_embeddings: int = 4096
    rope_theta: float = 10000.0
    attention_bias: bool = False
    # MLA
    q_lora_rank: Optional[int] = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    # MindFormers registers no qk_layernorm for DeepSeek-V3: TransformerConfig's default, no latent norms
    qk_layernorm: bool = False
    hidden_dropout: float = 0.0
    # MindFormers' YaRN (MLATransformerConfig): applied when position_embedding_type is 'yarn', the original
    # context taken as max_position_embeddings; the softmax scale is multiplied by
    # mscale(rotary_scaling_factor, mscale)² whatever the position embedding (as MindFormers' MLA does)
    position_embedding_type: str = "rope"
    rotary_scaling_factor: float = 40.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.707
    mscale_all_dim: float = 0.707
    # Hugging Face's spelling of YaRN, with Hugging Face's meaning (its own original context length; softmax
    # scale from mscale_all_dim): Kiln's import/export format; exclusive with the MindFormers keys above
    rope_scaling: Optional[RopeScalingConfig] = None
    # MoE
    moe_intermediate_size: int = 2048
    n_routed_experts: int = 256
    n_shared_experts: int = 1
    # Megatron's name; unset = moe_intermediate_size · n_shared_experts (HF's DeepSeek-V3)
    moe_shared_expert_intermediate_size: Optional[int] = None
    num_experts_per_tok: int = 8
    n_group: int = 8
    topk_group: int = 4
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 2.5
    first_k_dense_replace: int = 3
    moe_layer_freq: Union[int, list[int]] = 1
    moe_router_score_function: str = "sigmoid"
    moe_router_enable_expert_bias: bool = True
    moe_router_bias_update_rate: float = 1e-3
    moe_router_load_balancing_type: str = "seq_aux_loss"
    moe_aux_loss_coeff: float = 0.0
    # MTP
    num_nextn_predict_layers: int = 1
    mtp_loss_scaling_factor: float = 0.1

    has_moe = True
    MINDFORMERS_YARN_KEYS = ("position_embedding_type", "rotary_scaling_factor", "beta_fast", "beta_slow", "mscale",
                             "mscale_all_dim")

    @classmethod
    def from_dict(cls, data: dict, path: str = "model") -> "DeepseekV3Config":
        """Strict parse; ``rope_scaling`` is parsed on its own so its errors name its fields (an Optional
        section's errors would otherwise collapse into "expected Optional")."""
        if not isinstance(data, dict) or data.get("rope_scaling") is None:
            return super().from_dict(data, path)
        mindformers_yarn = sorted(set(data) & set(cls.MINDFORMERS_YARN_KEYS))
        require(not mindformers_yarn,
                f"{path}.rope_scaling (Hugging Face's YaRN) and {', '.join(f'{path}.{k}' for k in mindformers_yarn)} "
                "(MindFormers' YaRN) describe the rotary scaling twice, with different meanings; keep one")
        data = dict(data)
        scaling = RopeScalingConfig.from_dict(data.pop("rope_scaling"), f"{path}.rope_scaling")
        config = super().from_dict(data, path)
        config.rope_scaling = scaling
        return config

    def check(self, path: str) -> None:
        super().check(path)
        require(not self.attention_bias, f"{path}.attention_bias: MLA projections have no bias in DeepSeek-V3")
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "moe_intermediate_size",
                     "n_routed_experts", "num_experts_per_tok", "n_group", "topk_group"):
            require(getattr(self, name) > 0, f"{path}.{name} must be > 0, got {getattr(self, name)}")
        require(self.q_lora_rank is None or self.q_lora_rank > 0,
                f"{path}.q_lora_rank must be > 0 or null (no query compression), got {self.q_lora_rank}")
        require(self.position_embedding_type in ("rope", "yarn"),
                f"{path}.position_embedding_type = {self.position_embedding_type!r}: expected rope or yarn")
        require(self.rotary_scaling_factor > 0, f"{path}.rotary_scaling_factor must be > 0")
        require(self.beta_fast > self.beta_slow > 0,
                f"{path}.beta_fast ({self.beta_fast}) must exceed {path}.beta_slow ({self.beta_slow}) > 0")
        require(self.qk_rope_head_dim % 2 == 0, f"{path}.qk_rope_head_dim must be even, got {self.qk_rope_head_dim}")
        require(self.n_shared_experts >= 0, f"{path}.n_shared_experts must be >= 0")
        require(self.moe_shared_expert_intermediate_size is None or self.moe_shared_expert_intermediate_size > 0,
                f"{path}.moe_shared_expert_intermediate_size must be > 0 or unset")
        require(self.n_routed_experts % self.n_group == 0,
                f"{path}.n_routed_experts ({self.n_routed_experts}) must be a multiple of {path}.n_group ({self.n_group})")
        per_group = self.n_routed_experts // self.n_group
        require(self.n_group == 1 or per_group >= 2,
                f"{path}.n_group ({self.n_group}): a group's score is the sum of its top-2 experts, so each group "
                f"needs >= 2 of the {self.n_routed_experts} experts")
        require(self.topk_group <= self.n_group, f"{path}.topk_group ({self.topk_group}) exceeds {path}.n_group")
        require(self.num_experts_per_tok <= self.topk_group * per_group,
                f"{path}.num_experts_per_tok ({self.num_experts_per_tok}) exceeds the experts in "
                f"{path}.topk_group groups ({self.topk_group * per_group})")
        require(0 <= self.first_k_dense_replace <= self.num_hidden_layers,
                f"{path}.first_k_dense_replace must be in [0, num_hidden_layers], got {self.first_k_dense_replace}")
        if isinstance(self.moe_layer_freq, list):
            require(len(self.moe_layer_freq) == self.num_hidden_layers and set(self.moe_layer_freq) <= {0, 1},
                    f"{path}.moe_layer_freq: a list needs one 0/1 per layer ({self.num_hidden_layers}), "
                    f"got {self.moe_layer_freq}")
        else:
            require(self.moe_layer_freq >= 1, f"{path}.moe_layer_freq must be >= 1, got {self.moe_layer_freq}")
        require(self.moe_router_score_function in ("sigmoid", "softmax"),
                f"{path}.moe_router_score_function = {self.moe_router_score_function!r}: expected sigmoid or softmax")
        require(self.moe_router_load_balancing_type in LOAD_BALANCING_TYPES,
                f"{path}.moe_router_load_balancing_type = {self.moe_router_load_balancing_type!r}: expected one of "
                f"{', '.join(LOAD_BALANCING_TYPES)}")
        for name in ("moe_router_bias_update_rate", "moe_aux_loss_coeff", "mtp_loss_scaling_factor",
                     "routed_scaling_factor"):
            require(getattr(self, name) >= 0, f"{path}.{name} must be >= 0, got {getattr(self, name)}")
        require(self.num_nextn_predict_layers >= 0, f"{path}.num_nextn_predict_layers must be >= 0")

    # ---- structure ----
    @property
    def shared_expert_size(self) -> int:
        """The shared experts' MLP width (0: no shared experts)."""
        if not self.n_shared_experts:
            return 0
        return self.moe_shared_expert_intermediate_size or self.moe_intermediate_size * self.n_shared_experts

    def is_moe_layer(self, index: int) -> bool:
        """Dense for the first ``first_k_dense_replace`` layers; then MoE where ``moe_layer_freq`` says
        (every N-th layer counting from 0, or a 0/1 list per layer)."""
        if index < self.first_k_dense_replace:
            return False
        if isinstance(self.moe_layer_freq, list):
            return self.moe_layer_freq[index] == 1
        return index % self.moe_layer_freq == 0

    def moe_spec(self) -> ModuleSpec:
        """Router, routed experts and (when n_shared_experts) shared experts of ``shared_expert_size``."""
        experts = {"router": ModuleSpec(TopKRouter), "experts": ModuleSpec(GroupedExperts)}
        if self.shared_expert_size:
            experts["shared_experts"] = ModuleSpec(MLP, params={"ffn_size": self.shared_expert_size})
        return ModuleSpec(MoELayer, experts)

    def decoder_layer_specs(self) -> list[ModuleSpec]:
        attention = ModuleSpec(MLASelfAttention)
        dense = ModuleSpec(TransformerLayer, {"self_attention": attention, "mlp": ModuleSpec(MLP)})
        moe = ModuleSpec(TransformerLayer, {"self_attention": attention, "mlp": self.moe_spec()})
        return [moe if self.is_moe_layer(i) else dense for i in range(self.num_hidden_layers)]

    @property
    def num_mtp_layers(self) -> int:
        return self.num_nextn_predict_layers

    @property
    def mtp_loss_scale(self) -> float:
        return self.mtp_loss_scaling_factor

    def rotary_embedding(self) -> RotaryEmbedding:
        inv_freq, magnitude = None, 1.0
        s = self.rope_scaling
        if s is not None:
            inv_freq, magnitude = yarn_parameters(
                self.qk_rope_head_dim, self.rope_theta, s.factor,
                s.original_max_position_embeddings or self.max_position_embeddings,
                s.beta_fast, s.beta_slow, s.mscale, s.mscale_all_dim)
        elif self.position_embedding_type == "yarn":
            factor = self.rotary_scaling_factor
            inv_freq, _ = yarn_parameters(self.qk_rope_head_dim, self.rope_theta, factor, self.max_position_embeddings,
                                          self.beta_fast, self.beta_slow, self.mscale, self.mscale_all_dim)
            magnitude = yarn_mscale(factor, self.mscale) / yarn_mscale(factor, self.mscale_all_dim)
        return RotaryEmbedding(self.qk_rope_head_dim, self.rope_theta, self.max_position_embeddings,
                               self.dtype("rotary_dtype"), inv_freq=inv_freq, magnitude=magnitude)

    @property
    def plain_softmax_scale(self) -> float:
        return 1.0 / math.sqrt(self.qk_nope_head_dim + self.qk_rope_head_dim)

    def softmax_scale(self) -> float:
        """1/sqrt(q·k head dim), times mscale(factor, mscale_all_dim)² under Hugging Face's rope_scaling, else
        times mscale(rotary_scaling_factor, mscale)² (MindFormers' MLA, rope or yarn alike)."""
        scale = self.plain_softmax_scale
        if self.rope_scaling is None:
            return scale * yarn_mscale(self.rotary_scaling_factor, self.mscale) ** 2
        if self.rope_scaling.mscale_all_dim:
            scale *= yarn_mscale(self.rope_scaling.factor, self.rope_scaling.mscale_all_dim) ** 2
        return scale

    def mask_repeats(self) -> int:
        return 1

    def attention_dims(self) -> tuple[int, int, int]:
        return self.num_attention_heads, self.qk_nope_head_dim + self.qk_rope_head_dim, self.v_head_dim
