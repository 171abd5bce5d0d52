"""The Dagster side of the audit: a checkpoint's lineage.json checked against an instance's records.

    python -m pipelines.audit CHECKPOINT [--dagster-home DIR] [--data-root DIR] [--lineage-store DIR] [--json]

runs ``kiln audit``'s file audit, then, for every link of the chain, looks the data version the lineage
implies (the same hashes the assets report) up among that asset's recorded materializations: which run
produced it, with which code version (and whether the code here now has another), and whether the asset has
been re-materialized with other data since. The exit code is the file audit's: the cross-check reports (an
instance may simply be another one). ``training/`` never imports this: ``kiln audit`` runs without Dagster.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import dagster as dg
# not re-exported by dagster: the instance's parts, so that the cross-check opens only the one it reads
from dagster._core.instance.ref import InstanceRef
from dagster._core.storage.event_log.base import EventLogStorage

from assets.sources import SourcesConfigError
from training.cli import LINEAGE_STORE_HELP
from training.data.hashing import sha256_file
from training.lineage import audit_checkpoint, audit_exit_code, audit_json, audit_report

DATA_VERSION = "dagster/data_version"
CODE_VERSION = "dagster/code_version"
SEARCH_PAGE = 500  # materializations fetched per query, newest first
SEARCH_LIMIT = 20_000  # per link: older materializations than these are reported "outside the searched history"
# assets.data and pipelines.definitions read the sources config when imported: the functions that need them
# import them, so that main() reports a missing or bad sources config (SourcesConfigError) instead of a traceback


@dataclass
class Recorded:
    asset: str                 # e.g. token_shards[stdlib_code]
    data_version: str          # implied by lineage.json
    status: str                # recorded | superseded | NOT RECORDED | outside the searched history
    run_id: str | None = None
    code_version: str | None = None
    latest_data_version: str | None = None
    code_version_now: str | None = None  # of the asset as this code defines it

    def line(self) -> str:
        if self.status == "NOT RECORDED":
            return f"  NOT RECORDED  {self.asset}: no materialization with data version {self.data_version[:16]}"
        if self.status == OUTSIDE:
            return (f"  not found     {self.asset}: data version {self.data_version[:16]} is not among its newest "
                    f"{SEARCH_LIMIT:,} materializations, which is as far as the cross-check searches "
                    f"(outside the searched history)")
        text = (f"  {self.status:<12}  {self.asset}: run {self.run_id}, code version {self.code_version}, "
                f"data version {self.data_version[:16]}")
        if self.status == "superseded":
            text += f" (re-materialized since: now {(self.latest_data_version or '')[:16]})"
        if self.code_version and self.code_version_now and self.code_version != self.code_version_now:
            text += f" (its code changed since: code version now {self.code_version_now})"
        return text


def current_code_versions() -> dict[str, str]:
    """Each asset's code version as the code here defines it; a checkpoint carries training_run's."""
    from pipelines.definitions import ALL_ASSETS

    versions = {key.to_user_string(): version for asset in ALL_ASSETS if isinstance(asset, dg.AssetsDefinition)
                for key, version in asset.code_versions_by_key.items() if version}
    return {**versions, "checkpoint": versions["training_run"]}


def expected_versions(checkpoint_dir: Path, lineage: dict) -> list[tuple[str, str | None, str]]:
    """(asset key, partition, data version) for each link, computed as the assets compute their versions."""
    from assets.data import combined_hash

    links: list[tuple[str, str | None, str]] = []
    by_source: dict[str, dict[str, list[str]]] = {}  # by partition: a chunk, or an unchunked source
    for key in ("raw_files", "shards"):
        for record in lineage.get(key) or []:
            by_source.setdefault(record.get("chunk", record["source"]), {}).setdefault(key, []).append(record["sha256"])
    for source, hashes in sorted(by_source.items()):
        links.append(("raw_corpus", source, combined_hash(hashes.get("raw_files", []))))
    if lineage.get("tokenizer"):
        links.append(("tokenizer", None, lineage["tokenizer"]["sha256"]))
    for source, hashes in sorted(by_source.items()):
        links.append(("token_shards", source, combined_hash(hashes.get("shards", []))))
    if lineage.get("manifest"):
        links.append(("blend_manifest", None, lineage["manifest"]["sha256"]))
    partition = f"{checkpoint_dir.resolve().parent.parent.name}/{checkpoint_dir.resolve().name}"
    links.append(("checkpoint", partition, checkpoint_version(checkpoint_dir, lineage)))
    return links


def checkpoint_version(checkpoint_dir: Path, lineage: dict) -> str:
    """As the training asset computes it: over every file of the directory, lineage.json and common.json
    included (written after the list in lineage.json), sorted by name."""
    from assets.data import combined_hash

    hashes = {f["name"]: f["sha256"] for f in lineage["checkpoint"]["files"]}
    for name in ("lineage.json", "common.json"):
        path = checkpoint_dir / name
        hashes[name] = sha256_file(path) if path.is_file() else f"({name} missing)"
    return combined_hash([hashes[name] for name in sorted(hashes)])


def content_version(materialization: dg.AssetMaterialization, partition: str | None) -> str | None:
    """The content hash a materialization recorded for ``partition``: its data version, or, for a step
    that built several sources at once (``per_source``), the ``data_version/<source>`` entry."""
    from assets.data import PER_SOURCE_DATA_VERSION

    entry = materialization.metadata.get(f"{PER_SOURCE_DATA_VERSION}/{partition}") if partition else None
    return entry.value if entry is not None else (materialization.tags or {}).get(DATA_VERSION)


OUTSIDE = "outside the searched history"
EventLog = dg.DagsterInstance | EventLogStorage  # what the cross-check reads: fetch_materializations


@contextmanager
def open_event_log(dagster_home: str) -> Iterator[EventLogStorage]:
    """The event log storage of the instance in ``dagster_home``, as its dagster.yaml configures it (SQLite,
    PostgreSQL, ...), without the run and schedule storages a whole DagsterInstance also opens: the cross-check
    reads materializations only, and each storage costs its connection and schema-revision check (~0.15 s
    of the command's ~1.2 s, measured on the SQLite instance)."""
    events = InstanceRef.from_dir(dagster_home).event_storage
    try:
        yield events
    finally:
        events.dispose()


def find_materialization(events: EventLog, key: str, partition: str | None, version: str
                         ) -> tuple[dg.EventLogRecord | None, str | None, bool]:
    """(the newest materialization of ``key``[``partition``] with content ``version``, the newest one's
    content, whether the whole history was searched). Pages back through the history, SEARCH_PAGE records
    at a time, up to SEARCH_LIMIT: a link is found however many materializations came after it, and an
    instance with more than that says so instead of "not recorded"."""
    records_filter = dg.AssetRecordsFilter(asset_key=dg.AssetKey(key),
                                           asset_partitions=[partition] if partition else None)
    latest, searched, cursor = None, 0, None
    while searched < SEARCH_LIMIT:
        page = events.fetch_materializations(records_filter, limit=min(SEARCH_PAGE, SEARCH_LIMIT - searched),
                                               cursor=cursor)
        for record in page.records:
            content = content_version(record.asset_materialization, partition)
            latest = content if searched == 0 else latest
            searched += 1
            if content == version:
                return record, latest, True
        if not page.has_more:
            return None, latest, True
        cursor = page.cursor
    return None, latest, False


def cross_check(events: EventLog, checkpoint_dir: Path, lineage: dict) -> list[Recorded]:
    """Each link of ``lineage`` looked up in ``events``: a DagsterInstance or only its event log storage."""
    results = []
    code_now = current_code_versions()
    for key, partition, version in expected_versions(checkpoint_dir, lineage):
        name = f"{key}[{partition}]" if partition else key
        record, latest, searched_all = find_materialization(events, key, partition, version)
        if record is None:
            results.append(Recorded(name, version, "NOT RECORDED" if searched_all else OUTSIDE))
            continue
        found = record.asset_materialization.tags or {}
        results.append(Recorded(name, version, "recorded" if latest == version else "superseded",
                                run_id=record.run_id, code_version=found.get(CODE_VERSION),
                                latest_data_version=latest, code_version_now=code_now.get(key)))
    return results


def cross_check_report(results: list[Recorded], instance_description: str) -> str:
    lines = [f"Dagster cross-check against {instance_description}:"] + [r.line() for r in results]
    missing = [r.asset for r in results if r.status == "NOT RECORDED"]
    unsearched = [r.asset for r in results if r.status == OUTSIDE]
    if missing:
        lines.append(f"NOT RECORDED in the instance: {', '.join(missing)}")
    if unsearched:
        lines.append(f"outside the searched history (older than the newest {SEARCH_LIMIT:,} materializations): "
                     f"{', '.join(unsearched)}")
    if not missing and not unsearched:
        lines.append(f"OK: all {len(results)} links recorded")
    return "\n".join(lines)


def cross_check_json(results: list[Recorded]) -> list[dict]:
    return [asdict(r) for r in results]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipelines.audit", description=(
        "kiln audit's file audit of a checkpoint, then each link of its lineage cross-checked with a Dagster "
        "instance's materializations. Exit 0: every file matches; 1: a file changed since training; 3: nothing "
        "changed but some files were not found; 2: bad input (no instance, unreadable lineage or sources config)."))
    parser.add_argument("checkpoint", help="an iteration_XXXXXXXX checkpoint directory")
    parser.add_argument("--dagster-home", default=os.environ.get("DAGSTER_HOME"),
                        help="the Dagster instance's home directory (default: $DAGSTER_HOME)")
    parser.add_argument("--data-root", help="where the data root is now (default: as recorded)")
    parser.add_argument("--lineage-store", metavar="DIR", help=LINEAGE_STORE_HELP)
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    args = parser.parse_args(argv)

    def fail(message: str) -> int:
        print(f"{parser.prog}: {message}", file=sys.stderr)
        return 2

    if not args.dagster_home:
        return fail("no Dagster instance given: pass --dagster-home DIR or set DAGSTER_HOME "
                    "(kiln audit verifies the files alone)")
    if not Path(args.dagster_home).is_dir():
        return fail(f"--dagster-home {args.dagster_home} is not a directory")
    checkpoint = Path(args.checkpoint)
    try:
        lineage, checks = audit_checkpoint(checkpoint, args.data_root, lineage_store=args.lineage_store)
    except (ValueError, KeyError) as exc:
        return fail(str(exc))
    try:
        with open_event_log(args.dagster_home) as events:
            results = cross_check(events, checkpoint, lineage)
    except SourcesConfigError as exc:
        return fail(f"{exc}; the cross-check compares code versions with Kiln's definitions, which read the sources "
                    f"config: set KILN_SOURCES to the sources.yaml the chain ran with")
    instance_description = f"the instance in {args.dagster_home}"
    if args.json:
        report = json.loads(audit_json(checkpoint, lineage, checks))
        print(json.dumps({**report, "dagster_cross_check": {"instance": instance_description,
                                                            "links": cross_check_json(results)}}, indent=2))
    else:
        print(audit_report(checkpoint, lineage, checks))
        print(cross_check_report(results, instance_description))
    return audit_exit_code(checks)


if __name__ == "__main__":
    sys.exit(main())
