"""Running a recipe over raw files: filter each chunk, cluster duplicates over all chunks, write the results.

Phase 1, ``filter_chunk`` (per chunk, streaming): every raw document goes through the recipe's steps in order;
the first step that removes it is recorded with its reason and measured value (``removed.jsonl``), survivors
are written with their rewritten text (``survivors.jsonl``) and their dedup keys and MinHash signatures appended
to flat binary files (``exact.bin``, ``signatures.bin``, ``keys.bin``): nothing of a chunk is held in memory.
Phase 2, ``dedup.cluster``: every chunk's keys, a band (and shard of it) at a time. Phase 3, ``finalize_chunk``:
the cleaned JSONL (one per raw file, same stem) and the removals sidecar, one line per raw document in raw
order: kept (with its cluster's size) or the step that removed it, why, and for a duplicate the copy it matched.
A stage directory is built aside and renamed into place, so a failure never leaves half a stage.
"""
from __future__ import annotations

import heapq
import json
import shutil
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import orjson

from training.atomic import replace_dir, write_json_atomic
from training.data.cleaning.decontamination import Decontaminator, TaskSource, load_task_texts
from training.data.cleaning.dedup import EXACT, SIGNATURES, Clusters, cluster, matrix
from training.data.cleaning.filters import Document, Removal, UrlBlocklist
from training.data.cleaning.minhash import exact_key, signature
from training.data.cleaning.recipe import Recipe
from training.data.cleaning.text import simplify_text
from training.data.corpus import BadRecord, BadRecords, Rejection, file_format, iter_records, normalize_keys, \
    parse_jsonl_line
from training.data.hashing import sha256_file

SURVIVORS, REMOVED, KEYS, STATS = "survivors.jsonl", "removed.jsonl", "keys.bin", "stats.json"
REMOVALS = "removals.jsonl"  # the sidecar: one line per raw document
SAMPLES_PER_STEP = 5
SAMPLE_CHARS = 200


class CleaningError(ValueError):
    """Cleaning cannot go on; the message names the file and line, or the step."""


@dataclass(frozen=True)
class RawInput:
    path: Path
    shown: str                  # how sidecars name it (relative to the data root, or as given)
    sha256: str | None = None   # when already known (raw_corpus's sidecar): not hashed again before reading


@dataclass
class StepStats:
    step: str
    docs_in: int = 0
    docs_out: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    removed: dict = field(default_factory=dict)   # reason -> documents
    samples: list = field(default_factory=list)   # a few removed documents, truncated

    def remove(self, removal: Removal, where: dict, text: str) -> None:
        self.removed[removal.reason] = self.removed.get(removal.reason, 0) + 1
        if len(self.samples) < SAMPLES_PER_STEP:
            self.samples.append({**where, "reason": removal.reason, "value": removal.value,
                                 "text": text[:SAMPLE_CHARS]})


def _utf8_len(text: str) -> int:
    return len(text.encode("utf-8", "surrogatepass"))


def _records(raw: RawInput, keys: tuple[str, ...], url_key: str | None) -> Iterator[tuple[int, object, str | None]]:
    """(line, values or Rejection, url) of each record: JSONL line numbers from 1, a JSON array's element's line,
    a Parquet row number from 0. The url is read for a URL block list step (JSONL records only)."""
    if file_format(raw.path) != "jsonl":
        for item in iter_records(raw.path, keys):
            line = item.place.get("line", item.place.get("row"))
            yield line, (item if isinstance(item, Rejection) else item.values), None
        return
    with open(raw.path, "rb") as stream:
        for line, data in enumerate(stream, start=1):
            try:
                values = parse_jsonl_line(data, keys, line == 1)
            except BadRecord as bad:
                yield line, Rejection(str(raw.path), {"line": line}, bad.reason, bad.detail,
                                      data.rstrip(b"\r\n").decode("utf-8", "backslashreplace")), None
                continue
            if values is not None:
                url = orjson.loads(data).get(url_key) if url_key else None
                yield line, values, url if isinstance(url, str) else None


class _Stage:
    """The files phase 1 writes for a chunk, opened in a staging directory."""

    def __init__(self, staging: Path):
        staging.mkdir(parents=True)
        self.survivors = open(staging / SURVIVORS, "wb")
        self.removed = open(staging / REMOVED, "wb")
        self.exact = open(staging / EXACT, "wb")
        self.signatures = open(staging / SIGNATURES, "wb")
        self.keys = open(staging / KEYS, "wb")

    def close(self) -> None:
        for stream in (self.survivors, self.removed, self.exact, self.signatures, self.keys):
            stream.close()


class ChunkFilter:
    """Phase 1 for one chunk: the recipe's steps over every document of its raw files."""

    def __init__(self, recipe: Recipe, json_keys: Sequence[str] = ("text",), on_bad_line: str = "error",
                 task_source: TaskSource = load_task_texts):
        self.recipe = recipe
        self.keys = normalize_keys(json_keys)
        self.bad = BadRecords(on_bad_line)
        self.steps = [StepStats(step.name) for step in recipe.steps]
        self.read = StepStats("read")  # records that are not documents: bad (under skip) or empty
        self.decontaminator = None
        self.contamination: dict[str, dict[str, int]] = {}
        if recipe.decontaminate:
            settings = recipe.decontaminate
            texts = task_source(settings.tasks)
            self.decontaminator = Decontaminator(texts, settings.n, settings.min_words)
            self.contamination = {task: {"docs": 0, "ngrams": 0} for task in texts}
        self.decontaminated = StepStats("decontaminate")
        url_steps = [s for s in recipe.steps if isinstance(s, UrlBlocklist)]
        self.url_key = url_steps[0].url_key if url_steps else None

    def run(self, inputs: Sequence[RawInput], stage: Path) -> dict:
        staging = stage.with_name(f".{stage.name}.staging")
        shutil.rmtree(staging, ignore_errors=True)
        out = _Stage(staging)
        try:
            files = [self._file(index, raw, out) for index, raw in enumerate(inputs)]
            out.close()
            stats = {"recipe": self.recipe.spec(), "recipe_sha256": self.recipe.sha256, "files": files,
                     "max_removed_share": self.recipe.max_removed_share,
                     "read": vars(self.read), "steps": [vars(s) for s in self.steps],
                     "decontamination": self.contamination, "survivors": sum(f["survivors"] for f in files)}
            if self.recipe.decontaminate:
                stats["steps"].append(vars(self.decontaminated))
            write_json_atomic(staging / STATS, stats)
        except BaseException:
            out.close()
            shutil.rmtree(staging, ignore_errors=True)
            raise
        replace_dir(staging, stage)
        return stats

    def _file(self, index: int, raw: RawInput, out: _Stage) -> dict:
        before = raw.sha256 or sha256_file(raw.path)
        stat = raw.path.stat()
        docs = survivors = 0
        for line, values, url in _records(raw, self.keys, self.url_key):
            where = {"file": raw.shown, "line": line}
            self.read.docs_in += 1
            if isinstance(values, Rejection):
                self.bad(values)  # raises under on_bad_line: error
                removal = Removal(values.reason, detail=values.detail)
                self.read.remove(removal, where, values.raw)
                self._removed(out, index, line, "read", removal)
                continue
            docs += 1
            survivors += self._document(index, line, where, values, url, out)
        after = raw.path.stat()
        if (after.st_size, after.st_mtime_ns) != (stat.st_size, stat.st_mtime_ns) or sha256_file(raw.path) != before:
            raise CleaningError(f"{raw.path} changed while it was cleaned (sha256 {before[:16]}… when cleaning "
                                f"started): clean it again once it is complete")
        return {"path": raw.shown, "sha256": before, "bytes": stat.st_size, "docs": docs, "survivors": survivors}

    def _document(self, index: int, line: int, where: dict, values: tuple, url: str | None, out: _Stage) -> int:
        text = values[0]
        if not text:
            self.read.remove(Removal("empty"), where, text)
            self._removed(out, index, line, "read", Removal("empty"))
            return 0
        self.read.docs_out += 1
        self.read.bytes_out += _utf8_len(text)
        doc = Document(text, url)
        for step, stats in zip(self.recipe.steps, self.steps):
            stats.docs_in += 1
            stats.bytes_in += _utf8_len(doc.text)
            try:
                outcome = step.apply(doc)
            except Exception as exc:  # a filter's bug or a document it cannot read: the recipe's on_error
                if self.recipe.on_error == "fail":
                    raise CleaningError(f"{where['file']}:{line}: step {step.name} raised "
                                        f"{type(exc).__name__}: {exc} (on_error: skip removes and counts such "
                                        f"documents)") from exc
                outcome = Removal("error", detail=f"{type(exc).__name__}: {exc}")
            if isinstance(outcome, Removal):
                stats.remove(outcome, where, doc.text)
                self._removed(out, index, line, step.name, outcome)
                return 0
            if isinstance(outcome, str):
                doc = Document(outcome, url)
            stats.docs_out += 1
            stats.bytes_out += _utf8_len(doc.text)
        normalized = simplify_text(doc.text)
        contamination = self._decontaminate(normalized)
        if contamination and self.recipe.decontaminate.remove:
            removal = Removal("contamination", sum(contamination.values()), detail=", ".join(sorted(contamination)))
            self.decontaminated.remove(removal, where, doc.text)
            self._removed(out, index, line, "decontaminate", removal)
            return 0
        self._survivor(out, index, line, doc.text, values[1:], normalized, contamination)
        return 1

    def _decontaminate(self, normalized: str) -> dict[str, int]:
        if self.decontaminator is None:
            return {}
        self.decontaminated.docs_in += 1
        found = self.decontaminator.overlaps(normalized)
        for task, grams in found.items():
            self.contamination[task]["docs"] += 1
            self.contamination[task]["ngrams"] += grams
        if not (found and self.recipe.decontaminate.remove):
            self.decontaminated.docs_out += 1
        return found

    def _survivor(self, out: _Stage, index: int, line: int, text: str, others: tuple, normalized: str,
                  contamination: dict) -> None:
        record = {"f": index, "line": line, "text": text, "others": list(others)}
        if contamination:
            record["contamination"] = contamination
        out.survivors.write(orjson.dumps(record) + b"\n")
        out.keys.write(np.array([index, line], dtype=np.int64).tobytes())
        out.exact.write(np.array(exact_key(normalized), dtype=np.uint64).tobytes())
        minhash = self.recipe.minhash
        if minhash is not None:
            out.signatures.write(signature(normalized, minhash).tobytes())

    def _removed(self, out: _Stage, index: int, line: int, step: str, removal: Removal) -> None:
        entry = {"f": index, "line": line, "step": step, "reason": removal.reason}
        entry.update({k: v for k, v in (("value", removal.value), ("limit", removal.limit),
                                        ("detail", removal.detail)) if v not in (None, "")})
        out.removed.write(orjson.dumps(entry) + b"\n")


# ---- phases 2 and 3 ---------------------------------------------------------------------------------------------

def code_version() -> str:
    """sha256 (16 hex digits) of the cleaning code: this package and the raw-record reader it uses."""
    import hashlib

    digest = hashlib.sha256()
    here = Path(__file__).resolve().parent
    for path in sorted(here.glob("*.py")) + [here.parent / "corpus.py"]:
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


@dataclass
class ChunkStage:
    """A chunk's phase-1 output: its stage directory and what phase 1 recorded (stats.json)."""
    key: str
    stage: Path
    stats: dict

    @classmethod
    def load(cls, key: str, stage: Path) -> "ChunkStage":
        try:
            return cls(key, stage, json.loads((stage / STATS).read_text()))
        except (OSError, ValueError) as exc:
            raise CleaningError(f"{stage}: no complete filter stage for {key!r} ({exc}); clean it again") from None


class Numbering:
    """Global document numbers over stages in order, and the raw place each number stands for."""

    def __init__(self, stages: Sequence[ChunkStage]):
        self.stages = list(stages)
        self.keys = [matrix(s.stage / KEYS, 2, np.int64) for s in self.stages]
        self.offsets = np.cumsum([0] + [len(k) for k in self.keys])

    def place(self, number: int) -> dict:
        chunk = int(np.searchsorted(self.offsets, number, side="right")) - 1
        f, line = self.keys[chunk][number - self.offsets[chunk]]
        raw = self.stages[chunk].stats["files"][int(f)]
        return {"chunk": self.stages[chunk].key, "file": raw["path"], "raw_sha256": raw["sha256"], "line": int(line)}

    def signature(self, number: int) -> np.ndarray | None:
        chunk = int(np.searchsorted(self.offsets, number, side="right")) - 1
        stage = self.stages[chunk]
        rows = matrix(stage.stage / SIGNATURES, _signature_width(stage.stats))
        return rows[number - self.offsets[chunk]] if len(rows) else None


def _signature_width(stats: dict) -> int:
    minhash = stats["recipe"]["dedup"]["minhash"]
    return minhash["bands"] * minhash["rows"] if minhash else 0


def cluster_stages(stages: Sequence[ChunkStage], recipe: Recipe) -> Clusters | None:
    """Phase 2 over the stages (all made with ``recipe``'s dedup settings), in their order."""
    if not recipe.dedups:
        return None
    minhash = recipe.minhash
    return cluster([s.stage for s in stages], minhash.bands if minhash else 0, minhash.rows if minhash else 0,
                   exact=recipe.exact_dedup, near=minhash is not None)



def _similarity(numbering: Numbering, first: int, second: int) -> float | None:
    """MinHash estimate of two documents' Jaccard similarity: the share of equal signature values."""
    a, b = numbering.signature(first), numbering.signature(second)
    return None if a is None or b is None else round(float((a == b).mean()), 4)


def _outcomes(numbering: Numbering, position: int, clusters: Clusters | None, dedup: StepStats) -> Iterator[dict]:
    """The sidecar entry of each survivor of the stage at ``position``: kept, or the duplicate it is."""
    stage = numbering.stages[position]
    offset = int(numbering.offsets[position])
    with open(stage.stage / SURVIVORS, "rb") as stream:
        for local, data in enumerate(stream):
            record = orjson.loads(data)
            number = offset + local
            entry = {"f": record["f"], "line": record["line"], "record": record}
            if record.get("contamination"):
                entry["contamination"] = record["contamination"]
            dedup.docs_in += 1
            dedup.bytes_in += _utf8_len(record["text"])
            kept = number if clusters is None else int(clusters.kept[number])
            size = 1 if clusters is None else int(clusters.size[number])
            if size > 1:
                entry["cluster_size"] = size
            if kept == number:
                dedup.docs_out += 1
                dedup.bytes_out += _utf8_len(record["text"])
                yield entry
                continue
            exact = bool(clusters.exact[number])
            removal = Removal("exact_duplicate" if exact else "near_duplicate",
                              1.0 if exact else _similarity(numbering, number, kept))
            dedup.remove(removal, {"file": stage.stats["files"][record["f"]]["path"], "line": record["line"]},
                         record["text"])
            yield {**entry, "step": "exact_dedup" if exact else "minhash_dedup", "reason": removal.reason,
                   "value": removal.value, "duplicate_of": numbering.place(kept)}


def _removed_entries(stage: ChunkStage) -> Iterator[dict]:
    with open(stage.stage / REMOVED, "rb") as stream:
        for data in stream:
            yield orjson.loads(data)


class _CleanedFiles:
    """One cleaned JSONL per raw file of the chunk (``<raw stem>.jsonl``), written as the entries come."""

    def __init__(self, staging: Path, files: list[dict], keys: tuple[str, ...]):
        self.names = [f"{Path(f['path']).stem}.jsonl" for f in files]
        if len(set(self.names)) != len(self.names):
            raise CleaningError(f"two inputs have the same file name stem ({self.names}): their cleaned files "
                                f"would collide; rename one")
        self.staging, self.keys = staging, keys
        self.streams = [open(staging / name, "wb") for name in self.names]
        self.docs = [0] * len(files)
        self.files = files

    def write(self, entry: dict) -> None:
        record = entry["record"]
        raw = self.files[record["f"]]
        out = dict(zip(self.keys, [record["text"], *record["others"]]))
        out.update({"raw_sha256": raw["sha256"], "raw_line": record["line"]})
        self.streams[record["f"]].write(orjson.dumps(out) + b"\n")
        self.docs[record["f"]] += 1

    def close(self) -> list[dict]:
        for stream in self.streams:
            stream.close()
        return [{"name": name, "docs": docs, "bytes": (self.staging / name).stat().st_size,
                 "sha256": sha256_file(self.staging / name), "raw_sha256": raw["sha256"]}
                for name, docs, raw in zip(self.names, self.docs, self.files)]


def _sidecar_line(entry: dict, files: list[dict]) -> bytes:
    raw = files[entry["f"]]
    line = {"raw_sha256": raw["sha256"], "file": raw["path"], "line": entry["line"], "kept": "step" not in entry}
    line.update({k: v for k, v in entry.items() if k not in ("f", "line", "record")})
    return orjson.dumps(line) + b"\n"


def finalize_chunk(numbering: Numbering, position: int, clusters: Clusters | None, out_dir: Path, stem: str,
                   json_keys: Sequence[str] = ("text",)) -> dict:
    """Phase 3 for the stage at ``position``: ``out_dir`` with the cleaned files, ``removals.jsonl`` and
    ``<stem>.kiln.json`` (what was read and written, per-step figures, dedup and decontamination), built aside
    and swapped in whole."""
    stage = numbering.stages[position]
    staging = out_dir.with_name(f".{out_dir.name}.staging")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    dedup = StepStats("dedup")
    try:
        cleaned = _CleanedFiles(staging, stage.stats["files"], normalize_keys(json_keys))
        with open(staging / REMOVALS, "wb") as removals:
            entries = heapq.merge(_removed_entries(stage), _outcomes(numbering, position, clusters, dedup),
                                  key=lambda e: (e["f"], e["line"]))
            for entry in entries:
                removals.write(_sidecar_line(entry, stage.stats["files"]))
                if "record" in entry and "step" not in entry:
                    cleaned.write(entry)
        outputs = cleaned.close()
        sidecar = _sidecar(stage, outputs, dedup, clusters, numbering, position)
        write_json_atomic(staging / f"{stem}.kiln.json", sidecar)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    replace_dir(staging, out_dir)
    return sidecar


def _largest_clusters(numbering: Numbering, position: int, clusters: Clusters | None, top: int = 5) -> list[dict]:
    if clusters is None:
        return []
    start, end = int(numbering.offsets[position]), int(numbering.offsets[position + 1])
    kept = np.unique(clusters.kept[start:end])
    sizes = clusters.size[kept]
    order = np.argsort(-sizes, kind="stable")[:top]
    return [{"size": int(sizes[i]), "kept": numbering.place(int(kept[i]))} for i in order if sizes[i] > 1]


def _sidecar(stage: ChunkStage, outputs: list[dict], dedup: StepStats, clusters: Clusters | None,
             numbering: Numbering, position: int) -> dict:
    stats = stage.stats
    steps = [stats["read"], *stats["steps"]] + ([vars(dedup)] if clusters is not None else [])
    raw_docs = sum(f["docs"] for f in stats["files"])
    start, end = int(numbering.offsets[position]), int(numbering.offsets[position + 1])
    in_clusters = 0 if clusters is None else int((clusters.size[start:end] > 1).sum())
    return {"chunk": stage.key, "recipe": stats["recipe"], "recipe_sha256": stats["recipe_sha256"],
            "code_version": code_version(), "raw_files": stats["files"], "outputs": outputs,
            "docs_in": raw_docs, "docs_out": sum(o["docs"] for o in outputs), "steps": steps,
            "dedup": {"chunks_compared": len(numbering.stages), "docs_in_clusters": in_clusters,
                      "largest_clusters": _largest_clusters(numbering, position, clusters)},
            "decontamination": stats["decontamination"], "removals": REMOVALS,
            "max_removed_share": stats["max_removed_share"]}


def clean_files(inputs: Sequence[Path], out_dir: Path, recipe: Recipe, json_keys: Sequence[str] = ("text",),
                on_bad_line: str = "error", task_source: TaskSource = load_task_texts) -> dict:
    """``kiln clean``: the inputs as one chunk, deduplicated among themselves; ``out_dir`` gets a cleaned JSONL
    per input, ``removals.jsonl`` and ``clean.kiln.json``."""
    out_dir = Path(out_dir)
    stage_dir = out_dir.parent / f".{out_dir.name}.filtered"
    raw = [RawInput(Path(p), str(p)) for p in inputs]
    try:
        ChunkFilter(recipe, json_keys, on_bad_line, task_source).run(raw, stage_dir)
        numbering = Numbering([ChunkStage.load("input", stage_dir)])
        clusters = cluster_stages(numbering.stages, recipe)
        return finalize_chunk(numbering, 0, clusters, out_dir, "clean", json_keys)
    finally:
        shutil.rmtree(stage_dir, ignore_errors=True)
