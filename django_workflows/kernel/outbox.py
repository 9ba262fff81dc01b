"""Outbox appends (EV-1..3). Events are written in the transaction of the state change that
produced them; sequences are gap-free per run.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterable
from datetime import datetime
from typing import Any

from django.db import connection, transaction

from ..models import OutboxEvent, WorkflowRun
from . import rows


def new_causation_id() -> str:
    return str(uuid.uuid4())


_BUMP_SQL = (
    f"UPDATE {WorkflowRun._meta.db_table} "
    "SET event_sequence = event_sequence + %s, updated_at = %s "
    "WHERE id = %s RETURNING event_sequence"
)


def _reserve_sequences(run_id: Any, count: int, now: datetime, *, bump: bool = True) -> int:
    """Bump the run's ``event_sequence`` by ``count`` and return the new value (one statement).

    The UPDATE takes the run's row lock (if the caller does not hold it already), so two
    appenders of one run are serialised and their sequences never overlap or leave gaps. It
    also stamps ``updated_at`` (an appended event is activity on the run); ``version`` stays,
    as the counter is bookkeeping, not a change of the run's state. ``bump=False``: the
    caller's statement has just found no run row; go straight to the fallback below.
    """
    row = None
    if bump:
        meta = WorkflowRun._meta
        params = [
            count,
            meta.get_field("updated_at").get_db_prep_value(now, connection),
            meta.pk.get_db_prep_value(uuid.UUID(str(run_id)), connection),
        ]
        with connection.cursor() as cursor:
            cursor.execute(_BUMP_SQL, params)
            row = cursor.fetchone()
    if row is None:
        # No run row (deleted by an operator, or events of a run this database does not hold):
        # continue after the outbox's last row, serialised per run by an advisory lock.
        if connection.vendor == "postgresql":
            with connection.cursor() as cursor:
                cursor.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", [str(run_id)])
        last = (
            OutboxEvent.objects.filter(workflow_run_id=run_id)
            .order_by("-sequence")
            .values_list("sequence", flat=True)
            .first()
        )
        return (last or 0) + count
    return int(row[0])


#: The key :func:`caused_by` marks an event with (removed before the event is stored).
_CAUSATION_KEY = "_causation_id"


def caused_by(event: dict[str, Any], causation_id: str) -> dict[str, Any]:
    """Mark ``event`` (in place; returned) to be appended with ``causation_id`` instead of the
    one :func:`append_events` is given: one transaction may append the events of two
    causations (an outcome and the next stage's delivery it leased; one delivery is one
    causation, SPEC K-5, K-JE-2).
    """
    event[_CAUSATION_KEY] = causation_id
    return event


def caused_by_unless_marked(
    events: Iterable[dict[str, Any]], causation_id: str
) -> list[dict[str, Any]]:
    """``events`` (a new list of the same dicts), each not yet marked by :func:`caused_by`
    marked with ``causation_id``: events to be appended later, by another causation's
    :func:`append_events` call in the same transaction, with the causation they have now.
    """
    return [ev if _CAUSATION_KEY in ev else caused_by(ev, causation_id) for ev in events]


def append_events(events: Iterable[dict[str, Any]], causation_id: str, now: datetime) -> int:
    """Append ``events`` (in order) to the outbox; returns the count.

    ``causation_id``: every event's, except an event marked by :func:`caused_by`.

    Per run, the next ``len(events)`` sequence numbers are reserved on the run row (EV-3,
    serialised by its row lock) and the rows written: on PostgreSQL in one statement (the
    ``UPDATE ... RETURNING`` in a CTE feeding the ``INSERT``, :func:`_append_sequenced`), on
    SQLite (no DML in CTEs) one ``UPDATE ... RETURNING`` per run and one bulk INSERT of all
    rows. Must be called inside ``transaction.atomic()``.
    """
    events = list(events)
    if not events:
        return 0
    assert transaction.get_connection().in_atomic_block, "append_events needs a transaction"
    by_run: dict[str, list[dict[str, Any]]] = {}
    for ev in events:
        by_run.setdefault(str(ev["workflow_run_id"]), []).append(ev)
    one_statement = _has_writable_ctes()
    new: list[OutboxEvent] = []
    for run_id, run_events in by_run.items():
        unsequenced = [
            rows.new(
                OutboxEvent,
                created_at=now,
                workflow_run_id=run_id,
                sequence=0,  # set below (or by the statement)
                event_type=ev["type"],
                causation_id=ev.pop(_CAUSATION_KEY, causation_id),
                payload=ev,
                occurred_at=now,
            )
            for ev in run_events
        ]
        if one_statement and _append_sequenced(run_id, unsequenced, now):
            continue
        last = _reserve_sequences(run_id, len(unsequenced), now, bump=not one_statement)
        first = last - len(unsequenced) + 1
        for offset, obj in enumerate(unsequenced):
            obj.sequence = first + offset
        if one_statement:  # the run row is missing (rare): this run's rows now, in order
            rows.insert(unsequenced)
        else:
            new.extend(unsequenced)
    rows.insert(new)
    transaction.on_commit(_events_committed)
    return len(events)


def _has_writable_ctes() -> bool:
    """Whether this database runs an UPDATE inside a CTE (PostgreSQL; SQLite does not)."""
    return rows._conn().vendor == "postgresql"


#: :func:`_append_sequenced`'s SQL parts, built once per process (PostgreSQL only).
_sequenced_shape: tuple[str, str, str, list[Any]] | None = None


def _sequenced_sql() -> tuple[str, str, str, list[Any]]:
    """``(head, row, tail, fields)`` of :func:`_append_sequenced`'s statement: ``head`` up to the
    ``VALUES`` list (``{n}`` for the event count), ``row`` one row's placeholders (its
    ordinal, then every column but the id and ``sequence``, each cast to its column's type -
    strings to ``text``, so an over-long value still fails the column's length check as a
    plain INSERT would, never truncated), ``tail`` after it, and the fields in row order.
    """
    global _sequenced_shape
    if _sequenced_shape is None:
        q = connection.ops.quote_name
        meta = OutboxEvent._meta
        fields = [f for f in meta.concrete_fields if not f.primary_key and f.attname != "sequence"]
        casts = [
            "text" if f.get_internal_type() in ("CharField", "TextField") else f.db_type(connection)
            for f in fields
        ]
        aliases = [f"c{i}" for i in range(len(fields))]
        head = (
            f"WITH s AS (UPDATE {q(WorkflowRun._meta.db_table)} "
            "SET event_sequence = event_sequence + {n}, updated_at = %s "
            "WHERE id = %s RETURNING event_sequence) "
            f"INSERT INTO {q(meta.db_table)} ({', '.join(q(f.column) for f in fields)}, "
            f"{q(meta.get_field('sequence').column)}) "
            f"SELECT {', '.join('v.' + a for a in aliases)}, s.event_sequence - {{n}} + v.ord "
            "FROM s CROSS JOIN (VALUES "
        )
        row = "(%s::integer, " + ", ".join(f"CAST(%s AS {c})" for c in casts) + ")"
        tail = f") AS v(ord, {', '.join(aliases)}) ORDER BY v.ord"
        _sequenced_shape = (head, row, tail, rows.writable(fields))
    return _sequenced_shape


def _append_sequenced(run_id: Any, objs: list[OutboxEvent], now: datetime) -> bool:
    """PostgreSQL: reserve ``len(objs)`` sequence numbers on the run row and insert the rows
    numbered from them, in one statement (a writable CTE: the run's ``UPDATE ... RETURNING``
    feeds the ``INSERT ... SELECT``). The UPDATE takes the run's row lock as
    :func:`_reserve_sequences` does (appenders of one run are serialised, sequences gap-free,
    ``updated_at`` stamped, ``version`` kept). Values are prepared by their fields as
    :func:`.rows.insert` prepares them. Returns ``False`` (nothing written) when the run row
    is missing: the caller falls back to :func:`_reserve_sequences`.
    """
    head, row, tail, fields = _sequenced_sql()
    n = len(objs)
    meta = WorkflowRun._meta
    conn = rows._conn()
    params: list[Any] = [
        meta.get_field("updated_at").get_db_prep_value(now, conn),
        meta.pk.get_db_prep_value(uuid.UUID(str(run_id)), conn),
    ]
    for ordinal, obj in enumerate(objs, start=1):
        params.append(ordinal)
        d = obj.__dict__
        params += [rows.db_value(entry, d[entry[1]], conn) for entry in fields]
    sql = head.format(n=n) + ", ".join([row] * n) + tail
    cursor = rows._cursor(conn)
    cursor.execute(sql, params)
    inserted = cursor.rowcount
    if inserted == 0:
        return False
    assert inserted == n, f"appended {inserted} of {n} events"
    return True


#: Called after every commit that appended events (:mod:`.flusher` adds the wake-up of this
#: process's flusher when it is imported; the outbox imports nothing that flushes).
committed_hooks: list[Callable[[], None]] = []


def _events_committed() -> None:
    for hook in committed_hooks:
        hook()
