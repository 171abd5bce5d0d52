"""Cost of validation during training (``kiln.training.eval_interval: 50``, ``eval_iters: 10``) on the demo model.

One trainer (configs/qwen3_tiny.yaml, one process) and its Validation; each round times one training step and
one whole evaluation (10 global batches of the validation split, forward only), the order swapped every
round, so machine load drifts affect both alike. The overhead is one evaluation per 50 steps: the median over
rounds of evaluation / (50 x step) within a round (target <= 5% of training time). A smoke run: one round of 2
batches, one layer, 32 tokens, 2 samples, the step compiled as in a full run (so the evaluation's forward is).
"""
from __future__ import annotations

import dataclasses
import statistics
import tempfile
from pathlib import Path

from benchmarks import SMOKE_BATCH, smoke_model
from benchmarks.contention import LoadWatch
from benchmarks.monitoring import _random_shard, _trainer
from benchmarks.suite import Bench, at_most, standalone

EVAL_INTERVAL, EVAL_ITERS = 50, 10


def measure(bench: Bench, rounds: int, eval_iters: int, smoke: bool = False) -> None:
    from training.evaluation import Validation
    from training.step import compile_blockers
    from training.train_state import micro_batch_indices

    with tempfile.TemporaryDirectory(prefix="kiln-bench-validation-") as tmp:
        work = Path(tmp)
        # enough documents that the default split's 2% holds eval_iters global batches of validation samples
        shard = _random_shard(work / "random", vocab_size=4096, documents=600 * eval_iters)
        trainer = _trainer(shard, work, "run", {}, rounds + 1, [*smoke_model(1), *SMOKE_BATCH] if smoke else [])
        config = trainer.config
        config = dataclasses.replace(config, kiln=dataclasses.replace(config.kiln, training=dataclasses.replace(
            config.kiln.training, eval_interval=EVAL_INTERVAL, eval_iters=eval_iters)))
        validation = Validation(config, trainer.model, trainer.collectives, accumulation=trainer.accumulation,
                                use_positions=trainer.use_positions, vocab_size=trainer.model.config.vocab_size,
                                sample_indices=lambda first, micro: micro_batch_indices(
                                    first, micro, 0, 1, config.training.local_batch_size),
                                compiled=not compile_blockers(config, trainer.mesh.dims, trainer.model))
        trainer.train_step()  # the first step compiles kernels
        validation.evaluate(1)  # and the first evaluation its forward's
        with LoadWatch() as watch:
            seconds = watch.alternate({"training step": trainer.train_step,
                                       "evaluation": lambda: validation.evaluate(trainer.step)}, rounds)
    steps, evaluations = seconds["training step"], seconds["evaluation"]
    step, evaluation = statistics.median(steps), statistics.median(evaluations)
    bench.report("training step (median)", 1e3 * step, "ms", watch=watch)
    bench.report(f"validation, {eval_iters} global batches (median)", 1e3 * evaluation, "ms",
                 evaluation / step, "training step, paired per round", watch=watch)
    overhead = statistics.median(e / (EVAL_INTERVAL * s) for e, s in zip(evaluations, steps))
    bench.report(f"validation overhead at eval_interval {EVAL_INTERVAL}, eval_iters {eval_iters}", 100 * overhead,
                 "% of training time", target=at_most(5.0, of="value"), watch=watch)


def run(bench: Bench) -> None:
    measure(bench, rounds=1, eval_iters=2, smoke=True) if bench.smoke else measure(bench, 6, EVAL_ITERS)


if __name__ == "__main__":
    with standalone("validation") as bench:
        measure(bench, rounds=6, eval_iters=EVAL_ITERS)
