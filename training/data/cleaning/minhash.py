"""MinHash signatures and exact-duplicate keys, as DataTrove computes them (datatrove/pipeline/dedup/minhash.py).

A document's shingles are the xxHash64 values of its word n-grams (UTF-8) after ``simplify_text``; its signature is, per
hash function k, min over shingles of (a_k * shingle + b_k) mod (2^61 - 1) in 64-bit arithmetic, with a and b
drawn by NumPy's RandomState(seed) exactly as DataTrove draws them. So a signature here equals DataTrove's for
the same text and settings, bit for bit (benchmarks/cleaning.py measures the pairs both flag). datasketch's
MinHash has no scheme that gives these values (its 64-bit scheme permutes mod 2^64 after a pre-mix, its legacy
one truncates to 32 bits), and a different hash family flags a different ~10% of the pairs near the threshold.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import xxhash

MERSENNE_PRIME = np.uint64((1 << 61) - 1)
NO_SHINGLES = np.iinfo(np.uint64).max  # a document of fewer words than an n-gram: its signature row, never a match
_BLOCK = 4096  # shingles per block: a long document's shingles x hashes matrix stays a few MB


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


@lru_cache(maxsize=8)
def permutations(settings: MinHashSettings) -> tuple[np.ndarray, np.ndarray]:
    gen = np.random.RandomState(settings.seed)
    a = gen.randint(1, MERSENNE_PRIME, dtype=np.uint64, size=(1, settings.num_hashes))
    b = gen.randint(0, MERSENNE_PRIME, dtype=np.uint64, size=(1, settings.num_hashes))
    return a, b


def shingles(normalized: str, n: int) -> np.ndarray:
    """xxHash64 of each word n-gram of already simplified text, as a (count, 1) uint64 column."""
    words = normalized.split(" ") if normalized else []
    grams = [" ".join(words[i:i + n]).encode() for i in range(len(words) - n + 1)]
    return np.fromiter(map(xxhash.xxh64_intdigest, grams), dtype=np.uint64, count=len(grams)).reshape(-1, 1)


def signature(normalized: str, settings: MinHashSettings) -> np.ndarray:
    """The document's num_hashes minimum hash values (all NO_SHINGLES when it has no n-gram)."""
    hashed = shingles(normalized, settings.n_grams)
    out = np.full(settings.num_hashes, NO_SHINGLES, dtype=np.uint64)
    a, b = permutations(settings)
    with np.errstate(over="ignore"):  # DataTrove's arithmetic wraps at 2^64 the same way
        for start in range(0, len(hashed), _BLOCK):
            block = (hashed[start:start + _BLOCK] * a + b) % MERSENNE_PRIME
            np.minimum(out, block.min(axis=0), out=out)
    return out


def exact_key(normalized: str) -> tuple[int, int]:
    """128-bit xxHash3 of the normalized text, as two uint64: equal for documents equal after normalization."""
    digest = xxhash.xxh3_128_intdigest(normalized.encode())
    return digest >> 64, digest & 0xFFFF_FFFF_FFFF_FFFF
