"""Automation: changed raw files re-ingest their source; shards and manifest follow on their own.

``raw_files_sensor`` hashes every file source's inputs (re-hashing a file only when its size or mtime
moved) and requests ``raw_corpus[<source>]`` when a hash changed; its cursor holds two digests per
source (about 300 bytes), however many files the sources have; ``token_shards`` and
``blend_manifest`` carry ``AutomationCondition.eager()``, evaluated by ``kiln_automation``, declared
here because Dagster's default automation sensor ships stopped. Training is only started
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

from assets.data import blend_manifest, raw_corpus, source_partitions, token_shards
from assets.evaluation import checkpoint_eval
from assets.sources import SourcesConfigError, SourceSpec, load_sources
from assets.training import training_run
from resources.storage import KilnStorage
from training.atomic import write_json_atomic
from training.data.hashing import sha256_file

AUTOMATION_STATUS = (dg.DefaultSensorStatus.STOPPED if os.environ.get("KILN_AUTOMATION") == "off"
                     else dg.DefaultSensorStatus.RUNNING)


def _digest(*parts) -> str:
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()


def source_state(spec: SourceSpec, known: dict, hashes_path: Path) -> dict:
    """``{"stat": ..., "content": ...}`` of a source: digests of its spec with its files' sizes and mtimes, and
    with their sha256s. ``known`` is the previous state: while no size or mtime moved nothing is read. Else
    the files whose size or mtime moved are re-hashed; the per-file hashes are kept in ``hashes_path`` (one
    file per source, replaced), not in the cursor, which Dagster stores again with every tick."""
    spec_json = json.dumps(asdict(spec), sort_keys=True)
    stats = {str(path): [stat.st_size, stat.st_mtime_ns]
             for path, stat in ((p, p.stat()) for p in ([] if spec.builtin else spec.input_files()))}
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


def sensor_hashes_path(storage: KilnStorage, source: str) -> Path:
    return storage.root / ".kiln" / "raw_files_sensor" / f"{source}.json"


@dg.sensor(target=dg.AssetSelection.assets(raw_corpus), minimum_interval_seconds=30,
           default_status=AUTOMATION_STATUS,
           description="Re-materializes raw_corpus[<source>] when a file of the source changes (by sha256).")
def raw_files_sensor(context: dg.SensorEvaluationContext, storage: KilnStorage) -> dg.SensorResult:
    cursor = json.loads(context.cursor) if context.cursor else {}
    try:
        sources = load_sources(storage.sources_config)
    except SourcesConfigError as exc:
        return dg.SensorResult(skip_reason=str(exc))
    requests, states = [], {}
    partitions = set(source_partitions.get_partition_keys())
    for name in sorted(set(sources) - partitions):  # partitions are fixed when the code location loads
        context.log.warning(f"source {name} is not a raw_corpus partition yet: reload the code location")
    for name, spec in sorted((n, s) for n, s in sources.items() if n in partitions):
        try:
            states[name] = source_state(spec, cursor.get(name, {}), sensor_hashes_path(storage, name))
        except (SourcesConfigError, OSError) as exc:
            context.log.warning(f"source {name}: {exc}")
            if name in cursor:
                states[name] = cursor[name]
            continue
        # the first sight of a source only records it: its first ingest is the user's or the schedule's
        if name in cursor and cursor[name].get("content") != states[name]["content"]:
            requests.append(dg.RunRequest(partition_key=name, run_key=f"{name}:{states[name]['content'][:16]}",
                                          asset_selection=[raw_corpus.key]))
    return dg.SensorResult(run_requests=requests, cursor=json.dumps(states))


kiln_automation = dg.AutomationConditionSensorDefinition(
    "kiln_automation", target=dg.AssetSelection.assets(token_shards, blend_manifest, training_run, checkpoint_eval),
    default_status=AUTOMATION_STATUS, minimum_interval_seconds=30,
    description="Evaluates the eager conditions of token_shards, blend_manifest and checkpoint_eval (a new "
                "checkpoint partition is evaluated), and of training_run with KILN_AUTO_TRAIN=1.")
