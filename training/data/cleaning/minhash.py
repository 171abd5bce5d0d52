"""MinHash signatures by DataTrove's own code (datatrove 0.3.0, its last release that takes numpy<2, which
MindSpore needs), and the exact-duplicate keys.

A signature is DataTrove's ``MinhashDedupSignature``: shingles are the xxHash64 values of the word n-grams of the
normalized text (DataTrove's ``simplify_text``, text.py), and per hash function k the minimum of
(a_k * shingle + b_k) mod (2^61 - 1), a and b drawn by its seeded generator. One part is not DataTrove's English
default: its word tokenizer for English is NLTK's, whose punkt sentence model NLTK downloads on first use (offline
it raises LookupError 'punkt_tab'). Normalized text has no punctuation left, so its words are what the spaces
separate; that tokenizer is registered with DataTrove under a name of its own (``SIMPLIFIED``), the English one is
left as it is. The text is normalized once by the caller (its exact key and decontamination read it too), so the
signature stage's own normalization is switched off in its config instead of being run twice.

The duplicate buckets and clusters are Kiln's (dedup.py), not DataTrove's stages 2 and 3: those merge every
signature through a Python heap and cluster in one task (measured on 22,000 generated documents: 3.2 CPU-s vs
0.30 for dedup.py's sorted bands, load ~6-9), and 0.3.0's clusters record no sizes.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import xxhash

NO_SHINGLES = np.iinfo(np.uint64).max  # a document of fewer words than an n-gram: its signature row, never a match
SIMPLIFIED = "kiln_simplified_text"    # the word tokenizer's name in DataTrove's registry
_BLOCK = 4096  # shingles per call: a long document's shingles x hashes matrix stays a few MB


@dataclass(frozen=True)
class MinHashSettings:
    """FineWeb's: word 5-grams, 14 bands of 8 hashes, 64-bit; `seed` as DataTrove's MinhashConfig."""
    n_grams: int = 5
    bands: int = 14
    rows: int = 8
    seed: int = 1

    @property
    def num_hashes(self) -> int:
        return self.bands * self.rows


def _register_tokenizer() -> None:
    from datatrove.utils import word_tokenizers

    class SimplifiedTextWords(word_tokenizers.WordTokenizer):
        """Words of text ``simplify_text`` made (punctuation gone, whitespace single spaces)."""

        def word_tokenize(self, text: str) -> list[str]:
            return text.split()

        def sent_tokenize(self, text: str) -> list[str]:
            return [text]

        def span_tokenize(self, text: str) -> list[tuple[int, int]]:
            return [(0, len(text))]

    word_tokenizers.WORD_TOKENIZER_FACTORY.setdefault(SIMPLIFIED, SimplifiedTextWords)


@lru_cache(maxsize=8)
def signature_stage(settings: MinHashSettings):
    """DataTrove's signature stage at ``settings``, for its shingles and signatures (its ``run`` is not used: the
    signatures go to Kiln's per-chunk files)."""
    from datatrove.pipeline.dedup.minhash import MinhashConfig, MinhashDedupSignature
    from datatrove.utils.text import TextNormConfig

    _register_tokenizer()
    already_normalized = TextNormConfig(lowercase=False, norm_whitespace=False, remove_punctuation=False,
                                        norm_unicode_diacritics=False, norm_numbers=False)
    config = MinhashConfig(n_grams=settings.n_grams, num_buckets=settings.bands, hashes_per_bucket=settings.rows,
                           seed=settings.seed, norm_config=already_normalized)
    # the output folder is where its run() would write; nothing is written there
    return MinhashDedupSignature(output_folder="/nonexistent", config=config, language=SIMPLIFIED)


def signature(normalized: str, settings: MinHashSettings) -> np.ndarray:
    """The document's num_hashes minimum hash values (all NO_SHINGLES when it has no n-gram)."""
    stage = signature_stage(settings)
    shingles = stage.get_shingles(normalized)
    out = np.full(settings.num_hashes, NO_SHINGLES, dtype=np.uint64)
    for start in range(0, len(shingles), _BLOCK):
        block = np.asarray(stage.get_signature(shingles[start:start + _BLOCK]), dtype=np.uint64).ravel()
        np.minimum(out, block, out=out)
    return out


def exact_key(normalized: str) -> tuple[int, int]:
    """128-bit xxHash3 of the normalized text, as two uint64: equal for documents equal after normalization."""
    digest = xxhash.xxh3_128_intdigest(normalized.encode())
    return digest >> 64, digest & 0xFFFF_FFFF_FFFF_FFFF
