"""The Dagster side of the audit: a checkpoint's lineage.json checked against an instance's records.

    python -m pipelines.audit CHECKPOINT [--dagster-home DIR] [--data-root DIR] [--lineage-store DIR] [--json]

runs ``kiln audit``'s file audit, then, for every link of the chain, looks the data version the lineage
implies (the same hashes the assets report) up among that asset's recorded materializations: which run
produced it, with which code version (and whether the code here now has another), and whether the asset has
been re-materialized with other data since. The exit code is the file audit's: the cross-check reports (an
instance may simply be another one). ``training/`` never imports this: ``kiln audit`` runs without Dagster.

How the instance is read. Importing Dagster alone takes 0.8-1.5 s here (``python -X importtime``: its package
init loads SQLAlchemy, alembic, the definitions API and components), more than the whole command should take,
so for the two storages Kiln ships (deploy/dagster.yaml, deploy/dagster-postgres.yaml) the cross-check reads
the rows it needs with the database's own client, and goes through Dagster's API for any other:

- The rows: ``event_logs`` (id, run_id, event, dagster_event_type, asset_key, partition, timestamp),
  ``asset_event_tags`` (Dagster indexes every materialization's ``dagster/data_version`` there, so a link is
  one indexed lookup however long the history) and ``asset_keys.wipe_timestamp``: one schema for all of
  Dagster's SQL storages, created and migrated by Dagster (``dagster/_core/storage/event_log/schema.py``).
  Of an event, the serialized JSON Dagster stores, it reads the materialization's tags and text metadata.
- SQLite (no ``storage`` in dagster.yaml, or ``storage: sqlite``): the index shard
  ``<base>/history/runs/index.db``, which holds a copy of every asset event of every run, opened read-only.
  Wiping an asset deletes its copies there.
- PostgreSQL (``storage: postgres`` with ``postgres_db`` or ``postgres_url``): psycopg2, which
  dagster-postgres installs. A wiped asset's events stay in the table; they are skipped, as Dagster skips
  them, by the asset's wipe timestamp.
- Anything else (another storage class, MySQL, tables without those columns, an event whose JSON does not
  have that shape): ``EventLogStorage.fetch_materializations``, paged, as far as SEARCH_LIMIT.

The code versions "now" are the ones Kiln's definitions give: ``assets.versions.current_code_versions``
hashes the parts its table declares for each asset, as the definitions do, without importing them.
"""
from __future__ import annotations

import argparse
import json
import os
import sqlite3
import sys
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import yaml

from assets.versions import CodePartError, current_code_versions
from training.boundary import guarded
from training.cli import LINEAGE_STORE_HELP
from training.data.cleaning.versions import clean_data_version
from training.data.hashing import PER_SOURCE_DATA_VERSION, combined_hash, sha256_file
from training.lineage import audit_checkpoint, audit_exit_code, audit_json, audit_report

DATA_VERSION = "dagster/data_version"
CODE_VERSION = "dagster/code_version"
SEARCH_PAGE = 500  # Dagster's API: materializations fetched per query, newest first
SEARCH_LIMIT = 20_000  # Dagster's API, per link: older ones are reported "outside the searched history"
OUTSIDE = "outside the searched history"


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


# --- the materializations an instance recorded --------------------------------------------------------------

@dataclass
class Materialization:
    run_id: str
    tags: dict[str, str]
    texts: dict[str, str] = field(default_factory=dict)  # its text metadata entries

    def content(self, partition: str | None) -> str | None:
        """The content hash it recorded for ``partition``: its data version, or, for a step that built
        several sources at once (assets.data.per_source), the ``data_version/<source>`` entry."""
        entry = self.texts.get(f"{PER_SOURCE_DATA_VERSION}/{partition}") if partition else None
        return entry if entry is not None else self.tags.get(DATA_VERSION)


class SqlReaderUnsupported(Exception):
    """The SQL readers cannot read this instance (no database client, tables or an event of another shape):
    Dagster's API reads it instead."""


class SqlEvents:
    """Materializations read from Dagster's event log tables with a DB-API connection (module docstring)."""

    REQUIRED = {"event_logs": {"id", "run_id", "event", "dagster_event_type", "asset_key", "partition",
                               "timestamp"},
                "asset_event_tags": {"event_id", "asset_key", "key", "value"},
                "asset_keys": {"asset_key", "wipe_timestamp"}}

    def __init__(self, connection, placeholder: str, description: str):
        self.connection, self.mark, self.description = connection, placeholder, description
        self.complete = True  # every query covers the whole history

    def check_schema(self, columns_of) -> None:
        for table, needed in self.REQUIRED.items():
            missing = needed - set(columns_of(table))
            if missing:
                raise SqlReaderUnsupported(f"{table} has no column {', '.join(sorted(missing))}")

    def _query(self, key: str, partition: str | None, version: str | None = None, limit: int | None = None):
        mark = self.mark
        tag = (f" JOIN asset_event_tags t ON t.event_id = e.id AND t.asset_key = e.asset_key"
               f" AND t.key = {mark} AND t.value = {mark}") if version is not None else ""
        sql = (f"SELECT e.run_id, e.event FROM event_logs e{tag}"
               f" LEFT JOIN asset_keys k ON k.asset_key = e.asset_key"
               f" WHERE e.asset_key = {mark} AND e.dagster_event_type = 'ASSET_MATERIALIZATION'"
               f" AND e.partition {'= ' + mark if partition is not None else 'IS NULL'}"
               f" AND (k.wipe_timestamp IS NULL OR e.timestamp > k.wipe_timestamp) ORDER BY e.id DESC"
               + (f" LIMIT {int(limit)}" if limit else ""))
        params = ([DATA_VERSION, version] if version is not None else []) + [json.dumps([key])]
        params += [partition] if partition is not None else []
        cursor = self.connection.cursor()
        cursor.execute(sql, params)
        return cursor

    def newest(self, key: str, partition: str | None) -> Materialization | None:
        row = self._query(key, partition, limit=1).fetchone()
        return parse_materialization(*row) if row else None

    def with_data_version(self, key: str, partition: str | None, version: str) -> Materialization | None:
        row = self._query(key, partition, version, limit=1).fetchone()
        return parse_materialization(*row) if row else None

    def history(self, key: str, partition: str | None) -> Iterator[Materialization]:
        cursor = self._query(key, partition)
        while rows := cursor.fetchmany(SEARCH_PAGE):
            yield from (parse_materialization(*row) for row in rows)

    def close(self) -> None:
        self.connection.close()


def parse_materialization(run_id: str, event: str) -> Materialization:
    """The tags and text metadata of a stored ASSET_MATERIALIZATION event (Dagster's serialized JSON: the
    metadata as ``metadata_entries``, Dagster 1.x's stored form, or as a ``metadata`` mapping)."""
    try:
        materialization = json.loads(event)["dagster_event"]["event_specific_data"]["materialization"]
        entries = materialization.get("metadata_entries")
        values = ({e["label"]: e["entry_data"] for e in entries} if entries is not None
                  else dict(materialization.get("metadata") or {}))
        texts = {label: value["text"] for label, value in values.items()
                 if isinstance(value, dict) and isinstance(value.get("text"), str)}
        return Materialization(run_id, dict(materialization.get("tags") or {}), texts)
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise SqlReaderUnsupported(f"a materialization event of run {run_id} is not in the stored form this reads "
                            f"({type(exc).__name__}: {exc})") from None


class EmptyEvents:
    """An instance that has recorded nothing yet (its SQLite index not created)."""

    description = "no event log yet"
    complete = True

    def newest(self, key, partition):
        return None

    def with_data_version(self, key, partition, version):
        return None

    def history(self, key, partition):
        return iter(())

    def close(self) -> None:
        pass


class DagsterEvents:
    """Materializations through Dagster's own API (``fetch_materializations``), for any storage: paged
    newest first, SEARCH_PAGE at a time, up to SEARCH_LIMIT per link."""

    def __init__(self, events, description: str):
        self.events, self.description, self.complete = events, description, True

    @classmethod
    def open(cls, dagster_home: str, why: str) -> DagsterEvents:
        """Only the event log storage of the instance, as its dagster.yaml configures it: not the run and
        schedule storages a whole DagsterInstance also opens."""
        from dagster._core.instance.ref import InstanceRef  # not re-exported by dagster

        return cls(InstanceRef.from_dir(dagster_home).event_storage, f"Dagster's API ({why})")

    def _page(self, key, partition, limit, cursor=None):
        import dagster as dg

        return self.events.fetch_materializations(
            dg.AssetRecordsFilter(asset_key=dg.AssetKey(key), asset_partitions=[partition] if partition else None),
            limit=limit, cursor=cursor)

    @staticmethod
    def _materialization(record) -> Materialization:
        materialization = record.asset_materialization
        texts = {label: entry.value for label, entry in materialization.metadata.items()
                 if isinstance(entry.value, str)}
        return Materialization(record.run_id, dict(materialization.tags or {}), texts)

    def newest(self, key, partition):
        records = self._page(key, partition, 1).records
        return self._materialization(records[0]) if records else None

    def with_data_version(self, key, partition, version):
        return None  # the API filters by partition, not by tag: history() finds it

    def history(self, key, partition):
        searched, cursor = 0, None
        while searched < SEARCH_LIMIT:
            page = self._page(key, partition, min(SEARCH_PAGE, SEARCH_LIMIT - searched), cursor)
            searched += len(page.records)
            yield from (self._materialization(record) for record in page.records)
            if not page.has_more:
                return
            cursor = page.cursor
        self.complete = False

    def close(self) -> None:
        self.events.dispose()


class InstanceError(ValueError):
    """The instance's dagster.yaml asks for a setting that is not there, or its database cannot be reached."""


def _setting(value, where: str) -> str:
    """A dagster.yaml value: as given, or ``{env: NAME}``."""
    if isinstance(value, dict) and set(value) == {"env"}:
        if value["env"] not in os.environ:
            raise InstanceError(f"{where}: environment variable {value['env']} is not set")
        return os.environ[value["env"]]
    return str(value)


def open_events(dagster_home: str):
    """A reader of the instance's materializations: SQL for Kiln's two storages, Dagster's API otherwise."""
    home = Path(dagster_home)
    config_file = home / "dagster.yaml"
    config = (yaml.safe_load(config_file.read_text()) if config_file.is_file() else None) or {}
    if "event_log_storage" in config:
        return DagsterEvents.open(dagster_home, f"{config_file}: event_log_storage is set")
    storage = config.get("storage") or {"sqlite": {"base_dir": str(home)}}
    kind = next(iter(storage)) if len(storage) == 1 else None
    try:
        if kind == "sqlite":
            base = Path(_setting(storage["sqlite"].get("base_dir", str(home)), f"{config_file}: storage.sqlite.base_dir"))
            return _sqlite_events(base / "history" / "runs" / "index.db")
        if kind == "postgres":
            return _postgres_events(storage["postgres"], f"{config_file}: storage.postgres")
    except SqlReaderUnsupported as exc:
        return DagsterEvents.open(dagster_home, str(exc))
    return DagsterEvents.open(dagster_home, f"{config_file}: storage {', '.join(storage)}")


def _sqlite_events(index: Path):
    if not index.is_file():
        return EmptyEvents()
    # read-only; waits for a writer's lock as Dagster's own connections do
    connection = sqlite3.connect(f"{index.resolve().as_uri()}?mode=ro", uri=True, timeout=30)
    events = SqlEvents(connection, "?", f"SQLite, {index}")
    try:
        events.check_schema(lambda table: [row[1] for row in connection.execute(f"PRAGMA table_info({table})")])
    except sqlite3.Error as exc:  # e.g. a write-ahead log in a directory it may not create the index's -shm in
        connection.close()
        raise SqlReaderUnsupported(f"{index}: {exc}") from None
    except SqlReaderUnsupported:
        connection.close()
        raise
    return events


def _postgres_events(config: dict, where: str):
    try:
        import psycopg2  # the Makefile installs it with dagster-postgres, which Dagster's own reader needs too
    except ImportError as exc:
        raise SqlReaderUnsupported(f"no psycopg2 to read {where} with ({exc})") from None

    if "postgres_url" in config:
        scheme, _, rest = _setting(config["postgres_url"], f"{where}.postgres_url").partition("://")
        connect = {"dsn": f"{scheme.split('+')[0]}://{rest}"}  # postgresql+psycopg2 is SQLAlchemy's spelling
    else:
        db = config.get("postgres_db") or {}
        names = {"hostname": "host", "port": "port", "username": "user", "password": "password", "db_name": "dbname"}
        connect = {libpq: _setting(db[key], f"{where}.postgres_db.{key}") for key, libpq in names.items() if key in db}
        connect.update({name: _setting(value, f"{where}.postgres_db.params.{name}")
                        for name, value in (db.get("params") or {}).items()})
    try:
        connection = psycopg2.connect(**connect)
    except psycopg2.Error as exc:
        raise InstanceError(f"{where}: cannot connect: {str(exc).strip()}") from None
    connection.set_session(readonly=True, autocommit=True)
    events = SqlEvents(connection, "%s", f"PostgreSQL, database {connection.info.dbname} on {connection.info.host}")

    def columns_of(table):
        cursor = connection.cursor()
        cursor.execute("SELECT column_name FROM information_schema.columns WHERE table_name = %s", [table])
        return [row[0] for row in cursor.fetchall()]
    try:
        events.check_schema(columns_of)
    except SqlReaderUnsupported:
        connection.close()
        raise
    return events


# --- the cross-check -------------------------------------------------------------------------------------

def expected_versions(checkpoint_dir: Path, lineage: dict) -> list[tuple[str, str | None, str]]:
    """(asset key, partition, data version) for each link, computed as the assets compute their versions."""
    links: list[tuple[str, str | None, str]] = []
    by_source: dict[str, dict[str, list[str]]] = {}  # by partition: a chunk, or an unchunked source
    for key in ("raw_files", "shards"):
        for record in lineage.get(key) or []:
            by_source.setdefault(record.get("chunk", record["source"]), {}).setdefault(key, []).append(record["sha256"])
    for source, hashes in sorted(by_source.items()):
        links.append(("raw_corpus", source, combined_hash(hashes.get("raw_files", []))))
    cleaned: dict[str, list[dict]] = {}  # a cleaned source's chunks (clean_corpus), their files in chunk order
    for record in lineage.get("clean_files") or []:
        cleaned.setdefault(record.get("chunk", record["source"]), []).append(record)
    for chunk, records in sorted(cleaned.items()):
        links.append(("clean_corpus", chunk, clean_data_version([r["sha256"] for r in records])))
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
    hashes = {f["name"]: f["sha256"] for f in lineage["checkpoint"]["files"]}
    for name in ("lineage.json", "common.json"):
        path = checkpoint_dir / name
        hashes[name] = sha256_file(path) if path.is_file() else f"({name} missing)"
    return combined_hash([hashes[name] for name in sorted(hashes)])


def find_materialization(events, key: str, partition: str | None, version: str
                         ) -> tuple[Materialization | None, str | None, bool]:
    """(the newest materialization of ``key``[``partition``] with content ``version``, the newest one's
    content, whether the whole history was searched). A link is found however many materializations came
    after it: by its data version where the instance indexes it, else by going back through the history."""
    newest = events.newest(key, partition)
    latest = newest.content(partition) if newest else None
    found = events.with_data_version(key, partition, version)
    if found is not None and found.content(partition) == version:
        return found, latest, True
    for materialization in events.history(key, partition):  # e.g. a version kept as per-source metadata
        if materialization.content(partition) == version:
            return materialization, latest, True
    return None, latest, events.complete


def cross_check(events, checkpoint_dir: Path, lineage: dict) -> list[Recorded]:
    """Each link of ``lineage`` looked up in ``events`` (SqlEvents, DagsterEvents)."""
    results = []
    code_now = current_code_versions()
    for key, partition, version in expected_versions(checkpoint_dir, lineage):
        name = f"{key}[{partition}]" if partition else key
        found, latest, searched_all = find_materialization(events, key, partition, version)
        if found is None:
            results.append(Recorded(name, version, "NOT RECORDED" if searched_all else OUTSIDE))
            continue
        results.append(Recorded(name, version, "recorded" if latest == version else "superseded",
                                run_id=found.run_id, code_version=found.tags.get(CODE_VERSION),
                                latest_data_version=latest, code_version_now=code_now.get(key)))
    return results


def cross_check_instance(dagster_home: str, checkpoint_dir: Path, lineage: dict) -> tuple[list[Recorded], str]:
    """The cross-check against the instance in ``dagster_home``, and how its events were read."""
    events = open_events(dagster_home)
    try:
        return cross_check(events, checkpoint_dir, lineage), events.description
    except SqlReaderUnsupported as exc:  # an event in another shape than the SQL reader knows
        events.close()
        events = DagsterEvents.open(dagster_home, str(exc))
        return cross_check(events, checkpoint_dir, lineage), events.description
    finally:
        events.close()


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
    parser.add_argument("--debug", action="store_true", help="show the traceback of a bad input too (or KILN_DEBUG=1)")
    args = parser.parse_args(argv)
    return guarded(parser.prog, lambda: cross_checked_audit(args), args.debug)


def cross_checked_audit(args) -> int:
    prog = "python -m pipelines.audit"

    def fail(message: str) -> int:
        print(f"{prog}: {message}", file=sys.stderr)
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
        results, read_through = cross_check_instance(args.dagster_home, checkpoint, lineage)
    except CodePartError as exc:  # the code versions now hash a file that is not there
        return fail(f"{exc}; set KILN_SOURCES and KILN_TRAIN_CONFIG as the chain ran with")
    except (InstanceError, yaml.YAMLError) as exc:
        return fail(f"the instance's configuration: {exc}")
    instance_description = f"the instance in {args.dagster_home}"
    if args.json:
        report = json.loads(audit_json(checkpoint, lineage, checks))
        print(json.dumps({**report, "dagster_cross_check": {"instance": instance_description,
                                                            "read_through": read_through,
                                                            "links": cross_check_json(results)}}, indent=2))
    else:
        print(audit_report(checkpoint, lineage, checks))
        print(cross_check_report(results, f"{instance_description} (read through {read_through})"))
    return audit_exit_code(checks)


if __name__ == "__main__":
    sys.exit(main())
