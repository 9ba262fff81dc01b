"""``dead-letters/``: list the dead-lettered outbox events, replay or skip one (issue 17 §4).

A dead letter is an outbox event whose plugin delivery failed ``OUTBOX_MAX_RETRIES`` times
(``dlq_at`` set, ``published_at`` null); it blocks the later events of its run (strict
per-run order). These routes are the API's face of the admin's "Replay" and "Skip"
operations and dispatch the same kernel commands:

* ``POST dead-letters/{event_id}/replay/`` - ``plugin.replayDLQ`` for that one event (EV-32):
  the next outbox flush delivers it again, its retry count starts over;
* ``POST dead-letters/{event_id}/skip/`` - ``outbox.skipDeadLetter``: it is never delivered,
  the row stays for audit with the note, the run's later events flow again.

Both are idempotent: repeating a replay of an event that is no longer a dead letter (already
re-armed, or delivered since) answers 200 with ``replayed: false``; repeating a skip answers
200 with ``changed: false``. A skipped event cannot be replayed, a delivered or still
retrying one cannot be skipped: 409 ``not_a_dead_letter``.
"""

from __future__ import annotations

from typing import Any

from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter
from rest_framework.request import Request
from rest_framework.response import Response

from ...kernel.commands import ReplayDeadLetters, SkipDeadLetter
from ...kernel.errors import OutboxEventStateError
from ...kernel.runtime import get_kernel
from ...models import OutboxEvent
from .. import serializers as s
from ..errors import APIError
from .base import _BODY_ERRORS, WorkflowsAPIView, _errors, document

INT64_MAX = 2**63 - 1

EVENT_ID = OpenApiParameter(
    "event_id",
    OpenApiTypes.INT,
    OpenApiParameter.PATH,
    description="the outbox event's id (`id` of GET dead-letters/ or of the run's events)",
)


def event_state(row: OutboxEvent) -> str:
    """``dead_letter``, ``skipped``, ``published`` (delivered) or ``pending`` (to deliver)."""
    if row.skipped_at is not None:
        return "skipped"
    if row.published_at is not None:
        return "published"
    return "dead_letter" if row.dlq_at is not None else "pending"


def get_event(event_id: str) -> OutboxEvent:
    """The outbox event ``event_id`` (a positive 64-bit integer) or a 404."""
    try:
        pk = int(event_id) if event_id.isascii() and event_id.isdigit() else 0
    except ValueError:
        pk = 0
    row = OutboxEvent.objects.filter(pk=pk).first() if 1 <= pk <= INT64_MAX else None
    if row is None:
        raise APIError(f"No outbox event {event_id[:100]!r}.", code="not_found", status_code=404)
    return row


def dead_letter_document(row: OutboxEvent) -> dict[str, Any]:
    return {
        "id": row.pk,
        "workflow_run_id": row.workflow_run_id,
        "sequence": row.sequence,
        "event_type": row.event_type,
        "occurred_at": row.occurred_at,
        "dlq_at": row.dlq_at,
        "retry_count": row.retry_count,
        "last_error": row.last_error,
        "state": event_state(row),
    }


def _errors_404(*codes: int) -> dict[int, Any]:
    out = _errors(*codes)
    if 404 in out:
        out[404].description = "unknown or malformed event id"
    return out


class DeadLetterListView(WorkflowsAPIView):
    required_permissions = {"GET": ["view_outboxevent"]}

    @document(
        operation_id="dead_letters_list",
        summary="Dead-lettered outbox events, oldest id first, after an id",
        parameters=[s.DeadLetterQuerySerializer],
        responses={200: s.DeadLetterListSerializer, **_errors(400)},
    )
    def get(self, request: Request) -> Response:
        query = self.query(s.DeadLetterQuerySerializer)
        qs = OutboxEvent.objects.filter(
            dlq_at__isnull=False, published_at__isnull=True, id__gt=query["after"]
        )
        if "workflow_run_id" in query:
            qs = qs.filter(workflow_run_id=query["workflow_run_id"])
        rows = [dead_letter_document(row) for row in qs.order_by("id")[: query["limit"]]]
        next_after = rows[-1]["id"] if rows else query["after"]
        return Response(
            s.DeadLetterListSerializer({"results": rows, "next_after": next_after}).data
        )


class DeadLetterReplayView(WorkflowsAPIView):
    required_permissions = {"POST": ["replay_outboxevent"]}
    throttle_scope = "write"

    @document(
        operation_id="dead_letters_replay",
        summary="Replay a dead letter: the next outbox flush delivers it again",
        parameters=[EVENT_ID],
        request=s.EmptyBodySerializer,
        responses={200: s.DeadLetterReplayResultSerializer, **_errors_404(*_BODY_ERRORS, 404, 409)},
    )
    def post(self, request: Request, event_id: str) -> Response:
        row = get_event(event_id)
        self.body(s.EmptyBodySerializer)
        if row.skipped_at is not None:
            raise APIError(
                f"Outbox event {row.pk} was skipped at {row.skipped_at.isoformat()}; a "
                "skipped event is never delivered.",
                code="not_a_dead_letter",
                status_code=409,
            )
        result = get_kernel().dispatch(ReplayDeadLetters(max_events=1, event_ids=(row.pk,)))
        row.refresh_from_db()
        return Response(
            s.DeadLetterReplayResultSerializer(
                {"event_id": row.pk, "replayed": result.replayed > 0, "state": event_state(row)}
            ).data
        )


class DeadLetterSkipView(WorkflowsAPIView):
    required_permissions = {"POST": ["skip_outboxevent"]}
    throttle_scope = "write"

    @document(
        operation_id="dead_letters_skip",
        summary="Skip a dead letter for good: never delivered, the run's later events flow",
        parameters=[EVENT_ID],
        request=s.DeadLetterSkipSerializer,
        responses={200: s.DeadLetterSkipResultSerializer, **_errors_404(*_BODY_ERRORS, 404, 409)},
    )
    def post(self, request: Request, event_id: str) -> Response:
        row = get_event(event_id)
        body = self.body(s.DeadLetterSkipSerializer)
        changed = row.skipped_at is None
        if changed:
            try:
                get_kernel().dispatch(SkipDeadLetter(event_id=row.pk, note=body["note"]))
            except OutboxEventStateError as exc:
                row.refresh_from_db()
                if row.skipped_at is None:  # delivered, or still being retried
                    raise APIError(str(exc), code="not_a_dead_letter", status_code=409) from None
                changed = False  # a concurrent skip won
            row.refresh_from_db()
        unblocked = OutboxEvent.objects.filter(
            workflow_run_id=row.workflow_run_id,
            sequence__gt=row.sequence,
            published_at__isnull=True,
        ).count()
        return Response(
            s.DeadLetterSkipResultSerializer(
                {
                    "event_id": row.pk,
                    "workflow_run_id": row.workflow_run_id,
                    "sequence": row.sequence,
                    "event_type": row.event_type,
                    "changed": changed,
                    "skipped_at": row.skipped_at,
                    "note": row.skip_note,
                    "unblocked": unblocked,
                }
            ).data
        )
