"""Blocking asset checks on the data chain and the audit check on checkpoints.

A failing blocking check stops the assets downstream of it in the same run (and marks the run failed),
so a corrupt shard never reaches a blend and a blend naming a changed shard never reaches training.
"""
from pathlib import Path

import dagster as dg

from assets.chunks import source_chunks
from assets.data import blend_manifest, read_shard_sidecar, token_shards
from assets.training import audit_evaluation, checkpoint, checkpoint_dir
from resources.storage import KilnStorage
from training.data.hashing import sha256_file
from training.data.indexed import IndexedDataset, IndexedDatasetError
from training.data.manifest import ManifestError, load_manifest


def shard_problems(storage: KilnStorage, key: str) -> tuple[list[str], list[dict]]:
    """Every shard of the chunk ``key``: the .idx parses and .bin size == sum(sequence lengths) x dtype size."""
    problems, rows = [], []
    try:
        sidecar = read_shard_sidecar(storage, key)
    except dg.Failure as exc:
        return [exc.description], rows
    for shard in sidecar["shards"]:
        prefix = storage.root / shard["prefix"]
        bin_path = Path(f"{prefix}.bin")
        try:
            dataset = IndexedDataset(prefix)
        except IndexedDatasetError as exc:
            problems.append(str(exc))
            continue
        expected = int(dataset.sequence_lengths.astype("int64").sum()) * dataset.dtype.itemsize
        actual = bin_path.stat().st_size
        if actual != expected:
            problems.append(f"{bin_path}: {actual} bytes, expected {expected} "
                            f"(sum of sequence lengths x {dataset.dtype.itemsize})")
        rows.append({"prefix": shard["prefix"], "sequences": len(dataset), "bin_bytes": actual})
    return problems, rows


def _result(problems: list[str], metadata: dict) -> dg.AssetCheckResult:
    if problems:
        metadata["problems"] = dg.MetadataValue.md("\n".join(f"- {p}" for p in problems))
    return dg.AssetCheckResult(passed=not problems, metadata=metadata)


def run_sources(context: dg.AssetCheckExecutionContext) -> list[str]:
    """The chunks the run materialized: its partition, its partition range, or (a check run alone) all."""
    tags, keys = context.run.tags, context.instance.get_dynamic_partitions(source_chunks.name)
    if "dagster/partition" in tags:
        return [tags["dagster/partition"]]
    if "dagster/asset_partition_range_start" in tags:
        start = keys.index(tags["dagster/asset_partition_range_start"])
        return keys[start:keys.index(tags["dagster/asset_partition_range_end"]) + 1]
    return keys


@dg.asset_check(asset=token_shards, blocking=True,
                description="Every shard's .idx parses and its .bin holds exactly sum(lengths) x dtype bytes.")
def shards_are_well_formed(context: dg.AssetCheckExecutionContext, storage: KilnStorage) -> dg.AssetCheckResult:
    problems, checked, sources = [], 0, run_sources(context)
    for source in sources:
        source_problems, rows = shard_problems(storage, source)
        problems += [f"{source}: {p}" for p in source_problems]
        checked += len(rows)
    return _result(problems, {"sources": ", ".join(sources), "shards_checked": checked})


@dg.asset_check(asset=blend_manifest, blocking=True,
                description="Every shard the manifest references exists with the sha256 it recorded.")
def manifest_shards_match(storage: KilnStorage) -> dg.AssetCheckResult:
    try:
        manifest = load_manifest(storage.manifest_path(), storage.root)
    except ManifestError as exc:
        return _result([str(exc)], {})
    problems, checked = [], 0
    for source in manifest["sources"]:
        for shard in source["shards"]:
            for ext in ("bin", "idx"):
                path = storage.root / f"{shard['prefix']}.{ext}"
                checked += 1
                if not path.is_file():
                    problems.append(f"{source['name']}: {path} is missing")
                elif sha256_file(path) != shard[f"{ext}_sha256"]:
                    problems.append(f"{source['name']}: {path} changed since the manifest was written "
                                    f"(sha256 {shard[f'{ext}_sha256'][:16]}… recorded)")
    return _result(problems, {"files_checked": checked})


@dg.asset_check(asset=checkpoint.key, name="audit",
                description="`kiln audit` of a checkpoint: every file complete with its sha256, and the run "
                            "config, manifest, shards, tokenizer and raw files it trained on unchanged. Every "
                            "checkpoint's result is in its own `audit` metadata; `training_run` records an "
                            "evaluation here for every failed audit, at once, and for the newest checkpoint, so "
                            "this check's status is the newest checkpoint's audit. Executed from here, it audits "
                            "the newest recorded checkpoint.")
def checkpoint_audit(context: dg.AssetCheckExecutionContext, storage: KilnStorage) -> dg.AssetCheckResult:
    newest = context.instance.get_latest_materialization_event(checkpoint.key)
    if newest is None:
        return dg.AssetCheckResult(passed=False, metadata={"error": "no checkpoint recorded yet"})
    partition = newest.dagster_event.partition
    evaluation = audit_evaluation(checkpoint_dir(storage, partition), partition)
    return dg.AssetCheckResult(passed=evaluation.passed, metadata=evaluation.metadata)
