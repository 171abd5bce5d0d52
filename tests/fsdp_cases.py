"""Data-parallel training cases run under msrun by tests/test_fsdp.py: one launch, several layouts.

``python -m ... fsdp_cases.py OUT SHARD`` trains the micro Qwen3 for a few steps in each case and, on rank 0,
writes ``OUT/<case>/weights.npz`` (the full final weights, chunks gathered) beside the case's metrics.jsonl.
"""
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import MICRO_CONFIG, PROJECT_ROOT  # noqa: E402
from training.parallel.mesh import init_world  # noqa: E402
from training.config import load_config  # noqa: E402
from training.reporting import Reporter  # noqa: E402
from training.trainer import Trainer, configure_runtime  # noqa: E402

STEPS = 3
# name -> parallelism overrides; the world is 4 workers, so dp = 4
CASES = {
    "replicated": ["parallelism.data_parallel_shard=1"],
    "zero1": ["parallelism.data_parallel_shard_strategy=optim"],
    "zero2": ["parallelism.data_parallel_shard_strategy=optim_grads"],
    "zero3": ["parallelism.data_parallel_shard_strategy=optim_grads_params"],
    "hsdp_zero3": ["parallelism.data_parallel_shard=2"],
    "zero3_divide_after": ["parallelism.disable_gradient_division=false"],
}


def case_config(shard: str, overrides: list[str]):
    return load_config(PROJECT_ROOT / MICRO_CONFIG, [
        f"train_dataset.dataloader.config.data_path=[1.0, '{shard}']", "train_dataset.dataloader.config.eod=2",
        "train_dataset.dataloader.config.pad=3", "checkpoint.enable_save=false", f"training.steps={STEPS}",
        "training.local_batch_size=1", *overrides])


def main(out: str, shard: str) -> None:
    configure_runtime(case_config(shard, []))  # once: MindSpore's device cannot be set again
    world = init_world()
    for name, overrides in CASES.items():
        config = case_config(shard, overrides)
        run_dir = Path(out) / name
        trainer = Trainer(config, world, run_dir, Reporter(run_dir / "metrics.jsonl", enabled=world.is_main))
        trainer.train()
        weights = trainer.parallel.full_weights()
        if world.is_main:
            np.savez(run_dir / "weights.npz", **weights)


if __name__ == "__main__":
    main(*sys.argv[1:])
