"""MindRecord sources: GPT samples written with MindSpore's FileWriter, read back from several sources.

Conversion (`convert_to_mindrecord`) cuts fixed-length samples of seq_length + 1 tokens from a
Megatron indexed dataset with `GPTDataset` and writes one record per sample: column `input_ids`
(int32), plus MindFormers' compressed-EOD column `actual_seq_len` when asked. A JSON sidecar
`<output>.json` records where the samples came from.

Files are named as MindFormers finds them: its loader (`_get_mindrecord_files`) takes a path ending in
`.mindrecord`, or every file under a directory whose name ends so, and skips anything else; a sharded write
is therefore N independent files `<stem>_<i>.mindrecord`, not MindSpore's `<name>.mindrecord<i>` group.

Reading (`MultiSourceMindRecordDataset`, `build_mindrecord_train_dataset`). MindFormers' PyNative trainer reads a
`MindDataset` section as one `mindspore.dataset.MindDataset` over every file: without `shuffle` (its default)
the records of each file in order, file after file in the order listed. Kiln reads the same records in the same
order then, each `dataset_files` entry a source. Blending the sources by `kiln.mindrecord`'s counts
(`dataset_ratios` × `samples_count`, `nums_per_dataset`, else every source whole; MultiSourceDataLoader's keys
and rules) and the shuffled order are Kiln's own, as MindFormers' PyNative trainer has no multi-source
MindRecord loader: neither flavour of MultiSourceDataLoader is followed. Its "iterator" flavour keeps the source
order and redraws with Python's global `random` every epoch; its "random_access" flavour shuffles the list of
sources once (seeded by train_dataset.seed) and repeats one order every epoch. Kiln keeps the listed order of
sources, interleaves them at fixed proportions within windows of `shuffle_buffer_size` (`multi_source_indices`),
and draws every epoch afresh from (`seed`, epoch), like a shuffled MindDataset, so a run and its resume read the
same samples. Item i is record `sample_index[i]` of source `source_index[i]`. A source with no records is
refused (MindFormers takes 0 samples from it): an empty source is a failed conversion more often than a choice.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
from mindspore.mindrecord import FileReader, FileWriter

from training.atomic import default_mode
from training.data import gpt_dataset
from training.data.gpt_dataset import GPTDataset, split_document_range
from training.data.hashing import sha256_file
from training.data.indexed import IndexedDataset, token_id_fix

logger = logging.getLogger(__name__)

INPUT_IDS = "input_ids"
ACTUAL_SEQ_LEN = "actual_seq_len"
SIDECAR_FORMAT = "kiln.mindrecord_samples"
SIDECAR_VERSION = 1
# MindFormers' defaults: eod_pad_length for actual_seq_len, shuffle_buffer_size for interleaving.
DEFAULT_EOD_PAD_LENGTH = 128
DEFAULT_SHUFFLE_BUFFER_SIZE = 320
# MindFormers accepts ratios that sum to 1 within this tolerance.
_RATIO_SUM_TOLERANCE = 1e-5
# Tokens per block of whole records when checking token ids: bounds the temporary mask (a byte per token).
_CHECK_TOKENS = 1 << 23
# Samples handed to FileWriter per call: large enough to amortize its per-call cost, small enough
# to keep memory flat.
_WRITE_BATCH = 256
# The only file names MindFormers' loader reads (a directory scan keeps these, a named file must be one).
MINDRECORD_SUFFIX = ".mindrecord"
# MindSpore's own shard names, `<name>.mindrecord<N>`: MindFormers skips them, so Kiln refuses them by name.
_MINDSPORE_SHARD = re.compile(r".*\.mindrecord\d+")


# ---- conversion ------------------------------------------------------------------------------


def convert_to_mindrecord(
    source: str | os.PathLike | GPTDataset,
    output_path: str | os.PathLike,
    *,
    seq_length: int,
    eod_id: int,
    num_samples: int | None = None,
    seed: int | None = None,
    split: str | None = None,
    pad_id: int | None = None,
    actual_seq_len: bool = False,
    eod_pad_length: int = DEFAULT_EOD_PAD_LENGTH,
    shard_num: int = 1,
    overwrite: bool = False,
) -> dict:
    """Write `num_samples` samples of `source` to the MindRecord file `output_path`; returns the sidecar.

    `source` is an indexed-dataset prefix, cut into samples by a `GPTDataset` over the training
    split (seed defaults to MindFormers' 1234, split to "1,0,0", pad_id to -1, num_samples to one
    pass over the split), or a ready `GPTDataset` (num_samples defaults to its length; seed,
    split, pad_id and eod_id, when given, must agree with it). Record i holds sample i's
    seq_length + 1 tokens as int32; pad ids are stored as they are and masked when read.

    `output_path` must end in `.mindrecord`, the only name MindFormers' loader reads. With `shard_num` > 1 the
    samples are cut into `shard_num` consecutive runs written as independent files `<stem>_<i>.mindrecord`
    (`i` zero-padded), which read in name order give the samples in order. Each data file gets a `.db` index. Everything is written into a temporary directory next to the output
    and renamed into place, the sidecar `<output_path>.json` last, so a failure leaves no output
    files. An existing output is an error unless `overwrite`.

    Both source files are hashed for the sidecar: a sequential read of the corpus, small next to
    writing 4 bytes per sample token.
    """
    output = _mindrecord_output(output_path)
    dataset = _gpt_dataset_for(source, seq_length=seq_length, eod_id=eod_id, num_samples=num_samples,
                               seed=seed, split=split, pad_id=pad_id)
    count = len(dataset) if num_samples is None else _positive_int("num_samples", num_samples)
    if count > len(dataset):
        raise ValueError(f"num_samples = {count} but the dataset holds only {len(dataset)} samples")
    if actual_seq_len:
        _positive_int("eod_pad_length", eod_pad_length)
    if _positive_int("shard_num", shard_num) > count:
        raise ValueError(f"shard_num = {shard_num} files for {count} samples would leave a file empty")
    existing = _group_files(output)
    if existing and not overwrite:
        raise FileExistsError(f"{output}: already exists ({existing[0].name}); pass overwrite=True to replace it")

    output.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=output.parent, prefix=f".{output.name}.", suffix=".tmp"))
    try:
        for name, samples in zip(shard_names(output.name, shard_num), _consecutive_runs(count, shard_num)):
            _write_samples(dataset, samples, staging / name, eod_pad_length=eod_pad_length if actual_seq_len else None)
        written = sorted(path.name for path in staging.iterdir())
        sidecar = _sidecar(dataset, count, written, actual_seq_len, eod_pad_length)
        (staging / _sidecar_path(output).name).write_text(json.dumps(sidecar, indent=2, sort_keys=True) + "\n")
        _move_into_place(staging, output, written, replaced=existing)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return sidecar


def _mindrecord_output(output_path: str | os.PathLike) -> Path:
    output = Path(output_path)
    if not output.name.endswith(MINDRECORD_SUFFIX) or output.name == MINDRECORD_SUFFIX:
        raise ValueError(f"{output}: a MindRecord output must be named <name>{MINDRECORD_SUFFIX}: MindFormers' "
                         f"loader reads no other name")
    return output


def _gpt_dataset_for(source, *, seq_length, eod_id, num_samples, seed, split, pad_id) -> GPTDataset:
    """The GPTDataset that cuts `source` into samples, checking given options against a ready one."""
    if isinstance(source, GPTDataset):
        given = {"seq_length": seq_length, "eod_id": eod_id, "seed": seed, "split": split, "pad_id": pad_id}
        for name, value in given.items():
            if value is not None and value != getattr(source, name):
                raise ValueError(f"{name} = {value!r} disagrees with the given GPTDataset's {getattr(source, name)!r}")
        return source
    indexed = IndexedDataset(source)
    split = "1,0,0" if split is None else split
    if num_samples is None:
        num_samples = _samples_in_one_pass(indexed, split, _positive_int("seq_length", seq_length))
    return GPTDataset(indexed, seq_length=seq_length, num_samples=num_samples,
                      seed=1234 if seed is None else seed, split=split, split_index=0,
                      eod_id=eod_id, pad_id=-1 if pad_id is None else pad_id)


def _samples_in_one_pass(indexed: IndexedDataset, split: str, seq_length: int) -> int:
    """How many samples one pass over the training split yields (consecutive samples share a token)."""
    begin, end = split_document_range(split, 0, indexed.num_documents)
    tokens = int(indexed.sequence_lengths[begin:end].sum(dtype=np.int64))
    samples = (tokens - 1) // seq_length
    if samples < 1:
        raise ValueError(f"{indexed.prefix}: the training split holds {tokens} tokens, "
                         f"too few for one sample of {seq_length} + 1")
    return samples


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def shard_names(name: str, shard_num: int) -> list[str]:
    """The file names of `name` (`<stem>.mindrecord`) written as `shard_num` files."""
    if shard_num == 1:
        return [name]
    stem, width = name[: -len(MINDRECORD_SUFFIX)], len(str(shard_num - 1))
    return [f"{stem}_{i:0{width}d}{MINDRECORD_SUFFIX}" for i in range(shard_num)]


def _consecutive_runs(count: int, parts: int) -> list[range]:
    bounds = [count * i // parts for i in range(parts + 1)]
    return [range(bounds[i], bounds[i + 1]) for i in range(parts)]


def _group_files(output: Path) -> list[Path]:
    """The files of an existing output at `output` (any shard count, MindSpore's shard names included, each
    with its `.db` index) and its sidecar."""
    if not output.parent.is_dir():
        return []
    stem = re.escape(output.name[: -len(MINDRECORD_SUFFIX)])
    pattern = re.compile(rf"{stem}(_\d+)?\.mindrecord\d*(\.db)?")
    found = [path for path in output.parent.iterdir() if pattern.fullmatch(path.name)]
    sidecar = _sidecar_path(output)
    return sorted(found) + ([sidecar] if sidecar.exists() else [])


def _sidecar_path(output: Path) -> Path:
    return output.with_name(output.name + ".json")


def _write_samples(dataset: GPTDataset, samples: range, file_name: Path, *, eod_pad_length: int | None) -> None:
    """Samples `samples` of `dataset` as one MindRecord file (and its `.db` index)."""
    schema = {INPUT_IDS: {"type": "int32", "shape": [-1]}}
    if eod_pad_length is not None:
        schema[ACTUAL_SEQ_LEN] = {"type": "int32", "shape": [-1]}
    writer = FileWriter(str(file_name), shard_num=1)
    writer.add_schema(schema, "kiln GPT samples")
    for start in range(samples.start, samples.stop, _WRITE_BATCH):
        rows = []
        for index in range(start, min(samples.stop, start + _WRITE_BATCH)):
            tokens = _int32_tokens(dataset.sample_tokens(index), file_name, index)
            row = {INPUT_IDS: tokens}
            if eod_pad_length is not None:
                row[ACTUAL_SEQ_LEN] = _actual_seq_len(tokens, dataset.eod_id, eod_pad_length, file_name, index)
            rows.append(row)
        writer.write_raw_data(rows)
    writer.commit()


def _int32_tokens(tokens: np.ndarray, file_name: Path, index: int) -> np.ndarray:
    converted = tokens.astype(np.int32)
    # An int64 corpus could hold ids that int32 would silently wrap.
    if not np.array_equal(converted, tokens):
        raise ValueError(f"{file_name.name}: sample {index} has token ids outside int32 "
                         f"(min {tokens.min()}, max {tokens.max()})")
    return converted


def _actual_seq_len(tokens: np.ndarray, eod_id: int, eod_pad_length: int, file_name: Path, index: int) -> np.ndarray:
    """MindFormers' compressed-EOD column: the end (index + 1) of every document inside the
    sample's seq_length inputs, an EOD in the last input position excluded, padded with seq_length."""
    seq_length = tokens.size - 1
    ends = np.flatnonzero(tokens[: seq_length - 1] == eod_id) + 1
    if ends.size > eod_pad_length:
        raise ValueError(f"{file_name.name}: sample {index} has {ends.size} document ends, "
                         f"more than eod_pad_length = {eod_pad_length}")
    padded = np.full(eod_pad_length, seq_length, dtype=np.int32)
    padded[: ends.size] = ends
    return padded


def _sidecar(dataset: GPTDataset, count: int, files: list[str], actual_seq_len: bool, eod_pad_length: int) -> dict:
    indexed = dataset.indexed
    sidecar = {
        "format": SIDECAR_FORMAT,
        "version": SIDECAR_VERSION,
        "files": [name for name in files if not name.endswith(".db")],
        "columns": [INPUT_IDS] + ([ACTUAL_SEQ_LEN] if actual_seq_len else []),
        "seq_length": dataset.seq_length,
        "num_samples": count,
        "source": {
            "prefix": str(Path(indexed.prefix).resolve()),
            "bin_sha256": sha256_file(indexed.bin_path),
            "idx_sha256": sha256_file(indexed.idx_path),
            "split": dataset.split,
            "split_index": dataset.split_index,
            "seed": dataset.seed,
            "eod_id": dataset.eod_id,
            "pad_id": dataset.pad_id,
        },
    }
    if actual_seq_len:
        sidecar["eod_pad_length"] = eod_pad_length
    return sidecar


def _move_into_place(staging: Path, output: Path, written: list[str], replaced: list[Path]) -> None:
    """Rename the staged files next to `output`, with the mode the umask gives a new file (MindSpore's FileWriter
    makes its files 0600); the sidecar lands last and marks the output complete."""
    for name in written:
        (staging / name).chmod(default_mode())
        os.replace(staging / name, output.parent / name)
    # Files of a replaced output that the new one does not overwrite (e.g. it had more shards).
    sidecar = _sidecar_path(output)
    for path in replaced:
        if path.name not in written and path != sidecar:
            path.unlink(missing_ok=True)
    os.replace(staging / sidecar.name, sidecar)


# ---- reading ---------------------------------------------------------------------------------


def read_mindrecord_samples(files: str | os.PathLike | Sequence[str | os.PathLike], where: str) -> np.ndarray:
    """Every record's `input_ids` of one source, as an int32 array [records, seq_length + 1].

    `files` is one MindRecord file (MindSpore then reads its whole shard group) or a list of
    files (read exactly those). Records come in MindSpore's read order: shard by shard, each in
    write order, the order MindDataset(shuffle=False) yields. All records are held in memory,
    4 * (seq_length + 1) bytes each. MindSpore offers no cheap random access: MindPage looks
    each record up through the SQLite index (measured 17 records/s at seq_length 128 over 20,000
    records, 93/s at 2048 over 4,000), while one FileReader pass loads 21,000 / 6,000 records/s
    (2 CPU cores), after which any record is a numpy row.
    `where` names the source in errors.
    """
    names = str(files) if isinstance(files, (str, os.PathLike)) else [str(name) for name in files]
    try:
        reader = FileReader(names, num_consumer=1, columns=[INPUT_IDS])
    except RuntimeError as err:
        raise ValueError(f"{where}: cannot read MindRecord {names}: {_mindspore_reason(err)}") from None
    try:
        return _load_input_ids(reader, where)
    except RuntimeError as err:
        raise ValueError(f"{where}: cannot read MindRecord {names}: {_mindspore_reason(err)}") from None
    finally:
        reader.close()


def _load_input_ids(reader: FileReader, where: str) -> np.ndarray:
    column = reader.schema().get(INPUT_IDS, {})
    if column.get("type") != "int32" or column.get("shape") != [-1]:
        raise ValueError(f"{where}: column {INPUT_IDS} must be an int32 array (shape [-1]), got {column}")
    samples = None
    for index, row in enumerate(reader.get_next()):
        tokens = row[INPUT_IDS]
        if samples is None:
            if tokens.size < 2:
                raise ValueError(f"{where}: record 0 holds {tokens.size} tokens; a sample needs at least 2")
            samples = np.empty((reader.len(), tokens.size), dtype=np.int32)
        if tokens.size != samples.shape[1]:
            raise ValueError(f"{where}: record {index} holds {tokens.size} tokens, "
                             f"record 0 holds {samples.shape[1]}; every record must have the same length")
        samples[index] = tokens
    if samples is None:
        raise ValueError(f"{where}: holds no records")
    return samples


def check_token_ids(records: np.ndarray, files: str | Sequence[str], *, vocab_size: int, pad_id: int, where: str,
                    field: str = "model.vocab_size") -> None:
    """Every id of one source's records is in [0, ``vocab_size``) or is ``pad_id`` (pads are stored as they are
    and masked when read), else an error naming the source (``where``, its YAML path), the file and record of
    the first id outside, the largest id and ``field``, before training rather than in the embedding's Gather."""
    first, rows = None, max(1, _CHECK_TOKENS // records.shape[1])
    for start in range(0, len(records), rows):
        block = records[start : start + rows]
        if block.max() < vocab_size and block.min() >= 0:
            continue  # the common case (pads sit only in a last partial sample): no mask built
        outside = ((block >= vocab_size) | (block < 0)) & (block != pad_id)
        if outside.any():
            first = (start, *np.unravel_index(int(np.argmax(outside)), outside.shape))
            break
    if first is None:
        return
    start, row, token = first
    file, record = _file_of_record(files, start + int(row))
    largest = int(records.max())
    fix = token_id_fix(largest, vocab_size, field, f"negative ids other than the pad id ({pad_id}) are never valid")
    raise ValueError(f"{where}: {file}: token ids up to {largest}, but {field} is {vocab_size} (first outside "
                     f"[0, {vocab_size}): {records[start + row, token]} at token {token} of record {record}): {fix}")


def _file_of_record(files: str | Sequence[str], index: int) -> tuple[str, int]:
    """(file, record within it) of record ``index`` of a source read as one (see read_mindrecord_samples).
    A single path is named as given (MindSpore reads its whole shard group); a list is read file by file, in
    its order, so the record counts of the files before the one holding it are subtracted. Error path only."""
    if isinstance(files, str):
        return files, index
    for name in files:
        reader = FileReader(name, num_consumer=1, columns=[INPUT_IDS])
        try:
            count = reader.len()
        finally:
            reader.close()
        if index < count:
            return name, index
        index -= count
    raise IndexError(f"record {index} is beyond the records of {files}")


def _mindspore_reason(err: RuntimeError) -> str:
    """The one informative line of a MindSpore reader error (they carry a long C++ trace)."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    detail = [line for line in lines if line.startswith("[ERROR]")]
    return (detail or lines or ["unknown error"])[0].removeprefix("[ERROR]").strip()


def parse_shuffle(shuffle, where: str = "shuffle") -> tuple[bool, bool]:
    """MultiSourceDataLoader's `shuffle` as (interleave sources randomly, shuffle inside sources).

    True / "global": both; "files": only the interleaving; "infile": only inside sources (the
    sources follow each other in order); False: neither.
    """
    if isinstance(shuffle, bool):
        return shuffle, shuffle
    modes = {"global": (True, True), "files": (True, False), "infile": (False, True)}
    if isinstance(shuffle, str) and shuffle.lower() in modes:
        return modes[shuffle.lower()]
    raise ValueError(f"{where} must be true, false, 'global', 'files' or 'infile', got {shuffle!r}")


def sample_counts(
    sizes: Sequence[int],
    labels: Sequence[str],
    *,
    dataset_ratios: Sequence[float] | None = None,
    samples_count: int | None = None,
    nums_per_dataset: Sequence[int] | None = None,
    where: str = "",
) -> list[int]:
    """Samples to take from each source, MultiSourceDataLoader's rules.

    `dataset_ratios` (non-negative, summing to 1) with `samples_count` > 0 gives
    int(ratio * samples_count) each; `nums_per_dataset` gives the counts outright; neither takes
    every source whole. A count above a source's size is capped to it with a warning. `where` is
    the config path prefix used in errors (e.g. "train_dataset.dataloader.").
    """
    if dataset_ratios is not None and nums_per_dataset is not None:
        raise ValueError(f"{where}dataset_ratios and {where}nums_per_dataset are exclusive; give one")
    if dataset_ratios is not None:
        ratios = _number_list(dataset_ratios, len(sizes), f"{where}dataset_ratios")
        if abs(sum(ratios) - 1.0) > _RATIO_SUM_TOLERANCE:
            raise ValueError(f"{where}dataset_ratios must sum to 1, got {sum(ratios)}")
        if isinstance(samples_count, bool) or not isinstance(samples_count, int) or samples_count <= 0:
            raise ValueError(f"{where}samples_count must be a positive integer with dataset_ratios, "
                             f"got {samples_count!r}")
        requested = [int(ratio * samples_count) for ratio in ratios]
        asked = [f"dataset_ratios[{k}] * samples_count = {ratios[k]} * {samples_count}" for k in range(len(sizes))]
    elif samples_count is not None:
        raise ValueError(f"{where}samples_count is only used with {where}dataset_ratios")
    elif nums_per_dataset is not None:
        requested = _number_list(nums_per_dataset, len(sizes), f"{where}nums_per_dataset", integers=True)
        asked = [f"nums_per_dataset[{k}]" for k in range(len(sizes))]
    else:
        return list(sizes)

    counts = []
    for k, (want, size) in enumerate(zip(requested, sizes)):
        if want > size:
            logger.warning("%s: %s%s asks for %d samples but the source holds %d; taking %d",
                           labels[k], where, asked[k], want, size, size)
        counts.append(min(want, size))
    if sum(counts) == 0:
        raise ValueError(f"{where}dataset_ratios / nums_per_dataset select no samples at all")
    return counts


def _number_list(values, length: int, where: str, integers: bool = False) -> list:
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise ValueError(f"{where} must be a list, got {values!r}")
    if len(values) != length:
        raise ValueError(f"{where} has {len(values)} entries but there are {length} sources")
    kinds = (int, np.integer) if integers else (int, float, np.integer, np.floating)
    for k, value in enumerate(values):
        if isinstance(value, bool) or not isinstance(value, kinds) or not math.isfinite(value) or value < 0:
            kind = "a non-negative integer" if integers else "a non-negative number"
            raise ValueError(f"{where}[{k}] must be {kind}, got {value!r}")
    return [int(v) for v in values] if integers else [float(v) for v in values]


def multi_source_indices(
    counts: Sequence[int],
    sizes: Sequence[int],
    *,
    interleave: bool,
    shuffle_within: bool,
    rng: np.random.Generator,
    shuffle_buffer_size: int = DEFAULT_SHUFFLE_BUFFER_SIZE,
) -> tuple[np.ndarray, np.ndarray]:
    """One epoch's (source_index, sample_index): item i is record sample_index[i] of source source_index[i].

    Interleaving places source k's j-th sample at its ideal time (j + 1/2) / counts[k] (a fixed
    sort order close to, but not the same as, the greedy rule of Megatron's BlendedDataset; per-source
    counts are exact by construction) and, to randomize it, shuffles that order
    within consecutive windows of `shuffle_buffer_size` items (MindFormers draws its source choices
    from a buffer of that size), so every prefix stays within a window of the exact proportions.
    Without interleaving the sources follow each other in order.

    Inside a source, shuffled picks are the first counts[k] of a permutation of the whole source
    (so a partial source is a random subset); otherwise its first counts[k] records in order.
    """
    counts = [int(c) for c in counts]
    source_dtype = np.int16 if len(counts) <= np.iinfo(np.int16).max else np.int32
    sources = np.repeat(np.arange(len(counts), dtype=source_dtype), counts)
    if interleave:
        ideal_time = np.concatenate([(np.arange(c) + 0.5) / c for c in counts if c])
        sources = sources[np.argsort(ideal_time, kind="stable")]
        window = np.arange(sources.size) // shuffle_buffer_size
        sources = sources[np.lexsort((rng.random(sources.size), window))]

    samples = np.empty(sources.size, dtype=np.int64)
    for k, (count, size) in enumerate(zip(counts, sizes)):
        picks = rng.permutation(size)[:count] if shuffle_within else np.arange(count)
        samples[sources == k] = picks
    return sources, samples


def _gpt_sample_item(tokens: np.ndarray, *, pad_id: int) -> dict[str, np.ndarray]:
    """GPTDataset's own sample-to-item conversion, so both readers treat pads and masks alike. No document flag
    is set (MindFormers' MindDataset items carry none), so no end-of-document id is read: -1 matches no token."""
    return gpt_dataset.sample_item(tokens, eod_id=-1, pad_id=pad_id)


class MultiSourceMindRecordDataset(gpt_dataset.SourceIndexedDataset):
    """`num_samples` items drawn from several MindRecord sources by MultiSourceDataLoader's rules.

    `sources` lists each source's files (see `read_mindrecord_samples`); `labels` name them in
    errors and warnings (default: the paths). Per-source counts come from `sample_counts`; one
    epoch holds their sum. Item i is a GPTDataset-style dict (`input_ids`, `labels`, `loss_mask`,
    `position_ids`, seq_length each) made by `to_item` from the record's seq_length + 1 tokens;
    the default is `gpt_dataset.sample_item` with this dataset's pad_id, so both readers
    treat pads identically. `num_samples` beyond one epoch repeats the epoch, each with fresh
    shuffles; every order is a function of `seed` only. With `vocab_size` (the model's), every stored id
    is checked against it once the records are read (`check_token_ids`); they are not read again.

    All records sit in memory (4 * (seq_length + 1) bytes per record): fine for the corpora Kiln
    trains on today; a larger corpus wants a memory-mapped cache instead.
    """

    def __init__(
        self,
        sources: Sequence[str | os.PathLike | Sequence[str | os.PathLike]],
        *,
        pad_id: int,
        seed: int,
        num_samples: int | None = None,
        dataset_ratios: Sequence[float] | None = None,
        samples_count: int | None = None,
        nums_per_dataset: Sequence[int] | None = None,
        shuffle: bool | str = True,
        shuffle_buffer_size: int = DEFAULT_SHUFFLE_BUFFER_SIZE,
        labels: Sequence[str] | None = None,
        where: str = "",
        to_item: Callable[[np.ndarray], dict[str, np.ndarray]] | None = None,
        vocab_size: int | None = None,
    ) -> None:
        if not sources:
            raise ValueError(f"{where}dataset_files: no sources given")
        self.labels = [str(s) for s in sources] if labels is None else list(labels)
        interleave, shuffle_within = parse_shuffle(shuffle, f"{where}shuffle")
        buffer_size = _positive_int(f"{where}shuffle_buffer_size", shuffle_buffer_size)
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
            raise ValueError(f"seed must be a non-negative integer, got {seed!r}")

        self.records = [read_mindrecord_samples(files, label) for files, label in zip(sources, self.labels)]
        for records, files, label in zip(self.records, sources, self.labels) if vocab_size is not None else ():
            check_token_ids(records, files, vocab_size=vocab_size, pad_id=pad_id, where=label)
        widths = {records.shape[1] for records in self.records}
        if len(widths) > 1:
            found = ", ".join(f"{label}: {records.shape[1]}" for label, records in zip(self.labels, self.records))
            raise ValueError(f"sources hold samples of different lengths (seq_length + 1): {found}")
        self.seq_length = widths.pop() - 1
        sizes = [len(records) for records in self.records]
        self.counts = sample_counts(sizes, self.labels, dataset_ratios=dataset_ratios, samples_count=samples_count,
                                    nums_per_dataset=nums_per_dataset, where=where)
        self.epoch_size = sum(self.counts)
        self.size = self.epoch_size if num_samples is None else _positive_int("num_samples", num_samples)

        epochs = []
        for epoch in range(-(-self.size // self.epoch_size)):
            rng = np.random.default_rng([int(seed), epoch])
            epochs.append(multi_source_indices(self.counts, sizes, interleave=interleave,
                                               shuffle_within=shuffle_within, rng=rng,
                                               shuffle_buffer_size=buffer_size))
        self.source_index = np.concatenate([sources for sources, _ in epochs])[: self.size]
        self.sample_index = np.concatenate([samples for _, samples in epochs])[: self.size]
        self.to_item = to_item or functools.partial(_gpt_sample_item, pad_id=pad_id)

    def sample_tokens(self, idx: int) -> np.ndarray:
        """The seq_length + 1 stored tokens behind item `idx`."""
        source, sample = self.locate(idx)
        return self.records[source][sample]

    def __getitem__(self, idx: int) -> dict[str, np.ndarray]:
        return self.to_item(self.sample_tokens(idx))


# ---- YAML ----------------------------------------------------------------------------------

FILES_PATH = "train_dataset.dataloader.dataset_files"
BLEND_PATH = "kiln.mindrecord"


def build_mindrecord_train_dataset(dataset_files, *, shuffle: bool, blend, num_samples: int,
                                   vocab_size: int | None = None) -> MultiSourceMindRecordDataset:
    """The training dataset of a `MindDataset` dataloader: `dataset_files` (its YAML key) read as MindFormers
    finds the files, blended as `blend` (the kiln.mindrecord section: dataset_ratios, samples_count,
    nums_per_dataset, shuffle_buffer_size, seed, pad) says; `shuffle` is the dataloader's.

    `dataset_files` is a path or a list of them, one source each: a file named `*.mindrecord` (read alone), or a
    directory (every `*.mindrecord` under it, recursively, in name order, as one source). Errors name the YAML
    path, e.g. `train_dataset.dataloader.dataset_files[1]: no such file`. With `vocab_size`, a token id outside
    [0, vocab_size) (pads aside) is one, naming the file and record too.
    """
    sources, labels = _resolve_dataset_files(dataset_files, FILES_PATH)
    return MultiSourceMindRecordDataset(
        sources, labels=labels, where=f"{BLEND_PATH}.", pad_id=blend.pad, seed=blend.seed, num_samples=num_samples,
        dataset_ratios=blend.dataset_ratios, samples_count=blend.samples_count,
        nums_per_dataset=blend.nums_per_dataset, shuffle=shuffle, shuffle_buffer_size=blend.shuffle_buffer_size,
        vocab_size=vocab_size)


def _resolve_dataset_files(entries, where: str) -> tuple[list, list[str]]:
    """(files of each source, its YAML path) for `dataset_files`: one path or a list of them."""
    if isinstance(entries, (str, os.PathLike)):
        return [_source_files(entries, where)], [where]
    if not isinstance(entries, list) or not entries:
        raise ValueError(f"{where} must be a path or a non-empty list of paths, got {entries!r}")
    labels = [f"{where}[{i}]" for i in range(len(entries))]
    return [_source_files(entry, label) for entry, label in zip(entries, labels)], labels


def _source_files(entry, where: str) -> list[str]:
    """The files of one `dataset_files` entry, as MindFormers' loader finds them, or an error where it would
    read something else (a file it skips, a directory holding such files)."""
    if not isinstance(entry, (str, os.PathLike)):
        raise ValueError(f"{where}: {entry!r} is not a path")
    path = Path(entry)
    if path.is_file():
        if not path.name.endswith(MINDRECORD_SUFFIX):
            raise ValueError(f"{where}: {path} does not end in {MINDRECORD_SUFFIX}: MindFormers' loader skips it; "
                             f"rename it{_rewrite_hint(path.name)}")
        return [str(path)]
    if not path.is_dir():
        raise ValueError(f"{where}: no such file or directory: {path}")
    found = sorted(p for p in path.rglob("*") if p.is_file())
    skipped = [p.name for p in found if _MINDSPORE_SHARD.fullmatch(p.name)]
    if skipped:
        raise ValueError(f"{where}: {path} holds {', '.join(skipped[:3])}{' ...' if len(skipped) > 3 else ''}, "
                         f"which MindFormers' loader skips (it reads names ending in {MINDRECORD_SUFFIX} only)"
                         f"{_rewrite_hint(skipped[0])}")
    files = [str(p) for p in found if p.name.endswith(MINDRECORD_SUFFIX)]
    if not files:
        raise ValueError(f"{where}: no *{MINDRECORD_SUFFIX} files under {path}")
    return files


def _rewrite_hint(name: str) -> str:
    if _MINDSPORE_SHARD.fullmatch(name):
        return (": a MindSpore shard group; write it again with `kiln mindrecord --shards N`, which names its "
                f"files <name>_<i>{MINDRECORD_SUFFIX}")
    return ""
