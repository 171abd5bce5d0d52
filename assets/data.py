"""Data assets: raw corpus → (clean corpus, assets/cleaning.py) → tokenizer → token shards → blend manifest.

Each asset records what it read and wrote (paths, bytes, counts, sha256) and returns a content-hash
``DataVersion``, so Dagster can tell when a downstream asset is stale and an audit can re-verify it.
Outputs are written under a temporary name and renamed, so a failed step never leaves half a file.
"""

import contextlib
import dataclasses
import json
import os
import re
import shutil
from pathlib import Path

import dagster as dg

from assets.builtin_corpus import write_builtin_source
from assets.chunks import chunk_files, group_chunks, key_stem, source_chunk_keys, source_chunks, source_of
from assets.sources import SourcesConfigError, load_sources, source_recipe
from assets.versions import code_version, sources_config, versioned_asset
from resources.storage import KilnStorage
from resources.tokenizer import SPECIAL_IDS, TokenizerSettings
from training.atomic import replace_dir, write_json_atomic
from training.boundary import is_user_error
from training.data.cleaning.pipeline import CleaningError
from training.data.cleaning.recipe import RecipeError
from training.data.corpus import SUFFIXES, iter_texts, scan_corpus
from training.data.hashing import PER_SOURCE_DATA_VERSION, combined_hash, sha256_file
from training.data.manifest import build_manifest
from training.data.preprocess import tokenize_to_indexed

SOURCES_CONFIG = sources_config()
# checked when the code location loads: the data assets' code versions hash this file, and a missing or broken
# one must be named here rather than hashed (the partitions are the chunks, registered at run time)
load_sources(SOURCES_CONFIG)
# `raw/<chunk>/<stem>.kiln.json`: every raw file of a chunk; `shards/<chunk>/<stem>.kiln.json`: the chunk's shards
# and what they came from (an unchunked source is the chunk `<source>`, stem `<source>`; else `<source>/NNNNN`,
# stem `<source>_NNNNN`: assets/chunks.py)
SIDECAR = ".kiln.json"
SHARD_STATS = ("key", "docs", "tokens", "bin_sha256", "idx_sha256", "bin_bytes", "idx_bytes")  # copied per shard
# automation re-builds an asset when an input's data version changed, not on every materialization of it (eager()'s
# newly_updated): a chunk re-cleaned to the same bytes, or shards rebuilt to the same tokens, leave what is built
# from them fresh, as the UI shows them; and only once every blocking check of its inputs passed: a corrupt shard
# found by `shards_are_well_formed` must stop the automatic re-blend as it stops the blend in the same run
# (the target's own "handled" reset keeps newly_updated: a run of it to the same bytes still handles the request)
ANY_DEPS_DATA_CHANGED = dg.AutomationCondition.any_deps_match(
    (dg.AutomationCondition.data_version_changed() & ~dg.AutomationCondition.executed_with_root_target())
    | dg.AutomationCondition.will_be_requested()).with_label("any_deps_data_changed")
EAGER_AFTER_CHECKS = (dg.AutomationCondition.eager().replace("any_deps_updated", ANY_DEPS_DATA_CHANGED)
                      & dg.AutomationCondition.all_deps_blocking_checks_passed())

TABLE_ROWS = 20  # rows of a per-file table in an event; every row is in the on-disk sidecar the event names

def files_table(rows: list[dict], columns: list[str]) -> dg.MetadataValue:
    """The first TABLE_ROWS rows: an event is stored whole and sent whole to the UI, so a row per file in every
    materialization grows the instance and the Events tab with the corpus (1 MB per event at 5,000 files)."""
    types = {"bytes": "int", "docs": "int", "tokens": "int", "bin_bytes": "int", "idx_bytes": "int",
             "empty_docs": "int", "skipped": "int"}
    schema = dg.TableSchema(columns=[dg.TableColumn(c, types.get(c, "string")) for c in columns])
    return dg.MetadataValue.table([dg.TableRecord({c: row[c] for c in columns}) for row in rows[:TABLE_ROWS]],
                                  schema=schema)

def _source_spec(storage: KilnStorage, source: str):
    sources = load_sources(storage.sources_config)
    if source not in sources:
        raise dg.Failure(f"source {source!r} is not in {storage.sources_config} (has {sorted(sources)})")
    return sources[source]

def _part_files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.glob("part-*") if p.suffix.lower() in SUFFIXES)

def raw_files(storage: KilnStorage, key: str) -> list[Path]:
    """The raw files of the chunk ``key`` (an unchunked source's: its name)."""
    files = _part_files(storage.raw_dir(key))
    if not files:
        raise dg.Failure(f"no raw files for {key!r} in {storage.raw_dir(key)}; materialize raw_corpus[{key}] first")
    return files

CLEAN_CORPUS = dg.AssetKey("clean_corpus")  # assets/cleaning.py, which builds on this module's helpers


def clean_dir(storage: KilnStorage, key: str) -> Path:
    """`clean/<chunk>/`: the chunk's cleaned files, its removals sidecar and `<stem>.kiln.json`."""
    return storage.root / "clean" / key


def clean_sidecar(storage: KilnStorage, key: str) -> dict | None:
    """What clean_corpus recorded for the chunk; None when it has not cleaned it."""
    path = clean_dir(storage, key) / f"{key_stem(key)}{SIDECAR}"
    return json.loads(path.read_text()) if path.is_file() else None


def chunk_inputs(storage: KilnStorage, key: str) -> tuple[list[Path], dict | None]:
    """The files the tokenizer and token_shards read for the chunk, with its cleaning sidecar: clean_corpus's
    output for a cleaned source, the raw files (and None) for a source with `cleaning: none`."""
    spec = _source_spec(storage, source_of(key))
    if source_recipe(spec, storage.sources_config) is None:
        return raw_files(storage, key), None
    sidecar = clean_sidecar(storage, key)
    if sidecar is None:
        raise dg.Failure(f"source {spec.name!r} is cleaned (recipe {spec.cleaning!r}) and {key!r} has no "
                         f"clean_corpus output in {clean_dir(storage, key)}; materialize clean_corpus[{key}] first")
    return [clean_dir(storage, key) / output["name"] for output in sidecar["outputs"]], sidecar


def _ingest_chunk(storage: KilnStorage, key: str) -> dg.MaterializeResult:
    spec = _source_spec(storage, source_of(key))
    target = storage.raw_dir(key)
    staging = target.with_name(f".{target.name}.staging")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        if spec.builtin:
            write_builtin_source(spec.builtin, staging, spec.max_bytes, planted_every=spec.planted_every)
        else:
            for i, src in enumerate(chunk_files(storage, spec, key)):
                # validate before copying: errors name the user's file:line
                scan_corpus(src, spec.json_keys, spec.on_bad_line)
                shutil.copyfile(src, staging / f"part-{i:05d}{src.suffix}")
        # the modification time (kept by the rename below) lets token_shards reuse the sha256 of an unchanged file
        rows = [{"path": str((target / p.name).relative_to(storage.root)),
                 **scan_corpus(p, spec.json_keys, spec.on_bad_line), "mtime_ns": p.stat().st_mtime_ns}
                for p in _part_files(staging)]
        if not sum(r["docs"] for r in rows):  # an error now, not an empty shard that fails training later
            files = ", ".join(spec.files) or spec.builtin or "no files"
            raise dg.Failure(f"source {spec.name}{f' chunk {key}' if key != spec.name else ''}: {files} hold no "
                             f"document ({sum(r['empty_docs'] for r in rows)} empty, {sum(r['skipped'] for r in rows)} "
                             f"skipped): give it text, or take it out of the sources config", allow_retries=False)
        write_json_atomic(staging / f"{key_stem(key)}{SIDECAR}", {"source": spec.name, "chunk": key, "files": rows})
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    replace_dir(staging, target)
    return dg.MaterializeResult(
        metadata={
            "chunk": dg.MetadataValue.text(key), "dir": dg.MetadataValue.path(str(target)),
            "sidecar": dg.MetadataValue.path(str(target / f"{key_stem(key)}{SIDECAR}")),  # every file, with its sha256
            "files": files_table(rows, ["path", "bytes", "docs", "empty_docs", "skipped", "sha256"]),
            "num_files": len(rows), "docs": sum(r["docs"] for r in rows), "bytes": sum(r["bytes"] for r in rows),
            "empty_docs": sum(r["empty_docs"] for r in rows), "skipped": sum(r["skipped"] for r in rows),
            "origin": spec.builtin or ", ".join(spec.files),
        },
        data_version=dg.DataVersion(combined_hash([r["sha256"] for r in rows])),
    )


def figures(result: dg.MaterializeResult) -> dict[str, int | float]:
    """The numbers among a result's metadata (what a range's table shows per chunk)."""
    return {k: v for k, v in result.metadata.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}

@contextlib.contextmanager
def failing_as(where: str):
    """Each data asset's error boundary (training.boundary's, for a step): a user error raised inside (a file,
    field or setting named in its message; here also the sources config's, a cleaning recipe's) is the step's
    Failure, one line ``<where>: <message>``, not retried (a retry would read the same input); a bug keeps its
    traceback."""
    try:
        yield
    except dg.Failure:
        raise
    except Exception as exc:  # noqa: BLE001 -- re-raised unless it is the user's
        if not (is_user_error(exc) or isinstance(exc, (SourcesConfigError, RecipeError, CleaningError))):
            raise
        raise dg.Failure(f"{where}: {exc}", allow_retries=False) from None


def per_source(context: dg.AssetExecutionContext, build) -> dg.MaterializeResult:
    """Build every partition (chunk) of the step, logging each one's figures; a run over several reports them all
    (`combined_result`)."""
    results = {}
    for key in context.partition_keys:
        with failing_as(f"{context.asset_key.to_user_string()}[{key}]"):
            results[key] = build(key)
        context.log.info(f"{context.asset_key.to_user_string()}[{key}]: "
                         + ", ".join(f"{k}={v}" for k, v in figures(results[key]).items()))
    return combined_result(results)

def combined_result(results: dict[str, dg.MaterializeResult]) -> dg.MaterializeResult:
    """One result for a partition range: each chunk of a range gets the same metadata, a table row per chunk,
    `<figure>/<chunk>` numbers and `data_version/<chunk>` (the content hash a one-chunk step would report, which
    `python -m pipelines.audit` looks up), and no data version (Dagster derives one from the inputs and the code
    version) since a shared one would be wrong for each.
    """
    keys = list(results)
    figures_of = {source: figures(r) for source, r in results.items()}
    if len(keys) == 1:
        return results[keys[0]]
    names = sorted({k for numbers in figures_of.values() for k in numbers})
    rows = [{"source": source, **{k: numbers.get(k, 0) for k in names}} for source, numbers in figures_of.items()]
    metadata = {"sources": dg.MetadataValue.table(
        [dg.TableRecord(r) for r in rows],
        schema=dg.TableSchema(columns=[dg.TableColumn("source")] + [dg.TableColumn(k, "int") for k in names]))}
    metadata.update({f"{k}/{source}": v for source, numbers in figures_of.items() for k, v in numbers.items()})
    metadata.update({f"{PER_SOURCE_DATA_VERSION}/{source}": dg.MetadataValue.text(r.data_version.value)
                     for source, r in results.items()})
    return dg.MaterializeResult(metadata=metadata)

@versioned_asset(partitions_def=source_chunks, group_name="data", kinds={"json"}, owners=["team:kiln"],
                 tags={"stage": "ingest"}, backfill_policy=dg.BackfillPolicy.single_run())
def raw_corpus(context: dg.AssetExecutionContext, storage: KilnStorage) -> dg.MaterializeResult:
    """A validated copy of one chunk's documents under `data/raw/<chunk>/` (a whole source unless it sets
    `files_per_chunk`).

    Built-in sources are written offline from the Python standard library; file sources (JSONL,
    JSON arrays, Parquet) are copied as `part-NNNNN<suffix>`. Every record is validated: with the
    source's `on_bad_line: error` a bad one fails the step, naming `file:line`; with `skip` it is
    counted here and quarantined by `token_shards`. The `raw_files_sensor` registers the chunks as
    files appear and re-materializes a chunk when one of its files changes.
    """
    return per_source(context, lambda key: _ingest_chunk(storage, key))

@versioned_asset(deps=[raw_corpus, CLEAN_CORPUS], group_name="data", kinds={"sentencepiece"}, owners=["team:kiln"],
                 tags={"stage": "tokenizer"})
def tokenizer(context: dg.AssetExecutionContext, storage: KilnStorage,
              tokenizer_settings: TokenizerSettings) -> dg.MaterializeResult:
    """A sentencepiece model trained on a seeded, bounded sample of every source's documents: cleaned ones
    (clean_corpus) for a source with a cleaning recipe, raw ones for a source with `cleaning: none`."""
    with failing_as("tokenizer"):
        return _train_tokenizer(storage, tokenizer_settings)


def _train_tokenizer(storage: KilnStorage, tokenizer_settings: TokenizerSettings) -> dg.MaterializeResult:
    sources = load_sources(storage.sources_config)
    inputs = [(name, path) for name in sorted(sources) for key in source_chunk_keys(storage, sources[name])
              for path in chunk_inputs(storage, key)[0]]

    def documents():
        for name, path in inputs:
            yield from iter_texts(path, sources[name].json_keys, sources[name].on_bad_line)

    final = storage.tokenizer_prefix()
    # .model and .vocab are a pair: both are written into a staging directory that replaces the tokenizer's
    staging = final.parent.with_name(f".{final.parent.name}.staging")
    shutil.rmtree(staging, ignore_errors=True)
    trained_on = [str(p.relative_to(storage.root)) for _, p in inputs]
    try:
        stats = tokenizer_settings.train(documents(), staging / final.name)
        write_json_atomic(staging / TRAINED_ON, trained_on)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    replace_dir(staging, final.parent)
    model_path = final.with_suffix(".model")
    digest = sha256_file(model_path)
    special = {**SPECIAL_IDS, "eod": SPECIAL_IDS["eos"]}
    return dg.MaterializeResult(
        metadata={
            "model_path": dg.MetadataValue.path(str(model_path)), "sha256": dg.MetadataValue.text(digest),
            "bytes": model_path.stat().st_size, "vocab_size": tokenizer_settings.vocab_size,
            "model_type": tokenizer_settings.model_type, "special_ids": dg.MetadataValue.json(special),
            "sample_lines": stats["sample_lines"], "sample_chars": stats["sample_chars"],
            "seed": tokenizer_settings.seed,
            "trained_on": dg.MetadataValue.path(str(final.parent / TRAINED_ON)), "trained_on_files": len(trained_on),
        },
        data_version=dg.DataVersion(digest),
    )

TRAINED_ON = "trained_on.json"  # next to the tokenizer model: the raw files its sample was drawn from

def shard_dir(storage: KilnStorage, key: str) -> Path:
    """`shards/<chunk>/`: every shard of the chunk, its sidecar and its quarantine file."""
    return storage.root / "shards" / key

def shards_hash(shards: list[dict]) -> str:
    return combined_hash([digest for s in shards for digest in (s["bin_sha256"], s["idx_sha256"])])

def _histogram_table(histogram: dict[str, int]) -> dg.MetadataValue:
    schema = dg.TableSchema(columns=[dg.TableColumn("tokens"), dg.TableColumn("docs", "int")])
    return dg.MetadataValue.table([dg.TableRecord({"tokens": k, "docs": v}) for k, v in histogram.items()],
                                  schema=schema)

def raw_file_hashes(storage: KilnStorage, key: str, files: list[Path]) -> dict[str, str]:
    """The sha256 of each of the chunk's raw files, by name: raw_corpus's sidecar's for a file that still has the
    size and modification time recorded beside it (raw_corpus hashed it as it wrote it), else hashed again.
    Reading a chunk a second time only to hash it cost a backfill ~1.3 CPU-s per GiB (docs/data.md)."""
    sidecar = storage.raw_dir(key) / f"{key_stem(key)}{SIDECAR}"
    try:
        recorded = {Path(row["path"]).name: row for row in json.loads(sidecar.read_text())["files"]}
    except (OSError, ValueError, KeyError, TypeError):
        recorded = {}  # hash every file: what it says is unknown
    hashes = {}
    for path in files:
        row, stat = recorded.get(path.name, {}), path.stat()
        unchanged = (row.get("bytes"), row.get("mtime_ns")) == (stat.st_size, stat.st_mtime_ns) and "sha256" in row
        hashes[path.name] = row["sha256"] if unchanged else sha256_file(path)
    return hashes


def clean_file_records(storage: KilnStorage, key: str, cleaning: dict | None) -> list[dict]:
    """The cleaned files a chunk's shards hold, with the recipe and cleaning code that made them (lineage)."""
    if cleaning is None:
        return []
    return [{"path": str((clean_dir(storage, key) / o["name"]).relative_to(storage.root)), "chunk": key,
             "sha256": o["sha256"], "bytes": o["bytes"], "raw_sha256": o["raw_sha256"],
             "recipe": cleaning["recipe"]["name"], "recipe_sha256": cleaning["recipe_sha256"],
             "code_version": cleaning["code_version"]} for o in cleaning["outputs"]]


def _tokenize_chunk(storage: KilnStorage, key: str, log, workers: int | None = None) -> dg.MaterializeResult:
    source = source_of(key)
    spec = _source_spec(storage, source)
    inputs = raw_files(storage, key)
    model_path = storage.tokenizer_prefix().with_suffix(".model")
    if not model_path.exists():
        raise dg.Failure(f"no tokenizer at {model_path}; materialize `tokenizer` first")
    target = shard_dir(storage, key)
    staging = target.with_name(f".{target.name}.staging")
    shutil.rmtree(staging, ignore_errors=True)
    stem = key_stem(key)
    tokenized, cleaning = chunk_inputs(storage, key)
    try:
        raw_hashes = raw_file_hashes(storage, key, inputs)
        stats = tokenize_to_indexed(tokenized, model_path, staging / stem, json_keys=spec.json_keys,
                                    append_eod=True, on_bad_line=spec.on_bad_line,
                                    max_shard_tokens=spec.max_shard_tokens, workers=workers)
        shards = [{"prefix": str((target / Path(out["prefix"]).name).relative_to(storage.root)), "chunk": key,
                   "dtype": stats["dtype"], **{k: out[k] for k in SHARD_STATS}} for out in stats["outputs"]]
        sidecar = {
            "source": source, "chunk": key, "docs": stats["docs"], "tokens": stats["tokens"],
            "dtype": stats["dtype"], "shards": shards,
            "tokenizer": {"path": str(model_path.relative_to(storage.root)), "sha256": sha256_file(model_path)},
            "raw_files": [{"path": str(p.relative_to(storage.root)), "chunk": key, "sha256": raw_hashes[p.name],
                           "bytes": p.stat().st_size} for p in inputs],
            "clean_files": clean_file_records(storage, key, cleaning),
        }
        write_json_atomic(staging / f"{stem}{SIDECAR}", sidecar)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    replace_dir(staging, target)
    log.info(f"token_shards[{key}]: {stats['docs']} docs, {stats['tokens']} tokens in {len(shards)} "
             f"shard(s), {stats['tokens_per_s']:.0f} tokens/s, {stats['skipped']} bad record(s) skipped")
    metadata = {
        "chunk": dg.MetadataValue.text(key),
        "dir": dg.MetadataValue.path(str(target)), "docs": stats["docs"], "tokens": stats["tokens"],
        "dtype": stats["dtype"], "bytes": sum(s["bin_bytes"] + s["idx_bytes"] for s in shards),
        "tokens_per_s": round(stats["tokens_per_s"], 1), "num_shards": len(shards),
        "shards": files_table(shards, ["prefix", "chunk", "key", "docs", "tokens", "bin_bytes", "idx_bytes", "bin_sha256",
                                       "idx_sha256"]),
        "tokenizer_sha256": dg.MetadataValue.text(sidecar["tokenizer"]["sha256"]),
        "sidecar": dg.MetadataValue.path(str(target / f"{stem}{SIDECAR}")),  # every shard and raw file
        "num_raw_files": len(sidecar["raw_files"]),
        "empty_docs": stats["empty_docs"], "skipped": stats["skipped"],
        "skipped_by_reason": dg.MetadataValue.json(stats["skipped_by_reason"]),
        "length_histogram": _histogram_table(stats["length_histogram"]),
    }
    if stats["quarantine"]:
        metadata["quarantine"] = dg.MetadataValue.path(str(target / Path(stats["quarantine"]).name))
    return dg.MaterializeResult(metadata=metadata, data_version=dg.DataVersion(shards_hash(shards)))

class ChunkStepConfig(dg.Config):
    """How a run over many chunks is cut into steps (`token_shards`' fan-out op, chunks_of_run)."""
    step_mib: float = 512.0  # raw MiB a step tokenizes at least (contiguous chunks); 0: a step per chunk

@dataclasses.dataclass(frozen=True)
class ChunkStep:
    """What one tokenizing step does: these chunks, in order, each with this many tokenizing processes."""
    chunks: tuple[str, ...]
    workers: int

    @property
    def mapping_key(self) -> str:
        """The step's name in its key, `token_shards.tokenize_chunks[<first>_to_<last>]` (or `[<chunk>]`)."""
        ends = self.chunks[:1] if len(self.chunks) == 1 else (self.chunks[0], self.chunks[-1])
        return re.sub(r"\W", "_", "_to_".join(ends))

def chunk_steps(storage: KilnStorage, keys: list[str], step_mib: float) -> list[ChunkStep]:
    """The run's chunks cut into steps of about `step_mib` raw MiB each (`chunks.group_chunks`); each step
    tokenizes with the cores shared by the steps the executor runs at once (as many steps as there are cores by
    default), so steps do not fight for cores."""
    if step_mib < 0:
        raise dg.Failure(f"chunks_of_run config step_mib must be >= 0, got {step_mib}")
    sizes = {key: sum(p.stat().st_size for p in raw_files(storage, key)) for key in keys}
    groups = group_chunks(sizes, int(step_mib * 2**20))
    cores = os.cpu_count() or 1
    workers = max(1, cores // min(len(groups), cores))
    return [ChunkStep(tuple(group), workers) for group in groups]

@dg.op(ins={"raw_corpus": dg.In(dg.Nothing), "clean_corpus": dg.In(dg.Nothing), "tokenizer": dg.In(dg.Nothing)},
       out=dg.DynamicOut(ChunkStep))
def chunks_of_run(context: dg.OpExecutionContext, config: ChunkStepConfig, storage: KilnStorage):
    """One output per group of contiguous chunks of the run's partition range: each is tokenized by a step of
    its own."""
    for step in chunk_steps(storage, list(context.partition_keys), config.step_mib):
        yield dg.DynamicOutput(step, mapping_key=step.mapping_key)

@dg.op(tags={"stage": "tokenize"})
def tokenize_chunks(context: dg.OpExecutionContext, storage: KilnStorage,
                    step: ChunkStep) -> list[tuple[str, dict, str]]:
    """(chunk, metadata, data version) of each chunk of the step: an op's MaterializeResult would be taken for
    the asset's own."""
    results = []
    for key in step.chunks:
        with failing_as(f"token_shards[{key}]"):
            result = _tokenize_chunk(storage, key, context.log, workers=step.workers)
        results.append((key, dict(result.metadata), result.data_version.value))
    return results

@dg.op(out=dg.Out(dg.Nothing))
def shards_of_run(context: dg.OpExecutionContext, steps: list[list[tuple[str, dict, str]]]):
    """The asset's materialization of every chunk of the run, from the tokenizing steps' results (which logged
    each chunk's figures: one event per chunk fewer here, on the run's critical path)."""
    by_key = {key: dg.MaterializeResult(metadata=metadata, data_version=dg.DataVersion(version))
              for results in steps for key, metadata, version in results}
    result = combined_result({key: by_key[key] for key in context.partition_keys})
    yield dg.Output(None, metadata=result.metadata, data_version=result.data_version)

@dg.graph_asset(
    partitions_def=source_chunks, ins={"raw_corpus": dg.AssetIn(dagster_type=dg.Nothing),
                                       "clean_corpus": dg.AssetIn(key=CLEAN_CORPUS, dagster_type=dg.Nothing),
                                       "tokenizer": dg.AssetIn(dagster_type=dg.Nothing)},
    group_name="data", kinds={"numpy"}, owners=["team:kiln"], tags={"stage": "tokenize", "format": "megatron-indexed"},
    backfill_policy=dg.BackfillPolicy.single_run(), automation_condition=EAGER_AFTER_CHECKS,
    code_version=code_version("token_shards"))
def token_shards(raw_corpus, clean_corpus, tokenizer):
    """Each chunk tokenized into Megatron `.bin/.idx` datasets (EOD after every document).

    `shards/<chunk>/<stem>_<key>_document` per json key, or `..._document_00000`, ... with the
    source's `max_shard_tokens`; bad records skipped under `on_bad_line: skip` are listed in
    `<stem>_quarantine.jsonl`. The directory is built aside and swapped in whole. A run over many chunks
    (a backfill) fans out into `tokenize_chunks` steps, each over contiguous chunks of at least `step_mib` raw
    MiB in all (`chunks_of_run`'s config; 0: a step per chunk), run side by side by the executor (the
    multiprocess executor: as many at once as there are cores). Re-materialized automatically (eager) when
    its raw chunk or the tokenizer changes.
    """
    return shards_of_run(chunks_of_run(raw_corpus=raw_corpus, clean_corpus=clean_corpus, tokenizer=tokenizer)
                         .map(tokenize_chunks).collect())

def _blend_summary(manifest: dict, total: int) -> str:
    lines = [f"**{len(manifest['sources'])} sources, {total:,} tokens**, sequences of {manifest['seq_length']} "
             f"tokens, split {manifest['split']}", ""]
    lines += [f"- `{s['name']}`: weight {s['weight']:.1%}, {s['tokens']:,} tokens ({s['tokens'] / total:.1%}) "
              f"in {len(s['shards'])} shard(s)" for s in manifest["sources"]]
    return "\n".join(lines)

class BlendConfig(dg.Config):
    seq_length: int = 128
    split: str = "98,2,0"
    seed: int = 1234

def read_shard_sidecar(storage: KilnStorage, key: str) -> dict:
    path = shard_dir(storage, key) / f"{key_stem(key)}{SIDECAR}"
    if not path.exists():
        raise dg.Failure(f"no shards for {key!r} ({path} missing); materialize token_shards[{key}]")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise dg.Failure(f"{path}: unreadable shard sidecar ({exc}); materialize token_shards[{key}] again",
                         allow_retries=False) from None

def source_shards(storage: KilnStorage, spec) -> dict:
    """A source's shards and raw files, gathered from its chunks' sidecars in chunk order."""
    keys = source_chunk_keys(storage, spec)
    if not keys:
        raise dg.Failure(f"source {spec.name!r} has no chunk yet: let raw_files_sensor register its files "
                         f"(or run `python -m pipelines.pools`)")
    sidecars = {key: read_shard_sidecar(storage, key) for key in keys}
    return {"shards": [shard for s in sidecars.values() for shard in s["shards"]],
            "raw_files": [raw for s in sidecars.values() for raw in s["raw_files"]],
            "clean_files": [clean for s in sidecars.values() for clean in s.get("clean_files", [])],
            "tokenizers": {key: s["tokenizer"]["sha256"] for key, s in sidecars.items()}}

@versioned_asset(deps=[token_shards, tokenizer], group_name="data", kinds={"json"}, owners=["team:kiln"],
                 tags={"stage": "blend"}, automation_condition=EAGER_AFTER_CHECKS)
def blend_manifest(context: dg.AssetExecutionContext, config: BlendConfig,
                   storage: KilnStorage) -> dg.MaterializeResult:
    """`manifest.json`: every source's shards (of all its chunks) with normalized weights, ready for
    `train_dataset`; a source's weight is split over its shards by tokens.

    Re-materialized automatically (eager) once every chunk's shards are up to date again.
    """
    with failing_as("blend_manifest"):
        return _blend(config, storage)


def _blend(config: BlendConfig, storage: KilnStorage) -> dg.MaterializeResult:
    sources = load_sources(storage.sources_config)
    sidecars = {name: source_shards(storage, sources[name]) for name in sorted(sources)}
    tokenizer_shas = {sha for s in sidecars.values() for sha in s["tokenizers"].values()}
    model_path = storage.tokenizer_prefix().with_suffix(".model")
    current = sha256_file(model_path)
    stale = [key for s in sidecars.values() for key, sha in s["tokenizers"].items() if sha != current]
    if stale:
        raise dg.Failure(f"shards of {stale} were tokenized with another tokenizer than {model_path} "
                         f"(sha256 {sorted(tokenizer_shas)} vs {current}); re-materialize token_shards for them")
    manifest = build_manifest(
        sources=[{"name": name, "weight": sources[name].weight, "shards": s["shards"], "raw_files": s["raw_files"],
                  "clean_files": s["clean_files"]} for name, s in sidecars.items()],
        tokenizer={"path": str(model_path), "sha256": current, "special_ids": {**SPECIAL_IDS, "eod": SPECIAL_IDS["eos"]}},
        seq_length=config.seq_length, split=config.split, seed=config.seed, data_root=storage.root)
    path = storage.manifest_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, manifest)
    digest = sha256_file(path)
    total = sum(s["tokens"] for s in manifest["sources"])
    rows = [{"source": s["name"], "weight": f"{s['weight']:.4f}", "tokens": s["tokens"],
             "token_share": f"{s['tokens'] / total:.4f}"} for s in manifest["sources"]]
    schema = dg.TableSchema(columns=[dg.TableColumn("source"), dg.TableColumn("weight"),
                                     dg.TableColumn("tokens", "int"), dg.TableColumn("token_share")])
    return dg.MaterializeResult(
        metadata={
            "manifest_path": dg.MetadataValue.path(str(path)), "sha256": dg.MetadataValue.text(digest),
            "summary": dg.MetadataValue.md(_blend_summary(manifest, total)),
            "sources": dg.MetadataValue.table([dg.TableRecord(r) for r in rows], schema=schema),
            "total_tokens": total, "seq_length": config.seq_length, "split": config.split,
            "seed": config.seed,
            # Dagster's input event pointer is wrong for partitioned parents: record what we read
            "shard_data_versions": dg.MetadataValue.json(
                {key: shards_hash([shard for shard in s["shards"] if shard["chunk"] == key])
                 for s in sidecars.values() for key in s["tokenizers"]}),
            **{f"tokens/{s['name']}": s["tokens"] for s in manifest["sources"]},
        },
        data_version=dg.DataVersion(digest),
    )
