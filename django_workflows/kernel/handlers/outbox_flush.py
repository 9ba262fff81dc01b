"""``outbox.flush`` (SPEC §4.10, EV-4..7; Part I item 16).

Publishes unpublished events through the event sink in per-run order (run id, then sequence).
When an event fails, the later events of its run wait for the next pass; after
``sink.max_retries`` failures the event is dead-lettered and its run stays blocked until an
operator replays (``plugin.replayDLQ``) or skips the dead letter: events of one run are never
published out of order (EC-27 fixed).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from django.db.models import F

from ...models import OutboxEvent
from ..commands import FlushOutbox, FlushOutboxResult

if TYPE_CHECKING:
    from ..dispatch import Kernel

logger = logging.getLogger("django_workflows.outbox")


def handle(kernel: Kernel, cmd: FlushOutbox) -> FlushOutboxResult:
    blocked = OutboxEvent.objects.filter(dlq_at__isnull=False, published_at__isnull=True).values(
        "workflow_run_id"
    )
    rows = list(
        OutboxEvent.objects.filter(published_at__isnull=True, dlq_at__isnull=True)
        .exclude(workflow_run_id__in=blocked)
        .order_by("workflow_run_id", "sequence")[: max(0, cmd.max_events)]
    )
    sink = kernel.event_sink
    max_retries = int(getattr(sink, "max_retries", 3) or 3)
    failed_runs: set[object] = set()
    published: list[int] = []
    for row in rows:
        if row.workflow_run_id in failed_runs:
            continue
        try:
            sink.emit(row.payload)
        except Exception as exc:
            failed_runs.add(row.workflow_run_id)
            logger.warning("Outbox event %s #%s failed: %s", row.event_type, row.sequence, exc)
            retries = row.retry_count + 1
            updates: dict[str, object] = {"retry_count": F("retry_count") + 1}
            if retries >= max_retries:
                updates["dlq_at"] = kernel.clock.now()
            OutboxEvent.objects.filter(pk=row.pk).update(**updates)
            continue
        published.append(row.pk)
    if published:
        OutboxEvent.objects.filter(pk__in=published).update(published_at=kernel.clock.now())
    return FlushOutboxResult(len(published))
