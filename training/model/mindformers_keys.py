"""MindFormers 2.1.0's ``model:`` vocabulary beyond the fields Kiln's family configs declare.

MindFormers builds its HF-style config (``Qwen3Config`` / ``DeepseekV3Config``) from the section, then
converts it to a Megatron-style ``TransformerConfig``: some keys are renamed on the way, some are dropped,
and many TransformerConfig fields are never read by its PyNative trainer. So that a MindFormers user's
YAML means here what it means there, every such key is one of:

  * an alias: a second spelling of a field Kiln implements (both given with different values is an error
    naming both, as MindFormers' converter reports a "Mapping Conflict");
  * inert: accepted and logged once as having no effect, with the reason (MindFormers drops it, never
    reads it in PyNative, or it picks a kernel for the same math);
  * fixed: read by MindFormers, and Kiln implements only the value given here (MindFormers' default for
    these models); another value is an error naming the field and why.

Keys not known to MindFormers' code at all stay errors (MindFormers would warn "Unmapped Keys" and drop
them; here a typo must not pass).
"""
from __future__ import annotations

import logging

from training.config import ConfigError

log = logging.getLogger(__name__)

# Kiln field (MindFormers' HF-style name) -> the other names MindFormers' converters accept for it
_COMMON_ALIASES = {
    "num_hidden_layers": ("num_layers", "n_layer"),
    "num_attention_heads": ("num_heads", "n_head"),
    "num_key_value_heads": ("num_query_groups", "n_kv_heads"),
    "intermediate_size": ("ffn_hidden_size",),
    "rms_norm_eps": ("layernorm_epsilon", "layer_norm_epsilon"),
    "attention_bias": ("add_qkv_bias", "qkv_has_bias"),
    "initializer_range": ("init_method_std",),
    "rope_theta": ("rotary_base",),
    "params_dtype": ("param_init_type",),
}
ALIASES = {
    "qwen3": {**_COMMON_ALIASES, "head_dim": ("kv_channels",)},
    "deepseek_v3": {
        **_COMMON_ALIASES,
        "num_nextn_predict_layers": ("mtp_num_layers", "mtp_depth"),
        "mtp_loss_scaling_factor": ("mtp_loss_factor",),
        "n_group": ("moe_router_num_groups",),
        "n_routed_experts": ("num_moe_experts", "expert_num", "num_experts"),
        "topk_group": ("moe_router_group_topk",),
        "n_shared_experts": ("shared_expert_num",),
        "num_experts_per_tok": ("moe_router_topk",),
        "moe_intermediate_size": ("moe_ffn_hidden_size",),
        "routed_scaling_factor": ("moe_router_topk_scaling_factor",),
        "qk_nope_head_dim": ("qk_head_dim",),
        "qk_rope_head_dim": ("qk_pos_emb_head_dim",),
        "qk_layernorm": ("use_qk_norm",),
    },
}

_PARALLEL = "the parallel layout comes from the parallelism section"
_KERNEL = "it picks a kernel or memory layout on Ascend; Kiln computes the same math with CPU-capable ops"
_INFERENCE = "inference only"
_NOT_READ = "MindFormers' PyNative trainer never reads it"
_RECOMPUTE = "recomputation and swapping come from the recompute/swap sections"
_FLASH_LAYOUT = ("FlashAttentionScore's layout and sparse mode; with model.use_flash_attention Kiln picks them itself "
                 "(BNSD; causal mode, or the dataset's masks whole)")
_DATASET = "loss masking and positions come from the dataset (loss_mask, position_ids)"
_LATER_DEEPSEEK = "read only with experimental_attention_variant or enable_hyper_connections (not implemented)"
_HF_BOOKKEEPING = "Hugging Face bookkeeping; MindFormers drops it"

_INERT_GROUPS = {
    _PARALLEL: "data_parallel model_parallel context_parallel expert_parallel pipeline_stage micro_batch_num "
               "seq_split_num use_seq_parallel optimizer_shard gradient_aggregation_group vocab_emb_dp "
               "context_parallel_algo ulysses_degree_in_cp mem_coeff parallel_config data_parallel_size "
               "tensor_model_parallel_size pipeline_model_parallel_size virtual_pipeline_model_parallel_size "
               "pp_interleave_num sequence_parallel context_parallel_size hierarchical_context_parallel_sizes "
               "expert_model_parallel_size expert_model_parallel expert_tensor_parallel_size cp_comm_type offset "
               "moe_token_dispatcher_type npu_nums_per_device",
    _KERNEL: "fused_norm apply_rope_fusion moe_grouped_gemm moe_permute_fusion moe_router_fusion "
             "use_fused_ops_topkrouter bias_dropout_fusion bias_swiglu_fusion chunk_loss_num "
             "is_dynamic use_attn_mask_compression use_eod_attn_mask_compression mla_qkv_concat "
             "use_contiguous_weight_layout_attention use_interleaved_weight_layout_mlp disable_lazy_inline "
             "comp_comm_parallel comp_comm_parallel_degree group_wise_a2a use_ring_attention",
    _INFERENCE: "block_size num_blocks use_past rotary_cos_format add_mlp_fc1_bias_linear add_mlp_fc2_bias_linear "
                "sandwich_norm pre_process dispatch_global_max_bs attn_reduce_scatter attn_allgather attn_allreduce "
                "ffn_reduce_scatter ffn_allgather ffn_allreduce use_alltoall use_fused_mla quantization_config "
                "quantization coeff rope_type max_decode_length top_k top_p do_sample temperature repetition_penalty "
                "is_sample_acceleration use_cache",
    _RECOMPUTE: "recompute select_recompute parallel_optimizer_comm_recompute select_comm_recompute "
                "mp_comm_recompute recompute_slice_activation select_recompute_exclude "
                "select_comm_recompute_exclude swap layer_swap op_swap default_prefetch cpu_offloading "
                "cpu_offloading_num_layers",
    _NOT_READ: "activation_func attention_softmax_in_fp32 callback_moe_droprate enable_expert_relocation "
               "expert_relocation_freq expert_relocation_initial_iteration fp16_lm_cross_entropy "
               "fp32_residual_connection mask_func_type model_architecture moe_expert_capacity_factor "
               "moe_router_pre_softmax moe_shared_expert_overlap moe_token_drop_policy moe_z_loss_coeff "
               "nope_layer_interval num_decoder_layers num_encoder_layers param_init_std_rules "
               "partial_rotary_factor pet_config print_expert_load print_separate_loss softmax_scale topk_method "
               "untie_embeddings_and_output_weights use_eod_reset use_pad_tokens window_attn_skip_freq window_size "
               "dsa_index_skip_topk_offset normalization_type multiple_of ffn_dim_multiplier qkv_concat "
               "input_sliced_sig return_extra_loss moe_config monitor_config dataset_config batch_size",
    _FLASH_LAYOUT: "input_layout sparse_mode",
    _DATASET: "pad_token_id ignore_token_id use_rotary_position_ids",
    _LATER_DEEPSEEK: "dsa_indexer_n_heads dsa_indexer_head_dim dsa_indexer_topk dsa_index_topk_freq "
                     "dsa_index_share_topk_offload dsa_index_share_loss dsa_indexer_types "
                     "dsa_warmup_layerwise_backward "
                     "dsa_indexer_loss_coeff dsa_indexer_use_sparse_loss csa_window_size csa_compress_ratios "
                     "csa_compress_rotary_base csa_dense_mode o_groups o_lora_rank apply_dsa_kernel_fusion "
                     "num_residual_streams mhc_sinkhorn_iterations mhc_init_gating_factor mhc_layernorm_epsilon "
                     "use_fused_mhc enable_hc_head index_head_dim index_n_heads index_topk",
    _HF_BOOKKEEPING: "auto_map torch_dtype transformers_version name_or_path _name_or_path _commit_hash "
                     "checkpoint_name_or_path pretrained_model_dir mindformers_version tokenizer_class bos_token_id "
                     "eos_token_id is_encoder_decoder type",
}
_INERT_COMMON = {key: reason for reason, keys in _INERT_GROUPS.items() for key in keys.split()}
_INERT_COMMON.update({
    "attention_dropout": "MindFormers' PyNative attention computes a keep probability from it but never passes it "
                         "to its attention kernel: attention probabilities are not dropped",
    "track_max_attention_logit": "set from the monitor section (max attention logit)",
})
INERT = {
    "qwen3": {**_INERT_COMMON,
              "qk_layernorm": "MindFormers' Qwen3 always normalises q and k per head",
              "use_qk_norm": "MindFormers' Qwen3 always normalises q and k per head",
              "use_sliding_window": "MindFormers' Qwen3Config drops sliding-window keys",
              "sliding_window": "MindFormers' Qwen3Config drops sliding-window keys",
              "max_window_layers": "MindFormers' Qwen3Config drops sliding-window keys",
              "layer_types": "MindFormers' Qwen3Config drops sliding-window keys"},
    "deepseek_v3": {**_INERT_COMMON,
                    "scoring_func": "MindFormers' DeepseekV3Config drops it; the router's score function is "
                                    "moe_router_score_function",
                    "ep_size": "MindFormers' DeepseekV3Config drops it; expert parallelism comes from the "
                               "parallelism section",
                    "scaling_factor": "MindFormers' converter drops it; the YaRN factor is rotary_scaling_factor",
                    "router_dense_type": "not a TransformerConfig field, so MindFormers' converter drops it; the "
                                         "router computes in float32 (moe_router_dtype)",
                    "original_max_position_embeddings": "MindFormers' PyNative YaRN takes the original context "
                                                        "length from max_position_embeddings"},
}

_NOT_IMPLEMENTED = "not implemented in Kiln"
# key -> (the only value Kiln implements, why); shared by both families unless overridden
_FIXED_COMMON = {
    "add_bias_linear": (False, "linear-layer biases are not implemented (attention_bias biases linear_qkv)"),
    "gated_linear_unit": (True, "Kiln's MLPs are gated (SwiGLU)"),
    "normalization": ("RMSNorm", "Kiln's norms are RMSNorm"),
    "apply_residual_connection_post_layernorm": (False, "Kiln's layers are pre-norm"),
    "apply_query_key_layer_scaling": (False, _NOT_IMPLEMENTED),
    "calculate_per_token_loss": (False, "the loss is the mean over loss-masked tokens of the micro-batch"),
    "rotary_interleaved": (False, "rotary embeddings rotate halves"),
    "rotary_percent": (1.0, "rotary embeddings cover the whole rotary head dimension"),
    "rotary_seq_len_interpolation_factor": (None, _NOT_IMPLEMENTED),
    "use_rope_scaling": (False, _NOT_IMPLEMENTED),
    "use_alibi_mask": (False, _NOT_IMPLEMENTED),
    "use_attention_mask": (True, "attention is always masked (causal or the dataset's mask)"),
    "experimental_attention_variant": (None, "sparse attention (DeepSeek-V3.2) is not implemented"),
    "enable_hyper_connections": (False, "hyper-connections are not implemented"),
    "moe_apply_probs_on_input": (False, _NOT_IMPLEMENTED),
    "moe_n_hash_layers": (0, _NOT_IMPLEMENTED),
    "moe_router_force_expert_balance": (False, _NOT_IMPLEMENTED),
    "use_shared_expert_gating": (False, _NOT_IMPLEMENTED),
    "activation_func_clamp_value": (None, _NOT_IMPLEMENTED),
    "actual_vocab_size": (None, _NOT_IMPLEMENTED),
    "moe_router_dtype": ("float32", "the router computes in float32"),
    "embedding_params_dtype": ("float32", "the embedding table is stored in model.params_dtype"),
    "post_process": (True, "the model always ends in the output layer and loss"),
}
FIXED = {
    "qwen3": {**_FIXED_COMMON,
              "multi_latent_attention": (False, "Qwen3 uses grouped-query attention"),
              "position_embedding_type": ("rope", "Qwen3 uses plain RoPE")},
    "deepseek_v3": {**_FIXED_COMMON,
                    "multi_latent_attention": (True, "DeepSeek-V3 uses multi-latent attention")},
}

_logged: set[tuple[str, str]] = set()


def resolve(section: dict, family: str, path: str = "model") -> dict:
    """``section`` with aliases folded into Kiln's field names and inert/fixed keys checked and removed;
    inert keys are logged once per process. A family MindFormers does not know (one registered with
    ``training.model.register_model``) has no other spellings."""
    aliases, inert, fixed = ALIASES.get(family, {}), INERT.get(family, {}), FIXED.get(family, {})
    settings = {}
    for key, value in section.items():
        if key in inert:
            if (family, key) not in _logged:
                _logged.add((family, key))
                log.info("%s.%s = %r has no effect: %s", path, key, value, inert[key])
        elif key in fixed:
            allowed, reason = fixed[key]
            if value != allowed or isinstance(value, bool) != isinstance(allowed, bool):
                raise ConfigError(f"{path}.{key} = {value!r}: only {allowed!r} is supported ({reason})")
        else:
            settings[key] = value
    for field, others in aliases.items():
        given = [name for name in (field, *others) if name in settings]
        for name in given[1:]:
            if settings[name] != settings[given[0]]:
                raise ConfigError(f"{path}.{given[0]} = {settings[given[0]]!r} and {path}.{name} = "
                                  f"{settings[name]!r} are one setting spelled two ways; they disagree")
        if given:
            value = settings[given[0]]
            for name in given:
                del settings[name]
            settings[field] = value
    return settings
