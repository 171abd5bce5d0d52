"""The cross-check's PostgreSQL reader (psycopg2, no Dagster import) on an instance Dagster wrote to a real
server configured by deploy/dagster-postgres.yaml: the same links as Dagster's own API finds."""
import shutil

import dagster as dg

from conftest import PROJECT_ROOT
from test_audit import check_recorded_links, record_links
from test_postgres import postgres  # noqa: F401 -- the server, a fixture


def test_the_cross_check_reads_postgres_as_dagster_does(tmp_path, postgres, monkeypatch):  # noqa: F811
    from pipelines.audit import DagsterEvents, SqlEvents, cross_check, cross_check_instance, open_events

    for name, value in postgres.items():
        monkeypatch.setenv(name, value)
    home = tmp_path / "dagster_home"
    home.mkdir()
    shutil.copy(PROJECT_ROOT / "deploy/dagster-postgres.yaml", home / "dagster.yaml")
    with dg.DagsterInstance.from_config(str(home)) as instance:
        assert type(instance.event_log_storage).__name__ == "PostgresEventLogStorage"
        checkpoint, lineage = record_links(tmp_path, instance)
    events = open_events(str(home))
    assert isinstance(events, SqlEvents) and events.description.startswith("PostgreSQL, database dagster")
    events.close()
    through_sql, read_through = cross_check_instance(str(home), checkpoint, lineage)
    assert read_through.startswith("PostgreSQL")
    check_recorded_links(through_sql, lineage)  # the wiped tokenizer's events stay in the table: skipped
    reference = DagsterEvents.open(str(home), "the test's reference")
    assert cross_check(reference, checkpoint, lineage) == through_sql
    reference.close()
