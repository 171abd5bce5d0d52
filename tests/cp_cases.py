"""Context-parallel training cases run under msrun by tests/test_context_parallel.py: one launch of 4 workers.

``python cp_cases.py OUT SHARD`` trains the micro Qwen3 for a few steps in each case, each case saving a
checkpoint at step 2 and its last (sharded as the case lays its tensors out) under ``OUT/<case>/checkpoints``.
"""
import os
import sys
from pathlib import Path

# single-threaded dispatch, as training.run sets it before MindSpore loads (fast_step.host_blocking_dispatch): the
# workers' busy-waiting dispatch threads on two loaded cores make each step several times slower
os.environ.setdefault("MS_DEV_HOST_BLOCKING_RUN", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))
from fsdp_cases import case_config  # noqa: E402
from training.parallel.mesh import init_world  # noqa: E402
from training.reporting import Reporter  # noqa: E402
from training.trainer import Trainer, configure_runtime  # noqa: E402

# name -> overrides; the world is 4 workers, so cp 2 leaves dp 2 (ZeRO-3 over dp_shard × cp = 4 ranks)
CASES = {
    "ring_cp2_dp2": ["parallelism.context_parallel=2"],
    "ulysses_cp2_dp2_zero1": ["parallelism.context_parallel=2", "parallelism.context_parallel_method=ulysses",
                              "parallelism.data_parallel_shard_strategy=optim"],
    "hybrid_cp4_zigzag": ["parallelism.context_parallel=4", "parallelism.context_parallel_method=hybrid",
                          "parallelism.ulysses_degree_in_cp=2", "parallelism.context_parallel_load_balance=true"],
    "ring_cp4_zigzag": ["parallelism.context_parallel=4", "parallelism.context_parallel_load_balance=true"],
}


def main(out: str, shard: str) -> None:
    configure_runtime(case_config(shard, []))  # once: MindSpore's device cannot be set again
    world = init_world()
    for name, overrides in CASES.items():
        run_dir = Path(out) / name
        config = case_config(shard, [*overrides, "checkpoint.save_interleaved_steps=2"], run_dir / "checkpoints")
        Trainer(config, world, run_dir, Reporter(run_dir / "metrics.jsonl", enabled=world.is_main)).train()


if __name__ == "__main__":
    main(*sys.argv[1:])
