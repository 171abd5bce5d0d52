"""GPT pretraining samples over Megatron indexed datasets, following Megatron-core's index logic.

Three index arrays define a `GPTDataset` (numpy only, no compiled helper):

* document index: the split's document ids, repeated once per epoch and shuffled with
  `np.random.RandomState(seed)`; when the last epoch is used for less than 80% of its samples it
  is shuffled separately so its few samples are not all drawn from the front of the order.
* sample index: row j is (position in the document index, token offset) where sample j starts.
  Sample j covers tokens j*S .. j*S + S + e of the stream the document index defines (S =
  seq_length, e = 1 with add_extra_token_to_sequence), so with e = 1 consecutive samples share one
  token: the last label of one is the first input of the next.
* shuffle index: a permutation of the samples (again with the final epoch kept apart).

A `BlendedDataset` interleaves several datasets by weight with Megatron's greedy rule. Both cache
their index arrays on disk, keyed by a hash of everything that determines them.
"""

from __future__ import annotations

import array
import functools
import hashlib
import json
import logging
import math
import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from training.atomic import write_atomic
from training.data.hashing import sha256_file
from training.data.indexed import IndexedDataset, IndexedDatasetError

logger = logging.getLogger(__name__)


class DatasetError(ValueError):
    """A dataset or blend that cannot be built from its input (the files, or the config fields describing them);
    the message names the file or the field."""


# Megatron: a final epoch used for less than this share of its samples is shuffled on its own.
_SEPARATE_FINAL_EPOCH_THRESHOLD = 0.80
# Megatron asks each blended source for this many times its share, so rounding never starves the blend.
_BLEND_SURPLUS = 1.005
# Bump when the way indices are built or cached changes, so old caches stop matching.
_INDEX_FORMAT = 2
_SPLIT_NAMES = ("train", "valid", "test")
# Megatron stores blend sources as int16.
_MAX_SOURCES = np.iinfo(np.int16).max
# The parallel blend builder (see _blending_indices): positions per chain, steps each chain runs from a
# guessed state before its own positions, and the size below which one scalar loop is quicker.
_BLEND_CHUNK = 1024
_BLEND_WARMUP = 256
_BLEND_PARALLEL_MIN_SIZE = 1 << 18


# ---- splits ---------------------------------------------------------------------------------


def parse_split(split: str) -> list[float]:
    """Megatron's `split` string ("train,valid,test" ratios, up to 3) normalized to sum 1."""
    if not isinstance(split, str):
        raise DatasetError(f"split must be a string like '99,1,0', got {split!r}")
    fields = [field.strip() for field in split.split(",")]
    if not 1 <= len(fields) <= 3:
        raise DatasetError(f"split {split!r}: expected 1 to 3 comma-separated ratios, got {len(fields)}")
    try:
        ratios = [float(field) for field in fields]
    except ValueError:
        raise DatasetError(f"split {split!r}: every ratio must be a number") from None
    if any(not math.isfinite(r) or r < 0 for r in ratios) or sum(ratios) <= 0:
        raise DatasetError(f"split {split!r}: ratios must be finite, non-negative and not all zero")
    return _normalize(ratios + [0.0] * (3 - len(ratios)))


def split_document_range(split: str, split_index: int, num_documents: int) -> tuple[int, int]:
    """[begin, end) documents of split `split_index` (0 train, 1 valid, 2 test), as Megatron rounds them."""
    if split_index not in (0, 1, 2):
        raise DatasetError(f"split_index must be 0 (train), 1 (valid) or 2 (test), got {split_index!r}")
    bookends = [0.0]
    for ratio in parse_split(split):
        bookends.append(bookends[-1] + ratio)
    begin = int(round(bookends[split_index] * float(num_documents)))
    end = int(round(bookends[split_index + 1] * float(num_documents)))
    return begin, end


def _normalize(weights: Sequence[float]) -> list[float]:
    """Weights divided by their sum the way Megatron does it (numpy float64), for bit-identical blends."""
    values = np.array(weights, dtype=np.float64)
    return (values / np.sum(values)).tolist()


# ---- argument checks ------------------------------------------------------------------------


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
        raise DatasetError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def _integer(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise DatasetError(f"{name} must be an integer, got {value!r}")
    return int(value)


def _flag(name: str, value) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise DatasetError(f"{name} must be true or false, got {value!r}")
    return bool(value)


# ---- index cache ----------------------------------------------------------------------------


def _canonical(description) -> str:
    return json.dumps(description, sort_keys=True)


def _cached_indices(cache_dir: str | os.PathLike | None, kind: str, description: dict, names: Sequence[str],
                    build: Callable[[], Sequence[np.ndarray]]) -> tuple[list[np.ndarray], bool]:
    """Index arrays from the cache entry for `description`, else built and cached.

    An entry is `<sha256 of description>-<kind>-<name>.npy` per array plus
    `<sha256>-<kind>-description.json`, written last, holding the description and each array
    file's sha256. An entry whose description differs or whose files do not match their sums is
    rebuilt, not trusted. Returns the arrays and whether they came from the cache.
    """
    if cache_dir is None:
        return list(build()), False
    directory = Path(cache_dir)
    directory.mkdir(parents=True, exist_ok=True)
    stem = f"{hashlib.sha256(_canonical(description).encode('utf-8')).hexdigest()}-{kind}"
    manifest_path = directory / f"{stem}-description.json"
    paths = [directory / f"{stem}-{name}.npy" for name in names]

    arrays = _load_cached(manifest_path, paths, description)
    if arrays is not None:
        return arrays, True
    arrays = list(build())
    for path, values in zip(paths, arrays):
        write_atomic(path, lambda stream, values=values: np.save(stream, values, allow_pickle=False))
    manifest = {"description": description, "sha256": {path.name: sha256_file(path) for path in paths}}
    text = json.dumps(manifest, indent=2, sort_keys=True) + "\n"
    write_atomic(manifest_path, lambda stream: stream.write(text.encode("utf-8")))
    return arrays, False


def _load_cached(manifest_path: Path, paths: Sequence[Path], description: dict) -> list[np.ndarray] | None:
    """The cached arrays, or None (with a warning when an entry exists but cannot be trusted)."""
    if not manifest_path.is_file():
        return None
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        logger.warning("%s: unreadable index cache description (%s); rebuilding", manifest_path, err)
        return None
    if not isinstance(manifest, dict) or _canonical(manifest.get("description")) != _canonical(description):
        logger.warning("%s: index cache describes other indices; rebuilding", manifest_path)
        return None
    sums = manifest.get("sha256")
    for path in paths:
        if not path.is_file() or not isinstance(sums, dict) or sha256_file(path) != sums.get(path.name):
            logger.warning("%s: index cache file is missing or corrupt; rebuilding", path)
            return None
    return [np.load(path, allow_pickle=False) for path in paths]


# ---- GPTDataset index building ----------------------------------------------------------------


def _build_document_index(documents: np.ndarray, num_epochs: int, random_state: np.random.RandomState,
                          separate_final_epoch: bool) -> np.ndarray:
    """`documents` once per epoch, shuffled; the final epoch shuffled on its own if asked (int32)."""
    if not separate_final_epoch or num_epochs == 1:
        index = np.tile(documents.astype(np.int32), num_epochs)
        random_state.shuffle(index)
        return index
    return np.concatenate((_build_document_index(documents, num_epochs - 1, random_state, False),
                           _build_document_index(documents, 1, random_state, False)))


def _build_sample_index(sequence_lengths: np.ndarray, document_index: np.ndarray, seq_length: int,
                        drop_last_partial_sequence: bool, extra_token: int) -> np.ndarray:
    """Megatron's build_sample_idx, vectorized: [samples + 1, 2] rows of (document index position, offset).

    Megatron walks the documents sample by sample, each sample taking seq_length + extra_token
    tokens and the next one starting seq_length tokens later. Its stopping rule puts boundary
    j*S in the first document whose end reaches past token j*S + extra_token - 1, so a document
    ending exactly at a boundary is kept when extra_token is 0 (offset = its length) and left
    behind when it is 1; searchsorted on the documents' cumulative ends finds that document for
    every boundary at once. Row 0 is always (0, 0). A last partial sequence, when kept, ends at the
    last document's length - extra_token, as Megatron's loop leaves it (as do any rows its
    single-precision count of samples adds past the end).
    """
    lengths = sequence_lengths[document_index].astype(np.int64)
    ends = np.cumsum(lengths)
    usable = int(ends[-1]) - extra_token
    if drop_last_partial_sequence:
        num_samples = usable // seq_length
    else:
        # As helpers.cpp counts them: ceil(float(usable) / seq_length) in single precision, so past
        # 2**24 tokens the rounding can drop (or add) the last partial sample just as in Megatron.
        num_samples = int(np.ceil(np.float32(usable) / np.float32(seq_length)))
    boundaries = np.arange(1, num_samples + 1, dtype=np.int64) * seq_length
    positions = np.searchsorted(ends, boundaries + (extra_token - 1), side="right")
    past_end = positions == ends.size
    positions[past_end] = ends.size - 1
    offsets = boundaries - (ends[positions] - lengths[positions])
    offsets[past_end] = lengths[-1] - extra_token

    dtype = np.int32 if document_index.size <= np.iinfo(np.int32).max else np.int64
    index = np.zeros((num_samples + 1, 2), dtype=dtype)
    index[1:, 0] = positions
    index[1:, 1] = offsets
    return index


def _build_shuffle_index(first_part: int, total: int, random_state: np.random.RandomState) -> np.ndarray:
    """Permutation of range(total) with [0, first_part) and [first_part, total) shuffled apart."""
    dtype = np.uint32 if total < np.iinfo(np.uint32).max - 1 else np.int64
    head = np.arange(first_part, dtype=dtype)
    random_state.shuffle(head)
    if first_part == total:
        return head
    tail = np.arange(first_part, total, dtype=dtype)
    random_state.shuffle(tail)
    return np.concatenate((head, tail))


# ---- sample items ---------------------------------------------------------------------------


@dataclass(frozen=True)
class SampleFormat:
    """How a sample's tokens become a training item (Megatron's `_get_ltor_masks_and_position_ids`).

    Items hold `input_ids`, `labels` (int32), `loss_mask` (float32) and `position_ids` (int32),
    seq_length each, then either `actual_seq_len` (int32 [eod_pad_length], with
    create_compressed_eod_mask, which wins) or `attention_mask` (int32 [1, S, S], 1 = masked; with
    create_attention_mask). Documents end at EOD tokens of the inputs: eod_mask_loss zeroes the
    loss there, reset_position_ids restarts positions after each, reset_attention_mask makes the
    mask block-diagonal (causal within a document). Labels equal to pad_id are not learned, and pad
    ids are replaced by 0 so the embedding never sees them (pad_id may be -1).
    """

    eod_id: int
    pad_id: int = -1
    add_extra_token_to_sequence: bool = True
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    eod_mask_loss: bool = False
    create_attention_mask: bool = False
    create_compressed_eod_mask: bool = False
    eod_pad_length: int = 128

    def __post_init__(self) -> None:
        _integer("eod_id", self.eod_id)
        _integer("pad_id", self.pad_id)
        for name in ("add_extra_token_to_sequence", "reset_position_ids", "reset_attention_mask",
                     "eod_mask_loss", "create_attention_mask", "create_compressed_eod_mask"):
            _flag(name, getattr(self, name))
        _positive_int("eod_pad_length", self.eod_pad_length)

    def item(self, tokens: np.ndarray, where: str = "sample") -> dict[str, np.ndarray]:
        """The item for a sample's seq_length + 1 tokens (seq_length without the extra token)."""
        text = np.asarray(tokens)
        if self.add_extra_token_to_sequence:
            inputs, labels = text[:-1].astype(np.int32), text[1:].astype(np.int32)
        else:
            inputs = text.astype(np.int32)
            labels = np.append(text[1:], self.pad_id).astype(np.int32)
        size = inputs.size
        eods = inputs == self.eod_id

        loss_mask = np.ones(size, dtype=np.float32)
        if self.eod_mask_loss:
            loss_mask[eods] = 0.0
        position_ids = np.arange(size, dtype=np.int32)
        if self.reset_position_ids:
            position_ids -= _document_starts(eods)
        extra = {}
        if self.create_compressed_eod_mask:
            extra["actual_seq_len"] = _actual_seq_len(eods, self.eod_pad_length, where)
        elif self.create_attention_mask:
            extra["attention_mask"] = (_block_causal_mask(_document_starts(eods)) if self.reset_attention_mask
                                       else _causal_mask(size))

        loss_mask[labels == self.pad_id] = 0.0
        inputs[inputs == self.pad_id] = 0
        labels[labels == self.pad_id] = 0
        return {"input_ids": inputs, "labels": labels, "loss_mask": loss_mask, "position_ids": position_ids,
                **extra}


def sample_item(tokens: np.ndarray, *, eod_id: int, pad_id: int = -1, **options) -> dict[str, np.ndarray]:
    """The training item for a sample's tokens; `options` are SampleFormat's (all off by default)."""
    return SampleFormat(eod_id=eod_id, pad_id=pad_id, **options).item(tokens)


def _document_starts(eods: np.ndarray) -> np.ndarray:
    """For each position, where its document starts: one past the last EOD before it (0 if none)."""
    starts = np.zeros(eods.size, dtype=np.int32)
    after_eod = np.flatnonzero(eods[:-1]) + 1
    starts[after_eod] = after_eod
    return np.maximum.accumulate(starts)


@functools.lru_cache(maxsize=4)
def _causal_mask(size: int) -> np.ndarray:
    """[1, size, size] int32, 1 above the diagonal; shared between items, so read-only."""
    mask = np.triu(np.ones((1, size, size), dtype=np.int32), k=1)
    mask.flags.writeable = False
    return mask


def _block_causal_mask(document_starts: np.ndarray) -> np.ndarray:
    """Causal mask that also hides every earlier document from a position (1 = masked)."""
    columns = np.arange(document_starts.size)
    masked = (columns[None, :] > columns[:, None]) | (columns[None, :] < document_starts[:, None])
    return masked.astype(np.int32)[None]


def block_causal_mask_from_actual_seq_len(actual_seq_len: np.ndarray, size: int) -> np.ndarray:
    """The [1, size, size] mask (1 = masked) that a compressed EOD mask stands for: causal within each
    document, documents ending at the listed positions (padding entries equal `size`)."""
    ends = np.asarray(actual_seq_len)
    ends = ends[ends < size]
    starts = np.zeros(size, dtype=np.int32)
    starts[ends] = ends
    return _block_causal_mask(np.maximum.accumulate(starts))


def _actual_seq_len(eods: np.ndarray, eod_pad_length: int, where: str) -> np.ndarray:
    """End (index + 1) of each document inside the sample, an EOD in the last position excluded,
    right-padded with the sequence length: MindFormers' compressed EOD mask."""
    ends = np.flatnonzero(eods[:-1]) + 1
    if ends.size > eod_pad_length:
        raise DatasetError(f"{where} has {ends.size} document ends, more than eod_pad_length = {eod_pad_length}")
    padded = np.full(eod_pad_length, eods.size, dtype=np.int32)
    padded[: ends.size] = ends
    return padded


# ---- GPTDataset -----------------------------------------------------------------------------


class GPTDataset:
    """Samples of `seq_length` tokens from one split of an indexed dataset, as Megatron-core cuts them.

    The index covers enough whole epochs for `num_samples` samples (one epoch if None), and
    `len()` is every sample it holds, as in Megatron: at least `num_samples`. Items are
    `SampleFormat` dicts; `sample_options` are SampleFormat's fields besides eod_id and pad_id
    (`add_extra_token_to_sequence`, `reset_position_ids`, `reset_attention_mask`,
    `eod_mask_loss`, `create_attention_mask`, `create_compressed_eod_mask`, `eod_pad_length`).
    `drop_last_partial_validation_sequence` applies to the valid split only (split_index 1); the
    others always drop a last partial sample. With `cache_dir` the index arrays are cached there.
    """

    def __init__(
        self,
        indexed: IndexedDataset,
        *,
        seq_length: int,
        num_samples: int | None,
        seed: int,
        eod_id: int,
        split: str = "1,0,0",
        split_index: int = 0,
        pad_id: int = -1,
        cache_dir: str | os.PathLike | None = None,
        drop_last_partial_validation_sequence: bool = True,
        vocab_size: int | None = None,
        **sample_options,
    ) -> None:
        self.indexed = indexed
        self.vocab_size = vocab_size  # when set, every sample's ids are checked against it as it is read
        self.seq_length = _positive_int("seq_length", seq_length)
        self.num_samples = None if num_samples is None else _positive_int("num_samples", num_samples)
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or not 0 <= seed < 2**32:
            raise DatasetError(f"seed must be an integer in [0, 2**32), got {seed!r}")
        self.seed = int(seed)
        self.format = SampleFormat(eod_id=eod_id, pad_id=pad_id, **sample_options)
        self.split = split
        self.split_index = split_index
        drop_last_partial = _flag("drop_last_partial_validation_sequence", drop_last_partial_validation_sequence)
        self.drop_last_partial_sequence = drop_last_partial or split_index != 1
        if indexed.num_documents != len(indexed):
            raise DatasetError(
                f"{indexed.prefix}: {indexed.num_documents} documents but {len(indexed)} sequences; "
                "GPTDataset needs one sequence per document"
            )
        self.document_begin, self.document_end = split_document_range(split, split_index, indexed.num_documents)
        if indexed.num_documents == 0:
            raise DatasetError(f"{indexed.prefix}: holds no documents (an empty .bin/.idx pair): tokenize data into it, "
                               f"or take it out of the blend")
        if self.document_end <= self.document_begin:
            raise DatasetError(
                f"{indexed.prefix}: split {split!r} gives split_index {split_index} no documents "
                f"(of {indexed.num_documents})"
            )
        lengths = indexed.sequence_lengths[self.document_begin : self.document_end]
        self.tokens_per_epoch = int(lengths.sum(dtype=np.int64))
        # Samples may span epochs, so a short split only fails when it must supply one epoch.
        if self.tokens_per_epoch == 0 or (
                num_samples is None and self.tokens_per_epoch < self.seq_length + self._extra_token):
            raise DatasetError(
                f"{indexed.prefix}: split {split_index} holds {self.tokens_per_epoch} tokens, too few for one "
                f"sample of seq_length {self.seq_length}"
            )
        self.num_epochs = self._num_epochs()
        self.separate_final_epoch = self._separate_final_epoch()
        self._load_or_build_indices(cache_dir, lengths)

    def _load_or_build_indices(self, cache_dir: str | os.PathLike | None, lengths: np.ndarray) -> None:
        """The document, sample and shuffle indices: from ``cache_dir`` when it holds them for exactly this
        dataset (``description``), else built (and cached)."""
        self.description = {
            "class": "GPTDataset",
            "index_format": _INDEX_FORMAT,
            "sequence_lengths_sha256": hashlib.sha256(np.ascontiguousarray(lengths)).hexdigest(),
            "documents": [self.document_begin, self.document_end],
            "seq_length": self.seq_length,
            "num_samples": self.num_samples,
            "seed": self.seed,
            "add_extra_token_to_sequence": self.format.add_extra_token_to_sequence,
            "drop_last_partial_sequence": self.drop_last_partial_sequence,
        }
        indices, self.loaded_from_cache = _cached_indices(
            cache_dir, f"GPTDataset-{_SPLIT_NAMES[self.split_index]}", self.description,
            ("document_index", "sample_index", "shuffle_index"), self._build_indices)
        self.document_index, self.sample_index, self.shuffle_index = indices

    @property
    def eod_id(self) -> int:
        return self.format.eod_id

    @property
    def pad_id(self) -> int:
        return self.format.pad_id

    @property
    def _extra_token(self) -> int:
        return int(self.format.add_extra_token_to_sequence)

    def _num_epochs(self) -> int:
        if self.num_samples is None:
            return 1
        needed = self.num_samples * self.seq_length + self._extra_token
        return max(1, -(-needed // self.tokens_per_epoch))

    def _samples_before_final_epoch(self) -> int:
        return ((self.num_epochs - 1) * self.tokens_per_epoch - self._extra_token) // self.seq_length

    def _separate_final_epoch(self) -> bool:
        """Megatron's rule: the final epoch stands apart when it supplies under 80% of an epoch's samples."""
        if self.num_epochs == 1:
            return False
        from_final_epoch = self.num_samples - self._samples_before_final_epoch()
        per_epoch = (self.tokens_per_epoch - self._extra_token) // self.seq_length
        return from_final_epoch < int(_SEPARATE_FINAL_EPOCH_THRESHOLD * per_epoch)

    def _build_indices(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        started = time.perf_counter()
        # One generator for both shuffles, document index first, as in Megatron.
        random_state = np.random.RandomState(self.seed)
        documents = np.arange(self.document_begin, self.document_end, dtype=np.int32)
        document_index = _build_document_index(documents, self.num_epochs, random_state, self.separate_final_epoch)
        sample_index = _build_sample_index(self.indexed.sequence_lengths, document_index, self.seq_length,
                                           self.drop_last_partial_sequence, self._extra_token)
        total = sample_index.shape[0] - 1
        first_part = self._samples_before_final_epoch() if self.separate_final_epoch else total
        shuffle_index = _build_shuffle_index(first_part, total, random_state)
        logger.info("%s: built the GPTDataset index (%d samples, %d epochs) in %.2f s",
                    self.indexed.prefix, total, self.num_epochs, time.perf_counter() - started)
        return document_index, sample_index, shuffle_index

    def __len__(self) -> int:
        return self.sample_index.shape[0] - 1

    def sample_tokens(self, idx: int) -> np.ndarray:
        """The seq_length + 1 tokens (seq_length without the extra token) of sample `idx`, after
        shuffling; a last partial sample is padded with pad_id."""
        if not 0 <= idx < len(self):
            raise IndexError(f"{self.indexed.prefix}: sample {idx} out of range [0, {len(self)})")
        sample = int(self.shuffle_index[idx])
        begin_position, begin_offset = (int(v) for v in self.sample_index[sample])
        end_position, end_offset = (int(v) for v in self.sample_index[sample + 1])
        get, documents, extra = self.indexed.get, self.document_index, self._extra_token
        if begin_position == end_position:
            parts = [get(int(documents[begin_position]), begin_offset, end_offset - begin_offset + extra)]
        else:
            parts = [get(int(documents[begin_position]), begin_offset)]
            parts += [get(document) for document in documents[begin_position + 1 : end_position].tolist()]
            parts.append(get(int(documents[end_position]), 0, end_offset + extra))
        tokens = np.concatenate(parts, dtype=np.int64)
        if self.vocab_size is not None and (tokens.max() >= self.vocab_size or tokens.min() < 0):
            bad = tokens[(tokens >= self.vocab_size) | (tokens < 0)][0]
            raise IndexedDatasetError(
                f"{self.indexed.bin_path}: sample {idx} holds token id {bad}, outside [0, {self.vocab_size}) "
                f"(model.vocab_size), though every id was inside when the dataset was built: the file changed "
                f"since (compare it with the blend manifest's sha256: kiln audit)")
        missing = self.seq_length + extra - tokens.size
        if missing > 0:
            tokens = np.append(tokens, np.full(missing, self.pad_id, dtype=np.int64))
        return tokens

    def __getitem__(self, idx: int) -> dict[str, np.ndarray]:
        return self.format.item(self.sample_tokens(idx), where=f"{self.indexed.prefix}: sample {idx}")


# ---- blending -------------------------------------------------------------------------------


def _greedy_steps(weights: Sequence[float], start: int, counts: list[int],
                  steps: int) -> tuple[np.ndarray, np.ndarray]:
    """Megatron's build_blending_indices from position `start`, `counts` samples already taken
    (updated in place): position i goes to the source with the largest weight * max(i, 1) - count,
    the lowest index winning a tie. Plain Python floats give the C++ helper's double arithmetic.
    Returns each position's source and its sample number within that source."""
    sources, numbers = array.array("h", bytes(2 * steps)), array.array("q", bytes(8 * steps))
    first_weight, others = weights[0], list(enumerate(weights))[1:]
    for i in range(start, start + steps):
        t = i if i > 1 else 1
        best, best_error = 0, first_weight * t - counts[0]
        for source, weight in others:
            error = weight * t - counts[source]
            if error > best_error:
                best, best_error = source, error
        sources[i - start], numbers[i - start] = best, counts[best]
        counts[best] += 1
    return np.frombuffer(sources, dtype=np.int16), np.frombuffer(numbers, dtype=np.int64)


def _guessed_counts(weights: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """[sources, positions]: counts summing to each position, as close to weight * position as
    possible (largest remainders round up): a plausible state of the greedy there."""
    quotas = weights[:, None] * positions[None, :].astype(np.float64)
    counts = np.floor(quotas)
    short = positions - counts.sum(axis=0)
    ranks = np.argsort(np.argsort(counts - quotas, axis=0, kind="stable"), axis=0, kind="stable")
    return counts + (ranks < short[None, :])


def _blending_indices(weights: Sequence[float], size: int, chunk: int = _BLEND_CHUNK,
                      warmup: int = _BLEND_WARMUP) -> tuple[np.ndarray, np.ndarray]:
    """(dataset_index int16, dataset_sample_index int64) under Megatron's greedy rule, exactly,
    without a Python loop over positions.

    The positions are cut into chunks and numpy steps through all chunks together: chunk 0 from
    the true start, every other one from a guessed state `warmup` positions before it. The greedy
    forgets its past within a few dozen steps, so a chunk's state on reaching its first position
    almost always equals the true one, i.e. the previous chunk's final state; the rule being
    deterministic, equal states give equal futures, which makes that check exact. A chunk that
    fails it is redone from the true state with the scalar loop. Needs chunk >= warmup.
    """
    num_sources = len(weights)
    if num_sources == 1:
        return np.zeros(size, dtype=np.int16), np.arange(size, dtype=np.int64)
    if size < max(_BLEND_PARALLEL_MIN_SIZE, 2 * chunk):
        return _greedy_steps(weights, 0, [0] * num_sources, size)

    weight_column = np.asarray(weights, dtype=np.float64)[:, None]
    starts = np.arange(0, size, chunk)
    begins = np.maximum(starts - warmup, 0)
    chains = np.arange(starts.size)
    counts = _guessed_counts(weight_column[:, 0], begins)  # [source, chain], float64 like the C++ helper
    source_column = np.arange(num_sources)[:, None]
    position = begins.astype(np.float64)
    sources = np.empty((warmup + chunk, starts.size), dtype=np.int16)
    numbers = np.empty((warmup + chunk, starts.size), dtype=np.int64)
    states = {}
    for step in range(warmup + chunk):
        if step in (warmup, chunk):
            states[step] = counts.copy()
        errors = weight_column * np.maximum(position, 1.0)
        errors -= counts
        # argmax over the few sources, a strict > so the lowest index wins ties as in Megatron
        best, best_error = np.zeros(starts.size, dtype=np.intp), errors[0]
        for source in range(1, num_sources):
            best[errors[source] > best_error] = source
            best_error = np.maximum(best_error, errors[source])
        sources[step] = best
        numbers[step] = counts[best, chains]
        counts += best == source_column
        position += 1.0
    states.setdefault(chunk, counts)  # without warm-up, chunk 0 ends when the loop does

    # Chunk 0 starts at position 0 (no warm-up); the others start `warmup` steps into their run.
    def by_position(per_step: np.ndarray) -> np.ndarray:
        return np.concatenate((per_step[:chunk, 0], per_step[warmup:, 1:].T.ravel()))[:size]

    dataset_index, dataset_sample_index = by_position(sources), by_position(numbers)
    true_state = states[chunk][:, 0]
    for c in range(1, starts.size):
        if np.array_equal(states[warmup][:, c], true_state):
            true_state = counts[:, c]
            continue
        replayed = true_state.astype(np.int64).tolist()
        begin, end = int(starts[c]), min(int(starts[c]) + chunk, size)
        dataset_index[begin:end], dataset_sample_index[begin:end] = _greedy_steps(weights, begin, replayed,
                                                                                 end - begin)
        true_state = np.array(replayed, dtype=np.float64)
    return dataset_index, dataset_sample_index


def _exhaustive_blending_indices(lengths: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """Megatron's build_exhaustive_blending_indices: every sample of every source exactly once, by the
    greedy rule with weights length / total, a source leaving the race once it is used up.

    Until the first source is used up this is the weighted greedy, which keeps every source within
    one sample of its share, so only the last few positions need the scalar loop with exclusions."""
    total = int(sum(lengths))
    weights = [length / total for length in lengths]
    dataset_index, dataset_sample_index = _blending_indices(weights, total)
    over = np.flatnonzero(dataset_sample_index >= np.asarray(lengths, dtype=np.int64)[dataset_index])
    if over.size == 0:
        return dataset_index, dataset_sample_index
    first = int(over[0])
    counts = np.bincount(dataset_index[:first], minlength=len(lengths)).tolist()
    for i in range(first, total):
        t = max(float(i), 1.0)
        best = max((k for k in range(len(lengths)) if counts[k] < lengths[k]),
                   key=lambda k: (weights[k] * t - counts[k], -k))
        dataset_index[i], dataset_sample_index[i] = best, counts[best]
        counts[best] += 1
    return dataset_index, dataset_sample_index


class SourceIndexedDataset:
    """Items drawn from several sources: item i is sample `sample_index[i]` of source `source_index[i]`.

    Subclasses set `source_index`, `sample_index` (one entry per item) and `size`, and say how a
    source's sample becomes tokens (`sample_tokens`) and a training item (`__getitem__`)."""

    source_index: np.ndarray
    sample_index: np.ndarray
    size: int

    def __len__(self) -> int:
        return self.size

    def locate(self, idx: int) -> tuple[int, int]:
        """(source, sample within that source) of item `idx`."""
        if not 0 <= idx < self.size:
            raise IndexError(f"sample {idx} out of range [0, {self.size})")
        return int(self.source_index[idx]), int(self.sample_index[idx])

    def source_of(self, idx: int) -> int:
        """Which source item `idx` comes from."""
        return self.locate(idx)[0]


class BlendedDataset(SourceIndexedDataset):
    """`size` samples drawn from `datasets` in proportion to `weights`, as Megatron's BlendedDataset.

    Sample i is sample `sample_index[i]` of dataset `source_index[i]`; each source's
    samples are taken in order, so a source is read exactly as far as its share requires. Position
    i goes to the source furthest behind its share, weight * max(i, 1) - samples taken so far
    (Megatron's greedy rule, max(i, 1) included); items carry their source as `dataset_id`.
    With `weights` and `size` None, every sample of every dataset is taken once, by the same rule
    with weights proportional to the datasets' lengths among the sources not yet used up
    (Megatron's exhaustive blend, for a blend list without weights).
    """

    def __init__(
        self,
        datasets: Sequence,
        weights: Sequence[float] | None,
        size: int | None,
        *,
        cache_dir: str | os.PathLike | None = None,
    ) -> None:
        if not datasets:
            raise DatasetError("a blend needs at least one dataset")
        if len(datasets) > _MAX_SOURCES:
            raise DatasetError(f"at most {_MAX_SOURCES} datasets can be blended, got {len(datasets)}")
        self.datasets = list(datasets)
        if weights is None:
            if size is not None:
                raise DatasetError(f"an exhaustive blend (weights None) takes every sample: size must be None, got {size}")
            lengths = [len(d) for d in self.datasets]
            self.weights, self.size = _normalize(lengths), sum(lengths)
            description = {"class": "BlendedDataset", "index_format": _INDEX_FORMAT, "exhaustive": lengths}
            build = functools.partial(_exhaustive_blending_indices, lengths)
        else:
            if len(datasets) != len(weights):
                raise DatasetError(f"need one weight per dataset, got {len(datasets)} datasets and {len(weights)} weights")
            try:
                values = [float(w) for w in weights]
            except (TypeError, ValueError):
                raise DatasetError(f"weights must be numbers, got {list(weights)}") from None
            if any(not math.isfinite(w) or w < 0 for w in values) or sum(values) <= 0:
                raise DatasetError(f"weights must be finite, non-negative and not all zero, got {values}")
            self.weights = _normalize(values)
            self.size = _positive_int("size", size)
            # The greedy index depends on the weights and the size only.
            description = {"class": "BlendedDataset", "index_format": _INDEX_FORMAT, "weights": self.weights,
                           "size": self.size}
            build = functools.partial(_blending_indices, self.weights, self.size)

        indices, self.loaded_from_cache = _cached_indices(
            cache_dir, "BlendedDataset", description, ("dataset_index", "dataset_sample_index"), build)
        self.source_index, self.sample_index = indices

        needed = np.bincount(self.source_index, minlength=len(self.datasets))
        for source, (count, dataset) in enumerate(zip(needed, self.datasets)):
            if count > len(dataset):
                raise DatasetError(f"blend source {source} must supply {count} samples but has only {len(dataset)}")

    def sample_tokens(self, idx: int) -> np.ndarray:
        """The raw tokens behind item `idx` (see GPTDataset.sample_tokens)."""
        source, sample = self.locate(idx)
        return self.datasets[source].sample_tokens(sample)

    def __getitem__(self, idx: int) -> dict:
        source, sample = self.locate(idx)
        item = self.datasets[source][sample]
        item["dataset_id"] = source
        return item


# ---- Megatron blend lists -------------------------------------------------------------------


def _as_weight(entry) -> float | None:
    """`entry` as a blend weight, or None when it is not a number (bools are not numbers)."""
    if isinstance(entry, bool):
        return None
    try:
        return float(entry)
    except (TypeError, ValueError):
        return None


def parse_data_path(data_path: Sequence, where: str = "data_path") -> tuple[list[str], list[float] | None]:
    """Megatron's blend list as (prefixes, weights), weights None for a list of prefixes only.

    As Megatron's get_blend_from_list: an odd-length list is prefixes only; an even-length one is
    `[weight, prefix, weight, prefix, ...]` when every even entry is a number (or numeric string),
    prefixes only when none is, and an error when only some are. Weights must be positive; both
    files of every prefix must exist. Errors name the entry as `where[i]`.
    """
    if isinstance(data_path, (str, bytes)) or not isinstance(data_path, Sequence):
        raise DatasetError(f"{where} must be a list [weight, prefix, ...] or [prefix, ...], "
                         f"got {type(data_path).__name__}")
    if not data_path:
        raise DatasetError(f"{where} is empty: name at least one dataset prefix")
    weights: list[float] | None = None
    prefixes = list(data_path)
    if len(data_path) % 2 == 0:
        raw = [_as_weight(entry) for entry in data_path[0::2]]
        if all(w is not None for w in raw):
            weights, prefixes = raw, list(data_path[1::2])
        elif any(w is not None for w in raw):
            bad = next(i for i, w in zip(range(0, len(data_path), 2), raw) if w is None)
            raise DatasetError(f"{where}[{bad}]: weight {data_path[bad]!r} is not a number (the list mixes "
                             "[weight, prefix] pairs with bare prefixes)")
    step = 1 if weights is None else 2
    for k, weight in enumerate(weights or []):
        if not math.isfinite(weight) or weight <= 0:
            raise DatasetError(f"{where}[{2 * k}]: weight {data_path[2 * k]!r} must be a positive number")
    for k, prefix in enumerate(prefixes):
        index = k * step + step - 1
        if not isinstance(prefix, (str, os.PathLike)):
            raise DatasetError(f"{where}[{index}]: prefix {prefix!r} is not a path")
        for suffix in (".bin", ".idx"):
            if not Path(f"{prefix}{suffix}").is_file():
                raise DatasetError(f"{where}[{index}]: {prefix}{suffix} not found")
    return [str(prefix).strip() for prefix in prefixes], weights


class MockIndexedDataset:
    """Megatron-core's mock low-level dataset, for trying training without data (`mock: true`).

    100,000 documents with lengths drawn by `numpy.random.default_rng(0)` from [1, 4096); document
    d holds the tokens 1, 2, ..., length - 1 and then the eod id. Token ids reach 4094, so the
    model's vocabulary must hold at least 4,095 ids (plus the eod id).
    """

    SIZE = 100_000
    MAX_SEQUENCE_LENGTH = 4096
    prefix = "mock"

    def __init__(self, eod_id: int) -> None:
        self.eod_id = _integer("eod_id", eod_id)
        self.sequence_lengths = np.random.default_rng(0).integers(1, self.MAX_SEQUENCE_LENGTH, size=self.SIZE,
                                                                  dtype=np.int32)

    def __len__(self) -> int:
        return self.SIZE

    @property
    def num_documents(self) -> int:
        return self.SIZE

    def get(self, idx: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        full = int(self.sequence_lengths[idx])
        length = full - offset if length is None else length
        tokens = np.arange(offset + 1, offset + length + 1, dtype=np.int64)
        if length and offset + length == full:
            tokens[-1] = self.eod_id
        return tokens


def _blend_sources(data_path: Sequence | None, eod_id: int, mmap_bin: bool, where: str, vocab_size: int | None
                   ) -> tuple[list, list | None]:
    """The blend's sources and weights (None: unweighted), each source's token ids checked below ``vocab_size``
    when given; ``data_path`` None is one mock source."""
    if data_path is None:
        return [MockIndexedDataset(eod_id)], None
    prefixes, weights = parse_data_path(data_path, where)
    sources = [IndexedDataset(prefix, mmap_bin=mmap_bin) for prefix in prefixes]
    for source in sources if vocab_size is not None else ():
        try:
            source.check_token_ids(vocab_size, "model.vocab_size")
        except IndexedDatasetError as exc:
            raise IndexedDatasetError(f"{where}: {exc}") from None
    return sources, weights


def build_blended_dataset(
    data_path: Sequence | None,
    *,
    seq_length: int,
    num_samples: int,
    seed: int,
    split: str,
    eod_id: int,
    pad_id: int = -1,
    cache_dir: str | os.PathLike | None = None,
    split_index: int = 0,
    builder_threads: int = 1,
    mmap_bin: bool = True,
    where: str = "data_path",
    vocab_size: int | None = None,
    **options,
) -> BlendedDataset:
    """Split `split_index` (0 train, 1 valid, 2 test) of a Megatron blend, one GPTDataset per source,
    at least `num_samples` samples long.

    As MindFormers' BlendedMegatronDatasetBuilder: with weights, source k is asked for
    ceil(num_samples * weight_k * 1.005) samples and the blend is as long as all those requests
    together, marginally more than `num_samples` (the greedy order of its first positions does not
    depend on its length). Without weights, one source is asked for `num_samples`, and several are
    each read for one epoch and blended exhaustively, in proportion to their sizes. `data_path`
    None is Megatron's mock data (MockIndexedDataset). With `vocab_size`, every token id of every source is
    checked to be below it first, and each sample again as it is read. The per-source datasets are built by
    `builder_threads` threads (num_dataset_builder_threads); `mmap_bin` memory-maps the .bin files
    (mmap_bin_files), else tokens are read from them per sample. `options` are GPTDataset's further
    keyword options; errors about the list name it as `where`.
    """
    num_samples = _positive_int("num_samples", num_samples)
    sources, weights = _blend_sources(data_path, eod_id, mmap_bin, where, vocab_size)
    if weights is not None:
        weights = _normalize(weights)
        sizes = [math.ceil(num_samples * weight * _BLEND_SURPLUS) for weight in weights]
    else:
        sizes = [num_samples] if len(sources) == 1 else [None] * len(sources)

    def build(source, size) -> GPTDataset:
        return GPTDataset(source, seq_length=seq_length, num_samples=size, seed=seed, split=split,
                          split_index=split_index, eod_id=eod_id, pad_id=pad_id, cache_dir=cache_dir,
                          vocab_size=None if data_path is None else vocab_size, **options)

    with ThreadPoolExecutor(_positive_int("builder_threads", builder_threads)) as pool:
        datasets = list(pool.map(build, sources, sizes))
    if weights is None and len(datasets) > 1:
        blend = BlendedDataset(datasets, None, None, cache_dir=cache_dir)
        if len(blend) < num_samples:
            raise DatasetError(f"{where}: the unweighted blend holds {len(blend)} samples (one epoch of every "
                             f"source) but {num_samples} are needed; give weights to repeat sources")
        return blend
    return BlendedDataset(datasets, weights or [1.0], sum(sizes), cache_dir=cache_dir)
