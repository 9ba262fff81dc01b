"""kernel/rows.py prepares a value as the ORM would, skipping the field only for values the
field would send unchanged (issue 19: worker CPU)."""

from __future__ import annotations

import uuid
import warnings
from datetime import UTC, datetime

import pytest
from django.db import connection

from django_workflows.kernel import rows
from django_workflows.models import OutboxEvent, WorkflowJob, WorkflowRun, WorkflowStage

pytestmark = pytest.mark.django_db


def _entry(model: type, name: str) -> tuple:
    (entry,) = rows.writable([model._meta.get_field(name)])
    return entry


@pytest.mark.parametrize(
    ("model", "name", "value"),
    [
        (OutboxEvent, "created_at", datetime(2026, 12, 3, 6, 0, tzinfo=UTC)),
        (OutboxEvent, "workflow_run_id", uuid.uuid4()),
        (OutboxEvent, "workflow_run_id", str(uuid.uuid4())),
        (OutboxEvent, "sequence", 7),
        (OutboxEvent, "event_type", "stage.completed"),
        (OutboxEvent, "payload", {"a": [1, 2]}),
        (OutboxEvent, "published_at", None),
        (WorkflowRun, "id", uuid.uuid4()),
    ],
)
def test_a_value_is_sent_as_the_field_would_send_it(model: type, name: str, value: object) -> None:
    field = model._meta.get_field(name)
    ours = rows.db_value(_entry(model, name), value, connection)
    orm = field.get_db_prep_save(value, connection)
    if name == "payload":  # a JSON adapter object on PostgreSQL: compare what it wraps
        assert getattr(ours, "obj", ours) == getattr(orm, "obj", orm)
    elif type(value) is int:
        # the ORM wraps it for PostgreSQL (psycopg's Int4); a plain int is the same number
        # (rows.insert and rows.update have always sent plain ints)
        assert ours == orm and type(ours) is int
    else:
        assert ours == orm and type(ours) is type(orm)


def test_a_naive_datetime_still_goes_through_its_field() -> None:
    """Only an aware datetime is plain: a naive one is warned about and made aware by the
    field, as ``save()`` does."""
    naive = datetime(2026, 12, 3, 6, 0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        value = rows.db_value(_entry(OutboxEvent, "created_at"), naive, connection)
    assert any("naive datetime" in str(w.message) for w in caught)
    if connection.vendor == "postgresql":
        assert value.tzinfo is not None


@pytest.mark.django_db
def test_code_in_another_context_of_the_thread_gets_that_contexts_connection() -> None:
    """Django keeps connections per asyncio context, not per thread: rows must use the one of
    the caller's context (a per-thread cache handed an event loop's code another session)."""
    import asyncio

    from django.db import connections

    outer = rows._conn()

    async def under_a_loop() -> tuple[object, object]:
        return rows._conn(), connections["default"]  # a lookup only: no query

    inner, theirs = asyncio.run(under_a_loop())
    assert outer is connections["default"]
    assert inner is not outer and inner is theirs


@pytest.mark.django_db
def test_sqlite_gets_a_cursor_per_statement() -> None:
    from django.db import connections

    conn = connections["default"]
    if conn.vendor == "postgresql":
        pytest.skip("PostgreSQL keeps the thread's cursor (next test)")
    assert rows._cursor(conn) is not rows._cursor(conn)


@pytest.mark.django_db(transaction=True)  # outside a test transaction: close() closes
def test_the_kept_cursor_is_made_anew_whenever_django_would_make_it_differently() -> None:
    """rows._cursor reuses this thread's last cursor only on the same driver connection, with
    the same statement logging and no health check pending (PostgreSQL: SQLite gets a cursor
    per statement)."""
    from django.db import connections
    from django.test.utils import CaptureQueriesContext

    conn = connections["default"]
    if conn.vendor != "postgresql":
        pytest.skip("the cursor is kept on PostgreSQL only")
    first = rows._cursor(conn)
    assert rows._cursor(conn) is first
    with CaptureQueriesContext(conn) as captured:  # logging on: a debug cursor, counted
        logged = rows._cursor(conn)
        assert logged is not first
        rows.select(WorkflowRun, "test-none", "1 = 0", [])
    assert len(captured.captured_queries) == 1
    plain = rows._cursor(conn)
    assert plain is not logged
    conn.health_check_enabled, conn.health_check_done = True, False  # a check is pending
    try:
        checked = rows._cursor(conn)
        assert checked is not plain
    finally:
        conn.health_check_enabled = conn.settings_dict["CONN_HEALTH_CHECKS"]
    raw = conn.connection
    conn.close()
    reopened = rows._cursor(conn)
    if conn.vendor == "postgresql":  # (Django never closes SQLite's in-memory test database)
        assert conn.connection is not raw and reopened is not checked
    reopened.execute("SELECT 1")
    assert reopened.fetchall() == [(1,)]


@pytest.mark.django_db(transaction=True)
def test_the_kept_cursor_reads_timestamps_with_psycopgs_loader_giving_djangos_values() -> None:
    """Issue 19: on PostgreSQL in UTC the kept cursor reads ``timestamptz`` with psycopg's own
    loader (run in C by psycopg's binary package), not Django's Python subclass of it; the
    values are Django's to the tzinfo object."""
    from django.db import connections
    from psycopg.pq import Format

    conn = connections["default"]
    if conn.vendor != "postgresql":
        pytest.skip("the cursor is kept on PostgreSQL only")
    cursor = rows._cursor(conn)
    timestamptz = conn.connection.adapters.types["timestamptz"].oid
    ours = cursor.cursor.adapters.get_loader(timestamptz, Format.TEXT)
    django = conn.connection.adapters.get_loader(timestamptz, Format.TEXT)
    assert ours.__name__ == "TimestamptzLoader" and ours.__module__.startswith("psycopg")
    assert django.__module__.startswith("django")  # every other cursor keeps Django's
    for text in (
        "2026-01-01T10:00:00.123456+02:00",
        "1999-12-31T23:59:59Z",
        "2026-06-30 12:00:00-09:30",
        "0001-01-01 00:00:00+00",
    ):
        cursor.execute("SELECT %s::timestamptz", [text])
        (value,) = cursor.fetchone()
        with conn.cursor() as plain:
            plain.execute("SELECT %s::timestamptz", [text])
            (expected,) = plain.fetchone()
        assert value == expected and value.tzinfo is expected.tzinfo is UTC


@pytest.mark.django_db(transaction=True)
def test_a_database_time_zone_other_than_utc_keeps_djangos_timestamp_loader() -> None:
    """Where Django gives timestamps another time zone (``DATABASES["TIME_ZONE"]``), the kept
    cursor keeps Django's loader: psycopg's would not give the same values."""
    from zoneinfo import ZoneInfo

    from django.db import connections
    from psycopg.pq import Format

    conn = connections["default"]
    if conn.vendor != "postgresql":
        pytest.skip("the cursor is kept on PostgreSQL only")
    conn.ensure_connection()
    conn.__dict__["timezone"] = ZoneInfo("Europe/Paris")  # Django's cached_property
    try:
        rows._local.cursor = None
        cursor = rows._cursor(conn)
        timestamptz = conn.connection.adapters.types["timestamptz"].oid
        loader = cursor.cursor.adapters.get_loader(timestamptz, Format.TEXT)
        assert loader.__module__.startswith("django")
    finally:
        del conn.__dict__["timezone"]
        rows._local.cursor = None


@pytest.mark.parametrize("model", [WorkflowRun, WorkflowStage, WorkflowJob, OutboxEvent])
def test_a_new_instance_has_every_default_the_model_would_give(model: type) -> None:
    """``rows.new`` keeps constant defaults once per model (issue 19: Python calls per stage);
    every field still gets what ``field.get_default()`` gives, and a callable default (``dict``,
    ``uuid4``) is called for each instance, never shared."""
    ours, again = rows.new(model), rows.new(model)
    for field in model._meta.concrete_fields:
        expected = field.get_default()
        value = getattr(ours, field.attname)
        if field.has_default() and callable(field.default):
            assert type(value) is type(expected), field.name
            if isinstance(value, (dict, list, uuid.UUID)):
                assert value is not getattr(again, field.attname), field.name
        elif field.has_db_default() and not field.has_default():
            assert type(value) is type(expected), field.name
        else:
            assert value == expected and type(value) is type(expected), field.name
    assert ours._state.adding


def test_a_new_instance_takes_the_values_given_and_refuses_unknown_names() -> None:
    run_id = uuid.uuid4()
    job = rows.new(WorkflowJob, workflow_run_id=run_id, stage_id="s", payload=None)
    assert (job.workflow_run_id, job.stage_id, job.payload) == (run_id, "s", None)
    assert job.status == WorkflowJob._meta.get_field("status").get_default()
    with pytest.raises(TypeError, match="no fields \\['nope'\\]"):
        rows.new(WorkflowJob, stage_id="s", nope=1)


@pytest.mark.parametrize(
    ("model", "name", "value"),
    [
        (WorkflowStage, "run_id", uuid.uuid4()),
        (WorkflowStage, "run_id", str(uuid.uuid4())),
        (WorkflowJob, "status", "PENDING"),
        (WorkflowJob, "attempt", 2),
        (OutboxEvent, "created_at", datetime(2026, 12, 3, 6, 0, tzinfo=UTC)),
        (WorkflowRun, "id", None),
    ],
)
def test_a_parameter_is_prepared_as_a_filter_would_prepare_it(
    model: type, name: str, value: object
) -> None:
    field = model._meta.get_field(name)
    ours = rows.prep(model, name, value)
    orm = field.get_db_prep_value(value, connection, prepared=False)
    assert ours == orm
    if type(value) is not int:  # the ORM may wrap an int for psycopg (Int4): the same number
        assert type(ours) is type(orm)


@pytest.mark.parametrize(
    "text", [None, '{"a": [1, 2.5, null]}', '"x"', "3", "not json", b'{"b": 1}']
)
def test_a_json_column_is_read_as_the_field_reads_it(text: object) -> None:
    field = WorkflowRun._meta.get_field("input")
    ((_, (convert,)),) = rows._converters([field], WorkflowRun._meta.db_table, connection)
    assert convert is rows._json_value  # the plain JSONField takes the short way
    ours = convert(text, None, connection)
    assert ours == field.from_db_value(text, None, connection)
    assert type(ours) is type(field.from_db_value(text, None, connection))


def test_a_stage_record_read_back_has_the_values_written() -> None:
    """Through the short JSON decoding: a stage record read by ``rows.select`` has the values
    ``save()`` wrote, JSON columns included."""
    now = datetime(2026, 12, 3, 6, 0, tzinfo=UTC)
    times = {"created_at": now, "updated_at": now}
    run = WorkflowRun.objects.create(
        workflow_id="w", workflow_name="w", input={"n": [1, "x"]}, **times
    )
    stage = WorkflowStage.objects.create(
        run=run,
        stage_id="s",
        stage_name="s",
        stage_number=1,
        execution_group=1,
        output_data={"k": {"v": None}},
        **times,
    )
    (read,) = rows.select(
        WorkflowStage, "test_read_back", "id = %s", [rows.prep(WorkflowStage, "id", stage.pk)]
    )
    assert read.output_data == {"k": {"v": None}}
    assert read.metrics == WorkflowStage.objects.get(pk=stage.pk).metrics
    (run_read,) = rows.select(
        WorkflowRun, "test_read_back", "id = %s", [rows.prep(WorkflowRun, "id", run.pk)]
    )
    assert run_read.input == {"n": [1, "x"]}


@pytest.mark.parametrize(
    "value",
    [
        {"a": [1, 2.5, None], "when": datetime(2026, 12, 3, 6, 0, tzinfo=UTC)},
        [{"id": uuid.UUID(int=7)}, "ü", float("nan")],
        {},
    ],
)
def test_a_json_value_is_written_as_the_field_would_write_it(value: object) -> None:
    """A dict or list for a JSONField takes the short way on PostgreSQL (one encoder per
    encoder class): the same adapter type, the same text as the field's own ``json.dumps``
    with its ``DjangoJSONEncoder``."""
    field = WorkflowStage._meta.get_field("output_data")
    ours = rows.db_value(_entry(WorkflowStage, "output_data"), value, connection)
    orm = field.get_db_prep_save(value, connection)
    assert type(ours) is type(orm)
    if connection.vendor == "postgresql":
        assert ours.obj is value and ours.dumps(ours.obj) == orm.dumps(orm.obj)
    else:
        assert ours == orm
