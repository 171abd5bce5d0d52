"""The bare-sentencepiece reference of the tokenizing benchmark, run in worker processes.

A module of its own because spawned processes cannot import functions from `benchmarks/__main__.py`.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import sentencepiece

from training.data.corpus import iter_texts

_texts: list[str] = []
_processor: sentencepiece.SentencePieceProcessor | None = None


def load_share(files: list[Path], model: str, part: int, parts: int) -> None:
    """Pool initializer: this process's share of the texts, split by characters, and the model (untimed)."""
    global _processor
    texts = [text for path in files for text in iter_texts(path)]
    bounds = np.searchsorted(np.cumsum([len(t) for t in texts]), np.linspace(0, sum(map(len, texts)), parts + 1))
    bounds[-1] = len(texts)
    _texts[:] = texts[bounds[part]:bounds[part + 1]]
    _processor = sentencepiece.SentencePieceProcessor(model_file=model)


def encode_share(out_type) -> int:
    """The tokens of this process's share, encoded, counting one EOD per document."""
    return sum(len(ids) + 1 for ids in _processor.encode(_texts, out_type=out_type, num_threads=1))
