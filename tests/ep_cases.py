"""Expert-parallel training cases run under msrun by tests/test_expert_parallel.py: one launch of 4 workers,
several layouts of the micro DeepSeek-V3 (4 routed experts, top-2, expert biases, a balancing loss, MTP).

``python ep_cases.py OUT SHARD`` trains each case for a few steps, each saving its final checkpoint (sharded as
the case lays its tensors out) under ``OUT/<case>/checkpoints``.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fsdp_cases import DEEPSEEK, case_config, train_cases  # noqa: E402

# two steps (both update: warmup to lr 3e-3), the second from the first's Adam moments, and a checkpoint between
STEPS = 2
EP2 = "parallelism.expert_parallel=2"
# name -> overrides ({out}: the cases' directory)
CASES = {
    # every layer recomputed, MoE layers' all-gather dispatch included (the replay's token counts dropped)
    "ep2_zero1_recompute_full": [EP2, "parallelism.data_parallel_shard_strategy=optim", "recompute.mode=full",
                                 "recompute.full_recompute_layer=true"],
    # ep 2 inside dp_shard 4: each ep rank's experts ZeRO-3-sharded over efsdp 2 (and gathered as their own unit);
    # dense weights sharded over 2 ranks (dense_fsdp_shard_size) and replicated over the other 2. Also saves at
    # step 1, which the ep4 case resumes from
    "ep2_zero3_dense_shard2": [EP2, "parallelism.dense_fsdp_shard_size=2", "checkpoint.save_interleaved_steps=1"],
    # pipeline 2 × ep 2 (each stage's 2 ranks: MoE layer and MTP on the last), 1F1B over the step's 2 micro-batches;
    # ZeRO-1 (the experts' gradients all-reduced whole over expert_dp, then chunked), without the safe tokens. Also
    # saves at step 1, which pp2_zero3_from_ep2_pp2 resumes from
    "ep2_pp2_zero1_no_safe_tokens": [EP2, "parallelism.pipeline_parallel=2",
                                     "parallelism.data_parallel_shard_strategy=optim",
                                     "parallelism.expert_parallel_use_safe_tokens=false",
                                     "checkpoint.save_interleaved_steps=1"],
    # the pipeline checkpoint into another layout of the stages' ranks: no expert parallelism, each stage's experts
    # and dense weights ZeRO-3 chunks over its 2 data-parallel ranks (the step-1 files hold ZeRO-1 moments, whole
    # weights, experts cut over ep)
    "pp2_zero3_from_ep2_pp2": ["parallelism.pipeline_parallel=2", "checkpoint.load_path={out}/"
                               "ep2_pp2_zero1_no_safe_tokens/checkpoints/iteration_00000001"],
    # context 2 × ep 2 with HSDP: ep carved out of dp_shard 1 × cp 2, so each ep group is a cp pair (ring
    # attention), holding whole experts (efsdp 1) replicated over dp_replicate 2, which sums their gradients
    "cp2_ep2_hsdp": [EP2, "parallelism.context_parallel=2", "parallelism.data_parallel_shard=1"],
    # compiled (the micro config's default is eager): forward and backward in one graph with the all-gather token
    # dispatch, this rank's experts run by the block dispatch; ZeRO-1's reduction, clip and update eager, as a
    # multi-rank run does by default (the whole step with fast_step.compile_reduction costs ~40 CPU-s more to compile)
    "ep2_zero1_compiled": [EP2, "parallelism.data_parallel_shard_strategy=optim", "fast_step.compile=true"],
    # another expert-parallel degree (one expert per rank), and dense weights over all 4 shards, resuming ep2
    "ep4_from_ep2": ["parallelism.expert_parallel=4",
                     "checkpoint.load_path={out}/ep2_zero3_dense_shard2/checkpoints/iteration_00000001"],
}


def ep_config(shard: str, overrides: list[str], save_path: Path | None = None):
    """A case's config (the single-process reference: no overrides) of the micro DeepSeek-V3."""
    return case_config(shard, [f"training.steps={STEPS}", *overrides], save_path, DEEPSEEK)


def main(out: str, shard: str) -> None:
    steps = f"training.steps={STEPS}"
    train_cases(out, shard, [(name, [steps, *overrides], DEEPSEEK) for name, overrides in CASES.items()])


if __name__ == "__main__":
    main(*sys.argv[1:])
