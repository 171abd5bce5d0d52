"""The tokenizing half of preprocessing: what each worker process runs.

A task is either a byte range of a JSONL file, which the worker reads and parses itself (so the
reading process never parses it), or the values of records already read (JSON arrays, Parquet). The
result is, per json key, the lengths of the documents kept and their tokens as one little-endian
array, ready to append to a `.bin`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import sentencepiece

from training.data.corpus import parse_jsonl_chunk

# Document lengths are bucketed by bit length: bucket b holds lengths in [2**(b-1), 2**b).
HISTOGRAM_BUCKETS = 32


def load_sentencepiece(path: str | Path) -> sentencepiece.SentencePieceProcessor:
    """The sentencepiece model at ``path``; a missing or foreign file is an error naming it, not
    sentencepiece's RuntimeError."""
    if not Path(path).is_file():
        raise FileNotFoundError(f"{path}: tokenizer model not found")
    try:
        return sentencepiece.SentencePieceProcessor(model_file=str(path))
    except RuntimeError:  # "INTERNAL: could not parse ModelProto from <path>"
        raise ValueError(f"{path}: not a sentencepiece model (a .model file written by sentencepiece's trainer, "
                         f"e.g. data/tokenizer/kiln.model)") from None


@dataclass(frozen=True)
class EncoderSpec:
    keys: tuple[str, ...]
    dtype: str  # of the tokens: "uint16" or "int32"
    eod_id: int | None  # the model's eos id, appended to every document when set
    bos_id: int | None  # the model's bos id, prepended to every document when set


@dataclass(frozen=True)
class JsonlRange:
    """Whole lines of a JSONL file: bytes [start, end)."""

    path: str
    start: int
    end: int


@dataclass
class Encoded:
    lengths: list[np.ndarray]  # per key: the token count of each document kept (int32)
    tokens: list[np.ndarray]  # per key: those documents' tokens, concatenated, little-endian
    empty: list[int]  # per key: documents dropped because their text has no tokens
    histogram: list[int]  # documents (all keys) per length bucket
    rejected: list[tuple[int, str, str, str]]  # JSONL only: (line index in the range, reason, detail, raw)
    lines: int  # JSONL only: lines in the range


class Encoder:
    def __init__(self, spec: EncoderSpec, processor: sentencepiece.SentencePieceProcessor) -> None:
        self.spec = spec
        self.processor = processor
        self.dtype = np.dtype(spec.dtype).newbyteorder("<")  # Megatron's files are little-endian
        self.extra = (spec.bos_id is not None) + (spec.eod_id is not None)

    def __call__(self, task: JsonlRange | list[tuple[str, ...]]) -> Encoded:
        rejected, lines = [], 0
        if isinstance(task, JsonlRange):
            with open(task.path, "rb") as stream:
                stream.seek(task.start)
                data = stream.read(task.end - task.start)
            records, rejected, lines = parse_jsonl_chunk(data, self.spec.keys, task.start == 0)
            values = [record for _, record in records]
        else:
            values = task
        streams = [self._encode([record[k] for record in values]) for k in range(len(self.spec.keys))]
        histogram = np.bincount(np.concatenate([np.log2(s[0]).astype(np.int64) + 1 for s in streams]),
                                minlength=HISTOGRAM_BUCKETS)
        return Encoded(lengths=[s[0] for s in streams], tokens=[s[1] for s in streams], empty=[s[2] for s in streams],
                       histogram=histogram.tolist(), rejected=rejected, lines=lines)

    def _encode(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray, int]:
        # "numpy" output hands over sentencepiece's own id buffers: building Python lists of ints
        # would cost a third of the encoding time. One thread: the parallelism is the workers.
        # sentencepiece adds bos/eos itself, so a document without text tokens is exactly `extra` long.
        documents = self.processor.encode(texts, out_type="numpy", num_threads=1, add_bos=self.spec.bos_id is not None,
                                          add_eos=self.spec.eod_id is not None)
        lengths = np.fromiter(map(len, documents), dtype=np.int32, count=len(documents))
        kept = lengths > self.extra
        if not kept.all():
            documents = [doc for doc, keep in zip(documents, kept) if keep]
        # one pass from sentencepiece's int32 buffers into the file's dtype (ids fit it: see dtype_for_vocab)
        tokens = np.concatenate(documents, dtype=self.dtype, casting="unsafe") if documents else np.zeros(0, self.dtype)
        return lengths[kept], tokens, int(len(kept) - kept.sum())
