"""Raw corpus files -> Megatron `.bin/.idx` datasets, tokenized with sentencepiece.

The same function serves the `token_shards` asset and the `kiln preprocess` command. Work is cut
into tasks of a few hundred KB: a JSONL file into byte ranges of whole lines that a worker reads,
parses and tokenizes by itself; JSON arrays and Parquet files are read here (streamed) and their
texts handed over in chunks. Results are written in task order, so the output bytes do not depend
on the number of workers, and only a few tasks per worker are in flight, so memory does not depend
on the corpus size.

The workers are forked processes, each with its own copy of the model. Threads would share one
interpreter: sentencepiece releases the GIL while it encodes, but JSON parsing and the numpy array
it makes per document do not, and on short documents that cost 10-15%: on 42 MB of English prose
(BPE 8k, 2 cores) threads reached 0.86 of bare sentencepiece in one process per core, forked
workers 1.0 (the bare encoding's own threads, 0.9). Forking costs milliseconds (spawning would cost
an interpreter and the imports, ~0.25 s per worker), and only the results travel back: the token
ids in the file's dtype, 2 bytes per token for most vocabularies.
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import time
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from pathlib import Path

import sentencepiece

from training.data.corpus import (
    BadRecords,
    CorpusError,
    Rejection,
    check_on_bad_line,
    file_format,
    iter_records,
    jsonl_ranges,
    normalize_keys,
)
from training.data.encoding import HISTOGRAM_BUCKETS, Encoded, Encoder, EncoderSpec, JsonlRange, load_sentencepiece
from training.data.indexed import IndexedDatasetWriter, dtype_for_vocab

# Task size: about 16 tasks per worker keeps every worker busy to the end; the bounds keep the
# per-task overhead small and a task's memory modest.
MIN_CHUNK_BYTES = 256 * 1024
MAX_CHUNK_BYTES = 16 * 1024 * 1024
TASKS_PER_WORKER = 16
IN_FLIGHT_PER_WORKER = 3


def output_prefix_for(output_prefix: str | os.PathLike, key: str, shard: int | None = None) -> Path:
    """`<output_prefix>_<key>_document`, Megatron's preprocess_data.py naming, plus `_<shard:05d>`
    when the output is split into shards."""
    name = f"{output_prefix}_{key}_document"
    return Path(name if shard is None else f"{name}_{shard:05d}")


@dataclass
class _Task:
    path: Path
    work: JsonlRange | list[tuple[str, ...]]
    rejections: list[Rejection] = field(default_factory=list)  # found while reading here (not JSONL)
    fatal: CorpusError | None = None  # the file cannot be read past this task


class _ShardedStream:
    """The documents of one json key: one `.bin/.idx` pair, or numbered shards of at most
    `max_tokens` tokens each (a document is never split; one longer than the limit gets a shard
    of its own). Every shard stays under a temporary name until `commit()`."""

    def __init__(self, output_prefix: str | os.PathLike, key: str, dtype, max_tokens: int | None) -> None:
        self.output_prefix, self.key, self.dtype, self.max_tokens = output_prefix, key, dtype, max_tokens
        self.writers: list[IndexedDatasetWriter] = []
        self._open_next()

    def _open_next(self) -> None:
        shard = None if self.max_tokens is None else len(self.writers)
        self.writers.append(IndexedDatasetWriter(output_prefix_for(self.output_prefix, self.key, shard), self.dtype))

    def add(self, lengths, tokens) -> None:
        current = self.writers[-1]
        if self.max_tokens is None:
            current.add_documents(lengths, tokens)
            return
        first = offset = taken = 0
        room = self.max_tokens - current.num_tokens
        for i, length in enumerate(lengths.tolist()):
            if taken + length > room and (i > first or current.num_documents):
                if i > first:
                    current.add_documents(lengths[first:i], tokens[offset:offset + taken])
                current.close()
                self._open_next()
                current = self.writers[-1]
                first, offset, room, taken = i, offset + taken, self.max_tokens, 0
            taken += length
        if len(lengths) > first:
            current.add_documents(lengths[first:], tokens[offset:offset + taken])

    def close(self) -> None:
        self.writers[-1].close()

    def commit(self) -> None:
        for writer in self.writers:
            writer.commit()

    def abort(self) -> None:
        for writer in self.writers:
            writer.abort()


def _input_paths(input_files) -> list[Path]:
    files = [Path(input_files)] if isinstance(input_files, (str, os.PathLike)) else [Path(p) for p in input_files]
    if not files:
        raise ValueError("input_files is empty: nothing to tokenize")
    for path in files:
        if not path.is_file():
            raise FileNotFoundError(f"{path}: input file not found")
        file_format(path)  # an unsupported file type fails before any work starts
    return files


def _chunk_bytes(files: list[Path], workers: int) -> int:
    total = sum(path.stat().st_size for path in files)
    return min(MAX_CHUNK_BYTES, max(MIN_CHUNK_BYTES, total // (workers * TASKS_PER_WORKER)))


def _tasks(files: list[Path], keys: tuple[str, ...], chunk_bytes: int) -> Iterator[_Task]:
    for path in files:
        if file_format(path) == "jsonl":
            for start, end in jsonl_ranges(path, chunk_bytes):
                yield _Task(path, JsonlRange(str(path), start, end))
        else:
            yield from _record_tasks(path, keys, chunk_bytes)


def _record_tasks(path: Path, keys: tuple[str, ...], chunk_bytes: int) -> Iterator[_Task]:
    """Records of a JSON array or Parquet file, read here, in tasks of about `chunk_bytes` of text."""
    task, size = _Task(path, []), 0
    try:
        for item in iter_records(path, keys):
            if isinstance(item, Rejection):
                task.rejections.append(item)
                size += len(item.raw)  # a file of bad records must not pile them all up here
            else:
                task.work.append(item.values)
                size += sum(map(len, item.values))
            if size >= chunk_bytes:
                yield task
                task, size = _Task(path, []), 0
    except CorpusError as err:
        # raised when this task's turn comes, after every earlier record was handled in order
        task.fatal = err
    yield task


_worker_encoder: Encoder | None = None  # in a worker process: its own Encoder, made once at start


def _start_worker(spec: EncoderSpec, model_file: str) -> None:
    global _worker_encoder
    # A forked worker shares its parent's pages until it writes them, and every garbage collection writes
    # to the header of each object it visits; frozen, the inherited objects are never visited (in a parent
    # holding 100 MB of texts and Dagster, the workers' CPU time fell ~8%: 8 paired rounds, 6 lower)
    gc.freeze()
    _worker_encoder = Encoder(spec, sentencepiece.SentencePieceProcessor(model_file=model_file))


def _encode_in_worker(work: JsonlRange | list[tuple[str, ...]]) -> Encoded:
    return _worker_encoder(work)


def _worker_context() -> multiprocessing.context.BaseContext:
    # fork: a worker starts in milliseconds with everything imported (spawn would pay an interpreter and
    # the imports, ~0.25 s, per worker); the workers only encode, so no lock of another thread is needed
    methods = multiprocessing.get_all_start_methods()
    return multiprocessing.get_context("fork" if "fork" in methods else "spawn")


def _encoded_in_order(tasks: Iterable[_Task], spec: EncoderSpec, model_file: str, processor,
                      workers: int) -> Iterator[tuple[_Task, Encoded]]:
    if workers == 1:
        encoder = Encoder(spec, processor)
        for task in tasks:
            yield task, encoder(task.work)
        return
    pool = ProcessPoolExecutor(workers, mp_context=_worker_context(), initializer=_start_worker,
                               initargs=(spec, model_file))

    def result(task: _Task, future) -> tuple[_Task, Encoded]:
        try:
            return task, future.result()
        except BrokenProcessPool:
            raise ChildProcessError(f"a tokenizing worker process died while {task.path} was being encoded "
                                    "(killed, or out of memory?); nothing was written") from None

    try:
        pending = deque()
        for task in tasks:
            pending.append((task, pool.submit(_encode_in_worker, task.work)))
            if len(pending) >= workers * IN_FLIGHT_PER_WORKER:
                yield result(*pending.popleft())
        while pending:
            yield result(*pending.popleft())
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _histogram_rows(histogram: list[int]) -> dict[str, int]:
    """{"1": n, "2-3": n, "4-7": n, ...}: documents per power-of-two length bucket (non-empty ones)."""
    rows = {}
    for bucket, count in enumerate(histogram):
        if count:
            low, high = 1 << (bucket - 1), (1 << bucket) - 1
            rows[str(low) if low == high else f"{low}-{high}"] = count
    return rows


def tokenize_to_indexed(
    input_files: str | os.PathLike | Iterable[str | os.PathLike],
    tokenizer_model: str | os.PathLike,
    output_prefix: str | os.PathLike,
    json_keys: str | Sequence[str] = ("text",),
    append_eod: bool = True,
    prepend_bos: bool = False,
    workers: int | None = None,
    on_bad_line: str = "error",
    max_shard_tokens: int | None = None,
) -> dict:
    """Tokenize the records of `input_files` (JSONL, JSON arrays, Parquet; in order) into Megatron datasets.

    Each json key is its own document stream, written to `<output_prefix>_<key>_document.bin/.idx`
    (as Megatron-LM's preprocess_data.py names them); with `max_shard_tokens`, to
    `<output_prefix>_<key>_document_00000.bin/.idx`, `..._00001`, ... of at most that many tokens
    each (a longer document gets a shard of its own). One sequence per document: the tokenizer's
    bos id first when `prepend_bos`, its eos id last when `append_eod`. A document whose text has
    no tokens is dropped and counted. Token dtype: uint16 for vocabularies below 65,500, else int32.

    `on_bad_line`: "error" raises CorpusError naming the first bad record (`file:line: reason`);
    "skip" counts bad records by reason and writes them to `<output_prefix>_quarantine.jsonl`.
    Every output is written under a temporary name and renamed only when all succeeded.
    `workers` (default: the CPU count) processes tokenize in parallel.
    """
    files = _input_paths(input_files)
    keys = normalize_keys(json_keys)
    check_on_bad_line(on_bad_line)
    workers = _checked_workers(workers, max_shard_tokens)
    model_file = str(tokenizer_model)
    processor, dtype, spec = _encoder(model_file, keys, append_eod, prepend_bos)
    started = time.perf_counter()
    bad = BadRecords(on_bad_line, f"{output_prefix}_quarantine.jsonl")
    streams: list[_ShardedStream] = []
    empty = [0] * len(keys)
    histogram = [0] * HISTOGRAM_BUCKETS
    line_bases: dict[Path, int] = {}  # JSONL: lines of each file seen so far, to number a range's lines
    try:
        streams += [_ShardedStream(output_prefix, key, dtype, max_shard_tokens) for key in keys]
        tasks = _tasks(files, keys, _chunk_bytes(files, workers))
        for task, encoded in _encoded_in_order(tasks, spec, model_file, processor, workers):
            _report_bad_records(task, encoded, bad, line_bases)
            for k, stream in enumerate(streams):
                stream.add(encoded.lengths[k], encoded.tokens[k])
                empty[k] += encoded.empty[k]
            histogram = [a + b for a, b in zip(histogram, encoded.histogram)]
        for stream in streams:
            stream.close()
    except BaseException:
        for stream in streams:
            stream.abort()
        bad.discard()
        raise
    for stream in streams:
        stream.commit()
    bad.commit()
    encoding = {"dtype": str(dtype), "eod_id": spec.eod_id, "bos_id": spec.bos_id,
                "vocab_size": processor.vocab_size(), "workers": workers}
    return _summary(streams, keys, empty, bad, histogram, encoding, time.perf_counter() - started)


def _checked_workers(workers: int | None, max_shard_tokens: int | None) -> int:
    """The tokenizing processes (default: the CPU count); each count a positive integer, else a ValueError."""
    workers = (os.cpu_count() or 1) if workers is None else workers
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers must be a positive integer, got {workers!r}")
    if max_shard_tokens is not None and (isinstance(max_shard_tokens, bool) or not isinstance(max_shard_tokens, int)
                                         or max_shard_tokens < 1):
        raise ValueError(f"max_shard_tokens must be a positive integer or None, got {max_shard_tokens!r}")
    return workers


def _encoder(model_file: str, keys: list[str], append_eod: bool, prepend_bos: bool):
    """The sentencepiece processor, the token dtype its vocabulary needs and the workers' encoding spec; a model
    without the eos (bos) piece that ``append_eod`` (``prepend_bos``) asks for is a ValueError naming it."""
    processor = load_sentencepiece(model_file)
    for wanted, piece, piece_id in ((append_eod, "eos", processor.eos_id()), (prepend_bos, "bos", processor.bos_id())):
        if wanted and piece_id < 0:
            raise ValueError(f"{model_file}: the model has no {piece} piece ({piece}_id = -1), so none can be added")
    dtype = dtype_for_vocab(processor.vocab_size())
    spec = EncoderSpec(keys, str(dtype), processor.eos_id() if append_eod else None,
                       processor.bos_id() if prepend_bos else None)
    return processor, dtype, spec


def _summary(streams, keys, empty: list[int], bad: BadRecords, histogram: list[int], encoding: dict,
             seconds: float) -> dict:
    """What the committed outputs hold (documents, tokens, records, empty and skipped documents, lengths), how
    they were encoded (``encoding``) and how fast."""
    outputs = [_output_stats(stream.key, writer) for stream in streams for writer in stream.writers]
    tokens = sum(o["tokens"] for o in outputs)
    return {
        "docs": sum(o["docs"] for o in outputs),
        "tokens": tokens,
        "records": sum(o["docs"] for o in outputs if o["key"] == keys[0]) + empty[0],
        "empty_docs": sum(empty),
        "skipped": bad.skipped,
        "skipped_by_reason": dict(bad.counts),
        "quarantine": str(bad.quarantine_path) if bad.skipped else None,
        "length_histogram": _histogram_rows(histogram),
        **encoding,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds if seconds > 0 else float("inf"),
        "outputs": outputs,
    }


def _report_bad_records(task: _Task, encoded: Encoded, bad: BadRecords, line_bases: dict[Path, int]) -> None:
    for rejection in task.rejections:
        bad(rejection)
    if isinstance(task.work, JsonlRange):
        base = line_bases.get(task.path, 0)
        for index, reason, detail, raw in encoded.rejected:
            bad(Rejection(str(task.path), {"line": base + index + 1}, reason, detail, raw))
        line_bases[task.path] = base + encoded.lines
    if task.fatal is not None:
        raise task.fatal


def _output_stats(key: str, writer: IndexedDatasetWriter) -> dict:
    return {
        "key": key,
        "prefix": str(writer.prefix),
        "docs": writer.num_documents,
        "tokens": writer.num_tokens,
        "bin_path": str(writer.bin_path),
        "idx_path": str(writer.idx_path),
        "bin_sha256": writer.bin_sha256,
        "idx_sha256": writer.idx_sha256,
        "bin_bytes": writer.bin_path.stat().st_size,
        "idx_bytes": writer.idx_path.stat().st_size,
    }
