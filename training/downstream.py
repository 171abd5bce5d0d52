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

Each is a mean over documents; ties go to the first choice (argmax). Requests are batched by length (a few
padded lengths, each one compiled graph: the model's forward with the held-out loss's per-sample sums,
``HeldOutLoss``); right padding changes no earlier position under causal attention.
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
BATCH_ROWS = 16  # requests per forward
SHORTEST_PADDED = 32  # padded lengths: 32, 64, 128, ... up to the model's sequence length (one graph each)


@dataclass
class EncodedRequests:
    """A task's requests as token windows: ``window[i]`` holds ``context + continuation`` (cut from the left to
    ``max_length + 1`` tokens), of which the last ``targets[i]`` are the continuation."""
    windows: list[np.ndarray]
    targets: np.ndarray  # [requests] continuation tokens
    document: np.ndarray  # [requests] index of the request's document in ``Task.instances``
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
    documents and the characters."""
    unk = processor.unk_id()
    windows, targets, document, choice, unknown, kept, too_long = [], [], [], [], {}, [], []
    for doc in documents:
        encoded = [(processor.encode(context), processor.encode(continuation))
                   for context, continuation in doc.requests]
        for (ctx, cont), (context, continuation) in zip(encoded, doc.requests):
            if unk in ctx or unk in cont:
                chars = {c for c in context + continuation if unk in processor.encode(c)}
                unknown.setdefault(doc.doc_id, set()).update(chars)
            if not cont:
                raise TaskError(f"task {task.name} ({task.path}), document {doc.doc_id}: the answer "
                                f"{continuation!r} encodes to no token")
        if max(len(cont) for _, cont in encoded) > max_length:
            too_long.append(doc.doc_id)
            continue
        for option, (ctx, cont) in enumerate(encoded):
            windows.append(np.asarray((ctx + cont)[-(max_length + 1):], np.int32))
            targets.append(len(cont))
            document.append(len(kept))
            choice.append(option)
        kept.append(doc)
    if unknown:
        chars = sorted(set().union(*unknown.values()))
        raise TaskError(f"task {task.name}: the checkpoint's tokenizer has no piece for {len(chars)} character(s) "
                        f"{''.join(chars)!r} (no byte fallback), in documents {sorted(unknown)[:10]}"
                        f"{' ...' if len(unknown) > 10 else ''} of {task.path}: drop the task or evaluate with a "
                        f"tokenizer that encodes them")
    return EncodedRequests(windows, np.asarray(targets), np.asarray(document), np.asarray(choice)), kept, too_long


def padded_length(length: int, max_length: int) -> int:
    padded = SHORTEST_PADDED
    while padded < length:
        padded *= 2
    return min(padded, max_length)


class RequestScorer:
    """Log-likelihoods of requests through ``loss`` (a HeldOutLoss: the model's per-sample summed cross entropy
    over the loss-masked tokens), ``BATCH_ROWS`` requests per forward, grouped by padded length."""

    def __init__(self, loss, max_length: int, pad_id: int = 0):
        self.loss = loss
        self.max_length = max_length
        self.pad_id = pad_id
        self.forwards = 0

    def loglikelihoods(self, requests: EncodedRequests) -> np.ndarray:
        from training.forward import forward_loss_sums

        lengths = np.array([len(w) - 1 for w in requests.windows])
        order = np.argsort(-lengths, kind="stable")
        result = np.zeros(len(order))
        for first in range(0, len(order), BATCH_ROWS):
            rows = order[first:first + BATCH_ROWS]
            width = padded_length(int(lengths[rows].max()), self.max_length)
            batch = {"input_ids": np.full((BATCH_ROWS, width), self.pad_id, np.int32),
                     "labels": np.full((BATCH_ROWS, width), self.pad_id, np.int32),
                     "loss_mask": np.zeros((BATCH_ROWS, width), np.float32)}
            for row, request in enumerate(rows):
                window, n = requests.windows[request], len(requests.windows[request]) - 1
                batch["input_ids"][row, :n] = window[:-1]
                batch["labels"][row, :n] = window[1:]
                batch["loss_mask"][row, n - requests.targets[request]:n] = 1.0
            sums, _ = forward_loss_sums(self.loss, batch)
            result[rows] = -sums[:len(rows)]
            self.forwards += 1
        return result


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


def score_task(task: Task, limit: int | None, processor, scorer: RequestScorer) -> dict:
    """One task's scores on its first ``limit`` documents, with the per-request log-likelihoods (in the order of
    the documents and their choices) and the requests' rate."""
    requests, documents, too_long = encode_task(task, task.instances(limit), processor, scorer.max_length)
    if not documents:
        raise TaskError(f"task {task.name}: each of its first {limit} documents has an answer longer than the "
                        f"model's sequence length ({scorer.max_length} tokens): nothing to score")
    started = time.perf_counter()
    loglikelihoods = scorer.loglikelihoods(requests)
    seconds = time.perf_counter() - started
    scores = score_documents(documents, requests, loglikelihoods)
    return {**scores, "primary_metric": task.primary_metric, "primary": scores[task.primary_metric],
            "left_out_too_long": too_long,
            "seconds": seconds, "requests_per_second": len(loglikelihoods) / max(seconds, 1e-9),
            "loglikelihoods": [float(x) for x in loglikelihoods]}


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

    def run(self, loss, processor, max_length: int, checkpoint_dir: Path) -> dict:
        """``{"tasks": {name: scores}, "task_settings": ...}``. Each task's scores are kept in PARTIAL_DIR as it
        finishes, so an evaluation stopped half-way resumes at the first task not scored (``discard_partial``
        once the sidecar is written)."""
        from training.atomic import write_json_atomic
        from training.data.hashing import sha256_file

        if processor is None:
            raise TaskError(f"{checkpoint_dir}: its lineage names no tokenizer to encode the task texts with: "
                            f"pass --tokenizer-model (the run's sentencepiece .model)")
        settings = {"limit": self.limit, "max_length": max_length, "batch_rows": BATCH_ROWS,
                    "tokenizer_sha256": hashlib.sha256(processor.serialized_model_proto()).hexdigest(),
                    "lineage_sha256": sha256_file(checkpoint_dir / "lineage.json")}
        scorer = RequestScorer(loss, max_length)
        scores, partial = {}, checkpoint_dir / PARTIAL_DIR
        for name in self.names:
            kept = partial / f"{name.replace(':', '-')}.json"
            if kept.is_file() and (done := _read_partial(kept)).get("settings") == settings:
                scores[name] = done["scores"]
                continue
            result = score_task(load_task(name), self.limit, processor, scorer)
            scores[name] = {k: v for k, v in result.items() if k != "loglikelihoods"}
            partial.mkdir(exist_ok=True)
            write_json_atomic(kept, {"settings": settings, "scores": scores[name],
                                     "loglikelihoods": result["loglikelihoods"]})
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
