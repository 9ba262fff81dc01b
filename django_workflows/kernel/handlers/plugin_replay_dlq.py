"""``plugin.replayDLQ`` (SPEC §4.11, EV-32): re-arm dead-lettered outbox events.

A re-armed row starts over: ``dlq_at`` and ``last_error`` are cleared, ``retry_count`` is 0.
``event_ids`` limits the replay to a selection (the admin's "Replay" of one dead letter); the
admin keeps the cleared error and retry count in its History record.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ...models import OutboxEvent
from ..commands import ReplayDeadLetters, ReplayDeadLettersResult

if TYPE_CHECKING:
    from ..dispatch import Kernel


def handle(kernel: Kernel, cmd: ReplayDeadLetters) -> ReplayDeadLettersResult:
    dead = OutboxEvent.objects.filter(dlq_at__isnull=False, published_at__isnull=True)
    if cmd.event_ids is not None:
        dead = dead.filter(pk__in=[int(i) for i in cmd.event_ids])
    ids = list(
        dead.order_by("workflow_run_id", "sequence").values_list("pk", flat=True)[
            : max(0, cmd.max_events)
        ]
    )
    replayed = OutboxEvent.objects.filter(pk__in=ids).update(
        dlq_at=None, retry_count=0, last_error=None
    )
    return ReplayDeadLettersResult(replayed)
