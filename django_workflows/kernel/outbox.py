"""Outbox appends (EV-1..3). Events are written in the transaction of the state change that
produced them; sequences are gap-free per run.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from datetime import datetime
from typing import Any

from django.db import connection, transaction
from django.db.models import Max

from ..models import OutboxEvent


def new_causation_id() -> str:
    return str(uuid.uuid4())


def append_events(events: Iterable[dict[str, Any]], causation_id: str, now: datetime) -> int:
    """Append ``events`` (in order) to the outbox; returns the count.

    Sequences continue each run's current maximum (EV-3). On PostgreSQL a transaction-scoped
    advisory lock per run serialises concurrent appenders; on SQLite the IMMEDIATE transaction
    already does. Must be called inside ``transaction.atomic()``.
    """
    events = list(events)
    if not events:
        return 0
    assert transaction.get_connection().in_atomic_block, "append_events needs a transaction"
    by_run: dict[str, list[dict[str, Any]]] = {}
    for ev in events:
        by_run.setdefault(ev["workflow_run_id"], []).append(ev)
    rows: list[OutboxEvent] = []
    for run_id, run_events in by_run.items():
        if connection.vendor == "postgresql":
            with connection.cursor() as cursor:
                cursor.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", [run_id])
        current = (
            OutboxEvent.objects.filter(workflow_run_id=run_id).aggregate(m=Max("sequence"))["m"]
            or 0
        )
        for offset, ev in enumerate(run_events, start=1):
            rows.append(
                OutboxEvent(
                    created_at=now,
                    workflow_run_id=run_id,
                    sequence=current + offset,
                    event_type=ev["type"],
                    payload=ev,
                    causation_id=causation_id,
                    occurred_at=now,
                )
            )
    OutboxEvent.objects.bulk_create(rows)
    return len(rows)
