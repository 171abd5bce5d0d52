"""JSONL documents -> one Megatron `<prefix>.bin/.idx` pair, tokenized with sentencepiece."""

from __future__ import annotations

import itertools
import multiprocessing
import os
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import numpy as np
import sentencepiece

from training.data.corpus import iter_jsonl_documents
from training.data.hashing import sha256_file
from training.data.indexed import IndexedDatasetWriter, dtype_for_vocab

# Documents per task sent to an encoder process: large enough that pickling overhead is small,
# small enough that workers stay busy to the end.
CHUNK_DOCUMENTS = 256


class _Encoder:
    """Encodes chunks of texts into (lengths, concatenated token array)."""

    def __init__(self, model_file: str, eod_id: int | None, dtype: str) -> None:
        self.processor = sentencepiece.SentencePieceProcessor(model_file=model_file)
        self.eod_id = eod_id
        self.dtype = np.dtype(dtype)

    def __call__(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        # one thread: the parallelism is the process pool, and more threads per process oversubscribe the cores
        pieces = self.processor.encode(texts, out_type=int, num_threads=1)
        if self.eod_id is not None:
            for ids in pieces:
                ids.append(self.eod_id)
        lengths = np.fromiter((len(ids) for ids in pieces), dtype=np.int64, count=len(pieces))
        tokens = np.fromiter(itertools.chain.from_iterable(pieces), dtype=self.dtype, count=int(lengths.sum()))
        return lengths, tokens


# One encoder per pool process, built by the pool initializer (the model is loaded once per process).
_worker_encoder: _Encoder | None = None


def _init_worker(model_file: str, eod_id: int | None, dtype: str) -> None:
    global _worker_encoder
    _worker_encoder = _Encoder(model_file, eod_id, dtype)


def _encode_in_worker(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    return _worker_encoder(texts)


def _text_chunks(input_files: Sequence[Path], json_keys: Sequence[str]) -> Iterator[list[str]]:
    texts = (text for path in input_files for _, text in iter_jsonl_documents(path, json_keys))
    while chunk := list(itertools.islice(texts, CHUNK_DOCUMENTS)):
        yield chunk


def tokenize_to_indexed(
    input_files: str | os.PathLike | Iterable[str | os.PathLike],
    tokenizer_model: str | os.PathLike,
    output_prefix: str | os.PathLike,
    json_keys: str | Sequence[str] = ("text",),
    append_eod: bool = True,
    workers: int = 1,
) -> dict:
    """Tokenize the documents of `input_files` (in order) into `<output_prefix>.bin/.idx`.

    One sequence per document, the tokenizer's eos id appended when `append_eod`. With
    `workers > 1` a process pool encodes chunks of documents; results are consumed in order, so
    the output bytes do not depend on `workers`.
    """
    files = [Path(input_files)] if isinstance(input_files, (str, os.PathLike)) else [Path(p) for p in input_files]
    if not files:
        raise ValueError("input_files is empty: nothing to tokenize")
    for path in files:
        if not path.is_file():
            raise FileNotFoundError(f"{path}: input file not found")
    if not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers must be a positive integer, got {workers!r}")
    model_file = str(tokenizer_model)
    if not Path(model_file).is_file():
        raise FileNotFoundError(f"{model_file}: tokenizer model not found")
    processor = sentencepiece.SentencePieceProcessor(model_file=model_file)
    eod_id = processor.eos_id()
    if append_eod and eod_id < 0:
        raise ValueError(f"{model_file}: the model has no eos piece (eos_id = -1), so no EOD can be appended")
    dtype = dtype_for_vocab(processor.vocab_size())
    encoder_args = (model_file, eod_id if append_eod else None, dtype.str)

    started = time.perf_counter()
    chunks = _text_chunks(files, json_keys)
    with IndexedDatasetWriter(output_prefix, dtype) as writer:
        if workers == 1:
            _write_encoded(writer, map(_Encoder(*encoder_args), chunks))
        else:
            # spawn, not fork: the caller may hold threads (Dagster, MindSpore) that fork would copy mid-state.
            context = multiprocessing.get_context("spawn")
            with context.Pool(workers, initializer=_init_worker, initargs=encoder_args) as pool:
                _write_encoded(writer, pool.imap(_encode_in_worker, chunks))
        num_docs = writer.num_documents
        num_tokens = writer.num_tokens
    seconds = time.perf_counter() - started

    bin_path, idx_path = writer.bin_path, writer.idx_path
    return {
        "docs": num_docs,
        "tokens": num_tokens,
        "dtype": str(dtype),
        "eod_id": eod_id if append_eod else None,
        "vocab_size": processor.vocab_size(),
        "seconds": seconds,
        "tokens_per_s": num_tokens / seconds if seconds > 0 else float("inf"),
        "bin_path": str(bin_path),
        "idx_path": str(idx_path),
        "bin_sha256": sha256_file(bin_path),
        "idx_sha256": sha256_file(idx_path),
        "bin_bytes": bin_path.stat().st_size,
        "idx_bytes": idx_path.stat().st_size,
    }


def _write_encoded(writer: IndexedDatasetWriter, encoded: Iterable[tuple[np.ndarray, np.ndarray]]) -> None:
    for lengths, tokens in encoded:
        for document in np.split(tokens, np.cumsum(lengths)[:-1]):
            writer.add_document(document)
