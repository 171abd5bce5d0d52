"""Pipeline-parallel training cases run under msrun by tests/test_pipeline.py: one launch of 4 workers, several
layouts, each against the single-process run of the same model (``REFERENCES``). DeepSeek-V3 (MoE, MTP) under
pipeline parallelism is one of tests/ep_cases.py's.

``python pipeline_cases.py OUT SHARD`` trains each case for ``STEPS`` steps of 4 samples (local batch 1), saving
its final checkpoint, sharded as the case lays its tensors out, under ``OUT/<case>/checkpoints``.
"""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import MICRO_CONFIG  # noqa: E402
from fsdp_cases import case_config  # noqa: E402
from plain_gpt import PLAIN_CONFIG  # noqa: E402  (registers model_type plain_gpt)
from training.parallel.mesh import init_world  # noqa: E402
from training.reporting import Reporter  # noqa: E402
from training.step import configure_runtime  # noqa: E402
from training.trainer import Trainer  # noqa: E402

# 4 samples per step: 2 micro-batches per pipeline under data parallel 2, 4 without; a validation split holding one
# such batch without repeating a sample
BATCH = ["training.global_batch_size=4", "train_dataset.dataloader.config.split=94,6,0"]
# the micro Qwen3 with 4 layers, so that 2 pipeline ranks × 2 virtual stages, or 4 ranks, each get one; its output
# layer tied to the embedding, whose copy on the last stage is then the output matmul's weight
FOUR_LAYERS_TIED = ["model.num_hidden_layers=4", "model.tie_word_embeddings=true"]
REFERENCES = {"qwen3": (MICRO_CONFIG, BATCH), "qwen3_4_layers_tied": (MICRO_CONFIG, BATCH + FOUR_LAYERS_TIED),
              # the third model (tests/plain_gpt.py, unknown to training/parallel), its output layer tied
              "plain_tied": (PLAIN_CONFIG, BATCH + ["model.tie_word_embeddings=true"])}
PP2 = ["parallelism.pipeline_parallel=2"]
# validation after the last step (training.steps): one global batch of the held-out split, forward through the stages
VALIDATE_ONCE = ["kiln.training.eval_interval=1000", "kiln.training.eval_iters=1"]
# the statistics that pipeline parallelism reports (local_norm and max_attention_logit are refused)
MONITORED = [*(f"monitor.train_state.{field}=true" for field in ("device_norm", "local_loss", "device_loss")),
             "kiln.train_state.param_norm=true"]
# name -> (reference, overrides); the world is 4 workers
CASES = {
    # ZeRO-3 (the default strategy) over the two data-parallel ranks of each stage
    "pp2_gpipe": ("qwen3", PP2 + ["parallelism.pipeline_parallel_schedule=gpipe"]),
    # ZeRO-1 over the two data-parallel ranks of each stage; its step-2 checkpoint resumes in one process
    "pp2_1f1b_zero1": ("qwen3", PP2 + ["parallelism.pipeline_parallel_schedule=1f1b",
                                       "parallelism.data_parallel_shard_strategy=optim",
                                       "checkpoint.save_interleaved_steps=2"]),
    # rank 0 runs layers 0 and 2, rank 1 layers 1 and 3; ZeRO-3 over the two data-parallel ranks of each stage, the
    # last one gathering the embedding's chunks for the tied output matmul too; compiled, each layer gathering its
    # chunks inside its stage's graphs (fsdp.GatheredMatrix & co)
    "pp2_interleaved_tied_zero3": ("qwen3_4_layers_tied", PP2 + VALIDATE_ONCE + [
        "parallelism.pipeline_parallel_schedule=interleaved_1f1b", "parallelism.pipeline_parallel_interleave_num=2",
        "parallelism.pipeline_parallel_layers_per_stage=['0-0,2-2', '1-1,3-3']", "fast_step.compile=true"]),
    # each stage's attention a ring over its cp pair, hidden states travelling as each rank's sequence segment
    "pp2_cp2": ("qwen3", PP2 + VALIDATE_ONCE + ["parallelism.context_parallel=2"]),
    # compiled: each stage's forward and recomputing backward a graph, tensor parallelism's collectives in them as
    # all-reduces (the micro config trains eagerly unless a case compiles)
    "tp2_pp2": ("qwen3", PP2 + VALIDATE_ONCE + ["parallelism.tensor_parallel=2", "parallelism.sequence_parallel=true",
                                                "fast_step.compile=true"]),
    # one layer per rank, 4 micro-batches through 4 stages; rank 0 reports the training-state statistics of every
    # stage's parameters (whole tensors: no data parallel here)
    # layer 1 (the second stage's) recomputed inside the stage's own recomputing backward
    "pp2_1f1b_recompute_layer1": ("qwen3", PP2 + ["parallelism.pipeline_parallel_schedule=1f1b", "recompute.mode=full",
                                                  "recompute.full_recompute_layer=['1']"]),
    "pp4_1f1b": ("qwen3_4_layers_tied", ["parallelism.pipeline_parallel=4"] + VALIDATE_ONCE + MONITORED),
    # the third model split in two stages, ZeRO-3 over each stage's two data-parallel ranks, the embedding on both
    "plain_pp2_tied_zero3": ("plain_tied", PP2 + VALIDATE_ONCE),
}


def reference_config(shard: str, reference: str, save_path: Path | None = None, overrides: list[str] = ()):
    model_config, base = REFERENCES[reference]
    return case_config(shard, [*base, *overrides], save_path, model_config)


def record_calls(pipeline, calls: list[str]) -> None:
    """Each of ``pipeline``'s stage graphs, and its exchanges between stages, append their name to ``calls``."""
    def recorded(name, call):
        def record(*args):
            calls.append(name)
            return call(*args)
        return record
    pipeline.forwards = [recorded(f"forward {i}", f) for i, f in enumerate(pipeline.forwards)]
    pipeline.grad_fns = [recorded(f"backward {i}", f) for i, f in enumerate(pipeline.grad_fns)]
    pipeline._exchange = recorded("exchange", pipeline._exchange)


def main(out: str, shard: str) -> None:
    configure_runtime(case_config(shard, []))  # once: MindSpore's device cannot be set again
    world = init_world()
    for name, (reference, overrides) in CASES.items():
        run_dir = Path(out) / name
        config = reference_config(shard, reference, run_dir / "checkpoints", overrides)
        trainer = Trainer(config, world, run_dir, Reporter(run_dir / "metrics.jsonl", enabled=world.is_main))
        calls = []
        if trainer.model_parts.pipeline.uncompiled_graphs:
            record_calls(trainer.model_parts.pipeline, calls)
        trainer.train()
        if calls:
            (run_dir / f"calls_rank{world.rank}.json").write_text(json.dumps(calls))
        if world.is_main:
            (run_dir / "step_mode.txt").write_text(trainer.step_mode)


if __name__ == "__main__":
    main(*sys.argv[1:])
