"""Parallel training cases run under msrun by tests/test_fsdp.py: one launch, several layouts.

``python fsdp_cases.py OUT SHARD`` trains the micro Qwen3 for a few steps in each case, each case saving its
final checkpoint (sharded as the case lays its tensors out) under ``OUT/<case>/checkpoints``.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import MICRO_CONFIG, PROJECT_ROOT, shard_data  # noqa: E402
from plain_gpt import PLAIN_CONFIG  # noqa: E402  (registers model_type plain_gpt)
from training.parallel.mesh import init_world  # noqa: E402
from training.config import load_config  # noqa: E402
from training.reporting import Reporter  # noqa: E402
from training.step import configure_runtime  # noqa: E402
from training.trainer import Trainer  # noqa: E402

STEPS = 3
TIED = "model.tie_word_embeddings=true"
# name -> overrides ({out}: the cases' directory); the world is 4 workers. zero3 also saves at step 2, and a run
# resumes from that sharded checkpoint into another layout (tensor parallel, ZeRO-1)
CASES = {
    "replicated": ["parallelism.data_parallel_shard=1"],
    "zero1": ["parallelism.data_parallel_shard_strategy=optim"],
    "zero2": ["parallelism.data_parallel_shard_strategy=optim_grads"],
    "zero3": ["parallelism.data_parallel_shard_strategy=optim_grads_params", "checkpoint.save_interleaved_steps=2"],
    # every other ZeRO-3 case re-gathers in backward (MindFormers' default policy); this one keeps the gathered weights,
    # compiled: each layer gathers its chunks in the graph over HSDP's shard groups (fsdp.GatheredMatrix & co)
    "hsdp_zero3_compiled_divide_after": ["parallelism.data_parallel_shard=2", "parallelism.disable_gradient_division=false",
                                         "parallelism.reshard_after_forward_policy=never", "fast_step.compile=true"],
    # compiled and resharding after forward (fsdp.RegatheredMatrix's hand-written backward gathers again), with the
    # output layer tied to the embedding table (its own reference: TIED); the first layer recomputed in the compiled
    # step (training.recompute.RecomputedLayers: the embedding's gradient summed over its stage and the loss's)
    "zero3_tied_compiled": ["parallelism.data_parallel_shard_strategy=optim_grads_params", "fast_step.compile=true",
                            TIED, "recompute.mode=full", "recompute.full_recompute_layer=1"],
    "tp2_sp_zero3": ["parallelism.tensor_parallel=2", "parallelism.sequence_parallel=true"],
    # resumed compiled, forward and backward in one graph (the default under data parallelism): tensor parallelism's
    # collectives as all-reduces in it (comm.for_graph), the gradient reduction over tp and the shards eager; the
    # first layer recomputed (its collectives run again in the graph's backward). Compiled here rather than in a case
    # of its own: that one took 41.8 s of the launch at load 13-16, this one costs the compile over its eager run
    "tp2_sp_zero1_compiled_from_zero3": ["parallelism.tensor_parallel=2", "parallelism.sequence_parallel=true",
                                         "parallelism.data_parallel_shard_strategy=optim", "fast_step.compile=true",
                                         "checkpoint.load_path={out}/zero3/checkpoints/iteration_00000002",
                                         "recompute.mode=full", "recompute.full_recompute_layer=1"],
    # activation recompute (training/recompute.py): every layer under ZeRO-3 resharding after forward, so the
    # recomputing backward gathers the weights again; the attention cores under tensor + sequence parallelism
    "zero3_recompute_full": ["parallelism.data_parallel_shard_strategy=optim_grads_params", "recompute.mode=full",
                             "recompute.full_recompute_layer=true"],
    "tp2_sp_zero2_recompute_select": ["parallelism.tensor_parallel=2", "parallelism.sequence_parallel=true",
                                      "parallelism.data_parallel_shard_strategy=optim_grads", "recompute.mode=select",
                                      "recompute.select_module={{self_attention.core_attention: true}}"],
    # the whole step compiled, the gradient reduction in its graph, over HSDP's sub-groups: a reduce-scatter over
    # the shards, then a sum over the replicas, divided after (one case: compiling costs seconds per rank)
    "hsdp_zero2_compiled_divide_after": ["parallelism.data_parallel_shard=2", "fast_step.compile=true",
                                         "fast_step.compile_reduction=true",
                                         "parallelism.data_parallel_shard_strategy=optim_grads",
                                         "parallelism.disable_gradient_division=false"],
}
# DeepSeek-V3 (MLA, MoE with expert biases and a balancing loss, MTP) against its own reference: ZeRO-3, and tensor +
# sequence parallel inside ZeRO-3 (its plain tensor parallelism is also in tests/test_tensor_parallel.py)
DEEPSEEK = "tests/configs/deepseek_v3_micro.yaml"
DEEPSEEK_CASES = {"deepseek_zero3": [],
                  # compiled: the router's and experts' chunks gathered in the graph (fsdp.GatheredMatrix, GatheredRows),
                  # the embedding's lookup bounded by its tensor-parallel rows, not by its chunk's
                  "deepseek_tp2_sp_zero3_compiled": ["parallelism.tensor_parallel=2", "parallelism.sequence_parallel=true",
                                                     "fast_step.compile=true"]}


# the third model (tests/plain_gpt.py, unknown to training/parallel) against its own reference: ZeRO-3 eagerly, and
# tensor + sequence parallel inside ZeRO-3 compiled (its q/k/v biases cut with their rows, its LayerNorms' vectors
# gathered in the graph)
PLAIN_CASES = {"plain_zero3": [],
               "plain_tp2_sp_zero3_compiled": ["parallelism.tensor_parallel=2", "parallelism.sequence_parallel=true",
                                               "fast_step.compile=true"]}


def case_config(shard: str, overrides: list[str], save_path: Path | None = None, model_config: str = MICRO_CONFIG):
    save = [f"checkpoint.save_path={save_path}", "checkpoint.save_interleaved_steps=1000"] if save_path else [
        "checkpoint.enable_save=false"]
    # AdamW's eps at 1e-5: a gradient that cancels to ~1e-9 is reduction-order noise, and with a tiny eps Adam
    # turns its sign into a step of ~lr (seen: one embedding entry 5e-4 apart after tensor parallelism's sums)
    return load_config(PROJECT_ROOT / model_config, [
        *shard_data(shard), f"training.steps={STEPS}", "training.local_batch_size=1",
        "optimizer.eps=1e-5", *save, *overrides])


def train_cases(out: str, shard: str, cases: list[tuple[str, list[str], str]]) -> None:
    """Train each (name, overrides, model config) case in turn in this launch, into ``OUT/<name>``."""
    configure_runtime(case_config(shard, []))  # once: MindSpore's device cannot be set again
    world = init_world()
    for name, overrides, model_config in cases:
        run_dir = Path(out) / name
        config = case_config(shard, [o.format(out=out) for o in overrides], run_dir / "checkpoints", model_config)
        trainer = Trainer(config, world, run_dir, Reporter(run_dir / "metrics.jsonl", enabled=world.is_main))
        trainer.train()
        if world.is_main:
            (run_dir / "step_mode.txt").write_text(trainer.step_mode)


def main(out: str, shard: str) -> None:
    train_cases(out, shard, [(name, overrides, MICRO_CONFIG) for name, overrides in CASES.items()]
                + [(name, overrides, DEEPSEEK) for name, overrides in DEEPSEEK_CASES.items()]
                + [(name, overrides, PLAIN_CONFIG) for name, overrides in PLAIN_CASES.items()])


if __name__ == "__main__":
    main(*sys.argv[1:])
