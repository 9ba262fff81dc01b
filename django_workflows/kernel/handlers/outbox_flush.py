"""``outbox.flush`` (SPEC §4.10, EV-4..7; Part I item 16).

Publishes unpublished events through the event sink in per-run order (run id, then sequence).
When an event fails, the later events of its run wait for the next pass; after
``sink.max_retries`` failures the event is dead-lettered and its run stays blocked until an
operator replays (``plugin.replayDLQ``) or skips the dead letter: events of one run are never
published out of order (EC-27 fixed).

The sink receives the stored payload plus ``sequence`` (1, 2, ... per run) and ``event_id`` (the
outbox row id), so a plugin can deduplicate a redelivery; the stored payload is not changed.
Every failed delivery records the error on the row (``last_error``, at most
``MAX_ERROR_CHARS`` characters, NUL characters made visible).

A sink that would hand an event to no one (:meth:`..plugins.PluginRunner.receives_nothing`:
no plugin and no ``workflow_event`` receiver) with tracing off has the same events marked
published in one ``UPDATE``, without reading them (issue 19).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from django.db.models import F, QuerySet

from ... import telemetry
from ...models import OutboxEvent
from ..commands import FlushOutbox, FlushOutboxResult
from ..jsonvalue import storable_text

if TYPE_CHECKING:
    from ..dispatch import Kernel

logger = logging.getLogger("django_workflows.outbox")

#: Longest ``OutboxEvent.last_error`` kept (characters); longer errors are cut with a note.
MAX_ERROR_CHARS = 4000


def delivery_error(exc: BaseException) -> str:
    """``ExceptionType: message`` of a failed delivery, storable in a text column and cut to
    ``MAX_ERROR_CHARS`` characters.
    """
    text = storable_text(f"{type(exc).__name__}: {exc}")
    if len(text) > MAX_ERROR_CHARS:
        cut = len(text) - MAX_ERROR_CHARS
        text = f"{text[:MAX_ERROR_CHARS]}\n… ({cut} more characters)"
    return text


def _waiting() -> QuerySet[OutboxEvent]:
    """The events a pass may publish, in publishing order: unpublished, not dead-lettered, of
    no run blocked behind a dead letter (EC-27), by run id, then sequence."""
    blocked = OutboxEvent.objects.filter(dlq_at__isnull=False, published_at__isnull=True).values(
        "workflow_run_id"
    )
    return (
        OutboxEvent.objects.filter(published_at__isnull=True, dlq_at__isnull=True)
        .exclude(workflow_run_id__in=blocked)
        .order_by("workflow_run_id", "sequence")
    )


def handle(kernel: Kernel, cmd: FlushOutbox) -> FlushOutboxResult:
    sink = kernel.event_sink
    limit = max(0, cmd.max_events)
    receives_nothing = getattr(sink, "receives_nothing", None)
    if receives_nothing is not None and receives_nothing() and telemetry.tracer() is None:
        # Nobody would receive them (no plugin, no workflow_event receiver, no trace to
        # record): mark the first ``limit`` waiting events published in one statement, the
        # same events in the same order a pass would publish, without reading a payload
        # (issue 19: the flushing process's CPU per event about a quarter).
        if not limit:
            return FlushOutboxResult(0)
        first = _waiting().values("pk")[:limit]
        published = OutboxEvent.objects.filter(pk__in=first).update(published_at=kernel.clock.now())
        return FlushOutboxResult(published)
    # Only the columns a pass uses, as tuples: no model instances, and none of the row's five
    # timestamps parsed (about a third of a worker's flush CPU; same single statement).
    rows = _waiting().values_list(
        "pk", "workflow_run_id", "sequence", "event_type", "payload", "retry_count"
    )[:limit]
    max_retries = int(getattr(sink, "max_retries", 3) or 3)
    failed_runs: set[object] = set()
    published: list[int] = []
    contexts = telemetry.outbox_contexts([row[1] for row in rows])
    for pk, run_id, sequence, event_type, payload, retry_count in rows:
        if run_id in failed_runs:
            continue
        try:
            with telemetry.delivering_event(contexts, run_id, event_type, sequence):
                sink.emit({**payload, "sequence": sequence, "event_id": pk})
        except Exception as exc:
            failed_runs.add(run_id)
            logger.warning("Outbox event %s #%s failed: %s", event_type, sequence, exc)
            retries = retry_count + 1
            updates: dict[str, object] = {
                "retry_count": F("retry_count") + 1,
                "last_error": delivery_error(exc),
            }
            if retries >= max_retries:
                updates["dlq_at"] = kernel.clock.now()
                telemetry.event_dead_lettered(event_type)
            OutboxEvent.objects.filter(pk=pk).update(**updates)
            continue
        published.append(pk)
    if published:
        OutboxEvent.objects.filter(pk__in=published).update(published_at=kernel.clock.now())
    return FlushOutboxResult(len(published))
