"""Automation: changed raw files re-ingest their source; shards and manifest follow on their own.

``raw_files_sensor`` hashes every file source's inputs (re-hashing a file only when its size or mtime
moved) and requests ``raw_corpus[<source>]`` when a hash changed; ``token_shards`` and
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

import dagster as dg

from assets.data import blend_manifest, raw_corpus, source_partitions, token_shards
from assets.sources import SourcesConfigError, SourceSpec, load_sources
from assets.training import training_run
from resources.storage import KilnStorage
from training.data.hashing import sha256_file

AUTOMATION_STATUS = (dg.DefaultSensorStatus.STOPPED if os.environ.get("KILN_AUTOMATION") == "off"
                     else dg.DefaultSensorStatus.RUNNING)


def source_fingerprint(spec: SourceSpec, known: dict) -> dict:
    """``{"spec": ..., "files": {path: [size, mtime_ns, sha256]}}``; ``known`` is the previous fingerprint."""
    previous = known.get("files", {})
    files = {}
    for path in ([] if spec.builtin else spec.input_files()):
        stat = path.stat()
        old = previous.get(str(path))
        unchanged = old is not None and old[:2] == [stat.st_size, stat.st_mtime_ns]
        files[str(path)] = [stat.st_size, stat.st_mtime_ns, old[2] if unchanged else sha256_file(path)]
    return {"spec": json.dumps(asdict(spec), sort_keys=True), "files": files}


def content_of(fingerprint: dict) -> tuple:
    """What decides the raw partition: the spec and the files' hashes (not their mtimes)."""
    return fingerprint["spec"], sorted((path, entry[2]) for path, entry in fingerprint["files"].items())


@dg.sensor(target=dg.AssetSelection.assets(raw_corpus), minimum_interval_seconds=30,
           default_status=AUTOMATION_STATUS,
           description="Re-materializes raw_corpus[<source>] when a file of the source changes (by sha256).")
def raw_files_sensor(context: dg.SensorEvaluationContext, storage: KilnStorage) -> dg.SensorResult:
    cursor = json.loads(context.cursor) if context.cursor else {}
    try:
        sources = load_sources(storage.sources_config)
    except SourcesConfigError as exc:
        return dg.SensorResult(skip_reason=str(exc))
    requests, fingerprints = [], {}
    partitions = set(source_partitions.get_partition_keys())
    for name in sorted(set(sources) - partitions):  # partitions are fixed when the code location loads
        context.log.warning(f"source {name} is not a raw_corpus partition yet: reload the code location")
    for name, spec in sorted((n, s) for n, s in sources.items() if n in partitions):
        try:
            fingerprints[name] = source_fingerprint(spec, cursor.get(name, {}))
        except (SourcesConfigError, OSError) as exc:
            context.log.warning(f"source {name}: {exc}")
            if name in cursor:
                fingerprints[name] = cursor[name]
            continue
        # the first sight of a source only records it: its first ingest is the user's or the schedule's
        if name in cursor and content_of(cursor[name]) != content_of(fingerprints[name]):
            digest = hashlib.sha256(repr(content_of(fingerprints[name])).encode()).hexdigest()[:16]
            requests.append(dg.RunRequest(partition_key=name, run_key=f"{name}:{digest}",
                                          asset_selection=[raw_corpus.key]))
    return dg.SensorResult(run_requests=requests, cursor=json.dumps(fingerprints))


kiln_automation = dg.AutomationConditionSensorDefinition(
    "kiln_automation", target=dg.AssetSelection.assets(token_shards, blend_manifest, training_run),
    default_status=AUTOMATION_STATUS, minimum_interval_seconds=30,
    description="Evaluates the eager conditions of token_shards and blend_manifest (and of training_run "
                "with KILN_AUTO_TRAIN=1).")
