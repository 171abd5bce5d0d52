"""GPT pretraining samples over Megatron indexed datasets, following Megatron-core's index logic.

Three index arrays define a `GPTDataset` (numpy only, no compiled helper):

* document index: the split's document ids, repeated once per epoch and shuffled with
  `np.random.RandomState(seed)`; when the last epoch is used for less than 80% of its samples it
  is shuffled separately so its few samples are not all drawn from the front of the order.
* sample index: for each sample boundary, (position in the document index, token offset). Sample
  j covers tokens j*S .. (j+1)*S of the stream the document index defines, S+1 tokens in all, so
  consecutive samples share one token (the last label of one is the first input of the next).
* shuffle index: a permutation of the samples (again with the final epoch kept apart).

A `BlendedDataset` interleaves several datasets by weight.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from training.data.hashing import sha256_file
from training.data.indexed import IndexedDataset

logger = logging.getLogger(__name__)

# Megatron: a final epoch used for less than this share of its samples is shuffled on its own.
_SEPARATE_FINAL_EPOCH_THRESHOLD = 0.80
# Megatron asks each blended source for this many times its share, so rounding never starves the blend.
_BLEND_SURPLUS = 1.005
# Bump when the way indices are built changes, so old caches stop matching.
_INDEX_FORMAT = 1


def parse_split(split: str) -> list[float]:
    """Megatron's `split` string ("train,valid,test" ratios, up to 3) normalized to sum 1."""
    if not isinstance(split, str):
        raise ValueError(f"split must be a string like '99,1,0', got {split!r}")
    fields = [field.strip() for field in split.split(",")]
    if not 1 <= len(fields) <= 3:
        raise ValueError(f"split {split!r}: expected 1 to 3 comma-separated ratios, got {len(fields)}")
    try:
        ratios = [float(field) for field in fields]
    except ValueError:
        raise ValueError(f"split {split!r}: every ratio must be a number") from None
    if any(not math.isfinite(r) or r < 0 for r in ratios) or sum(ratios) <= 0:
        raise ValueError(f"split {split!r}: ratios must be finite, non-negative and not all zero")
    ratios += [0.0] * (3 - len(ratios))
    total = sum(ratios)
    return [r / total for r in ratios]


def split_document_range(split: str, split_index: int, num_documents: int) -> tuple[int, int]:
    """[begin, end) documents of split `split_index` (0 train, 1 valid, 2 test), as Megatron rounds them."""
    if split_index not in (0, 1, 2):
        raise ValueError(f"split_index must be 0 (train), 1 (valid) or 2 (test), got {split_index!r}")
    bookends = [0.0]
    for ratio in parse_split(split):
        bookends.append(bookends[-1] + ratio)
    begin = int(round(bookends[split_index] * float(num_documents)))
    end = int(round(bookends[split_index + 1] * float(num_documents)))
    return begin, end


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def _save_npy(path: Path, values: np.ndarray) -> None:
    """np.save through a temporary name, so a crash never leaves a truncated cache file."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as stream:
            np.save(stream, values, allow_pickle=False)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _save_text(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as stream:
            stream.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _load_npy(paths: Sequence[Path]) -> list[np.ndarray] | None:
    """The arrays, or None when any file is missing or unreadable (the caller rebuilds)."""
    if not all(path.is_file() for path in paths):
        return None
    try:
        return [np.load(path, allow_pickle=False) for path in paths]
    except (OSError, ValueError, EOFError) as err:
        logger.warning("index cache %s is unreadable (%s); rebuilding", paths[0].parent, err)
        return None


def _cache_paths(cache_dir: str | os.PathLike, description: str, kind: str, names: Sequence[str]) -> list[Path]:
    directory = Path(cache_dir)
    directory.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256(description.encode("utf-8")).hexdigest()
    description_path = directory / f"{digest}-{kind}-description.json"
    if not description_path.is_file():
        _save_text(description_path, description)
    return [directory / f"{digest}-{kind}-{name}.npy" for name in names]


def _cached_indices(cache_dir: str | os.PathLike | None, description: str, kind: str, names: Sequence[str],
                    build: Callable[[], Sequence[np.ndarray]],
                    is_consistent: Callable[..., bool]) -> tuple[Sequence[np.ndarray], bool]:
    """Index arrays from the cache keyed by `description`, else built (and cached); a cache entry that
    fails `is_consistent` is rebuilt, not trusted. Returns the arrays and whether they came from the cache."""
    if cache_dir is None:
        return build(), False
    cache_paths = _cache_paths(cache_dir, description, kind, names)
    indices = _load_npy(cache_paths)
    if indices is not None:
        if is_consistent(*indices):
            return indices, True
        logger.warning("%s cache %s is inconsistent with its description; rebuilding", kind, cache_paths[0])
    indices = build()
    for path, values in zip(cache_paths, indices):
        _save_npy(path, values)
    return indices, False


class GPTDataset:
    """`num_samples` samples of `seq_length` tokens from one split of an indexed dataset.

    Each item is a dict of numpy arrays of length `seq_length`: `input_ids`, `labels` (input_ids
    shifted by one), `position_ids` (int32) and `loss_mask` (float32, 0 where the label is
    `pad_id`). As in Megatron, pad ids in input_ids/labels are replaced by 0. `eod_id` is kept
    for consumers that reset positions or masks at document ends.
    """

    def __init__(
        self,
        indexed: IndexedDataset,
        *,
        seq_length: int,
        num_samples: int,
        seed: int,
        split: str = "1,0,0",
        split_index: int = 0,
        eod_id: int,
        pad_id: int = -1,
        cache_dir: str | os.PathLike | None = None,
    ) -> None:
        self.indexed = indexed
        self.seq_length = _positive_int("seq_length", seq_length)
        self.num_samples = _positive_int("num_samples", num_samples)
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or not 0 <= seed < 2**32:
            raise ValueError(f"seed must be an integer in [0, 2**32), got {seed!r}")
        self.seed = int(seed)
        self.eod_id = int(eod_id)
        self.pad_id = int(pad_id)
        if indexed.num_documents != len(indexed):
            raise ValueError(
                f"{indexed.prefix}: {indexed.num_documents} documents but {len(indexed)} sequences; "
                "GPTDataset needs one sequence per document"
            )
        self.split = split
        self.split_index = split_index
        self.document_begin, self.document_end = split_document_range(split, split_index, indexed.num_documents)
        if self.document_end <= self.document_begin:
            raise ValueError(
                f"{indexed.prefix}: split {split!r} gives split_index {split_index} no documents "
                f"(of {indexed.num_documents})"
            )
        self.tokens_per_epoch = int(
            indexed.sequence_lengths[self.document_begin : self.document_end].sum(dtype=np.int64)
        )
        if self.tokens_per_epoch < 2:
            raise ValueError(
                f"{indexed.prefix}: split {split_index} holds {self.tokens_per_epoch} tokens; a sample needs at least 2"
            )
        self.num_epochs = self._num_epochs()

        self.description = json.dumps(
            {
                "class": "GPTDataset",
                "index_format": _INDEX_FORMAT,
                "prefix": str(Path(indexed.prefix).resolve()),
                "idx_sha256": sha256_file(indexed.idx_path),
                "idx_bytes": indexed.idx_path.stat().st_size,
                "seq_length": self.seq_length,
                "num_samples": self.num_samples,
                "seed": self.seed,
                "split": parse_split(split),
                "split_index": split_index,
            },
            sort_keys=True,
        )
        indices, self.loaded_from_cache = _cached_indices(
            cache_dir, self.description, "GPTDataset", ("document_index", "sample_index", "shuffle_index"),
            build=self._build_indices, is_consistent=self._indices_are_consistent)
        self.document_index, self.sample_index, self.shuffle_index = indices

    def _num_epochs(self) -> int:
        # Each sample reads seq_length + 1 tokens and shares one with the next.
        needed = self.num_samples * self.seq_length + 1
        return max(1, -(-needed // self.tokens_per_epoch))

    def _samples_in_index(self) -> int:
        return (self.num_epochs * self.tokens_per_epoch - 1) // self.seq_length

    def _build_indices(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        S, epochs, per_epoch = self.seq_length, self.num_epochs, self.tokens_per_epoch
        separate_final_epoch = False
        if epochs > 1:
            samples_before_final = ((epochs - 1) * per_epoch - 1) // S
            samples_from_final = self.num_samples - samples_before_final
            samples_per_epoch = (per_epoch - 1) // S
            separate_final_epoch = samples_from_final < int(_SEPARATE_FINAL_EPOCH_THRESHOLD * samples_per_epoch)

        random_state = np.random.RandomState(self.seed)
        documents = np.arange(self.document_begin, self.document_end, dtype=np.int32)
        if separate_final_epoch:
            document_index = np.concatenate(
                (_shuffled_epochs(documents, epochs - 1, random_state), _shuffled_epochs(documents, 1, random_state))
            )
        else:
            document_index = _shuffled_epochs(documents, epochs, random_state)

        # Sample boundaries are every S-th token of the stream; searchsorted maps each to the
        # document containing it (side="right" steps past a document that ends exactly there).
        lengths = self.indexed.sequence_lengths[document_index].astype(np.int64)
        ends = np.cumsum(lengths)
        total_samples = self._samples_in_index()
        boundaries = np.arange(total_samples + 1, dtype=np.int64) * S
        positions = np.searchsorted(ends, boundaries, side="right")
        offsets = boundaries - (ends[positions] - lengths[positions])
        fits_int32 = max(int(ends[-1]), document_index.size) <= np.iinfo(np.int32).max
        sample_index = np.stack((positions, offsets), axis=1).astype(np.int32 if fits_int32 else np.int64)

        if separate_final_epoch:
            shuffle_index = _shuffled_range(samples_before_final, total_samples, random_state)
        else:
            shuffle_index = _shuffled_range(total_samples, total_samples, random_state)
        return document_index, sample_index, shuffle_index

    def _indices_are_consistent(self, document_index, sample_index, shuffle_index) -> bool:
        """Structural check of cached arrays, so a damaged cache is rebuilt instead of misread."""
        total_samples = self._samples_in_index()
        documents = self.document_end - self.document_begin
        return bool(
            document_index.shape == (self.num_epochs * documents,)
            and np.issubdtype(document_index.dtype, np.integer)
            and document_index.min() >= self.document_begin
            and document_index.max() < self.document_end
            and sample_index.shape == (total_samples + 1, 2)
            and np.issubdtype(sample_index.dtype, np.integer)
            and sample_index.min() >= 0
            and sample_index[:, 0].max() < document_index.size
            and shuffle_index.shape == (total_samples,)
            and np.issubdtype(shuffle_index.dtype, np.integer)
            and np.array_equal(np.sort(shuffle_index), np.arange(total_samples))
        )

    def __len__(self) -> int:
        return self.num_samples

    def sample_tokens(self, idx: int) -> np.ndarray:
        """The seq_length + 1 tokens of sample `idx` (after shuffling)."""
        if not 0 <= idx < self.num_samples:
            raise IndexError(f"sample {idx} out of range [0, {self.num_samples})")
        sample = int(self.shuffle_index[idx])
        begin_position, begin_offset = (int(v) for v in self.sample_index[sample])
        end_position, end_offset = (int(v) for v in self.sample_index[sample + 1])
        get = self.indexed.get
        if begin_position == end_position:
            return get(int(self.document_index[begin_position]), begin_offset, end_offset - begin_offset + 1)
        parts = [get(int(self.document_index[begin_position]), begin_offset)]
        parts += [get(int(document)) for document in self.document_index[begin_position + 1 : end_position]]
        parts.append(get(int(self.document_index[end_position]), 0, end_offset + 1))
        return np.concatenate(parts)

    def __getitem__(self, idx: int) -> dict[str, np.ndarray]:
        tokens = self.sample_tokens(idx).astype(np.int64)
        input_ids, labels = tokens[:-1].copy(), tokens[1:].copy()
        loss_mask = np.ones(self.seq_length, dtype=np.float32)
        loss_mask[labels == self.pad_id] = 0.0
        # A pad id may be outside the vocabulary (-1); never feed it to the embedding.
        input_ids[input_ids == self.pad_id] = 0
        labels[labels == self.pad_id] = 0
        return {
            "input_ids": input_ids.astype(np.int32),
            "labels": labels.astype(np.int32),
            "loss_mask": loss_mask,
            "position_ids": np.arange(self.seq_length, dtype=np.int32),
        }


def _shuffled_epochs(documents: np.ndarray, epochs: int, random_state: np.random.RandomState) -> np.ndarray:
    index = np.tile(documents, epochs)
    random_state.shuffle(index)
    return index


def _shuffled_range(first_part: int, total: int, random_state: np.random.RandomState) -> np.ndarray:
    """Permutation of range(total) with [0, first_part) and [first_part, total) shuffled apart."""
    dtype = np.uint32 if total < np.iinfo(np.uint32).max - 1 else np.int64
    head = np.arange(first_part, dtype=dtype)
    random_state.shuffle(head)
    if first_part == total:
        return head
    tail = np.arange(first_part, total, dtype=dtype)
    random_state.shuffle(tail)
    return np.concatenate((head, tail))


def _blending_indices(weights: Sequence[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """Greedy blend: sample i goes to the source furthest behind its share, weight*(i+1) - count."""
    counts = [0] * len(weights)
    chosen = [0] * size
    within = [0] * size
    for i in range(size):
        target = i + 1
        best, best_error = 0, weights[0] * target - counts[0]
        for source in range(1, len(weights)):
            error = weights[source] * target - counts[source]
            if error > best_error:
                best, best_error = source, error
        chosen[i] = best
        within[i] = counts[best]
        counts[best] += 1
    return np.array(chosen, dtype=np.int16), np.array(within, dtype=np.int64)


class BlendedDataset:
    """`size` samples drawn from `datasets` in proportion to `weights`.

    Sample i is sample `dataset_sample_index[i]` of dataset `dataset_index[i]`; each source's
    samples are taken in order, so a source is read exactly as far as its share requires.
    """

    def __init__(
        self,
        datasets: Sequence,
        weights: Sequence[float],
        size: int,
        seed: int,
        cache_dir: str | os.PathLike | None = None,
    ) -> None:
        if not datasets or len(datasets) != len(weights):
            raise ValueError(f"need one weight per dataset, got {len(datasets)} datasets and {len(weights)} weights")
        if len(datasets) > np.iinfo(np.int16).max:
            raise ValueError(f"at most {np.iinfo(np.int16).max} datasets can be blended, got {len(datasets)}")
        weights = [float(w) for w in weights]
        if any(not math.isfinite(w) or w < 0 for w in weights) or sum(weights) <= 0:
            raise ValueError(f"weights must be finite, non-negative and not all zero, got {weights}")
        total = sum(weights)
        self.datasets = list(datasets)
        self.weights = [w / total for w in weights]
        self.size = _positive_int("size", size)
        self.seed = seed

        # The greedy index depends on the weights and size only; the seed is part of the blend's
        # identity as in Megatron, whose blend cache is keyed on it too.
        description = json.dumps(
            {"class": "BlendedDataset", "index_format": _INDEX_FORMAT, "weights": self.weights,
             "size": self.size, "seed": seed},
            sort_keys=True,
        )
        indices, self.loaded_from_cache = _cached_indices(
            cache_dir, description, "BlendedDataset", ("dataset_index", "dataset_sample_index"),
            build=lambda: _blending_indices(self.weights, self.size), is_consistent=self._indices_are_consistent)
        self.dataset_index, self.dataset_sample_index = indices

        needed = np.bincount(self.dataset_index, minlength=len(self.datasets))
        for source, (count, dataset) in enumerate(zip(needed, self.datasets)):
            if count > len(dataset):
                raise ValueError(f"blend source {source} must supply {count} samples but has only {len(dataset)}")

    def _indices_are_consistent(self, dataset_index: np.ndarray, dataset_sample_index: np.ndarray) -> bool:
        if dataset_index.shape != (self.size,) or dataset_sample_index.shape != (self.size,):
            return False
        if not np.issubdtype(dataset_index.dtype, np.integer) or not np.issubdtype(dataset_sample_index.dtype, np.integer):
            return False
        if dataset_index.min() < 0 or dataset_index.max() >= len(self.datasets):
            return False
        # Every source's samples must be 0, 1, 2, ... in order of use.
        for source in range(len(self.datasets)):
            taken = dataset_sample_index[dataset_index == source]
            if not np.array_equal(taken, np.arange(taken.size)):
                return False
        return True

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, idx: int) -> dict[str, np.ndarray]:
        if not 0 <= idx < self.size:
            raise IndexError(f"sample {idx} out of range [0, {self.size})")
        return self.datasets[int(self.dataset_index[idx])][int(self.dataset_sample_index[idx])]


def parse_data_path(data_path: Sequence) -> list[tuple[float, str]]:
    """Megatron's flat blend list `[weight, prefix, weight, prefix, ...]` as (weight, prefix) pairs.

    Weights may be numbers or numeric strings and must be positive; both files of every prefix
    must exist. Errors name the offending entry by its index in the list.
    """
    if isinstance(data_path, (str, bytes)) or not isinstance(data_path, Sequence):
        raise ValueError(f"data_path must be a list [weight, prefix, ...], got {type(data_path).__name__}")
    if not data_path or len(data_path) % 2:
        raise ValueError(f"data_path must hold weight, prefix pairs; got {len(data_path)} entries")
    pairs = []
    for i in range(0, len(data_path), 2):
        raw_weight, prefix = data_path[i], data_path[i + 1]
        try:
            if isinstance(raw_weight, bool):
                raise ValueError
            weight = float(raw_weight)
        except (TypeError, ValueError):
            raise ValueError(f"data_path[{i}]: weight {raw_weight!r} is not a number") from None
        if not math.isfinite(weight) or weight <= 0:
            raise ValueError(f"data_path[{i}]: weight {raw_weight!r} must be a positive number")
        if not isinstance(prefix, (str, os.PathLike)):
            raise ValueError(f"data_path[{i + 1}]: prefix {prefix!r} is not a path")
        for suffix in (".bin", ".idx"):
            if not Path(f"{prefix}{suffix}").is_file():
                raise ValueError(f"data_path[{i + 1}]: {prefix}{suffix} not found")
        pairs.append((weight, str(prefix)))
    return pairs


def build_blended_train_dataset(
    data_path: Sequence,
    *,
    seq_length: int,
    num_samples: int,
    seed: int,
    split: str,
    eod_id: int,
    pad_id: int = -1,
    cache_dir: str | os.PathLike | None = None,
) -> BlendedDataset:
    """The training split of a Megatron blend: one GPTDataset per source, blended by weight."""
    pairs = parse_data_path(data_path)
    num_samples = _positive_int("num_samples", num_samples)
    total = sum(weight for weight, _ in pairs)
    datasets = [
        GPTDataset(
            IndexedDataset(prefix),
            seq_length=seq_length,
            num_samples=math.ceil(num_samples * (weight / total) * _BLEND_SURPLUS),
            seed=seed,
            split=split,
            split_index=0,
            eod_id=eod_id,
            pad_id=pad_id,
            cache_dir=cache_dir,
        )
        for weight, prefix in pairs
    ]
    return BlendedDataset(datasets, [weight for weight, _ in pairs], num_samples, seed, cache_dir=cache_dir)
