"""Cost of the fast downstream task set (training/tasks.py FAST_TASKS, 200 documents each, checkpoint_eval's default)
on the demo model, beside its training step.

One trainer (configs/qwen3_tiny.yaml, one process, seq_length 128) and a tokenizer of the demo's 4,096 pieces
trained on the task texts; each round times one training step and one whole fast-set evaluation (every task
encoded, batched, scored through the compiled forward), the order swapped every round. Printed: the evaluation's
requests/s, the training step time, the overhead of evaluating every EVAL_INTERVAL steps: evaluation /
(EVAL_INTERVAL x step), median over rounds (target <= 5%), and the interval at which it would be 5%. Timings are
taken under benchmarks/contention.py's LoadWatch: under competition they are reported as not valid.
"""
from __future__ import annotations

import statistics
import tempfile
from pathlib import Path

from benchmarks.contention import LoadWatch
from benchmarks.monitoring import _random_shard, _trainer
from benchmarks.suite import Bench, at_most, standalone

EVAL_INTERVAL = 50  # steps between evaluations: the demo's training.eval_interval
TASK_LIMIT, SMOKE_TASK_LIMIT = 200, 5


def measure(bench: Bench, rounds: int, task_limit: int) -> None:
    from resources.tokenizer import TokenizerSettings
    from training.downstream import RequestScorer, score_task
    from training.evaluation import HeldOutLoss, evaluating
    from training.tasks import FAST_TASKS, load_task, task_texts
    from training.step import compile_blockers

    with tempfile.TemporaryDirectory(prefix="kiln-bench-downstream-") as tmp:
        work = Path(tmp)
        texts = [t for task in task_texts(["fast"]).values() for t in task]
        TokenizerSettings(sample_lines=50_000).train(texts, work / "tokenizer")
        import sentencepiece

        processor = sentencepiece.SentencePieceProcessor(model_file=str(work / "tokenizer.model"))
        shard = _random_shard(work / "random", vocab_size=4096)
        trainer = _trainer(shard, work, "run", {}, rounds + 2)
        model = trainer.model
        scorer = RequestScorer(HeldOutLoss(model, compiled=not compile_blockers(trainer.config, trainer.mesh.dims,
                                                                                 model)), trainer.seq_length)
        tasks = [load_task(name) for name in FAST_TASKS]

        def evaluate() -> int:
            with evaluating(model):
                return sum(score_task(task, task_limit, processor, scorer)["requests"] for task in tasks)

        trainer.train_step()  # compiles the step
        requests = evaluate()  # and the forward's graphs, one per padded length
        with LoadWatch() as watch:
            seconds = watch.alternate({"training step": trainer.train_step, "fast set evaluation": evaluate}, rounds)
    steps, evaluations = seconds["training step"], seconds["fast set evaluation"]
    step, evaluation = statistics.median(steps), statistics.median(evaluations)
    bench.report("training step (median)", 1e3 * step, "ms", watch=watch)
    bench.report(f"fast set, {len(tasks)} tasks x {task_limit} docs", evaluation, "s", evaluation / step,
                 "training step, paired per round", watch=watch)
    bench.report("  requests/s", requests / evaluation, "req/s", watch=watch)
    overhead = statistics.median(e / (EVAL_INTERVAL * s) for e, s in zip(evaluations, steps))
    bench.report(f"fast set every {EVAL_INTERVAL} steps", 100 * overhead, "% of training time",
                 target=at_most(5.0, of="value"), watch=watch)
    bench.report("  interval for <= 5%", statistics.median(e / (0.05 * s) for e, s in zip(evaluations, steps)),
                 "steps", watch=watch)


def run(bench: Bench) -> None:
    measure(bench, 1, SMOKE_TASK_LIMIT) if bench.smoke else measure(bench, 3, TASK_LIMIT)


if __name__ == "__main__":
    with standalone("downstream") as bench:
        measure(bench, 3, TASK_LIMIT)
