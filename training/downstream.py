"""Downstream tasks scored as OLMo's in-loop evaluation scores them: ranked classification by log-likelihood.

Each answer choice of a document is one request: the prompt (context) and the answer (continuation), tokenized
apart (each through the tokenizer alone, as olmo_eval does: a sentencepiece model's dummy prefix starts the
answer with its own "▁" piece), no BOS (Kiln's shards have none), the pair cut from the left to the model's
sequence length. A forward of ``context + continuation[:-1]`` gives the continuation's log-likelihood ``ll``, the
sum of its tokens' log-probabilities. Per document, with ``label`` the right choice:

- ``acc``: the choice of highest ``ll`` is the right one (oe-eval's acc_raw);
- ``len_norm``: the choice of highest ``ll / characters of the answer`` is (acc_per_char);
- ``bpb``: ``-ll / (bytes of the right answer · ln 2)``, bits per UTF-8 byte of the right answer (logits_per_byte),
  which moves long before accuracy leaves chance and does not depend on the tokenizer.

Each is a mean over documents; ties go to the first choice (argmax).

Scoring packs requests instead of padding each alone (``pack_rows``): the answers of a document that share its
prompt follow one copy of the prompt in a row, each answer attending to the prompt and to itself only (a block
mask) at the positions it would have alone, so each gets the log-likelihood it gets scored alone (to float32
rounding: tests/test_downstream.py); several documents share a row, longest first into the best-filled row; the
output layer runs only where an answer token is predicted (``GPTModel.target_losses``); rows of one width go
through one compiled graph, ``FORWARD_TOKENS`` positions at a time, across tasks. For the fast set this reads a
fraction of the tokens one padded row per request does (benchmarks/downstream.py prints both).
"""
from __future__ import annotations

import hashlib
import json
import math
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from training.tasks import Task, TaskError, load_task

LOG2_E = 1.0 / math.log(2.0)
FORWARD_TOKENS = 2048  # token positions per forward (rows x row width)
PACK_WIDTH = 256  # rows are this wide (the model's sequence length when shorter); a longer group gets a wider row
# a forward's answer tokens (whose log-probabilities the output layer computes), as a share of its positions:
# a batch of packed rows takes rows while their answers fit, so each row width is one compiled shape
TARGET_SHARE = 0.5


@dataclass
class EncodedRequests:
    """A task's requests as tokens: request ``i`` scores ``continuations[i]`` after ``contexts[i]``, the prompt cut
    from the left so that the two are at most ``max_length + 1`` tokens (the model reads all but the last)."""
    contexts: list[np.ndarray]
    continuations: list[np.ndarray]
    document: np.ndarray  # [requests] index of the request's document in the documents scored
    choice: np.ndarray  # [requests] its choice within the document


class TokenBytes:
    """UTF-8 bytes of each piece of a sentencepiece model: a byte-fallback piece <0xNN> is one byte, a control
    or unknown piece none, "▁" a space. Summed over a held-out split's target tokens, the bytes of the text they
    spell (a document's first piece counts the space of the dummy prefix, one byte per document)."""

    def __init__(self, processor):
        lengths = np.zeros(processor.get_piece_size(), np.int64)
        for piece_id in range(len(lengths)):
            if processor.is_control(piece_id) or processor.is_unknown(piece_id):
                continue
            lengths[piece_id] = 1 if processor.is_byte(piece_id) else \
                len(processor.id_to_piece(piece_id).replace("\u2581", " ").encode("utf-8"))
        self.lengths = lengths

    def count(self, labels: np.ndarray, loss_mask: np.ndarray) -> np.ndarray:
        """Per row of ``labels``: the bytes of its loss-masked tokens (ids past the tokenizer's pieces count
        none: a model's padded vocabulary)."""
        ids = np.asarray(labels, np.int64)
        known = (ids >= 0) & (ids < len(self.lengths))
        return (np.where(known, self.lengths[np.where(known, ids, 0)], 0) * (np.asarray(loss_mask) > 0)).sum(-1)


def encode_task(task: Task, documents, processor, max_length: int) -> tuple[EncodedRequests, list, list[int]]:
    """Every request of ``documents`` (the task's instances) tokenized, the documents scored and the ids of those
    left out: a document with an answer longer than ``max_length`` tokens (the model cannot condition all of it
    on anything). A text the tokenizer can only encode as its unknown piece is a TaskError naming the task, the
    documents and the characters; so is an answer with no token or no prompt."""
    unk = processor.unk_id()
    contexts, continuations, document, choice, unknown, kept, too_long = [], [], [], [], {}, [], []
    for doc in documents:
        encoded = [(processor.encode(context), processor.encode(continuation))
                   for context, continuation in doc.requests]
        for (ctx, cont), (context, continuation) in zip(encoded, doc.requests):
            if unk in ctx or unk in cont:
                chars = {c for c in context + continuation if unk in processor.encode(c)}
                unknown.setdefault(doc.doc_id, set()).update(chars)
            if not cont or not ctx:
                raise TaskError(f"task {task.name} ({task.path}), document {doc.doc_id}: the "
                                f"{'answer' if not cont else 'prompt'} {(continuation if not cont else context)!r} "
                                f"encodes to no token")
        if max(len(cont) for _, cont in encoded) > max_length:
            too_long.append(doc.doc_id)
            continue
        for option, (ctx, cont) in enumerate(encoded):
            contexts.append(np.asarray(ctx[-(max_length + 1 - len(cont)):], np.int32))
            continuations.append(np.asarray(cont, np.int32))
            document.append(len(kept))
            choice.append(option)
        kept.append(doc)
    if unknown:
        chars = sorted(set().union(*unknown.values()))
        raise TaskError(f"task {task.name}: the checkpoint's tokenizer has no piece for {len(chars)} character(s) "
                        f"{''.join(chars)!r} (no byte fallback), in documents {sorted(unknown)[:10]}"
                        f"{' ...' if len(unknown) > 10 else ''} of {task.path}: drop the task or evaluate with a "
                        f"tokenizer that encodes them")
    return EncodedRequests(contexts, continuations, np.asarray(document, np.int64),
                           np.asarray(choice, np.int64)), kept, too_long


@dataclass
class PromptGroup:
    """Requests of one document that share their prompt, as one segment of a packed row: the prompt's tokens once,
    then each answer's tokens but its last; each answer attends to the prompt and to itself only, at the
    positions it would have alone, so its log-likelihood is the one of the request scored alone."""
    context: np.ndarray
    requests: list[int]
    length: int  # the segment's tokens
    targets: int  # its answer tokens


def prompt_groups(requests: EncodedRequests, max_length: int) -> list[PromptGroup]:
    """The requests grouped by document and prompt (a prompt cut from the left for a long answer is its own), in
    request order; a group longer than ``max_length`` tokens is split between answers."""
    groups, by_prompt = [], {}
    for index, (context, continuation) in enumerate(zip(requests.contexts, requests.continuations)):
        key = (int(requests.document[index]), context.tobytes())
        group = by_prompt.get(key)
        if group is None or group.length + len(continuation) - 1 > max_length:
            group = by_prompt[key] = PromptGroup(context, [], len(context), 0)
            groups.append(group)
        group.requests.append(index)
        group.length += len(continuation) - 1
        group.targets += len(continuation)
    return groups


def row_widths(max_length: int) -> list[int]:
    """The widths packed rows come in: PACK_WIDTH (or ``max_length`` when shorter), then doublings up to
    ``max_length`` for longer groups; each is one compiled shape."""
    widths = [min(PACK_WIDTH, max_length)]
    while widths[-1] < max_length:
        widths.append(min(2 * widths[-1], max_length))
    return widths


def pack_rows(groups: list[PromptGroup], widths: list[int]) -> list[tuple[int, list[PromptGroup]]]:
    """The groups packed into rows, each as (width, its groups): a group goes to the narrowest width that holds
    it, longest first into the row it fills best (best-fit decreasing), so rows carry little padding."""
    rows: list[tuple[int, list[PromptGroup]]] = []
    free_rows = {width: [[] for _ in range(width + 1)] for width in widths}  # width -> free tokens -> rows
    for group in sorted(groups, key=lambda g: -g.length):
        width = next(w for w in widths if w >= group.length)
        by_free = free_rows[width]
        free = next((f for f in range(group.length, width + 1) if by_free[f]), None)
        if free is None:
            rows.append((width, []))
            row, free = len(rows) - 1, width
        else:
            row = by_free[free].pop()
        rows[row][1].append(group)
        by_free[free - group.length].append(row)
    return rows


@dataclass
class PackedBatch:
    """Rows of one width as the model's inputs (``GPTModel.target_losses``) and, per target, its request."""
    input_ids: np.ndarray  # [rows, width]
    position_ids: np.ndarray  # [rows, width]
    attention_mask: np.ndarray  # [rows, 1, width, width], 1 = masked
    target_index: np.ndarray  # [targets] flat position (row · width + column) predicting the target
    target_labels: np.ndarray  # [targets]
    target_request: np.ndarray  # [targets] its request (-1: padding)


def packed_batch(rows: list[list[PromptGroup]], requests: list[EncodedRequests], width: int, row_count: int,
                 target_count: int) -> PackedBatch:
    """``rows`` (their groups' requests indexing ``requests``, one EncodedRequests per row) padded to
    ``row_count`` rows and ``target_count`` targets. Each token's segment (its group in the row) and branch (-1
    for the prompt, else the answer's slot) make the mask: a token attends to earlier tokens of its segment
    that are the prompt or its own answer."""
    input_ids = np.zeros((row_count, width), np.int32)
    position_ids = np.zeros((row_count, width), np.int32)
    segment = np.full((row_count, width), -1, np.int64)
    branch = np.full((row_count, width), -1, np.int64)
    index, labels, owner = [], [], []
    for r, (groups, encoded) in enumerate(zip(rows, requests)):
        at = 0
        for s, group in enumerate(groups):
            prompt = len(group.context)
            input_ids[r, at:at + prompt] = group.context
            position_ids[r, at:at + prompt] = np.arange(prompt)
            segment[r, at:at + prompt] = s
            last_prompt = r * width + at + prompt - 1
            at += prompt
            for slot, request in enumerate(group.requests):
                answer = encoded.continuations[request]
                n = len(answer) - 1
                input_ids[r, at:at + n] = answer[:-1]
                position_ids[r, at:at + n] = np.arange(prompt, prompt + n)
                segment[r, at:at + n], branch[r, at:at + n] = s, slot
                index += [last_prompt, *range(r * width + at, r * width + at + n)]
                labels += answer.tolist()
                owner += [request] * len(answer)
                at += n
    causal = np.tril(np.ones((width, width), bool))
    allowed = causal & (segment[:, :, None] == segment[:, None, :]) & \
        ((branch[:, None, :] == -1) | (branch[:, :, None] == branch[:, None, :]))
    padding = target_count - len(index)
    return PackedBatch(input_ids, position_ids, (~allowed).astype(np.uint8)[:, None],
                       np.asarray(index + [0] * padding, np.int32), np.asarray(labels + [0] * padding, np.int32),
                       np.asarray(owner + [-1] * padding, np.int64))


class RequestScorer:
    """Log-likelihoods of requests through the model's ``target_losses`` (a compiled graph when ``compiled``):
    each task's requests grouped by prompt and packed into rows (``pack_rows``), rows of one width batched
    ``FORWARD_TOKENS`` positions and ``TARGET_SHARE`` of answer tokens at a time, across tasks, so only the last
    batch of each width is partly empty."""

    def __init__(self, model, max_length: int, compiled: bool):
        from training.forward import TargetLosses

        self.losses = TargetLosses(model, compiled)
        self.max_length = max_length
        self.widths = row_widths(max_length)

    def score(self, tasks):
        """For each ``(key, EncodedRequests)`` of ``tasks``: ``(key, per-request log-likelihoods, seconds)`` in
        their order, each as soon as its last batch is scored (its share of each batch's time)."""
        results: dict = {}  # position -> [key, log-likelihoods, rows left, seconds]
        pending = {width: [] for width in self.widths}  # width -> rows waiting: (position, encoded, groups)
        done = 0
        for position, (key, requests) in enumerate(tasks):
            rows = pack_rows(prompt_groups(requests, self.max_length), self.widths)
            results[position] = [key, np.zeros(len(requests.contexts)), len(rows), 0.0]
            for width, groups in rows:
                rows_per_batch, targets_per_batch = self._batch_shape(width)
                waiting = pending[width]
                if waiting and (len(waiting) == rows_per_batch or sum(g.targets for _, _, gs in waiting for g in gs)
                                + sum(g.targets for g in groups) > targets_per_batch):
                    self._run(width, waiting, results)
                waiting.append((position, requests, groups))
            while done in results and results[done][2] == 0:
                yield self._finished(results, done)
                done += 1
        for width, waiting in pending.items():
            if waiting:
                self._run(width, waiting, results)
        while done in results:
            yield self._finished(results, done)
            done += 1

    @staticmethod
    def _finished(results: dict, position: int) -> tuple:
        key, loglikelihoods, _, seconds = results.pop(position)
        return key, loglikelihoods, seconds

    def _batch_shape(self, width: int) -> tuple[int, int]:
        rows = max(1, FORWARD_TOKENS // width)
        return rows, int(TARGET_SHARE * rows * width)

    def _run(self, width: int, waiting: list, results: dict) -> None:
        """One forward of the rows ``waiting`` (emptied): each request's log-likelihood into its task's result."""
        from mindspore import Tensor

        rows, targets = self._batch_shape(width)
        needed = sum(g.targets for _, _, groups in waiting for g in groups)
        if needed > targets:  # a single row with more answer tokens than a batch holds: a shape of its own
            targets = 1 << (needed - 1).bit_length()
        started = time.perf_counter()
        batch = packed_batch([groups for _, _, groups in waiting], [encoded for _, encoded, _ in waiting], width,
                             rows, targets)
        losses = self.losses(*(Tensor(x) for x in (batch.input_ids, batch.position_ids, batch.attention_mask,
                                                   batch.target_index, batch.target_labels))).asnumpy()
        seconds = (time.perf_counter() - started) / len(waiting)
        offsets = np.cumsum([0] + [sum(g.targets for g in groups) for _, _, groups in waiting])
        for (position, _, _), first, end in zip(waiting, offsets[:-1], offsets[1:]):
            result = results[position]
            np.add.at(result[1], batch.target_request[first:end], -losses[first:end].astype(np.float64))
            result[2] -= 1
            result[3] += seconds
        waiting.clear()


def score_documents(documents, requests: EncodedRequests, loglikelihoods: np.ndarray) -> dict:
    """acc, len_norm and bpb (module docstring) over ``documents``; acc and len_norm are None for a task whose
    documents have one answer each (nothing to rank)."""
    correct = normalized = 0
    bits_per_byte = []
    for index, doc in enumerate(documents):
        mine = requests.document == index
        ll = np.full(len(doc.requests), -np.inf)
        ll[requests.choice[mine]] = loglikelihoods[mine]
        answers = [continuation for _, continuation in doc.requests]
        correct += int(np.argmax(ll)) == doc.label
        normalized += int(np.argmax(ll / np.array([max(len(a), 1) for a in answers]))) == doc.label
        bits_per_byte.append(-ll[doc.label] / max(len(answers[doc.label].encode("utf-8")), 1) * LOG2_E)
    ranked = any(len(doc.requests) > 1 for doc in documents)
    n = len(documents)
    return {"acc": correct / n if ranked else None, "len_norm": normalized / n if ranked else None,
            "bpb": float(np.mean(bits_per_byte)), "instances": n, "requests": len(loglikelihoods)}


def score_tasks(tasks: list[Task], limit: int | None, processor, scorer: RequestScorer):
    """Each task's scores on its first ``limit`` documents, with the per-request log-likelihoods (in the order of
    the documents and their choices) and the requests' rate: ``(task, scores)`` in the order of ``tasks``, each
    as soon as its requests are scored (the tasks share batches)."""
    encoded = {}

    def requests():
        for task in tasks:
            started = time.perf_counter()
            requests, documents, too_long = encode_task(task, task.instances(limit), processor, scorer.max_length)
            if not documents:
                raise TaskError(f"task {task.name}: each of its first {limit} documents has an answer longer than "
                                f"the model's sequence length ({scorer.max_length} tokens): nothing to score")
            encoded[task.name] = (requests, documents, too_long, time.perf_counter() - started)
            yield task, requests

    for task, loglikelihoods, seconds in scorer.score(requests()):
        requests, documents, too_long, encoding = encoded.pop(task.name)
        seconds += encoding
        scores = score_documents(documents, requests, loglikelihoods)
        yield task, {**scores, "primary_metric": task.primary_metric, "primary": scores[task.primary_metric],
                     "left_out_too_long": too_long,
                     "seconds": seconds, "requests_per_second": len(loglikelihoods) / max(seconds, 1e-9),
                     "loglikelihoods": [float(x) for x in loglikelihoods]}


def score_task(task: Task, limit: int | None, processor, scorer: RequestScorer) -> dict:
    """``score_tasks`` of one task."""
    ((_, scores),) = score_tasks([task], limit, processor, scorer)
    return scores


PARTIAL_DIR = ".eval-tasks-partial"  # in the checkpoint directory: each task's scores as it finishes


def checkpoint_tokenizer(lineage: dict, tokenizer_model: str | Path | None = None, required: bool = False):
    """The sentencepiece model the checkpoint's run trained on (its lineage's tokenizer, sha256 checked), or
    ``tokenizer_model`` when given; None when neither names one (a run trained on hand-picked shards) or the
    lineage's is gone and nothing ``required`` it (then the held-out split's bits per byte are left out)."""
    from training.data.encoding import load_sentencepiece
    from training.data.hashing import sha256_file

    if tokenizer_model is not None:
        return load_sentencepiece(tokenizer_model)
    recorded = lineage.get("tokenizer")
    if not recorded:
        return None
    path = Path(lineage.get("data_root", ".")) / recorded["path"]
    if not path.is_file():
        if not required:
            return None
        raise TaskError(f"{path}: the tokenizer the checkpoint's lineage names is not there (moved? pass "
                        f"--tokenizer-model)")
    actual = sha256_file(path)
    if actual != recorded["sha256"]:
        raise TaskError(f"{path}: tokenizer changed since training (sha256 {actual[:16]}…, the lineage says "
                        f"{recorded['sha256'][:16]}…)")
    return load_sentencepiece(path)


def token_bytes_of(lineage: dict) -> TokenBytes | None:
    """The byte lengths of the pieces of the tokenizer ``lineage`` names (None when it names none or the file is
    gone): validation's bits per byte during training."""
    processor = checkpoint_tokenizer(lineage)
    return TokenBytes(processor) if processor is not None else None


@dataclass
class TaskRun:
    """Which tasks a checkpoint's evaluation scores (``names`` as ``tasks.resolve_names`` gives them), on how many
    documents each (``limit``; None: all), and with which tokenizer when not the lineage's."""
    names: list[str]
    limit: int | None = 200
    tokenizer_model: str | None = None

    def run(self, model, compiled: bool, processor, max_length: int, checkpoint_dir: Path) -> dict:
        """``{"tasks": {name: scores}, "task_settings": ...}``, scored through ``model`` (``compiled``: the
        forward as a graph). Each task's scores are kept in PARTIAL_DIR as it finishes, so an evaluation stopped
        half-way resumes at the first task not scored (``discard_partial`` once the sidecar is written)."""
        from training.atomic import write_json_atomic
        from training.data.hashing import sha256_file

        if processor is None:
            raise TaskError(f"{checkpoint_dir}: its lineage names no tokenizer to encode the task texts with: "
                            f"pass --tokenizer-model (the run's sentencepiece .model)")
        settings = {"limit": self.limit, "max_length": max_length,
                    "tokenizer_sha256": hashlib.sha256(processor.serialized_model_proto()).hexdigest(),
                    "lineage_sha256": sha256_file(checkpoint_dir / "lineage.json")}
        scores, partial = {}, checkpoint_dir / PARTIAL_DIR
        kept = {name: partial / f"{name.replace(':', '-')}.json" for name in self.names}
        for name, path in kept.items():
            if path.is_file() and (done := _read_partial(path)).get("settings") == settings:
                scores[name] = done["scores"]
        todo = [load_task(name) for name in self.names if name not in scores]
        for task, result in score_tasks(todo, self.limit, processor, RequestScorer(model, max_length, compiled)):
            scores[task.name] = {k: v for k, v in result.items() if k != "loglikelihoods"}
            partial.mkdir(exist_ok=True)
            write_json_atomic(kept[task.name], {"settings": settings, "scores": scores[task.name],
                                                "loglikelihoods": result["loglikelihoods"]})
        scores = {name: scores[name] for name in self.names}
        primary = [s["primary"] for s in scores.values()]
        return {"tasks": scores, "task_settings": settings,
                "tasks_mean": {"primary": float(np.mean(primary)),
                               "bpb": float(np.mean([s["bpb"] for s in scores.values()]))}}


def _read_partial(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):  # written atomically, so only a foreign file is unreadable
        return {}


def discard_partial(checkpoint_dir: Path) -> None:
    """Drop the per-task scores kept while the evaluation ran (its sidecar now holds them)."""
    shutil.rmtree(Path(checkpoint_dir) / PARTIAL_DIR, ignore_errors=True)


def tensorboard_scalars(record: dict) -> dict[str, float]:
    """A checkpoint's evaluation as TensorBoard scalars: held-out loss and bits per byte (overall and per source)
    and each task's scores, grouped under ``eval/``."""
    scalars = {"eval/loss": record["loss"], **{f"eval/loss/{n}": s["loss"] for n, s in record["sources"].items()}}
    if "bpb" in record:
        scalars |= {"eval/bpb": record["bpb"], **{f"eval/bpb/{n}": s["bpb"] for n, s in record["sources"].items()}}
    for name, s in (record.get("tasks") or {}).items():
        scalars |= {f"eval/tasks/{name}/{metric}": s[metric] for metric in ("acc", "len_norm", "bpb")
                    if s[metric] is not None}
    if record.get("tasks"):
        scalars |= {"eval/tasks/mean_primary": record["tasks_mean"]["primary"],
                    "eval/tasks/mean_bpb": record["tasks_mean"]["bpb"]}
    return scalars


def log_to_tensorboard(record: dict) -> Path | None:
    """The evaluation's scalars at its checkpoint's step, into the run's TensorBoard directory (its config's
    monitor.tensorboard.output_dir) beside the training curves; None when the run writes no TensorBoard."""
    from training.config import TrainConfig
    from training.monitor import _summary_writer_class

    checkpoint_dir = Path(record["checkpoint"]["path"])
    run = json.loads((checkpoint_dir / "lineage.json").read_text())["run"]
    output_dir = TrainConfig.from_dict(run["config"]).monitor.tensorboard.output_dir
    if not output_dir:
        return None
    writer = _summary_writer_class()(logdir=output_dir)
    try:
        for name, value in tensorboard_scalars(record).items():
            writer.add_scalar(name, value, global_step=record["checkpoint"]["step"])
    finally:
        writer.close()
    return Path(output_dir)
