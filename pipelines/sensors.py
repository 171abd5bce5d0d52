"""Automation: changed raw files re-ingest their chunk; shards and manifest follow on their own.

``raw_files_sensor`` groups new files of a chunked source into chunks and registers them as
``source_chunks`` partitions (assets/chunks.py), hashes every chunk's files (re-hashing a file only when
its size or mtime moved) and requests ``raw_corpus[<chunk>]`` when a hash changed or a known source got a
new chunk, and ``clean_corpus[<chunk>]`` for every chunk of a source whose cleaning recipe changed (a recipe
file's content: its name alone is in the source's spec) and of every source in its dedup groups, old and new
(dedup is global: the copy kept can move between sources); its cursor holds a few digests per chunk (about
230 bytes), however many files a chunk has; ``clean_corpus``, ``token_shards`` and ``blend_manifest`` carry
Dagster's eager condition, firing on an input's changed data version (assets/data.py EAGER_AFTER_CHECKS),
evaluated by ``kiln_automation``, declared here because Dagster's default automation sensor ships stopped.
Training is only started automatically when ``KILN_AUTO_TRAIN=1`` gives ``training_run`` its eager condition.
Both sensors ship running; ``KILN_AUTOMATION=off`` ships them stopped (the UI tests click every
materialization themselves and must not race automation).
"""
import hashlib
import json
import os
from dataclasses import asdict
from pathlib import Path

import dagster as dg

from assets.chunks import ChunkError, assign_source_chunks, key_stem, source_chunks, source_of
from assets.cleaning import clean_corpus, dedup_group
from assets.data import blend_manifest, raw_corpus, token_shards
from assets.evaluation import checkpoint_eval
from assets.sources import SourcesConfigError, SourceSpec, load_sources, source_recipe
from assets.training import training_run
from resources.storage import KilnStorage
from training.atomic import write_json_atomic
from training.data.hashing import sha256_file

AUTOMATION_STATUS = (dg.DefaultSensorStatus.STOPPED if os.environ.get("KILN_AUTOMATION") == "off"
                     else dg.DefaultSensorStatus.RUNNING)


def _digest(*parts) -> str:
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()


def source_state(spec: SourceSpec, files: list[Path], known: dict, hashes_path: Path) -> dict:
    """``{"stat": ..., "content": ...}`` of a chunk: digests of its source's spec with the chunk's ``files``' sizes
    and mtimes, and with their sha256s. ``known`` is the previous state: while no size or mtime moved nothing is
    read. Else the files whose size or mtime moved are re-hashed; the per-file hashes are kept in
    ``hashes_path`` (one file per chunk, replaced), not in the cursor, which Dagster stores again every tick."""
    spec_json = json.dumps(asdict(spec), sort_keys=True)
    stats = {str(path): [stat.st_size, stat.st_mtime_ns] for path, stat in ((p, p.stat()) for p in files)}
    stat = _digest(spec_json, sorted(stats.items()))
    if known.get("stat") == stat:
        return known
    try:
        previous = json.loads(hashes_path.read_text())
    except (OSError, json.JSONDecodeError):  # none yet, or unreadable: every file is hashed again
        previous = {}
    hashes = {path: previous[path][2] if previous.get(path, [None, None])[:2] == entry else sha256_file(Path(path))
              for path, entry in stats.items()}
    write_json_atomic(hashes_path, {path: [*stats[path], digest] for path, digest in hashes.items()})
    return {"stat": stat, "content": _digest(spec_json, sorted(hashes.items()))}


def sensor_hashes_path(storage: KilnStorage, key: str) -> Path:
    return storage.root / ".kiln" / "raw_files_sensor" / f"{key_stem(key)}.json"


def recipe_state(spec: SourceSpec, sources_config: str) -> dict:
    """The source's cleaning recipe as it resolves now: its sha256 ("none": not cleaned) and its dedup group."""
    recipe = source_recipe(spec, sources_config)
    group = dedup_group(recipe)
    return {"recipe": "none" if recipe is None else recipe.sha256, "group": group and _digest(group)[:16]}


def recleaned_by_recipes(states: dict, cursor: dict) -> tuple[list[str], str]:
    """The chunks a recipe change re-cleans, and a digest of the change: every chunk of a source whose recipe
    changed, and every chunk of the dedup groups such a source took part in or takes part in now (a recipe change
    in one source can change which copy of a duplicate is kept in another's chunks)."""
    known = {key: state for key, state in states.items() if key in cursor}  # a chunk seen first is not ingested
    changed = {key: (cursor[key]["recipe"], state["recipe"]) for key, state in known.items()
               if cursor[key].get("recipe", state.get("recipe")) != state.get("recipe")}  # none recorded: no change
    groups = {group for key in changed for group in (cursor[key].get("group"), states[key]["group"])} - {None}
    keys = sorted(key for key, state in known.items() if key in changed or state.get("group") in groups)
    return keys, _digest(sorted({(source_of(key), *recipes) for key, recipes in changed.items()}))


@dg.sensor(target=dg.AssetSelection.assets(raw_corpus, clean_corpus), minimum_interval_seconds=30,
           default_status=AUTOMATION_STATUS,
           description="Registers new chunks of the sources' files and re-materializes raw_corpus[<chunk>] when a "
                       "file of the chunk changes (by sha256) or a known source gets a new chunk, and "
                       "clean_corpus[<chunk>] of every chunk a cleaning recipe change can change: its "
                       "source's and its dedup groups'.")
def raw_files_sensor(context: dg.SensorEvaluationContext, storage: KilnStorage) -> dg.SensorResult:
    cursor = json.loads(context.cursor) if context.cursor else {}
    try:
        sources = load_sources(storage.sources_config)
    except SourcesConfigError as exc:
        return dg.SensorResult(skip_reason=str(exc))
    requests, states, new_keys, reingested = [], {}, [], set()
    registered = set(context.instance.get_dynamic_partitions(source_chunks.name))
    known_sources = {source_of(key) for key in cursor}
    for name, spec in sorted(sources.items()):
        try:
            keys = assign_source_chunks(storage, spec)
            recipe = recipe_state(spec, storage.sources_config)
        except (SourcesConfigError, ChunkError, OSError) as exc:
            context.log.warning(f"source {name}: {exc}")
            states.update({key: state for key, state in cursor.items() if source_of(key) == name})
            continue
        new_keys += [key for key in keys if key not in registered]
        for key, files in keys.items():
            try:
                states[key] = source_state(spec, files, cursor.get(key, {}), sensor_hashes_path(storage, key))
            except OSError as exc:
                context.log.warning(f"chunk {key}: {exc}")
                if key in cursor:
                    states[key] = cursor[key]
                continue
            # the first sight of a source only records it: its first ingest is the user's or the schedule's; a
            # new chunk of a known source (files added) is ingested, as is a chunk whose files changed
            states[key] = {**states[key], **recipe}
            if name in known_sources and cursor.get(key, {}).get("content") != states[key]["content"]:
                reingested.add(key)
                requests.append(dg.RunRequest(partition_key=key, run_key=f"{key}:{states[key]['content'][:16]}",
                                              asset_selection=[raw_corpus.key]))  # its cleaning follows (eager)
    # a run per chunk: each records its own data version (one over a range records one for all), and a chunk
    # re-cleaned to the same bytes keeps it, so its shards stay as they are
    recleaned, change = recleaned_by_recipes(states, cursor)
    requests += [dg.RunRequest(partition_key=key, run_key=f"{key}:recipe:{change[:16]}",
                               asset_selection=[clean_corpus.key]) for key in recleaned if key not in reingested]
    return dg.SensorResult(run_requests=requests, cursor=json.dumps(states),
                           dynamic_partitions_requests=[source_chunks.build_add_request(new_keys)] if new_keys else [])


kiln_automation = dg.AutomationConditionSensorDefinition(
    "kiln_automation",
    target=dg.AssetSelection.assets(clean_corpus, token_shards, blend_manifest, training_run, checkpoint_eval),
    default_status=AUTOMATION_STATUS, minimum_interval_seconds=30,
    description="Evaluates the eager conditions of clean_corpus, token_shards, blend_manifest and checkpoint_eval "
                "(a new checkpoint partition is evaluated), and of training_run with KILN_AUTO_TRAIN=1.")
