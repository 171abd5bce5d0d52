"""Sentencepiece tokenizer settings and training."""
from __future__ import annotations

import random
from pathlib import Path
from typing import Iterable, Iterator

import dagster as dg
import sentencepiece as spm

SPECIAL_IDS = {"unk": 0, "bos": 1, "eos": 2, "pad": 3}


class TokenizerSettings(dg.ConfigurableResource):
    """A byte-fallback sentencepiece model: every UTF-8 text round-trips, code whitespace included.

    ``eos`` doubles as the end-of-document (EOD) token appended after every document.
    """

    vocab_size: int = 4096
    model_type: str = "unigram"
    sample_lines: int = 200_000       # bound on the training sample, drawn from all sources
    seed: int = 1234
    max_line_chars: int = 2048

    def train(self, documents: Iterable[str], model_prefix: Path) -> dict:
        """Train on a seeded reservoir sample of lines; write ``<prefix>.model`` and ``.vocab``."""
        sample = self._sample_lines(documents)
        model_prefix.parent.mkdir(parents=True, exist_ok=True)
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(sample), model_prefix=str(model_prefix), vocab_size=self.vocab_size,
            model_type=self.model_type, character_coverage=0.9995, byte_fallback=True,
            normalization_rule_name="identity", remove_extra_whitespaces=False,
            allow_whitespace_only_pieces=True, split_digits=True, max_sentence_length=4 * self.max_line_chars,
            unk_id=SPECIAL_IDS["unk"], bos_id=SPECIAL_IDS["bos"], eos_id=SPECIAL_IDS["eos"],
            pad_id=SPECIAL_IDS["pad"], num_threads=1, shuffle_input_sentence=False, minloglevel=2)
        return {"sample_lines": len(sample), "sample_chars": sum(map(len, sample))}

    def _sample_lines(self, documents: Iterable[str]) -> list[str]:
        rng = random.Random(self.seed)
        reservoir: list[str] = []
        for i, line in enumerate(self._lines(documents)):
            if len(reservoir) < self.sample_lines:
                reservoir.append(line)
            elif (j := rng.randrange(i + 1)) < self.sample_lines:
                reservoir[j] = line
        if not reservoir:
            raise ValueError("no text to train the tokenizer on")
        return reservoir

    def _lines(self, documents: Iterable[str]) -> Iterator[str]:
        for doc in documents:
            for line in doc.split("\n"):
                if line.strip():
                    yield line[: self.max_line_chars]
