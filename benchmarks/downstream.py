"""Cost of the fast downstream task set (training/tasks.py FAST_TASKS at checkpoint_eval's default documents per
task) on the demo model, beside its training step, against issue 37's target: <= 5% of the training time of a run
that scores it at every task interval (assets/evaluation.py TASK_INTERVAL).

One trainer (configs/qwen3_tiny.yaml, the demo's model and batch: 8 x 128 tokens a step, in one process) on the
built-in code corpus tokenized as the demo chain does; that tokenizer encodes the task texts, as the demo's does in
`kiln eval`. Each round times one training step and one whole fast-set evaluation (every task encoded, packed and
scored through the compiled forward: training/downstream.py), the order swapped every round; before them one
evaluation compiles the forward's graphs, as checkpoint_eval's process does each time. Printed: the training step,
the evaluation (and its ratio to the step: training steps per evaluation), its requests/s, the compiling, how many
positions it reads beside scoring each request alone, and the overhead (evaluation + compiling) / (interval x step)
at the shipped task interval (the target), at validation's interval and the interval at which it is 5%. Timings are taken under
benchmarks/contention.py's LoadWatch: under competition they are reported as not valid. A smoke run: one round of
5 documents a task, one layer, 32 tokens, 2 samples, the step compiled as in a full run (so the forward is).
"""
from __future__ import annotations

import statistics

from benchmarks import SMOKE_BATCH, smoke_model
from benchmarks.contention import LoadWatch
from benchmarks.monitoring import _trainer
from benchmarks.suite import Bench, at_most, standalone

EVAL_INTERVAL = 50  # the demo's kiln.training.eval_interval (validation loss), for comparison
TARGET_PERCENT = 5.0
SMOKE_TASK_LIMIT = 5


def positions_read(tasks, task_limit: int, processor, scorer) -> tuple[int, int, int]:
    """(positions of the packed rows, of those the output layer reads, tokens of the requests each read alone
    without padding): what the packing saves, independent of the machine's load."""
    from training.downstream import encode_task, pack_rows, prompt_groups

    packed = answers = alone = 0
    for task in tasks:
        requests = encode_task(task, task.instances(task_limit), processor, scorer.max_length)[0]
        groups = prompt_groups(requests, scorer.max_length)
        packed += sum(width for width, _ in pack_rows(groups, scorer.widths))
        answers += sum(g.targets for g in groups)
        alone += sum(len(c) + len(a) - 1 for c, a in zip(requests.contexts, requests.continuations))
    return packed, answers, alone


def measure(bench: Bench, rounds: int, task_limit: int, smoke: bool = False) -> None:
    import sentencepiece

    from assets.evaluation import TASK_INTERVAL
    from training.downstream import RequestScorer, score_tasks
    from training.evaluation import evaluating
    from training.step import compile_blockers
    from training.tasks import FAST_TASKS, load_task

    shard = bench.shard()
    processor = sentencepiece.SentencePieceProcessor(model_file=str(shard.parent / "tokenizer.model"))
    size = [*smoke_model(1), *SMOKE_BATCH] if smoke else []
    trainer = _trainer(shard, bench.work, "downstream", {}, rounds + 2, size)
    model = trainer.model
    scorer = RequestScorer(model, trainer.seq_length,
                           compiled=not compile_blockers(trainer.config, trainer.mesh.dims, model))
    tasks = [load_task(name) for name in FAST_TASKS]

    def evaluate() -> int:
        with evaluating(model):
            return sum(scores["requests"] for _, scores in score_tasks(tasks, task_limit, processor, scorer))

    trainer.train_step()  # compiles the step
    with LoadWatch() as watch:
        # checkpoint_eval's process compiles the forward's graphs (one per row width) at every evaluation
        first, requests = watch.call("fast set evaluation, compiling", evaluate)
        seconds = watch.alternate({"training step": trainer.train_step, "fast set evaluation": evaluate}, rounds)
    steps, evaluations = seconds["training step"], seconds["fast set evaluation"]
    step, evaluation = statistics.median(steps), statistics.median(evaluations)
    compiling = max(first - evaluation, 0.0)
    bench.report("training step (median)", 1e3 * step, "ms", watch=watch)
    bench.report(f"fast set, {len(tasks)} tasks x {task_limit} docs", evaluation, "s", evaluation / step,
                 "training step, paired per round", watch=watch)
    bench.report("  requests/s", requests / evaluation, "req/s", watch=watch)
    bench.report("  compiling its graphs", compiling, "s", compiling / step, "training step", watch=watch)
    packed, answers, alone = positions_read(tasks, task_limit, processor, scorer)
    bench.report("  positions through the layers", packed, "positions", packed / alone, "each request alone")
    bench.report("  positions through the output", answers, "positions", answers / alone, "each request alone")
    for interval, what in ((TASK_INTERVAL, "task interval"), (EVAL_INTERVAL, "validation's interval")):
        overhead = statistics.median((e + compiling) / (interval * s) for e, s in zip(evaluations, steps))
        bench.report(f"fast set every {interval} steps ({what})", 100 * overhead, "% of training time",
                     target=at_most(TARGET_PERCENT, of="value") if interval == TASK_INTERVAL else (), watch=watch)
    bench.report(f"  interval for <= {TARGET_PERCENT:g}%", statistics.median(
        (e + compiling) / (TARGET_PERCENT / 100 * s) for e, s in zip(evaluations, steps)), "steps", watch=watch)


def run(bench: Bench) -> None:
    from assets.evaluation import CheckpointEvalConfig

    if bench.smoke:
        measure(bench, 1, SMOKE_TASK_LIMIT, smoke=True)
    else:
        measure(bench, 3, CheckpointEvalConfig().task_limit)


if __name__ == "__main__":
    with standalone("downstream") as bench:
        run(bench)
