"""Text helpers shared by the filters and the dedup: word splitting, sentences, and the normalization before hashing.

Words are split by a regular expression that, like the spaCy tokenizer DataTrove uses for English in its later
releases, makes each punctuation mark a word of its own (datatrove 0.3.0, the release Kiln can install, asks
NLTK, which downloads its punkt model on first use). The normalization before exact keys, MinHash shingles and
decontamination n-grams is DataTrove's own ``simplify_text`` (lower case, numbers to 0, punctuation to spaces,
whitespace collapsed, diacritics dropped).
"""
from __future__ import annotations

import re
import unicodedata

from datatrove.utils.text import simplify_text  # noqa: F401  (imported from here by the cleaning)

WORD = re.compile(r"\w+(?:['’]\w+)*|[^\w\s]")
# a sentence ends at terminal punctuation followed by whitespace or the end (DataTrove asks NLTK's punkt)
SENTENCE_END = re.compile(r"[.!?。！？]+[\"')\]]*(?=\s|$)")
TERMINAL_PUNCTUATION = (".", "!", "?", '"', "'", "。", "！", "？", "…", "．")


def is_punctuation(char: str) -> bool:
    return unicodedata.category(char)[0] in "PS"


def split_words(text: str) -> list[str]:
    """Words and punctuation marks, each its own item."""
    return WORD.findall(text)


def count_sentences(line: str) -> int:
    """Sentences in a line: its terminal punctuation marks, and a last one without any."""
    ends = len(SENTENCE_END.findall(line))
    tail = SENTENCE_END.split(line)[-1].strip()
    return ends + (1 if tail else 0)
