"""Text helpers shared by the filters and the dedup: word splitting and the normalization before hashing.

They follow DataTrove's definitions (datatrove/utils/text.py) without its dependencies: words are split by a
regular expression that, like the spaCy tokenizer DataTrove uses for English, makes each punctuation mark a
word of its own; ``simplify_text`` is DataTrove's normalization (lower case, digits to 0, punctuation to spaces,
whitespace collapsed, diacritics dropped), so MinHash shingles come out as DataTrove's on the same text.
"""
from __future__ import annotations

import re
import sys
import unicodedata
from functools import lru_cache

WORD = re.compile(r"\w+(?:['’]\w+)*|[^\w\s]")
NUMBER = re.compile(r"\d+(?:[.,،٫⎖⎗⎘]\d+)?")
WHITESPACE = re.compile(r"\s+")
# a sentence ends at terminal punctuation followed by whitespace or the end (DataTrove asks NLTK's punkt)
SENTENCE_END = re.compile(r"[.!?。！？]+[\"')\]]*(?=\s|$)")
TERMINAL_PUNCTUATION = (".", "!", "?", '"', "'", "。", "！", "？", "…", "．")


def is_punctuation(char: str) -> bool:
    return unicodedata.category(char)[0] in "PS"


@lru_cache(maxsize=1)
def _punctuation_to_space() -> dict[int, int]:
    """Every punctuation or symbol code point (Unicode categories P*, S*) and control character -> a space."""
    space = ord(" ")
    table = {c: space for c in range(sys.maxunicode + 1)
             if unicodedata.category(chr(c))[0] in "PS" or unicodedata.category(chr(c)) == "Cc"}
    for keep in "\t\n\r":  # whitespace already: collapsed below either way
        table.pop(ord(keep), None)
    return table


def split_words(text: str) -> list[str]:
    """Words and punctuation marks, each its own item."""
    return WORD.findall(text)


def simplify_text(text: str) -> str:
    """Lower case, numbers as 0, punctuation as spaces, whitespace collapsed, diacritics removed."""
    text = NUMBER.sub("0", text.lower()).translate(_punctuation_to_space())
    text = WHITESPACE.sub(" ", text).strip()
    if not text.isascii():
        text = "".join(c for c in unicodedata.normalize("NFD", text) if unicodedata.category(c) != "Mn")
    return text


def count_sentences(line: str) -> int:
    """Sentences in a line: its terminal punctuation marks, and a last one without any."""
    ends = len(SENTENCE_END.findall(line))
    tail = SENTENCE_END.split(line)[-1].strip()
    return ends + (1 if tail else 0)
