"""Automation: changed raw files re-ingest their chunk; shards and manifest follow on their own.

``raw_files_sensor`` groups new files of a chunked source into chunks and registers them as
``source_chunks`` partitions (assets/chunks.py), hashes every chunk's files (re-hashing a file only when
its size or mtime moved) and requests ``raw_corpus[<chunk>]`` when a hash changed or a known source got a
new chunk, and ``clean_corpus[<chunk>]`` when only its source's cleaning recipe changed (a recipe file's
content: its name alone is in the source's spec); its cursor holds three digests per chunk (about 400 bytes),
however many files a chunk has; ``clean_corpus``, ``token_shards`` and ``blend_manifest`` carry
``AutomationCondition.eager()``, evaluated by ``kiln_automation``, declared here because Dagster's default
automation sensor ships stopped. Training is only started
automatically when ``KILN_AUTO_TRAIN=1`` gives ``training_run`` its eager condition.
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
from assets.cleaning import clean_corpus
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


def recipe_state(spec: SourceSpec, sources_config: str) -> str:
    """The sha256 of the source's cleaning recipe as it resolves now ("none": not cleaned)."""
    recipe = source_recipe(spec, sources_config)
    return "none" if recipe is None else recipe.sha256


@dg.sensor(target=dg.AssetSelection.assets(raw_corpus, clean_corpus), minimum_interval_seconds=30,
           default_status=AUTOMATION_STATUS,
           description="Registers new chunks of the sources' files and re-materializes raw_corpus[<chunk>] when a "
                       "file of the chunk changes (by sha256) or a known source gets a new chunk, and "
                       "clean_corpus[<chunk>] when only the source's cleaning recipe changed.")
def raw_files_sensor(context: dg.SensorEvaluationContext, storage: KilnStorage) -> dg.SensorResult:
    cursor = json.loads(context.cursor) if context.cursor else {}
    try:
        sources = load_sources(storage.sources_config)
    except SourcesConfigError as exc:
        return dg.SensorResult(skip_reason=str(exc))
    requests, states, new_keys = [], {}, []
    registered = set(context.instance.get_dynamic_partitions(source_chunks.name))
    known_sources = {source_of(key) for key in cursor}
    for name, spec in sorted(sources.items()):
        try:
            keys = assign_source_chunks(storage, spec)
        except (SourcesConfigError, ChunkError, OSError) as exc:
            context.log.warning(f"source {name}: {exc}")
            states.update({key: state for key, state in cursor.items() if source_of(key) == name})
            continue
        new_keys += [key for key in keys if key not in registered]
        recipe = recipe_state(spec, storage.sources_config)
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
            states[key] = {**states[key], "recipe": recipe}
            known = cursor.get(key, {})
            if name in known_sources and known.get("content") != states[key]["content"]:
                requests.append(dg.RunRequest(partition_key=key, run_key=f"{key}:{states[key]['content'][:16]}",
                                              asset_selection=[raw_corpus.key]))  # its cleaning follows (eager)
            elif known.get("recipe", recipe) != recipe:  # a cursor from before recipes were recorded: no change
                requests.append(dg.RunRequest(partition_key=key, run_key=f"{key}:recipe:{recipe[:16]}",
                                              asset_selection=[clean_corpus.key]))
    return dg.SensorResult(run_requests=requests, cursor=json.dumps(states),
                           dynamic_partitions_requests=[source_chunks.build_add_request(new_keys)] if new_keys else [])


kiln_automation = dg.AutomationConditionSensorDefinition(
    "kiln_automation",
    target=dg.AssetSelection.assets(clean_corpus, token_shards, blend_manifest, training_run, checkpoint_eval),
    default_status=AUTOMATION_STATUS, minimum_interval_seconds=30,
    description="Evaluates the eager conditions of clean_corpus, token_shards, blend_manifest and checkpoint_eval "
                "(a new checkpoint partition is evaluated), and of training_run with KILN_AUTO_TRAIN=1.")
