"""Tensor + sequence parallelism: under msrun on CPU, Qwen3 (plain TP, TP+SP, and TP+SP with tied embeddings,
a qkv bias and packed documents) and DeepSeek-V3 (MLA, MoE, MTP; plain TP and TP+SP) give the single-process
loss and every parameter's gradient, and the vocab-parallel cross-entropy gives the plain one's losses and
logit gradients (tests/tensor_parallel_worker.py runs every case in one launch); without msrun, the
configurations tensor parallelism cannot split are refused naming their fields."""
import json

import pytest

from conftest import run_under_msrun
from training.config import ConfigError
from training.model import DeepseekV3Config, GPTModel, Qwen3Config
from training.parallel.mesh import Group, ParallelDims
from training.parallel.tensor_parallel import apply_tensor_parallel

# fp32: TP sums partial matmuls and the loss's exponentials in another order than one process does; measured
# on 2 and 4 workers: losses within 4e-7 relative, every parameter's gradient within 9e-7 of the tensor's
# largest reference entry, the vocab-parallel cross-entropy's logit gradient within 2.3e-6
TOLERANCE = 1e-5
MODEL_CASES = ("qwen3", "qwen3_sp", "qwen3_sp_tied_bias_documents", "deepseek_v3", "deepseek_v3_sp")


def run_workers(tmp_path, workers: int, dp_replicate: int) -> list[dict]:
    run_under_msrun(["tests/tensor_parallel_worker.py", tmp_path, dp_replicate], tmp_path / "msrun_log", workers)
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(workers)]


def check_equivalence(ranks: list[dict], tp: int) -> None:
    for rank, results in enumerate(ranks):
        for case in MODEL_CASES:
            got = results[case]
            assert abs(got["loss"] - got["reference_loss"]) <= TOLERANCE * abs(got["reference_loss"]), (rank, case)
            assert got["grad_error"] <= TOLERANCE, (rank, case, got["worst"], got["grad_error"])
            assert got["max_logits_error"] <= TOLERANCE, (rank, case)  # every head's, in the global order
            assert got["parameters"] == got["reference_parameters"], (rank, case)
            assert got["own_chunks"] and got["layouts_cover_parameters"] and got["expert_counts_match"], (rank, case)
            for name, value in got["reference_components"].items():
                assert got["loss_components"][name] == pytest.approx(value, rel=TOLERANCE), (rank, case, name)
        ce = results["cross_entropy"]
        assert max(ce["loss_error"], ce["sum_error"], ce["grad_error"]) <= TOLERANCE, (rank, ce)
    # the ranks of one tp group compute one loss
    for first in range(0, len(ranks), tp):
        for case in MODEL_CASES:
            assert len({ranks[r][case]["loss"] for r in range(first, first + tp)}) == 1, case


def check_plans(results: dict) -> None:
    column_row = {"self_attention.linear_qkv.weight", "self_attention.linear_proj.weight",
                  "mlp.linear_fc1.weight", "mlp.linear_fc2.weight"}
    layer_parts = {name.split(".", 3)[3] for name in results["qwen3"]["sharded"] if name.startswith("decoder.layers.")}
    assert layer_parts == column_row
    assert {"embedding.word_embeddings.weight", "output_layer.weight"} <= set(results["qwen3"]["sharded"])
    # plain TP: only the per-head norms see a part (this rank's heads); SP: every replicated weight does
    assert {name.rsplit(".", 2)[-2] for name in results["qwen3"]["tp_reduced"]} == {"q_layernorm", "k_layernorm"}
    assert "decoder.final_layernorm.weight" in results["qwen3_sp"]["tp_reduced"]
    tied = results["qwen3_sp_tied_bias_documents"]["sharded"]
    assert "output_layer.weight" not in tied and "decoder.layers.0.self_attention.linear_qkv.bias" in tied
    deepseek = results["deepseek_v3_sp"]
    for part in ("linear_qb", "linear_kvb", "linear_proj"):
        assert f"decoder.layers.1.self_attention.{part}.weight" in deepseek["sharded"]
    for replicated in ("self_attention.linear_qkv.weight", "mlp.router.weight", "mlp.experts.weight1",
                       "mlp.shared_experts.linear_fc1.weight"):
        assert f"decoder.layers.1.{replicated}" in deepseek["tp_reduced"]
    assert "mtp.layers.0.eh_proj.weight" in deepseek["tp_reduced"]


@pytest.mark.msrun
def test_tensor_parallel_2_matches_the_single_process_run(tmp_path):
    ranks = run_workers(tmp_path, workers=2, dp_replicate=1)
    check_equivalence(ranks, tp=2)
    check_plans(ranks[0])


@pytest.mark.msrun
def test_tensor_parallel_2_by_data_parallel_2_matches_on_each_replica(tmp_path):
    """tp groups {0, 1} and {2, 3} are sub-groups of the world; each replica draws its own batch."""
    ranks = run_workers(tmp_path, workers=4, dp_replicate=2)
    check_equivalence(ranks, tp=2)
    assert ranks[0]["qwen3_sp"]["loss"] != ranks[2]["qwen3_sp"]["loss"]


# ---- without msrun: what cannot be split is refused before any collective ----------------------------------

class TwoRankMesh:
    """The mesh's interface for tp 2 seen from rank 0, without communicators (nothing here communicates)."""
    dims = ParallelDims(world=2, tp=2)
    rank = 0

    def group(self, name: str) -> Group:
        return Group(name, (0, 1), 0, None)


QWEN3 = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=6,
             num_key_value_heads=2, head_dim=8, seq_length=16, max_position_embeddings=32, compute_dtype="float32",
             hidden_dropout=0.0)
DEEPSEEK = dict(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=1,
                first_k_dense_replace=1, num_attention_heads=2, num_key_value_heads=2, q_lora_rank=16,
                kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, n_routed_experts=4,
                num_experts_per_tok=2, n_group=2, topk_group=1, num_nextn_predict_layers=0, seq_length=16,
                max_position_embeddings=32, compute_dtype="float32")


@pytest.mark.parametrize("config, sequence_parallel, message", [
    (Qwen3Config.from_dict({**QWEN3, "num_key_value_heads": 3}), True,
     r"parallelism\.tensor_parallel \(2\) must divide model\.num_key_value_heads \(3\): linear_qkv is split by "
     r"whole query groups"),
    (Qwen3Config.from_dict({**QWEN3, "vocab_size": 63}), True, r"must divide model\.vocab_size \(63\)"),
    (Qwen3Config.from_dict({**QWEN3, "intermediate_size": 63}), True, r"must divide model\.intermediate_size"),
    (Qwen3Config.from_dict({**QWEN3, "seq_length": 15}), True, r"must divide model\.seq_length \(15\)"),
    (Qwen3Config.from_dict({**QWEN3, "hidden_dropout": 0.1}), False,
     r"model\.hidden_dropout \(0\.1\) with tensor parallelism needs parallelism\.sequence_parallel: true"),
    (DeepseekV3Config.from_dict({**DEEPSEEK, "q_lora_rank": None}), True, r"model\.q_lora_rank is unset"),
    (DeepseekV3Config.from_dict({**DEEPSEEK, "num_attention_heads": 3}), True,
     r"must divide model\.num_attention_heads \(3\)"),
])
def test_what_tensor_parallelism_cannot_split_is_refused_naming_the_fields(config, sequence_parallel, message):
    with pytest.raises(ConfigError, match=message):
        apply_tensor_parallel(GPTModel(config, seed=0), TwoRankMesh(), sequence_parallel)
