"""Data assets: raw corpus → tokenizer → token shards → blend manifest.

Each asset records what it read and wrote (paths, bytes, counts, sha256) and returns a content-hash
``DataVersion``, so Dagster can tell when a downstream asset is stale and an audit can re-verify it.
Outputs are written under a temporary name and renamed, so a failed step never leaves half a file.
"""

import hashlib
import json
import os
import shutil
from pathlib import Path

import dagster as dg

from assets import builtin_corpus
from assets.builtin_corpus import write_builtin_source
from assets.sources import load_sources
from assets.versions import versioned_asset
from resources.storage import PROJECT_ROOT, KilnStorage
from resources import tokenizer as resources_tokenizer
from resources.tokenizer import SPECIAL_IDS, TokenizerSettings
from training.atomic import replace_dir, write_json_atomic
from training.data import corpus, indexed, preprocess
from training.data.corpus import SUFFIXES, iter_texts, scan_corpus
from training.data.hashing import sha256_file
from training.data import manifest as manifest_module
from training.data.manifest import build_manifest
from training.data.preprocess import tokenize_to_indexed

SOURCES_CONFIG = Path(os.environ.get("KILN_SOURCES", PROJECT_ROOT / "configs" / "sources.yaml"))
SOURCES = load_sources(SOURCES_CONFIG)
source_partitions = dg.StaticPartitionsDefinition(sorted(SOURCES))
# `raw/<source>/<source>.kiln.json`: every raw file; `shards/<source>/<source>.kiln.json`: the source's shards and
# what they came from
SIDECAR = ".kiln.json"
SHARD_STATS = ("key", "docs", "tokens", "bin_sha256", "idx_sha256", "bin_bytes", "idx_bytes")  # copied per shard
# automation re-builds an asset only once every blocking check of its inputs passed: a corrupt shard found by
# `shards_are_well_formed` must stop the automatic re-blend as it stops the blend in the same run
EAGER_AFTER_CHECKS = dg.AutomationCondition.eager() & dg.AutomationCondition.all_deps_blocking_checks_passed()

def combined_hash(hashes: list[str]) -> str:
    return hashlib.sha256("".join(hashes).encode()).hexdigest()

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

def raw_files(storage: KilnStorage, source: str) -> list[Path]:
    files = _part_files(storage.raw_dir(source))
    if not files:
        raise dg.Failure(f"no raw files for source {source!r} in {storage.raw_dir(source)}; "
                         f"materialize raw_corpus[{source}] first")
    return files

def _ingest_source(storage: KilnStorage, source: str) -> dg.MaterializeResult:
    spec = _source_spec(storage, source)
    target = storage.raw_dir(source)
    staging = target.with_name(f".{source}.staging")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        if spec.builtin:
            write_builtin_source(spec.builtin, staging, spec.max_bytes)
        else:
            for i, src in enumerate(spec.input_files()):
                # validate before copying: errors name the user's file:line
                scan_corpus(src, spec.json_keys, spec.on_bad_line)
                shutil.copyfile(src, staging / f"part-{i:05d}{src.suffix}")
        rows = [{"path": str((target / p.name).relative_to(storage.root)),
                 **scan_corpus(p, spec.json_keys, spec.on_bad_line)} for p in _part_files(staging)]
        write_json_atomic(staging / f"{source}{SIDECAR}", {"source": source, "files": rows})
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    replace_dir(staging, target)
    return dg.MaterializeResult(
        metadata={
            "dir": dg.MetadataValue.path(str(target)),
            "sidecar": dg.MetadataValue.path(str(target / f"{source}{SIDECAR}")),  # every file, with its sha256
            "files": files_table(rows, ["path", "bytes", "docs", "empty_docs", "skipped", "sha256"]),
            "num_files": len(rows), "docs": sum(r["docs"] for r in rows), "bytes": sum(r["bytes"] for r in rows),
            "empty_docs": sum(r["empty_docs"] for r in rows), "skipped": sum(r["skipped"] for r in rows),
            "origin": spec.builtin or ", ".join(spec.files),
        },
        data_version=dg.DataVersion(combined_hash([r["sha256"] for r in rows])),
    )

PER_SOURCE_DATA_VERSION = "data_version"  # metadata `data_version/<source>` of a step over several sources

def per_source(context: dg.AssetExecutionContext, build) -> dg.MaterializeResult:
    """Build every partition of the step; a run over several sources (the scheduled job) reports them all.

    One step materializes a partition range with one result, so each source of a range gets the same
    metadata: a table row per source, `<figure>/<source>` numbers and `data_version/<source>` (the content
    hash a one-source step would report, which `python -m pipelines.audit` looks up), and no data version (Dagster
    derives one from the inputs and the code version) since a shared one would be wrong for each.
    """
    keys = context.partition_keys
    results = {source: build(source) for source in keys}
    figures = {source: {k: v for k, v in r.metadata.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
               for source, r in results.items()}
    for source, numbers in figures.items():
        context.log.info(f"{context.asset_key.to_user_string()}[{source}]: "
                         + ", ".join(f"{k}={v}" for k, v in numbers.items()))
    if len(keys) == 1:
        return results[keys[0]]
    names = sorted({k for numbers in figures.values() for k in numbers})
    rows = [{"source": source, **{k: numbers.get(k, 0) for k in names}} for source, numbers in figures.items()]
    metadata = {"sources": dg.MetadataValue.table(
        [dg.TableRecord(r) for r in rows],
        schema=dg.TableSchema(columns=[dg.TableColumn("source")] + [dg.TableColumn(k, "int") for k in names]))}
    metadata.update({f"{k}/{source}": v for source, numbers in figures.items() for k, v in numbers.items()})
    metadata.update({f"{PER_SOURCE_DATA_VERSION}/{source}": dg.MetadataValue.text(r.data_version.value)
                     for source, r in results.items()})
    return dg.MaterializeResult(metadata=metadata)

@versioned_asset(_ingest_source, per_source, _part_files, replace_dir, builtin_corpus, corpus, SOURCES_CONFIG,
                 partitions_def=source_partitions, group_name="data", kinds={"json"}, owners=["team:kiln"],
                 tags={"stage": "ingest"}, backfill_policy=dg.BackfillPolicy.single_run())
def raw_corpus(context: dg.AssetExecutionContext, storage: KilnStorage) -> dg.MaterializeResult:
    """A validated copy of one source's documents under `data/raw/<source>/`.

    Built-in sources are written offline from the Python standard library; file sources (JSONL,
    JSON arrays, Parquet) are copied as `part-NNNNN<suffix>`. Every record is validated: with the
    source's `on_bad_line: error` a bad one fails the step, naming `file:line`; with `skip` it is
    counted here and quarantined by `token_shards`. The `raw_files_sensor` re-materializes a file
    source's partition when one of its files changes.
    """
    return per_source(context, lambda source: _ingest_source(storage, source))

@versioned_asset(raw_files, replace_dir, resources_tokenizer, SOURCES_CONFIG, deps=[raw_corpus], group_name="data",
                 kinds={"sentencepiece"}, owners=["team:kiln"], tags={"stage": "tokenizer"})
def tokenizer(context: dg.AssetExecutionContext, storage: KilnStorage,
              tokenizer_settings: TokenizerSettings) -> dg.MaterializeResult:
    """A sentencepiece model trained on a seeded, bounded sample of every source's raw documents."""
    sources = load_sources(storage.sources_config)
    inputs = [(name, path) for name in sorted(sources) for path in raw_files(storage, name)]

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

def shard_dir(storage: KilnStorage, source: str) -> Path:
    """`shards/<source>/`: every shard of the source, its sidecar and its quarantine file."""
    return storage.shard_prefix(source).parent

def shards_hash(shards: list[dict]) -> str:
    return combined_hash([digest for s in shards for digest in (s["bin_sha256"], s["idx_sha256"])])

def _histogram_table(histogram: dict[str, int]) -> dg.MetadataValue:
    schema = dg.TableSchema(columns=[dg.TableColumn("tokens"), dg.TableColumn("docs", "int")])
    return dg.MetadataValue.table([dg.TableRecord({"tokens": k, "docs": v}) for k, v in histogram.items()],
                                  schema=schema)

def _tokenize_source(storage: KilnStorage, source: str, log) -> dg.MaterializeResult:
    spec = _source_spec(storage, source)
    inputs = raw_files(storage, source)
    model_path = storage.tokenizer_prefix().with_suffix(".model")
    if not model_path.exists():
        raise dg.Failure(f"no tokenizer at {model_path}; materialize `tokenizer` first")
    target = shard_dir(storage, source)
    staging = target.with_name(f".{source}.staging")
    shutil.rmtree(staging, ignore_errors=True)
    try:
        stats = tokenize_to_indexed(inputs, model_path, staging / source, json_keys=spec.json_keys,
                                    append_eod=True, on_bad_line=spec.on_bad_line,
                                    max_shard_tokens=spec.max_shard_tokens)
        shards = [{"prefix": str((target / Path(out["prefix"]).name).relative_to(storage.root)),
                   "dtype": stats["dtype"], **{k: out[k] for k in SHARD_STATS}} for out in stats["outputs"]]
        sidecar = {
            "source": source, "docs": stats["docs"], "tokens": stats["tokens"], "dtype": stats["dtype"],
            "shards": shards,
            "tokenizer": {"path": str(model_path.relative_to(storage.root)), "sha256": sha256_file(model_path)},
            "raw_files": [{"path": str(p.relative_to(storage.root)), "sha256": sha256_file(p),
                           "bytes": p.stat().st_size} for p in inputs],
        }
        write_json_atomic(staging / f"{source}{SIDECAR}", sidecar)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    replace_dir(staging, target)
    log.info(f"token_shards[{source}]: {stats['docs']} docs, {stats['tokens']} tokens in {len(shards)} "
             f"shard(s), {stats['tokens_per_s']:.0f} tokens/s, {stats['skipped']} bad record(s) skipped")
    metadata = {
        "dir": dg.MetadataValue.path(str(target)), "docs": stats["docs"], "tokens": stats["tokens"],
        "dtype": stats["dtype"], "bytes": sum(s["bin_bytes"] + s["idx_bytes"] for s in shards),
        "tokens_per_s": round(stats["tokens_per_s"], 1), "num_shards": len(shards),
        "shards": files_table(shards, ["prefix", "key", "docs", "tokens", "bin_bytes", "idx_bytes", "bin_sha256",
                                       "idx_sha256"]),
        "tokenizer_sha256": dg.MetadataValue.text(sidecar["tokenizer"]["sha256"]),
        "sidecar": dg.MetadataValue.path(str(target / f"{source}{SIDECAR}")),  # every shard and raw file
        "num_raw_files": len(sidecar["raw_files"]),
        "empty_docs": stats["empty_docs"], "skipped": stats["skipped"],
        "skipped_by_reason": dg.MetadataValue.json(stats["skipped_by_reason"]),
        "length_histogram": _histogram_table(stats["length_histogram"]),
    }
    if stats["quarantine"]:
        metadata["quarantine"] = dg.MetadataValue.path(str(target / Path(stats["quarantine"]).name))
    return dg.MaterializeResult(metadata=metadata, data_version=dg.DataVersion(shards_hash(shards)))

@versioned_asset(_tokenize_source, per_source, replace_dir, preprocess, indexed, SOURCES_CONFIG,
                 partitions_def=source_partitions, deps=[raw_corpus, tokenizer], group_name="data", kinds={"numpy"},
                 owners=["team:kiln"], tags={"stage": "tokenize", "format": "megatron-indexed"},
                 backfill_policy=dg.BackfillPolicy.single_run(), automation_condition=EAGER_AFTER_CHECKS)
def token_shards(context: dg.AssetExecutionContext, storage: KilnStorage) -> dg.MaterializeResult:
    """One source tokenized into Megatron `.bin/.idx` datasets (EOD after every document).

    `shards/<source>/<source>_<key>_document` per json key, or `..._document_00000`, ... with the
    source's `max_shard_tokens`; bad records skipped under `on_bad_line: skip` are listed in
    `<source>_quarantine.jsonl`. The directory is built aside and swapped in whole. Re-materialized
    automatically (eager) when its raw partition or the tokenizer changes.
    """
    return per_source(context, lambda source: _tokenize_source(storage, source, context.log))

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

def read_shard_sidecar(storage: KilnStorage, source: str) -> dict:
    path = shard_dir(storage, source) / f"{source}{SIDECAR}"
    if not path.exists():
        raise dg.Failure(f"no shards for source {source!r} ({path} missing); materialize token_shards[{source}]")
    return json.loads(path.read_text())

@versioned_asset(read_shard_sidecar, _blend_summary, manifest_module, SOURCES_CONFIG,
                 deps=[token_shards, tokenizer], group_name="data", kinds={"json"}, owners=["team:kiln"],
                 tags={"stage": "blend"}, automation_condition=EAGER_AFTER_CHECKS)
def blend_manifest(context: dg.AssetExecutionContext, config: BlendConfig,
                   storage: KilnStorage) -> dg.MaterializeResult:
    """`manifest.json`: every source's shards with normalized weights, ready for `train_dataset`.

    Re-materialized automatically (eager) once every source's shards are up to date again.
    """
    sources = load_sources(storage.sources_config)
    sidecars = {name: read_shard_sidecar(storage, name) for name in sorted(sources)}
    tokenizer_shas = {s["tokenizer"]["sha256"] for s in sidecars.values()}
    model_path = storage.tokenizer_prefix().with_suffix(".model")
    current = sha256_file(model_path)
    stale = [n for n, s in sidecars.items() if s["tokenizer"]["sha256"] != current]
    if stale:
        raise dg.Failure(f"shards of {stale} were tokenized with another tokenizer than {model_path} "
                         f"(sha256 {sorted(tokenizer_shas)} vs {current}); re-materialize token_shards for them")
    manifest = build_manifest(
        sources=[{"name": name, "weight": sources[name].weight, "shards": s["shards"], "raw_files": s["raw_files"]}
                 for name, s in sidecars.items()],
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
            "shard_data_versions": dg.MetadataValue.json({n: shards_hash(s["shards"]) for n, s in sidecars.items()}),
            **{f"tokens/{s['name']}": s["tokens"] for s in manifest["sources"]},
        },
        data_version=dg.DataVersion(digest),
    )
