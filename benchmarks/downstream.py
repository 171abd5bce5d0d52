"""Cost of the fast downstream task set (training/tasks.py FAST_TASKS, 200 documents each, checkpoint_eval's default)
on the demo model, beside its training step.

One trainer (configs/qwen3_tiny.yaml, one process, seq_length 128) and a tokenizer of the demo's 4,096 pieces
trained on the task texts; each round times one training step and one whole fast-set evaluation (every task
encoded, batched, scored through the compiled forward), the order swapped every round. Printed: the evaluation's
requests/s, the training step time, the overhead of evaluating every EVAL_INTERVAL steps: evaluation /
(EVAL_INTERVAL x step), median over rounds (target <= 5%), and the interval at which it would be 5%.
The machine's load is printed first: a figure measured under contention is not a result.
"""
from __future__ import annotations

import os
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.monitoring import _random_shard, _trainer

EVAL_INTERVAL = 50  # steps between evaluations: the demo's training.eval_interval
TASK_LIMIT = 200


def run(report, rounds: int = 3) -> None:
    from resources.tokenizer import TokenizerSettings
    from training.downstream import RequestScorer, score_task
    from training.evaluation import HeldOutLoss, evaluating
    from training.tasks import FAST_TASKS, load_task, task_texts
    from training.trainer import compile_blockers

    load = os.getloadavg()[0]
    print(f"-- downstream tasks (load {load:.1f} on {os.cpu_count()} cores"
          f"{': contended, figures are not results' if load > (os.cpu_count() or 1) else ''})", flush=True)
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
                return sum(score_task(task, TASK_LIMIT, processor, scorer)["requests"] for task in tasks)

        trainer.train_step()  # compiles the step
        requests = evaluate()  # and the forward's graphs, one per padded length
        steps, evaluations = [], []
        for round_index in range(rounds):
            for kind in (("step", "eval") if round_index % 2 == 0 else ("eval", "step")):
                started = time.perf_counter()
                trainer.train_step() if kind == "step" else evaluate()
                (steps if kind == "step" else evaluations).append(time.perf_counter() - started)
        step, evaluation = statistics.median(steps), statistics.median(evaluations)
        report("training step (median)", 1e3 * step, "ms")
        report(f"fast set, {len(tasks)} tasks x {TASK_LIMIT} docs", evaluation, "s", evaluation / step,
               "training step, paired per round")
        report("  requests/s", requests / evaluation, "req/s")
        overhead = statistics.median(e / (EVAL_INTERVAL * s) for e, s in zip(evaluations, steps))
        report(f"fast set every {EVAL_INTERVAL} steps", 100 * overhead, "% of training time", overhead / 0.05,
               "the 5% target")
        report("  interval for <= 5%", statistics.median(e / (0.05 * s) for e, s in zip(evaluations, steps)),
               "steps")


if __name__ == "__main__":
    from benchmarks.__main__ import report

    run(report)
