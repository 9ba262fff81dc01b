"""``outbox.skipDeadLetter`` (Part I item 16): an operator skips one dead-lettered event.

A dead letter blocks the later events of its run (strict per-run order, EC-27 fixed). When an
event can never be delivered (its plugin rejects it for good), an operator either fixes the
plugin and replays (``plugin.replayDLQ``) or skips it with this command: the row is marked
published and skipped (``published_at = skipped_at = now``, ``skip_note``), keeps ``dlq_at`` and
``retry_count`` for audit, and is never delivered. The next flush delivers the run's later
events in order. Writes no events.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from django.db import transaction

from ...models import OutboxEvent
from ..commands import SkipDeadLetter, SkipDeadLetterResult
from ..errors import InvalidCommandError, OutboxEventNotFoundError, OutboxEventStateError

if TYPE_CHECKING:
    from ..dispatch import Kernel


def handle(kernel: Kernel, cmd: SkipDeadLetter) -> SkipDeadLetterResult:
    """Skip the dead letter ``cmd.event_id``.

    Raises:
        InvalidCommandError: ``event_id`` is not a positive integer.
        OutboxEventNotFoundError: no such event.
        OutboxEventStateError: the event is published, already skipped, or not dead-lettered
            (still being retried); nothing is changed.
    """
    try:
        event_id = int(cmd.event_id)
    except (TypeError, ValueError):
        raise InvalidCommandError(
            f"event_id: {cmd.event_id!r} is not an outbox event id (expected an integer)",
            field="event_id",
        ) from None
    if event_id <= 0:
        raise InvalidCommandError(f"event_id: must be > 0, got {event_id}", field="event_id")
    now = kernel.clock.now()
    with transaction.atomic():
        updated = OutboxEvent.objects.filter(
            pk=event_id, dlq_at__isnull=False, published_at__isnull=True
        ).update(published_at=now, skipped_at=now, skip_note=cmd.note or "")
        row = OutboxEvent.objects.filter(pk=event_id).first()
        if row is None:
            raise OutboxEventNotFoundError(event_id)
        if not updated:
            raise OutboxEventStateError(_why_not(row))
        unblocked = OutboxEvent.objects.filter(
            workflow_run_id=row.workflow_run_id,
            sequence__gt=row.sequence,
            published_at__isnull=True,
        ).count()
    return SkipDeadLetterResult(
        event_id=row.pk,
        workflow_run_id=str(row.workflow_run_id),
        sequence=row.sequence,
        event_type=row.event_type,
        unblocked=unblocked,
    )


def _why_not(row: OutboxEvent) -> str:
    name = f"Outbox event {row.pk} ({row.event_type} #{row.sequence} of run {row.workflow_run_id})"
    if row.skipped_at is not None:
        return f"{name} was already skipped at {row.skipped_at.isoformat()}"
    if row.published_at is not None:
        return f"{name} was already published at {row.published_at.isoformat()}"
    return (
        f"{name} is not dead-lettered (retry_count={row.retry_count}); only a dead letter can "
        "be skipped - wait for it to be delivered or dead-lettered"
    )
