"""``runs/``: list and start runs, one run's detail, cancel, rerun, approve and reject."""

from __future__ import annotations

import json
import math
from typing import Any

from django.db.models import Exists, OuterRef, QuerySet
from django.urls import NoReverseMatch, reverse
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse
from rest_framework import status as http
from rest_framework.request import Request
from rest_framework.response import Response

from ... import approval
from ...children import child_runs
from ...definition.registry import registry
from ...kernel.commands import CancelRun, CreateRun, RerunFrom
from ...kernel.errors import (
    InvalidCommandError,
    RunStateError,
    WorkflowError,
)
from ...kernel.runtime import get_kernel
from ...models import (
    TERMINAL_RUN_STATUSES,
    Status,
    WorkflowAnnotation,
    WorkflowJob,
    WorkflowRun,
    WorkflowStage,
)
from ...runs import run_error, waiting_reasons
from .. import serializers as s
from ..errors import APIError, kernel_error
from ..pagination import RunCursorPagination
from .base import (
    _BODY_ERRORS,
    RUN_LIST_FIELDS,
    WorkflowsAPIView,
    _errors,
    document,
    get_run,
)

#: What the server accepts as ``Idempotency-Key`` (``RunListView.idempotency_key``): 1-255
#: printable ASCII characters, not only spaces. Its OpenAPI schema; defined here, not in
#: :mod:`django_workflows.api.schema`, which reads the views (an import circle).
IDEMPOTENCY_KEY_SCHEMA = {
    "type": "string",
    "minLength": 1,
    "maxLength": 255,
    "pattern": "^[ -~]*[!-~][ -~]*$",
}


def _json_query_value(raw: str) -> Any:
    """The ``value=`` filter as JSON when it parses as such, else the string itself. ``NaN``,
    ``Infinity`` and numbers beyond a float's range (``1e999``) stay strings: no annotation can
    hold them (values are checked on write) and PostgreSQL's ``jsonb`` refuses them (a 500).
    So do JSON strings holding a NUL (``"\\u0000"``) or a lone surrogate (``"\\ud800"``),
    which no annotation holds either and no text column can store."""

    def not_json(text: str) -> Any:
        raise ValueError(text)

    def finite(text: str) -> float:
        number = float(text)
        if not math.isfinite(number):
            raise ValueError(text)
        return number

    try:
        value = json.loads(raw, parse_constant=not_json, parse_float=finite)
        text = json.dumps(value, ensure_ascii=False)
        text.encode("utf-8")  # a lone surrogate: UnicodeEncodeError (a ValueError)
    except ValueError:
        return raw
    return raw if "\\u0000" in text else value


class RunListView(WorkflowsAPIView):
    required_permissions = {"GET": ["view_workflowrun"], "POST": ["add_workflowrun"]}
    pagination_class = RunCursorPagination

    @property
    def throttle_scope(self) -> str:  # type: ignore[override]
        return "write" if self.request.method == "POST" else "read"

    def filtered(self, query: dict[str, Any]) -> QuerySet[WorkflowRun]:
        qs = WorkflowRun.objects.only(*RUN_LIST_FIELDS)
        if query.get("status"):
            statuses = sorted(set(query["status"]))
            qs = (
                qs.filter(status=statuses[0])
                if len(statuses) == 1
                else qs.filter(status__in=statuses)
            )
        if "workflow_id" in query:
            qs = qs.filter(workflow_id=query["workflow_id"])
        if "created_after" in query:
            qs = qs.filter(created_at__gte=query["created_after"])
        if "created_before" in query:
            qs = qs.filter(created_at__lt=query["created_before"])
        if "parent" in query:
            qs = qs.filter(parent_run_id=query["parent"])
        if "key" in query:
            annotations = WorkflowAnnotation.objects.filter(run=OuterRef("pk"), key=query["key"])
            if "value" in query:
                annotations = annotations.filter(value=_json_query_value(query["value"]))
            qs = qs.filter(Exists(annotations))
        return qs

    @document(
        operation_id="runs_list",
        summary="Runs, newest first (cursor pagination)",
        parameters=[s.RunListQuerySerializer],
        responses={200: s.RunPageSerializer, **_errors(400)},
    )
    def get(self, request: Request) -> Response:
        query = self.query(s.RunListQuerySerializer)
        paginator = self.pagination_class()
        page = paginator.paginate_queryset(self.filtered(query), request, view=self)
        rows = [self.summary(run) for run in page]
        return paginator.get_paginated_response(s.RunSerializer(rows, many=True).data)

    def summary(self, run: WorkflowRun) -> dict[str, Any]:
        data = {name: getattr(run, name) for name in RUN_LIST_FIELDS}
        data["url"] = self.url("run-detail", str(run.pk))
        return data

    @document(
        operation_id="runs_create",
        summary="Start a run",
        request=s.CreateRunSerializer,
        parameters=[
            OpenApiParameter(
                "Idempotency-Key",
                IDEMPOTENCY_KEY_SCHEMA,
                OpenApiParameter.HEADER,
                description="repeat a request safely: the same key and body return the same "
                "run (200); the same key with another body is a 409",
            )
        ],
        responses={
            201: s.RunDetailSerializer,
            200: OpenApiResponse(s.RunDetailSerializer, description="idempotent replay"),
            **_errors(*_BODY_ERRORS, 409),
        },
    )
    def post(self, request: Request) -> Response:
        body = self.body(s.CreateRunSerializer)
        key = self.idempotency_key()
        workflow = registry.get(body["workflow_id"])
        annotations = tuple(_envelope(a) for a in body.get("annotations") or ())
        try:
            result = get_kernel().dispatch(
                CreateRun(
                    workflow_id=body["workflow_id"],
                    input=body.get("input") or {},
                    config=body.get("config"),
                    priority=body["priority"],
                    idempotency_key=key,
                    annotations=annotations,
                )
            )
        except WorkflowError as exc:
            if isinstance(exc, InvalidCommandError) and (exc.field or "").startswith(
                "idempotency_key"
            ):
                raise APIError(
                    str(exc), code="invalid", errors={"Idempotency-Key": [str(exc)]}
                ) from None
            raise kernel_error(
                exc, workflow=workflow, input=body.get("input"), config=body.get("config")
            ) from None
        run = WorkflowRun.objects.get(pk=result.workflow_run_id)
        data = RunDetailView.document(self, run)
        code = http.HTTP_200_OK if result.replayed else http.HTTP_201_CREATED
        return Response(data, status=code, headers={"Location": data["url"]})

    def idempotency_key(self) -> str | None:
        return header_idempotency_key(self.request)


def header_idempotency_key(request: Request) -> str | None:
    """The request's ``Idempotency-Key`` header (``None`` when absent).

    Raises:
        APIError: 400 ``invalid`` naming the header: empty, longer than 255 characters or
            not printable ASCII.
    """
    raw = request.headers.get("Idempotency-Key")
    if raw is None:
        return None
    problem = None
    if not raw.strip():
        problem = "must not be empty"
    elif len(raw) > 255:
        problem = "at most 255 characters"
    elif any(ord(ch) < 32 or ord(ch) > 126 for ch in raw):
        problem = "printable ASCII only"
    if problem:
        message = f"Idempotency-Key: {problem}"
        raise APIError(message, code="invalid", errors={"Idempotency-Key": [message]})
    return raw


def _envelope(data: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in data.items() if v is not None}
    if "actor" in out:
        out["actor"] = {k: v for k, v in dict(out["actor"]).items() if v is not None} or None
        if out["actor"] is None:
            del out["actor"]
    return out


def _waiting(
    run: WorkflowRun, stages: list[WorkflowStage], jobs: dict[str, WorkflowJob]
) -> list[dict[str, Any]]:
    """Why ``run`` is not moving (:func:`django_workflows.runs.waiting_reasons`), as
    ``WaitingSerializer`` dicts; an approval names the API's approve/ and reject/ routes."""
    out = []
    for w in waiting_reasons(run, stages, jobs):
        message = w.message
        if w.reason == "approval":
            who = f" by one of {', '.join(w.allowed_approvers)}" if w.allowed_approvers else ""
            message = f"waiting for a decision (POST approve/ or reject/){who}"
        elif w.reason == "signal":
            message = f"{message}; POST signals/ with name {w.signal!r}"
        out.append(
            {
                "reason": w.reason,
                "stage_id": w.stage_id,
                "at": w.at,
                "message": message,
                "allowed_approvers": list(w.allowed_approvers),
            }
        )
    return out


class RunDetailView(WorkflowsAPIView):
    required_permissions = {"GET": ["view_workflowrun"]}

    @document(
        run=True,
        operation_id="runs_retrieve",
        summary="A run with its stages and what it waits for",
        responses={200: s.RunDetailSerializer, **_errors(404)},
    )
    def get(self, request: Request, run_id: str) -> Response:
        return Response(self.document(self, get_run(run_id)))

    @staticmethod
    def document(view: WorkflowsAPIView, run: WorkflowRun) -> dict[str, Any]:
        """The run detail: 3 queries (stages; open jobs, only while the run is active; child
        runs), and one more for worker presence while a job is queued (stage routing)."""
        stages = list(
            WorkflowStage.objects.filter(run=run).order_by("execution_group", "stage_number")
        )
        jobs: dict[str, WorkflowJob] = {}
        if run.status not in TERMINAL_RUN_STATUSES:
            for job in WorkflowJob.objects.filter(
                workflow_run_id=run.pk, status__in=[Status.PENDING, Status.RUNNING]
            ).order_by("id"):
                jobs[job.stage_id] = job
        rid = str(run.pk)
        try:
            admin_url: str | None = view.request.build_absolute_uri(
                reverse("admin:django_workflows_workflowrun_change", args=[rid])
            )
        except NoReverseMatch:
            admin_url = None
        data = {name: getattr(run, name) for name in RUN_LIST_FIELDS}
        data.update(
            url=view.url("run-detail", rid),
            input=run.input,
            config=run.config,
            output=run.output,
            error=run_error(run, list(stages)),
            error_detail=run.error if isinstance(run.error, dict) else None,
            stages=[
                {
                    "stage_id": st.stage_id,
                    "name": st.stage_name,
                    "execution_group": st.execution_group,
                    "stage_number": st.stage_number,
                    "generation": st.generation,
                    "status": st.status,
                    "started_at": st.started_at,
                    "completed_at": st.completed_at,
                    "duration_ms": st.duration_ms,
                    "error": st.error_message,
                    "progress": st.progress,
                    "progress_message": st.progress_message or "",
                    "next_poll_at": st.next_poll_at,
                    "skip_reason": st.skip_reason,
                    "items": (
                        {**st.items, "in_flight": st.items_in_flight()}
                        if st.items is not None
                        else None
                    ),
                }
                for st in stages
            ],
            waiting=_waiting(run, stages, jobs),
            parent_run_id=run.parent_run_id,
            parent_stage_id=run.parent_stage_id,
            children=[
                {**child, "url": view.url("run-detail", child["id"])}
                for child in child_runs(run.pk)
            ],
            links={
                "events": view.url("run-events", rid),
                "annotations": view.url("run-annotations", rid),
                "logs": view.url("run-logs", rid),
                "admin": admin_url,
            },
        )
        return s.RunDetailSerializer(data).data  # type: ignore[no-any-return]


class RunCancelView(WorkflowsAPIView):
    required_permissions = {"POST": ["cancel_workflowrun"]}
    throttle_scope = "write"

    @document(
        run=True,
        operation_id="runs_cancel",
        summary="Cancel a PENDING or RUNNING run",
        request=s.CancelSerializer,
        responses={200: s.CancelResultSerializer, **_errors(*_BODY_ERRORS, 404)},
    )
    def post(self, request: Request, run_id: str) -> Response:
        run = get_run(run_id, "id", "status")
        body = self.body(s.CancelSerializer)
        reason = body.get("reason") or f"Cancelled over the API by {request.user.get_username()}"
        result = get_kernel().dispatch(CancelRun(run.pk, reason=reason))
        current = WorkflowRun.objects.filter(pk=run.pk).values_list("status", flat=True).first()
        return Response(
            s.CancelResultSerializer(
                {"cancelled": bool(result.cancelled), "status": current or run.status}
            ).data
        )


class RunRerunView(WorkflowsAPIView):
    required_permissions = {"POST": ["rerun_workflowrun"]}
    throttle_scope = "write"

    @document(
        run=True,
        operation_id="runs_rerun",
        summary="Rerun a COMPLETED or FAILED run from a stage",
        request=s.RerunSerializer,
        responses={200: s.RerunResultSerializer, **_errors(*_BODY_ERRORS, 404, 409)},
    )
    def post(self, request: Request, run_id: str) -> Response:
        run = get_run(run_id, "id")
        body = self.body(s.RerunSerializer)
        try:
            result = get_kernel().dispatch(
                RerunFrom(
                    run.pk, body["from_stage_id"], idempotency_key=body.get("idempotency_key")
                )
            )
        except WorkflowError as exc:
            raise kernel_error(exc, stage_field="from_stage_id") from None
        return Response(
            s.RerunResultSerializer(
                {
                    "workflow_run_id": result.workflow_run_id,
                    "from_stage_id": result.from_stage_id,
                    "deleted_stages": list(result.deleted_stages),
                    "replayed": bool(result.replayed),
                }
            ).data
        )


class _DecisionView(WorkflowsAPIView):
    required_permissions = {"POST": ["approve_workflowrun"]}
    throttle_scope = "write"
    outcome = "approved"

    def decide(self, run_id: str, serializer_class: Any, text_field: str) -> Response:
        run = get_run(run_id, "id")
        body = self.body(serializer_class)
        by = self.request.user.get_username() or str(self.request.user.pk)
        decide = approval.approve if self.outcome == "approved" else approval.reject
        kwargs = {text_field: body.get(text_field) or None}
        try:
            recorded = decide(
                run.pk,
                by=by,
                stage_id=body.get("stage_id") or None,
                policy_version=body.get("policy_version") or None,
                **kwargs,
            )
        except InvalidCommandError as exc:
            if exc.field == "by":
                raise APIError(str(exc), code="not_allowed_approver", status_code=403) from None
            raise kernel_error(exc) from None
        except RunStateError as exc:
            code = (
                "approval_conflict"
                if isinstance(exc, approval.ApprovalConflictError)
                else ("no_approval_waiting")
            )
            raise APIError(str(exc), code=code, status_code=409) from None
        return Response(
            s.DecisionResultSerializer(
                {
                    "workflow_run_id": recorded.workflow_run_id,
                    "stage_id": recorded.stage_id,
                    "generation": recorded.generation,
                    "outcome": recorded.outcome,
                    "recorded": recorded.recorded,
                    "decided_by": by,
                }
            ).data
        )


class RunApproveView(_DecisionView):
    outcome = "approved"

    @document(
        run=True,
        operation_id="runs_approve",
        summary="Approve the run's waiting approval stage (decided by the current user)",
        request=s.ApproveSerializer,
        responses={200: s.DecisionResultSerializer, **_errors(*_BODY_ERRORS, 404, 409)},
    )
    def post(self, request: Request, run_id: str) -> Response:
        return self.decide(run_id, s.ApproveSerializer, "comment")


class RunRejectView(_DecisionView):
    outcome = "rejected"

    @document(
        run=True,
        operation_id="runs_reject",
        summary="Reject the run's waiting approval stage (decided by the current user)",
        request=s.RejectSerializer,
        responses={200: s.DecisionResultSerializer, **_errors(*_BODY_ERRORS, 404, 409)},
    )
    def post(self, request: Request, run_id: str) -> Response:
        return self.decide(run_id, s.RejectSerializer, "reason")
