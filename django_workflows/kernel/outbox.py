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


def _reserve_sequences(run_id: Any, count: int, now: datetime) -> int:
    """Bump the run's ``event_sequence`` by ``count`` and return the new value (one statement).

    The UPDATE takes the run's row lock (if the caller does not hold it already), so two
    appenders of one run are serialised and their sequences never overlap or leave gaps. It
    also stamps ``updated_at`` (an appended event is activity on the run); ``version`` stays,
    as the counter is bookkeeping, not a change of the run's state.
    """
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


def append_events(events: Iterable[dict[str, Any]], causation_id: str, now: datetime) -> int:
    """Append ``events`` (in order) to the outbox; returns the count.

    ``causation_id``: every event's, except an event marked by :func:`caused_by`.

    Per run, one ``UPDATE ... RETURNING`` reserves the next ``len(events)`` sequence numbers on
    the run row (EV-3) and one bulk INSERT writes all rows. Must be called inside
    ``transaction.atomic()``.
    """
    events = list(events)
    if not events:
        return 0
    assert transaction.get_connection().in_atomic_block, "append_events needs a transaction"
    by_run: dict[str, list[dict[str, Any]]] = {}
    for ev in events:
        by_run.setdefault(str(ev["workflow_run_id"]), []).append(ev)
    new: list[OutboxEvent] = []
    for run_id, run_events in by_run.items():
        last = _reserve_sequences(run_id, len(run_events), now)
        first = last - len(run_events) + 1
        new.extend(
            rows.new(
                OutboxEvent,
                created_at=now,
                workflow_run_id=run_id,
                sequence=first + offset,
                event_type=ev["type"],
                causation_id=ev.pop(_CAUSATION_KEY, causation_id),
                payload=ev,
                occurred_at=now,
            )
            for offset, ev in enumerate(run_events)
        )
    rows.insert(new)
    transaction.on_commit(_events_committed)
    return len(new)


#: Called after every commit that appended events (:mod:`.flusher` adds the wake-up of this
#: process's flusher when it is imported; the outbox imports nothing that flushes).
committed_hooks: list[Callable[[], None]] = []


def _events_committed() -> None:
    for hook in committed_hooks:
        hook()
