"""``clean_corpus``: each chunk's raw documents through its source's cleaning recipe, deduplicated globally.

Per chunk (``source_chunks``, as ``raw_corpus``): the recipe's filters and each survivor's MinHash signature go
to ``clean/.filtered/<chunk>/`` (phase 1, kept: the global dedup reads every chunk's); the duplicate clusters
are computed in one step over every configured chunk's signatures, in chunk order (phase 2), so the copy kept
is the one of the lowest chunk, file and line wherever the copies are; then ``clean/<chunk>/`` gets the cleaned
JSONL, ``removals.jsonl`` and ``<stem>.kiln.json`` (phase 3). A source with ``cleaning: none`` (the default) is
recorded as its raw files, which the tokenizer and token_shards read as before.

A run over several chunks filters them all before its one dedup step, and first filters again any chunk of its
dedup groups whose stage another recipe or other raw files made (``_outdated_peer_jobs``). A chunk outside the
run whose decisions the clusters now change (a chunk with a lower key appeared, a peer's recipe or files
changed) is listed (``stale_chunks``) and is right again once re-materialized: after a recipe change,
raw_files_sensor requests every chunk of the source's dedup groups (pipelines/sensors.py).
"""

import os
import shutil
from collections import defaultdict

import dagster as dg

from assets.chunks import key_stem, source_chunk_keys, source_chunks, source_of
from assets.data import (EAGER_AFTER_CHECKS, SIDECAR, _source_spec, clean_dir, clean_sidecar, combined_result,
                         failing_as, raw_corpus, raw_file_hashes, raw_files)
from assets.sources import load_sources, source_recipe
from assets.versions import versioned_asset
from resources.storage import KilnStorage
from training.data.cleaning.pipeline import STATS, ChunkStage, Numbering, RawInput
from training.data.cleaning.versions import clean_data_version
from training.data.cleaning.runners import FilterJob, FinalizeJob, LocalRunner, runner
from training.data.cleaning.recipe import Recipe
from training.data.hashing import combined_hash

SAMPLE_ROWS = 3  # removed documents shown per step in an event; every one is in removals.jsonl


def filter_stage(storage: KilnStorage, key: str):
    return storage.root / "clean" / ".filtered" / key_stem(key)


def _filter_job(storage: KilnStorage, key: str, recipe: Recipe) -> FilterJob:
    spec = _source_spec(storage, source_of(key))
    files = raw_files(storage, key)
    hashes = raw_file_hashes(storage, key, files)
    inputs = tuple(RawInput(p, str(p.relative_to(storage.root)), hashes[p.name]) for p in files)
    return FilterJob(recipe, inputs, filter_stage(storage, key), spec.json_keys, spec.on_bad_line)


def dedup_group(recipe: Recipe | None) -> str | None:
    """The dedup group a source with ``recipe`` takes part in, named by its dedup settings: every chunk of every
    source with the same settings is deduplicated together (signatures of other settings are not comparable);
    None: not deduplicated."""
    return None if recipe is None or not recipe.dedups else repr(recipe.spec()["dedup"])


def _dedup_groups(storage: KilnStorage) -> dict[str, list[str]]:
    """Every configured chunk with a filter stage, by dedup group, each group in chunk order."""
    sources = load_sources(storage.sources_config)
    groups: dict[str, list[str]] = defaultdict(list)
    for name in sorted(sources):
        group = dedup_group(source_recipe(sources[name], storage.sources_config))
        if group is None:
            continue
        for key in source_chunk_keys(storage, sources[name]):
            if (filter_stage(storage, key) / STATS).is_file():
                groups[group].append(key)
    return {group: sorted(keys) for group, keys in groups.items()}


def _outdated_peer_jobs(storage: KilnStorage, keys: list[str], recipes: dict) -> list[FilterJob]:
    """Phase 1 again for the chunks outside the run that share a dedup group with one of its chunks and whose
    filter stage no longer matches their source's recipe or raw files (a recipe change whose own chunks' runs
    have not come yet, a re-ingested chunk not re-cleaned yet): the run clusters every peer as it is now, so its
    decisions do not depend on the order the runs of one change come in."""
    groups = {dedup_group(recipes[key]) for key in keys} - {None}
    sources = load_sources(storage.sources_config)
    jobs = []
    for group, members in _dedup_groups(storage).items():
        for key in (members if group in groups else []):
            if key in recipes:
                continue
            job = _filter_job(storage, key, source_recipe(sources[source_of(key)], storage.sources_config))
            stats = ChunkStage.load(key, job.stage).stats
            made_from = (stats["recipe_sha256"], [(f["path"], f["sha256"]) for f in stats["files"]])
            if made_from != (job.recipe.sha256, [(raw.shown, raw.sha256) for raw in job.inputs]):
                jobs.append(job)
    return jobs


def _stale(numbering: Numbering, clusters, storage: KilnStorage, run: set[str]) -> list[str]:
    """Chunks outside the run whose recorded removals as duplicates differ from what the clusters say now."""
    stale = []
    for position, stage in enumerate(numbering.stages):
        recorded = clean_sidecar(storage, stage.key)
        if stage.key in run or recorded is None:
            continue
        start, end = int(numbering.offsets[position]), int(numbering.offsets[position + 1])
        now = int((clusters.kept[start:end] != range(start, end)).sum()) if clusters is not None else 0
        dedup = [s for s in recorded["steps"] if s["step"] == "dedup"]
        if dedup and sum(dedup[0]["removed"].values()) != now:
            stale.append(stage.key)
    return stale


def _steps_table(steps: list[dict]) -> dg.MetadataValue:
    columns = {"step": "string", "docs_in": "int", "docs_out": "int", "bytes_in": "int", "bytes_out": "int",
               "removed": "string"}
    rows = [{**{k: s[k] for k in columns if k != "removed"},
             "removed": ", ".join(f"{reason} {n}" for reason, n in sorted(s["removed"].items()))} for s in steps]
    schema = dg.TableSchema(columns=[dg.TableColumn(c, t) for c, t in columns.items()])
    return dg.MetadataValue.table([dg.TableRecord(r) for r in rows], schema=schema)


def _samples(steps: list[dict]) -> dg.MetadataValue:
    lines = []
    for step in steps:
        for sample in step["samples"][:SAMPLE_ROWS]:
            value = "" if sample.get("value") is None else f" = {sample['value']}"
            text = sample["text"].replace("\n", " ")[:120]
            lines.append(f"- **{step['step']}** {sample['reason']}{value} — `{sample['file']}:{sample['line']}`: {text}")
    return dg.MetadataValue.md("\n".join(lines) or "nothing removed")


def _dedup_summary(sidecar: dict) -> dg.MetadataValue:
    dedup = sidecar["dedup"]
    lines = [f"{dedup['docs_in_clusters']} of this chunk's documents are in duplicate clusters "
             f"(compared with {dedup['chunks_compared']} chunk(s)); largest clusters:"]
    lines += [f"- {c['size']} copies, kept `{c['kept']['file']}:{c['kept']['line']}` ({c['kept']['chunk']})"
              for c in dedup["largest_clusters"]]
    return dg.MetadataValue.md("\n".join(lines))


def _cleaned_result(storage: KilnStorage, key: str, sidecar: dict, stale: list[str]) -> dg.MaterializeResult:
    steps = sidecar["steps"]
    metadata = {
        "chunk": dg.MetadataValue.text(key), "dir": dg.MetadataValue.path(str(clean_dir(storage, key))),
        "sidecar": dg.MetadataValue.path(str(clean_dir(storage, key) / f"{key_stem(key)}{SIDECAR}")),
        "removals": dg.MetadataValue.path(str(clean_dir(storage, key) / sidecar["removals"])),
        "recipe": dg.MetadataValue.text(sidecar["recipe"]["name"]),
        "recipe_sha256": dg.MetadataValue.text(sidecar["recipe_sha256"]),
        "cleaning_code_version": dg.MetadataValue.text(sidecar["code_version"]),
        "docs_in": sidecar["docs_in"], "docs_out": sidecar["docs_out"],
        "raw_bytes": sum(f["bytes"] for f in sidecar["raw_files"]),
        "cleaned_bytes": sum(o["bytes"] for o in sidecar["outputs"]),  # JSONL with each document's raw place
        "steps": _steps_table(steps), "removed_samples": _samples(steps), "dedup": _dedup_summary(sidecar),
        **{f"removed/{s['step']}": s["docs_in"] - s["docs_out"] for s in steps},
    }
    if sidecar["decontamination"]:
        metadata["decontamination"] = dg.MetadataValue.json(sidecar["decontamination"])
    if stale:
        metadata["stale_chunks"] = dg.MetadataValue.text(", ".join(stale))
    version = clean_data_version([o["sha256"] for o in sidecar["outputs"]])
    return dg.MaterializeResult(metadata=metadata, data_version=dg.DataVersion(version))


def _uncleaned_result(storage: KilnStorage, key: str) -> dg.MaterializeResult:
    """A source with `cleaning: none`: its raw files are what the tokenizer reads; nothing is written."""
    files = raw_files(storage, key)
    hashes = raw_file_hashes(storage, key, files)
    shutil.rmtree(clean_dir(storage, key), ignore_errors=True)  # a recipe set before: its output is not used
    return dg.MaterializeResult(
        metadata={"chunk": dg.MetadataValue.text(key), "recipe": dg.MetadataValue.text("none"),
                  "num_files": len(files)},
        data_version=dg.DataVersion(combined_hash(["none", *(hashes[p.name] for p in files)])))


def _finalize(storage: KilnStorage, keys: list[str], recipes: dict, run: LocalRunner) -> dict:
    """Phases 2 and 3 for the run's cleaned chunks: each dedup group's clusters, then each chunk's output."""
    done, stale = {}, []
    alone = [[key] for key in keys if recipes[key] is not None and not recipes[key].dedups]
    for group in [*_dedup_groups(storage).values(), *alone]:
        todo = [key for key in group if key in keys]
        if not todo:
            continue
        stages = [ChunkStage.load(k, filter_stage(storage, k)) for k in group]
        clusters = run.cluster(stages, recipes[todo[0]])
        if clusters is not None:
            stale += _stale(Numbering(stages), clusters, storage, set(keys))
        jobs = [FinalizeJob(tuple((s.key, s.stage) for s in stages), group.index(key), clean_dir(storage, key),
                            key_stem(key), _source_spec(storage, source_of(key)).json_keys) for key in todo]
        done.update(zip(todo, run.finalize(jobs, clusters)))
    return {key: (sidecar, stale) for key, sidecar in done.items()}


# one clean_corpus step at a time (pipelines/pools.py gives the pool one slot): a run filters again the outdated
# stages of its dedup groups and reads every peer's, so the runs a recipe change starts must not write a stage
# another one is reading
CLEANING_POOL = "clean"


class CleanConfig(dg.Config):
    """Where the cleaning runs: this process, or the Ray cluster at `ray_address` (`host:port` of its head;
    default $KILN_RAY_ADDRESS), whose nodes mount the data root at the same path."""
    ray_address: str = os.environ.get("KILN_RAY_ADDRESS", "")


@versioned_asset(partitions_def=source_chunks, deps=[raw_corpus], group_name="data", kinds={"json"},
                 owners=["team:kiln"], tags={"stage": "clean"}, backfill_policy=dg.BackfillPolicy.single_run(),
                 pool=CLEANING_POOL,
                 automation_condition=EAGER_AFTER_CHECKS)
def clean_corpus(context: dg.AssetExecutionContext, config: CleanConfig, storage: KilnStorage) -> dg.MaterializeResult:
    """Each chunk through its source's cleaning recipe (`cleaning:` in the sources config): filters, then exact
    and MinHash dedup over every chunk, decontamination when the recipe asks. `clean/<chunk>/` holds the cleaned
    JSONL and `removals.jsonl` (one line per raw document: kept, or the step that removed it and why; `kiln why
    <raw file>:<line>`). On a Ray cluster with `ray_address` (byte-identical output). Re-materialized
    automatically (eager) when its raw chunk changes."""
    keys = list(context.partition_keys)
    with failing_as("clean_corpus"):  # an error names the file and line, the step, or the Ray address
        sources = load_sources(storage.sources_config)
        recipes = {key: source_recipe(sources[source_of(key)], storage.sources_config) for key in keys}
        run = runner(config.ray_address)
        run.filter([_filter_job(storage, key, recipes[key]) for key in keys if recipes[key] is not None]
                   + _outdated_peer_jobs(storage, keys, recipes))
        finished = _finalize(storage, keys, recipes, run)
    results = {}
    for key in keys:
        results[key] = (_uncleaned_result(storage, key) if recipes[key] is None
                        else _cleaned_result(storage, key, *finished[key]))
        context.log.info(f"clean_corpus[{key}]: " + ", ".join(
            f"{k}={v}" for k, v in results[key].metadata.items() if isinstance(v, int)))
    return combined_result(results)


@dg.asset_check(asset=clean_corpus, blocking=True,
                description="No cleaning step removed more than its recipe's max_removed_share of the documents it "
                            "was given: a broken filter that deletes everything stops the chain here.")
def clean_removals_within_limit(context: dg.AssetCheckExecutionContext, storage: KilnStorage) -> dg.AssetCheckResult:
    from assets.checks import run_sources

    problems, checked = [], 0
    for key in run_sources(context):
        sidecar = clean_sidecar(storage, key)
        if sidecar is None:
            continue
        checked += 1
        for step in sidecar["steps"]:
            share = (step["docs_in"] - step["docs_out"]) / step["docs_in"] if step["docs_in"] else 0.0
            if share > sidecar["max_removed_share"]:
                problems.append(f"{key}: step {step['step']} removed {share:.1%} of {step['docs_in']} documents "
                                f"(max_removed_share {sidecar['max_removed_share']}): "
                                f"{', '.join(f'{r} {n}' for r, n in sorted(step['removed'].items()))}")
    metadata = {"chunks_checked": checked}
    if problems:
        metadata["problems"] = dg.MetadataValue.md("\n".join(f"- {p}" for p in problems))
    return dg.AssetCheckResult(passed=not problems, metadata=metadata)
