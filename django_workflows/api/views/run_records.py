"""A run's records: ``annotations/`` (list, attach), ``signals/`` (list, send), ``events/``
(long poll), ``logs/``."""

from __future__ import annotations

import time
import uuid
from typing import Any

from django.db import InterfaceError, OperationalError, connection
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse
from rest_framework import status as http
from rest_framework.request import Request
from rest_framework.response import Response

from ...conf import workflow_settings
from ...kernel.errors import (
    RunTerminalError,
    WorkflowError,
)
from ...kernel.runtime import get_kernel
from ...models import (
    OutboxEvent,
    WorkflowLog,
    WorkflowRun,
)
from .. import serializers as s
from ..errors import APIError, Conflict, kernel_error
from .base import (
    _BODY_ERRORS,
    WorkflowsAPIView,
    _errors,
    document,
    get_run,
)
from .runs import IDEMPOTENCY_KEY_SCHEMA, header_idempotency_key


class RunSignalsView(WorkflowsAPIView):
    """``GET``: the run's signals, oldest first; ``POST``: send one (``send_signal``)."""

    required_permissions = {
        "GET": ["view_workflowrun", "view_workflowsignal"],
        "POST": ["add_workflowsignal"],
    }

    @property
    def throttle_scope(self) -> str:  # type: ignore[override]
        return "write" if self.request.method == "POST" else "read"

    @document(
        run=True,
        operation_id="runs_signals_list",
        summary="The run's signals, oldest first (pending and consumed)",
        responses={200: s.SignalListSerializer, **_errors(400, 404)},
    )
    def get(self, request: Request, run_id: str) -> Response:
        from ...signals import list_signals

        run = get_run(run_id, "id")
        data = [r.to_json() for r in list_signals(run.pk, limit=1000)]
        return Response(s.SignalListSerializer({"results": data}).data)

    @document(
        run=True,
        operation_id="runs_signals_create",
        summary="Send a signal to the run (actor: the current user unless given)",
        request=s.SendSignalSerializer,
        parameters=[
            OpenApiParameter(
                "Idempotency-Key",
                IDEMPOTENCY_KEY_SCHEMA,
                OpenApiParameter.HEADER,
                description="the signal's idempotency key (as the body's key): a repeat "
                "stores nothing and answers 200 with stored=false",
            )
        ],
        responses={
            201: s.SendSignalResultSerializer,
            200: OpenApiResponse(
                s.SendSignalResultSerializer, description="duplicate key: nothing stored"
            ),
            **_errors(*_BODY_ERRORS, 404, 409),
        },
    )
    def post(self, request: Request, run_id: str) -> Response:
        from ...signals import send_signal

        run = get_run(run_id, "id")
        body = self.body(s.SendSignalSerializer)
        header = header_idempotency_key(request)
        key = body.get("key")
        if header is not None and key is not None and header != key:
            message = "key: differs from the Idempotency-Key header (give one, or the same)"
            raise APIError(message, code="invalid", errors={"key": [message]})
        actor = body.get("actor") or f"user:{request.user.get_username() or request.user.pk}"
        try:
            result = send_signal(
                run.pk, body["name"], body.get("payload"), key=key or header, actor=actor
            )
        except RunTerminalError as exc:
            raise Conflict(str(exc), code="run_terminal") from None
        except WorkflowError as exc:
            raise kernel_error(exc) from None
        code = http.HTTP_201_CREATED if result.stored else http.HTTP_200_OK
        return Response(
            s.SendSignalResultSerializer(
                {
                    "workflow_run_id": result.workflow_run_id,
                    "signal_id": result.signal_id,
                    "name": result.name,
                    "stored": result.stored,
                    "woke": result.woke,
                }
            ).data,
            status=code,
        )


class RunAnnotationsView(WorkflowsAPIView):
    required_permissions = {
        "GET": ["view_workflowrun", "view_workflowannotation"],
        "POST": ["annotate_workflowrun"],
    }

    @property
    def throttle_scope(self) -> str:  # type: ignore[override]
        return "write" if self.request.method == "POST" else "read"

    @document(
        run=True,
        operation_id="runs_annotations_list",
        summary="The run's annotations, oldest first (SPEC §6.3 filters)",
        parameters=[s.AnnotationListQuerySerializer],
        responses={200: s.AnnotationListSerializer, **_errors(400, 404)},
    )
    def get(self, request: Request, run_id: str) -> Response:
        run = get_run(run_id, "id")
        query = self.query(s.AnnotationListQuerySerializer)
        filters: dict[str, Any] = {
            name: query[name]
            for name in (
                "key",
                "key_prefix",
                "scope",
                "scope_id",
                "actor_id",
                "actor_kind",
                "generation",
                "since",
                "until",
            )
            if name in query
        }
        if query.get("no_scope_id"):
            filters["scope_id"] = None
        records = get_kernel().annotations.list(
            run.pk, limit=query["limit"], include_legacy=query["include_legacy"], **filters
        )
        data = [record.to_json() | {"created_at": record.created_at} for record in records]
        return Response(s.AnnotationListSerializer({"results": data}).data)

    @document(
        run=True,
        operation_id="runs_annotations_create",
        summary="Attach annotations (actor: the current user unless given)",
        request=s.CreateAnnotationSerializer,
        responses={
            201: s.AttachResultSerializer,
            200: OpenApiResponse(
                s.AttachResultSerializer, description="nothing new (duplicates or all null)"
            ),
            **_errors(*_BODY_ERRORS, 404),
        },
    )
    def post(self, request: Request, run_id: str) -> Response:
        run = get_run(run_id, "id")
        body = self.body(s.CreateAnnotationSerializer)
        actor = {k: v for k, v in dict(body.get("actor") or {}).items() if v is not None}
        if not actor:
            actor = {"kind": "user", "id": request.user.get_username() or str(request.user.pk)}
        try:
            result = get_kernel().annotations.attach(
                run.pk,
                body["attributes"],
                actor=actor,
                scope=body.get("scope") or "run",
                scope_id=body.get("scope_id"),
                payload=body.get("payload"),
                idempotency_key=body.get("idempotency_key"),
                emit_event=body.get("emit_event", False),
            )
        except WorkflowError as exc:
            raise kernel_error(exc, stage_field="scope_id") from None
        code = http.HTTP_201_CREATED if result.created else http.HTTP_200_OK
        return Response(
            s.AttachResultSerializer(
                {"created": result.created, "duplicates": result.duplicates}
            ).data,
            status=code,
        )


def _events(run_pk: uuid.UUID, after: int, limit: int) -> list[dict[str, Any]]:
    return list(
        OutboxEvent.objects.filter(workflow_run_id=run_pk, sequence__gt=after)
        .order_by("sequence")
        .values("id", "sequence", "event_type", "occurred_at", "published_at", "payload")[:limit]
    )


def _poll_events(run_pk: uuid.UUID, after: int, limit: int) -> list[dict[str, Any]]:
    """One poll; a connection that broke while the long poll slept (database restart, idle
    timeout) is closed and the query retried once on a fresh one."""
    try:
        return _events(run_pk, after, limit)
    except (OperationalError, InterfaceError):
        if connection.in_atomic_block:
            raise
        connection.close()
        return _events(run_pk, after, limit)


class RunEventsView(WorkflowsAPIView):
    """Outbox events of a run in sequence order; ``wait`` turns it into a long poll.

    The long poll runs one indexed query (``workflow_run_id, sequence``) every
    ``API_LONG_POLL_INTERVAL_SECONDS`` until a newer event exists or ``wait`` seconds passed.
    It is routed with ``non_atomic_requests`` so every poll sees newly committed rows: no
    transaction, hence no snapshot or lock, is held while it sleeps. The request keeps its one
    database connection (idle between polls, returned to Django's per-request handling when
    the response is sent: closed or kept per ``CONN_MAX_AGE``); a connection that broke while
    it slept is replaced once (:func:`_poll_events`).
    """

    required_permissions = {"GET": ["view_workflowrun", "view_outboxevent"]}
    throttle_scope = "events"

    @document(
        run=True,
        operation_id="runs_events_list",
        summary="The run's events after a sequence number; wait= makes it a long poll",
        parameters=[s.EventsQuerySerializer],
        responses={200: s.EventListSerializer, **_errors(400, 404)},
    )
    def get(self, request: Request, run_id: str) -> Response:
        run = get_run(run_id, "id", "status")
        query = self.query(s.EventsQuerySerializer)
        after, limit = query["after"], query["limit"]
        wait = min(float(query["wait"]), float(workflow_settings.API_LONG_POLL_MAX_SECONDS))
        interval = max(0.01, float(workflow_settings.API_LONG_POLL_INTERVAL_SECONDS))
        deadline = time.monotonic() + wait
        polls = 0
        while True:
            rows = _poll_events(run.pk, after, limit)
            polls += 1
            remaining = deadline - time.monotonic()
            if rows or remaining <= 0:
                break
            time.sleep(min(interval, remaining))
        run_status = run.status
        if polls > 1 or rows:
            run_status = (
                WorkflowRun.objects.filter(pk=run.pk).values_list("status", flat=True).first()
                or run.status
            )
        next_after = rows[-1]["sequence"] if rows else after
        return Response(
            s.EventListSerializer(
                {"results": rows, "next_after": next_after, "run_status": run_status}
            ).data
        )


class RunLogsView(WorkflowsAPIView):
    required_permissions = {"GET": ["view_workflowrun", "view_workflowlog"]}

    @document(
        run=True,
        operation_id="runs_logs_list",
        summary="The run's log lines, oldest first, after a log id",
        parameters=[s.LogsQuerySerializer],
        responses={200: s.LogListSerializer, **_errors(400, 404)},
    )
    def get(self, request: Request, run_id: str) -> Response:
        run = get_run(run_id, "id")
        query = self.query(s.LogsQuerySerializer)
        qs = WorkflowLog.objects.filter(run_id=run.pk, id__gt=query["after"])
        if "level" in query:
            qs = qs.filter(level=query["level"])
        rows = list(
            qs.order_by("id").values(
                "id", "created_at", "level", "message", "metadata", "stage__stage_id"
            )[: query["limit"]]
        )
        for row in rows:
            row["stage_id"] = row.pop("stage__stage_id")
        next_after = rows[-1]["id"] if rows else query["after"]
        return Response(s.LogListSerializer({"results": rows, "next_after": next_after}).data)
