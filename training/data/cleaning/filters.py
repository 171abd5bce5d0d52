"""The cleaning steps that look at one document at a time: quality filters, language ID, URL block list, PII.

Each step is a dataclass whose fields are its parameters (defaults: the published values, DataTrove's where it
has the filter) and whose ``apply(doc)`` returns ``None`` (kept as is), a ``str`` (kept, rewritten: C4's line
filter, PII redaction) or a ``Removal`` naming the rule and the measured value that crossed its limit. The rules
follow DataTrove's filters (datatrove/pipeline/filters/*.py) rule for rule; words come from
``text.split_words`` instead of spaCy, sentences from a punctuation rule instead of NLTK's punkt (which
DataTrove downloads at run time).

They are not the installed DataTrove 0.3.0's filter classes: each of its Gopher, C4 and FineWeb filters splits
English words and sentences with NLTK, which needs the punkt model downloaded (offline: LookupError
'punkt_tab'), and a filter returns only the rule's name, where the removals sidecar records the measured value
and its limit. Given this module's word and sentence splitting instead (registered as a DataTrove tokenizer),
they ran offline and agreed with these steps on 1,199 of 1,200 documents (800 stdlib docstrings, 400 generated
paragraphs), at 0.72x their speed (980 vs 1,360 documents per CPU-s, load 13): the sidecar decides.
"""
from __future__ import annotations

import dataclasses
import functools
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import ClassVar
from urllib.parse import urlsplit

from training.data.cleaning.text import (TERMINAL_PUNCTUATION, count_sentences, is_punctuation, split_words)


@dataclass(frozen=True)
class Document:
    text: str
    url: str | None = None


@dataclass(frozen=True)
class Removal:
    reason: str                  # the rule, e.g. "dup_line_frac"
    value: float | None = None   # what was measured
    limit: float | None = None   # the threshold it crossed
    detail: str = ""             # e.g. the language found, the blocked host, the matched text


class Step:
    name: ClassVar[str]
    changes_text: ClassVar[bool] = False

    def apply(self, doc: Document) -> Removal | str | None:
        raise NotImplementedError


def _over(reason: str, value: float, limit: float | None) -> Removal | None:
    return Removal(reason, round(value, 4), limit) if limit is not None and value > limit else None


def _under(reason: str, value: float, limit: float | None) -> Removal | None:
    return Removal(reason, round(value, 4), limit) if limit is not None and value < limit else None


def _duplicates(items: list[str]) -> tuple[int, int]:
    """(repeated items, characters in them): each item after its first occurrence."""
    seen, elements, chars = set(), 0, 0
    for item in items:
        if item in seen:
            elements += 1
            chars += len(item)
        else:
            seen.add(item)
    return elements, chars


def _top_ngram_chars(words: list[str], n: int) -> int:
    grams = Counter(" ".join(words[i:i + n]) for i in range(len(words) - n + 1))
    if not grams:
        return 0
    gram, count = grams.most_common(1)[0]
    return len(gram) * count


def _repeated_ngram_chars(words: list[str], n: int) -> int:
    """Characters of the words in n-grams seen before, a repeat skipping its n words (as Gopher counts)."""
    seen, chars, i = set(), 0, 0
    while i < len(words) - n + 1:
        gram = "".join(words[i:i + n])
        if gram in seen:
            chars += len(gram)
            i += n
        else:
            seen.add(gram)
            i += 1
    return chars


PARAGRAPHS = re.compile(r"\n{2,}")
LINES = re.compile(r"\n+")


@dataclass
class GopherRepetition(Step):
    """Gopher's repetition rules (Rae et al. 2021, table A1): repeated lines, paragraphs and n-grams."""
    name: ClassVar[str] = "gopher_repetition"
    dup_line_frac: float | None = 0.3
    dup_para_frac: float | None = 0.3
    dup_line_char_frac: float | None = 0.2
    dup_para_char_frac: float | None = 0.2
    top_n_grams: dict = field(default_factory=lambda: {2: 0.2, 3: 0.18, 4: 0.16})
    dup_n_grams: dict = field(default_factory=lambda: {5: 0.15, 6: 0.14, 7: 0.13, 8: 0.12, 9: 0.11, 10: 0.10})

    def apply(self, doc: Document) -> Removal | None:
        text = doc.text
        if not text:
            return Removal("empty")
        paragraphs = PARAGRAPHS.split(text.strip())
        count, chars = _duplicates(paragraphs)
        removal = (_over("dup_para_frac", count / len(paragraphs), self.dup_para_frac)
                   or _over("dup_para_char_frac", chars / len(text), self.dup_para_char_frac))
        if removal:
            return removal
        lines = LINES.split(text)
        count, chars = _duplicates(lines)
        removal = (_over("dup_line_frac", count / len(lines), self.dup_line_frac)
                   or _over("dup_line_char_frac", chars / len(text), self.dup_line_char_frac))
        if removal:
            return removal
        words = split_words(text)
        for n, limit in sorted(self.top_n_grams.items()):
            if removal := _over(f"top_{n}_gram", _top_ngram_chars(words, int(n)) / len(text), limit):
                return removal
        for n, limit in sorted(self.dup_n_grams.items()):
            if removal := _over(f"duplicated_{n}_n_grams", _repeated_ngram_chars(words, int(n)) / len(text), limit):
                return removal
        return None


@dataclass
class GopherQuality(Step):
    """Gopher's quality rules: length in words, mean word length, symbols, bullets, ellipses, alphabetic words,
    stop words."""
    name: ClassVar[str] = "gopher_quality"
    min_doc_words: int | None = 50
    max_doc_words: int | None = 100000
    min_avg_word_length: float | None = 3
    max_avg_word_length: float | None = 10
    max_symbol_word_ratio: float | None = 0.1
    max_bullet_lines_ratio: float | None = 0.9
    max_ellipsis_lines_ratio: float | None = 0.3
    max_non_alpha_words_ratio: float | None = 0.8  # DataTrove's name: the least share of words with a letter
    min_stop_words: int | None = 2
    stop_words: list = field(default_factory=lambda: ["the", "be", "to", "of", "and", "that", "have", "with"])

    def apply(self, doc: Document) -> Removal | None:
        text = doc.text
        words = split_words(text)
        if not words:
            return Removal("gopher_short_doc", 0, self.min_doc_words)
        real = [w for w in words if not all(is_punctuation(c) for c in w)]
        removal = (_under("gopher_short_doc", len(real), self.min_doc_words)
                   or _over("gopher_long_doc", len(real), self.max_doc_words))
        if removal:
            return removal
        mean = sum(map(len, real)) / len(real) if real else 0.0
        removal = (_under("gopher_below_avg_threshold", mean, self.min_avg_word_length)
                   or _over("gopher_above_avg_threshold", mean, self.max_avg_word_length)
                   or _over("gopher_too_many_hashes", text.count("#") / len(words), self.max_symbol_word_ratio)
                   or _over("gopher_too_many_ellipsis", (text.count("...") + text.count("…")) / len(words),
                            self.max_symbol_word_ratio))
        if removal:
            return removal
        lines = text.splitlines() or [""]
        bullets = sum(line.lstrip().startswith(("•", "-")) for line in lines) / len(lines)
        ellipses = sum(line.rstrip().endswith(("...", "…")) for line in lines) / len(lines)
        alpha = sum(any(c.isalpha() for c in w) for w in words) / len(words)
        removal = (_over("gopher_too_many_bullets", bullets, self.max_bullet_lines_ratio)
                   or _over("gopher_too_many_end_ellipsis", ellipses, self.max_ellipsis_lines_ratio)
                   or _under("gopher_below_alpha_threshold", alpha, self.max_non_alpha_words_ratio))
        if removal:
            return removal
        if self.min_stop_words is not None:
            found = len(set(self.stop_words).intersection(words))
            return _under("gopher_enough_stop_words", found, self.min_stop_words)
        return None


CITATION = re.compile(r"\[\d*]|\[edit]|\[citation needed]")
POLICY = ("terms of use", "privacy policy", "cookie policy", "uses cookies", "use of cookies", "use cookies")
C4_END = (".", "?", "!", '"', "'")


@dataclass
class C4Quality(Step):
    """C4's rules (Raffel et al. 2020): lines kept only with terminal punctuation, 3+ words, no "javascript" or
    cookie/terms notices, no word over 1000 characters; pages dropped with "lorem ipsum", a curly bracket or
    fewer than 5 sentences. Rewrites the document to its kept lines."""
    name: ClassVar[str] = "c4"
    changes_text: ClassVar[bool] = True
    remove_citations: bool = True
    filter_no_terminal_punct: bool = True
    min_num_sentences: int = 5
    min_words_per_line: int = 3
    max_word_length: int = 1000
    filter_lorem_ipsum: bool = True
    filter_javascript: bool = True
    filter_curly_bracket: bool = True
    filter_policy: bool = True

    def apply(self, doc: Document) -> Removal | str:
        sentences, kept = 0, []
        for line in doc.text.splitlines():
            line = line.strip()
            words = line.split()
            if self.max_word_length != -1 and any(len(w) > self.max_word_length for w in words):
                continue
            if self.remove_citations:
                line = CITATION.sub("", line)
            if self.filter_no_terminal_punct and (not line.endswith(C4_END) or line.endswith("...")):
                continue
            if len(words) < self.min_words_per_line:
                continue
            lower = line.lower()
            if self.filter_lorem_ipsum and "lorem ipsum" in lower:
                return Removal("lorem_ipsum")
            if self.filter_javascript and "javascript" in lower:
                continue
            if self.filter_curly_bracket and "{" in line:
                return Removal("curly_bracket", detail=line[:80])
            if self.filter_policy and any(p in lower for p in POLICY):
                continue
            sentences += count_sentences(line)
            kept.append(line)
        if self.min_num_sentences != -1 and sentences < self.min_num_sentences:
            return Removal("too_few_sentences", sentences, self.min_num_sentences)
        return "\n".join(kept).strip()


@dataclass
class FineWebQuality(Step):
    """FineWeb's own rules (Penedo et al. 2024): share of lines ending in punctuation, of short lines, of
    characters in repeated lines, and newlines per word."""
    name: ClassVar[str] = "fineweb_quality"
    line_punct_thr: float = 0.12
    line_punct_exclude_zero: bool = False
    short_line_thr: float = 0.67
    short_line_length: int = 30
    char_duplicates_ratio: float = 0.01
    new_line_ratio: float = 0.3

    def apply(self, doc: Document) -> Removal | None:
        lines = [line for line in doc.text.split("\n") if line.strip()]
        if not lines:
            return Removal("empty")
        punct = sum(line.endswith(TERMINAL_PUNCTUATION) for line in lines) / len(lines)
        if punct < self.line_punct_thr and not (punct == 0 and self.line_punct_exclude_zero):
            return Removal("line_punct_ratio", round(punct, 4), self.line_punct_thr)
        short = sum(len(line) <= self.short_line_length for line in lines) / len(lines)
        chars = len(doc.text.replace("\n", "")) or 1
        removal = (_over("short_line_ratio", short, self.short_line_thr)
                   or _over("char_dup_ratio", _duplicates(lines)[1] / chars, self.char_duplicates_ratio))
        if removal:
            return removal
        words = split_words(doc.text) or [""]
        return _over("list_ratio", doc.text.count("\n") / len(words), self.new_line_ratio)


@dataclass
class Length(Step):
    """Document length in characters, and the share of characters that are neither letters, digits nor
    whitespace (markup, tables of symbols, binary debris)."""
    name: ClassVar[str] = "length"
    min_chars: int | None = 1
    max_chars: int | None = 1_000_000
    max_symbol_ratio: float | None = None

    def apply(self, doc: Document) -> Removal | None:
        size = len(doc.text)
        removal = _under("too_short", size, self.min_chars) or _over("too_long", size, self.max_chars)
        if removal or self.max_symbol_ratio is None or not size:
            return removal
        symbols = sum(1 for c in doc.text if not (c.isalnum() or c.isspace()))
        return _over("symbol_ratio", symbols / size, self.max_symbol_ratio)


@dataclass
class CodeQuality(Step):
    """The Stack / StarCoder's file rules for source code: longest line, mean line length, share of
    alphanumeric characters (generated, minified or data files fail them)."""
    name: ClassVar[str] = "code_quality"
    max_line_length: int | None = 1000
    max_mean_line_length: float | None = 100
    min_alnum_fraction: float | None = 0.25

    def apply(self, doc: Document) -> Removal | None:
        lines = doc.text.splitlines() or [""]
        lengths = [len(line) for line in lines]
        alnum = sum(c.isalnum() for c in doc.text) / (len(doc.text) or 1)
        return (_over("max_line_length", max(lengths), self.max_line_length)
                or _over("mean_line_length", sum(lengths) / len(lengths), self.max_mean_line_length)
                or _under("alnum_fraction", alnum, self.min_alnum_fraction))


@dataclass
class Language(Step):
    """Language ID by CLD2 (Chromium's Compact Language Detector 2, the `pycld2` package: its model is compiled
    into the extension, nothing is downloaded). Kept when the most likely language is one of ``languages``
    with at least ``min_score`` of the text (CLD2's percent / 100; FineWeb's fastText cut is 0.65). Measured by
    benchmarks/cleaning.py: 0.965 accuracy on 1,076 paragraphs of human gettext translations in 54 languages
    (misses mostly between close languages: Bosnian/Croatian, Malay/Indonesian)."""
    name: ClassVar[str] = "language"
    languages: list = field(default_factory=lambda: ["en"])
    min_score: float = 0.65

    def apply(self, doc: Document) -> Removal | None:
        language, score = detect_language(doc.text)
        if language not in self.languages:
            return Removal("language", score, self.min_score, detail=language)
        return _under("language_score", score, self.min_score)


def detect_language(text: str) -> tuple[str, float]:
    """(ISO 639-1 code or "un", share of the text in it) by CLD2."""
    import pycld2

    try:
        _, _, details = pycld2.detect(text.encode("utf-8", "replace").decode("utf-8"))
    except pycld2.error:  # CLD2 refuses some control characters: read the text without them
        _, _, details = pycld2.detect("".join(c for c in text if c.isprintable() or c in "\n\t"))
    _, code, percent, _ = details[0]
    return code, percent / 100


@dataclass
class UrlBlocklist(Step):
    """Documents whose ``url`` (the record's ``url_key``) has a host in ``domains``, or below one, are removed."""
    name: ClassVar[str] = "url_blocklist"
    domains: list = field(default_factory=list)
    url_key: str = "url"

    def apply(self, doc: Document) -> Removal | None:
        if not doc.url:
            return None
        host = (urlsplit(doc.url).hostname or "").lower()
        blocked = set(d.lower() for d in self.domains)
        parts = host.split(".")
        for i in range(len(parts)):
            if ".".join(parts[i:]) in blocked:
                return Removal("blocked_domain", detail=host)
        return None


@dataclass
class PiiRedaction(Step):
    """E-mail addresses and IPv4 addresses replaced by placeholders: DataTrove's own PIIFormatter (regular
    expressions, nothing to download), by default only public IP addresses as there. One replacement each, where
    DataTrove can cycle through several: a cycle would carry over from one document to the next, and so depend on
    which chunks a worker cleaned before (a Ray run would differ from a local one)."""
    name: ClassVar[str] = "pii"
    changes_text: ClassVar[bool] = True
    email_replacement: str = "email@example.com"
    ip_replacement: str = "0.0.0.0"
    only_public_ips: bool = True

    def apply(self, doc: Document) -> str:
        return self._formatter.format(doc.text)

    @functools.cached_property
    def _formatter(self):
        from datatrove.pipeline.formatters import PIIFormatter

        return PIIFormatter(only_remove_public_ips=self.only_public_ips, email_replacement=self.email_replacement,
                            ip_replacement=self.ip_replacement)


FILTERS: dict[str, type[Step]] = {cls.name: cls for cls in (
    Language, GopherRepetition, GopherQuality, C4Quality, FineWebQuality, Length, CodeQuality, UrlBlocklist,
    PiiRedaction)}


def parameters(cls: type) -> dict[str, object]:
    """A step's parameter names and defaults."""
    return {f.name: (f.default if f.default is not dataclasses.MISSING else f.default_factory())
            for f in dataclasses.fields(cls)}
