"""Context-parallel training cases run under msrun by tests/test_context_parallel.py: one launch of 4 workers.

``python cp_cases.py OUT SHARD`` trains the micro Qwen3 (and DeepSeek-V3) for a few steps in each case, each
case saving a checkpoint at step 2 and its last (sharded as the case lays its tensors out) under
``OUT/<case>/checkpoints``.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import MICRO_CONFIG  # noqa: E402
from fsdp_cases import DEEPSEEK, train_cases  # noqa: E402

# name -> overrides; the world is 4 workers, so cp 2 leaves dp 2 (ZeRO-3 over dp_shard × cp = 4 ranks)
# validation after the last step (training.steps): one global batch of the held-out split
VALIDATE_ONCE = ["kiln.training.eval_interval=1000", "kiln.training.eval_iters=1"]
COMPILED = ["fast_step.compile=true"]  # the micro config runs eagerly (tests/configs/qwen3_micro.yaml)
CASES = {
    # the ring's attention core recomputed (its collectives run again in the backward, in every rank's order)
    "ring_cp2_dp2_recompute_select": ["parallelism.context_parallel=2", "recompute.mode=select",
                                      "recompute.select_module={{self_attention.core_attention: true}}"],
    "ring_cp2_dp2": ["parallelism.context_parallel=2", *VALIDATE_ONCE],
    "ulysses_cp2_dp2_zero1": ["parallelism.context_parallel=2", "parallelism.context_parallel_method=ulysses",
                              "parallelism.data_parallel_shard_strategy=optim"],
    # compiled (forward and backward in one graph, the ring steps and Ulysses exchanges as all-reduces in it:
    # comm.for_graph); contiguous chunks; ZeRO-2, as ZeRO-3 does not compile; the first layer recomputed in the graph
    # (training.recompute.RecomputedLayers: its exchanges run again in the backward, every rank in one order)
    "hybrid_cp4_zero2_compiled": ["parallelism.context_parallel=4", "parallelism.context_parallel_method=hybrid",
                                  "parallelism.ulysses_degree_in_cp=2", *COMPILED,
                                  "parallelism.data_parallel_shard_strategy=optim_grads", "recompute.mode=full",
                                  "recompute.full_recompute_layer=1"],
    # with tensor parallel: each rank's heads, its zig-zag sequence segments cut again over tp between the layers
    # (sequence parallel); forward and backward compiled. Rings longer than 2: hybrid's cp 4, and a ring of 3
    # checked in one process
    "ring_tp2_cp2_zigzag_zero1_compiled": ["parallelism.context_parallel=2",
                                           "kiln.parallelism.context_parallel_load_balance=true",
                                           "parallelism.tensor_parallel=2", "parallelism.sequence_parallel=true",
                                           "parallelism.data_parallel_shard_strategy=optim", *COMPILED],
}
# DeepSeek-V3 (MLA, MoE with a balancing loss and expert biases, MTP) against its own reference
DEEPSEEK_CASES = {"deepseek_ring_cp2_dp2_zigzag": ["parallelism.context_parallel=2",
                                                   "kiln.parallelism.context_parallel_load_balance=true"]}


if __name__ == "__main__":
    save_at_2 = "checkpoint.save_interleaved_steps=2"
    train_cases(*sys.argv[1:], [(name, [*overrides, save_at_2], MICRO_CONFIG) for name, overrides in CASES.items()]
                + [(name, [*overrides, save_at_2], DEEPSEEK) for name, overrides in DEEPSEEK_CASES.items()])
