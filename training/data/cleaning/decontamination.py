"""N-gram overlap of documents with the evaluation tasks' texts (GPT-3's decontamination: 13-grams by default).

Texts are compared after ``simplify_text`` (case, punctuation and digits do not hide an overlap). A task text
shorter than ``n`` words but at least ``min_words`` long counts as one n-gram of its own length, so a short
question copied into the corpus is still found; shorter ones are ignored (a 5-word phrase is not evidence).
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import xxhash

from training.data.cleaning.text import simplify_text


def _grams(words: list[str], n: int) -> set[int]:
    return {xxhash.xxh64_intdigest(" ".join(words[i:i + n]).encode()) for i in range(len(words) - n + 1)}


class Decontaminator:
    def __init__(self, task_texts: Mapping[str, Sequence[str]], n: int = 13, min_words: int = 8):
        if n < 1 or min_words < 1:
            raise ValueError(f"decontamination n and min_words must be >= 1, got {n} and {min_words}")
        self.n = n
        self.tasks: dict[int, dict[int, set[str]]] = {}  # n-gram length -> n-gram hash -> tasks
        self.sizes: dict[str, int] = {}
        for task, texts in task_texts.items():
            grams = 0
            for text in texts:
                words = simplify_text(text).split()
                length = n if len(words) >= n else len(words)
                if length < min(n, min_words):
                    continue
                for gram in _grams(words, length):
                    self.tasks.setdefault(length, {}).setdefault(gram, set()).add(task)
                    grams += 1
            self.sizes[task] = grams

    def overlaps(self, normalized: str) -> dict[str, int]:
        """Task -> how many of the document's n-grams (of simplified text) are among the task's."""
        words = normalized.split()
        found: dict[str, int] = {}
        for length, table in self.tasks.items():
            for gram in _grams(words, length):
                for task in table.get(gram, ()):
                    found[task] = found.get(task, 0) + 1
        return found


def load_task_texts(names: Sequence[str]) -> dict[str, list[str]]:
    """The evaluation tasks' texts, from the evaluation side's module (training/tasks.py)."""
    try:
        from training.tasks import task_texts
    except ImportError as exc:
        raise ValueError(f"decontamination needs the evaluation tasks' texts (training.tasks.task_texts), which "
                         f"this install does not have ({exc})") from None
    return task_texts(list(names))


TaskSource = Callable[[Sequence[str]], Mapping[str, Sequence[str]]]
