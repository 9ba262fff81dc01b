"""Views of the HTTP API (see ``django_workflows/api/urls.py`` for the routes).

Reads query the models directly (a bounded number of indexed queries per request); every
write goes through ``Kernel.dispatch`` or the public helpers built on it (``annotate_run``,
``approval.approve/reject``), so the API never assigns a status field.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from typing import Any

from django.db import InterfaceError, OperationalError, connection
from django.db.models import Exists, OuterRef, QuerySet
from django.urls import NoReverseMatch, reverse
from django.utils.module_loading import import_string
from drf_spectacular.openapi import AutoSchema
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema
from rest_framework import status as http
from rest_framework.renderers import JSONRenderer
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.settings import api_settings
from rest_framework.views import APIView

from .. import approval
from ..conf import workflow_settings
from ..definition.registry import registry
from ..kernel import timeouts
from ..kernel.commands import CancelRun, CreateRun, RerunFrom
from ..kernel.errors import (
    InvalidCommandError,
    RunStateError,
    WorkflowError,
)
from ..kernel.runtime import get_kernel
from ..models import (
    TERMINAL_RUN_STATUSES,
    OutboxEvent,
    Status,
    WorkflowAnnotation,
    WorkflowJob,
    WorkflowLog,
    WorkflowRun,
    WorkflowStage,
)
from ..runs import run_error, waiting_reasons
from . import serializers as s
from .errors import APIError, RunNotFound, error_body, exception_handler, kernel_error
from .pagination import RunCursorPagination
from .parsers import StrictJSONParser, check_body_size

NAMESPACE = "django_workflows_api"
RUN_LIST_FIELDS = (
    "id",
    "workflow_id",
    "workflow_name",
    "status",
    "priority",
    "created_at",
    "updated_at",
    "started_at",
    "completed_at",
    "duration_ms",
    "definition_version",
)


def _errors(*codes: int) -> dict[int, OpenApiResponse]:
    """Documented error responses: always 401, 403, 429; plus ``codes``."""
    descriptions = {
        400: "invalid request (code: invalid, parse_error, too_deep, unknown_workflow, "
        "invalid_input, invalid_config, unknown_stage)",
        401: "not authenticated (token authentication)",
        403: "not authenticated (session only) or a missing permission",
        404: "unknown or malformed run id",
        409: "conflict (idempotency_key_reused, idempotency_in_progress, run_state, "
        "no_approval_waiting, approval_conflict)",
        413: "request body too large",
        415: "not application/json",
        429: "throttled",
    }
    wanted = sorted({401, 403, 429, *codes})
    return {c: OpenApiResponse(s.ErrorSerializer, description=descriptions[c]) for c in wanted}


_BODY_ERRORS = (400, 413, 415)


RUN_ID = OpenApiParameter(
    "run_id", OpenApiTypes.UUID, OpenApiParameter.PATH, description="the run's id"
)


def document(*, run: bool = False, **kwargs: Any) -> Any:
    """``extend_schema`` based on drf-spectacular's ``AutoSchema`` whatever the project's
    ``DEFAULT_SCHEMA_CLASS`` is; ``run=True`` documents the ``run_id`` path parameter."""
    if run:
        kwargs["parameters"] = [RUN_ID, *kwargs.get("parameters", [])]

    def decorator(method: Any) -> Any:
        method.schema = AutoSchema
        return extend_schema(**kwargs)(method)

    return decorator


class WorkflowsAPIView(APIView):
    """Base of the API views: JSON only, settings-driven authentication, permissions and
    throttles, the API's exception handler and the body size limit (before parsing).

    ``required_permissions``: ``{method: [codename, ...]}`` read by
    :class:`~django_workflows.api.permissions.WorkflowModelPermissions`.
    """

    schema = AutoSchema()
    parser_classes = [StrictJSONParser]
    renderer_classes = [JSONRenderer]
    throttle_scope = "read"
    required_permissions: dict[str, list[str]] = {}

    def get_authenticators(self) -> list[Any]:
        paths = workflow_settings.API_AUTHENTICATION_CLASSES
        if paths is None:
            return [cls() for cls in api_settings.DEFAULT_AUTHENTICATION_CLASSES]
        return [import_string(p)() for p in paths]

    def get_permissions(self) -> list[Any]:
        return [import_string(p)() for p in workflow_settings.API_PERMISSION_CLASSES]

    def get_throttles(self) -> list[Any]:
        return [import_string(p)() for p in workflow_settings.API_THROTTLE_CLASSES or ()]

    def get_exception_handler(self) -> Any:
        return exception_handler

    def initial(self, request: Request, *args: Any, **kwargs: Any) -> None:
        check_body_size(request._request)
        super().initial(request, *args, **kwargs)

    # --- helpers ----------------------------------------------------------------------------

    def body(self, serializer_class: type[s.serializers.Serializer]) -> dict[str, Any]:
        """The validated JSON body (an empty body counts as ``{}``)."""
        data = self.request.data
        if data is None or (hasattr(data, "dict") and not data):
            data = {}
        if not isinstance(data, dict):
            raise APIError(
                "The request body must be a JSON object.",
                code="invalid",
                errors={"(root)": ["expected a JSON object"]},
            )
        serializer = serializer_class(data=data)
        serializer.is_valid(raise_exception=True)
        return dict(serializer.validated_data)

    def query(self, serializer_class: type[s.serializers.Serializer]) -> dict[str, Any]:
        """The validated query string."""
        serializer = serializer_class(data=self.request.query_params)
        serializer.is_valid(raise_exception=True)
        return dict(serializer.validated_data)

    def url(self, name: str, *args: Any) -> str:
        return self.request.build_absolute_uri(reverse(f"{NAMESPACE}:{name}", args=args))


def parse_run_id(value: str) -> uuid.UUID:
    """``value`` as a UUID; a malformed id is a 404 like an unknown one."""
    try:
        return uuid.UUID(value)
    except (TypeError, ValueError):
        raise RunNotFound(f"No workflow run {value[:100]!r} (not a run id).") from None


def get_run(run_id: str, *fields: str) -> WorkflowRun:
    """The run (only ``fields`` loaded when given) or a 404."""
    rid = parse_run_id(run_id)
    qs = WorkflowRun.objects.filter(pk=rid)
    if fields:
        qs = qs.only(*fields)
    run = qs.first()
    if run is None:
        raise RunNotFound(f"Workflow run {rid} not found.")
    return run


def _json_schema(model: Any) -> Any:
    try:
        return model.model_json_schema()
    except Exception as exc:  # a model pydantic cannot describe (arbitrary types)
        return {"description": f"no JSON Schema available: {type(exc).__name__}"}


def definition_document(workflow: Any) -> dict[str, Any]:
    """A registered workflow: input schema and execution groups with stage config schemas."""
    groups = []
    for index, group in enumerate(workflow.execution_plan, start=1):
        groups.append(
            {
                "execution_group": index,
                "parallel": len(group) > 1,
                "stages": [
                    {
                        "stage_id": node.stage.id,
                        "name": node.stage.name,
                        "description": node.stage.description or "",
                        "mode": node.stage.mode,
                        "dependencies": list(node.stage.dependencies),
                        "config_schema": _json_schema(node.stage.config_model),
                        "config_defaults": node.stage.default_config,
                        "output_schema": _json_schema(node.stage.output_model)
                        if node.stage.output_model is not None
                        else None,
                        **timeouts.describe(node.stage),
                    }
                    for node in group
                ],
            }
        )
    return {
        "workflow_id": workflow.id,
        "name": workflow.name,
        "description": workflow.description or "",
        "input_schema": _json_schema(workflow.input_model),
        "execution_groups": groups,
    }


# --- definitions -------------------------------------------------------------------------------


class DefinitionListView(WorkflowsAPIView):
    required_permissions = {"GET": ["view_workflowrun"]}

    @document(
        operation_id="definitions_list",
        summary="Registered workflows",
        responses={200: s.DefinitionSerializer(many=True), **_errors()},
    )
    def get(self, request: Request) -> Response:
        data = [definition_document(wf) for wf in registry]
        return Response(s.DefinitionSerializer(data, many=True).data)


class DefinitionDetailView(WorkflowsAPIView):
    required_permissions = {"GET": ["view_workflowrun"]}

    @document(
        operation_id="definitions_retrieve",
        summary="One registered workflow",
        responses={200: s.DefinitionSerializer, **_errors(404)},
    )
    def get(self, request: Request, workflow_id: str) -> Response:
        workflow = registry.get(workflow_id)
        if workflow is None:
            raise APIError(
                f"Workflow {workflow_id[:200]!r} is not registered.",
                code="not_found",
                status_code=404,
            )
        return Response(s.DefinitionSerializer(definition_document(workflow)).data)


# --- runs ---------------------------------------------------------------------------------------


def _json_query_value(raw: str) -> Any:
    """The ``value=`` filter as JSON when it parses as such, else the string itself. ``NaN``,
    ``Infinity`` and numbers beyond a float's range (``1e999``) stay strings: no annotation can
    hold them (values are checked on write) and PostgreSQL's ``jsonb`` refuses them (a 500)."""

    def not_json(text: str) -> Any:
        raise ValueError(text)

    def finite(text: str) -> float:
        number = float(text)
        if not math.isfinite(number):
            raise ValueError(text)
        return number

    try:
        return json.loads(raw, parse_constant=not_json, parse_float=finite)
    except ValueError:
        return raw


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
                OpenApiTypes.STR,
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
        raw = self.request.headers.get("Idempotency-Key")
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
        """The run detail: 2 queries (stages; open jobs, only while the run is active), and one
        more for worker presence while a job is queued (stage routing)."""
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
            version=run.version,
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
                }
                for st in stages
            ],
            waiting=_waiting(run, stages, jobs),
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


class NotFoundView(WorkflowsAPIView):
    """Any other path under the API's prefix: a JSON 404 (never Django's HTML page)."""

    permission_classes: list[Any] = []
    schema = None  # type: ignore[assignment]

    def get_permissions(self) -> list[Any]:
        return []

    def dispatch(self, request: Any, *args: Any, **kwargs: Any) -> Any:
        response = Response(
            error_body("not_found", f"No API route {request.path[:200]!r}."), status=404
        )
        response.accepted_renderer = JSONRenderer()
        response.accepted_media_type = "application/json"
        response.renderer_context = {}
        return response


# --- schedules (issue 12) ----------------------------------------------------------------------

SCHEDULE_NAME = OpenApiParameter(
    "name", OpenApiTypes.STR, OpenApiParameter.PATH, description="the schedule's name"
)


def _schedule_document(view: WorkflowsAPIView, row: Any, *, upcoming: bool = False) -> Any:
    from ..kernel.schedules import upcoming_times

    data = {
        "name": row.name,
        "workflow_id": row.workflow_id,
        "description": row.description,
        "spec": row.spec_text,
        "cron": row.cron or None,
        "every_seconds": row.every_seconds,
        "tz": row.tz,
        "input": row.input or {},
        "config": row.config or {},
        "priority": row.priority,
        "overlap": row.overlap,
        "catchup": row.catchup,
        "catchup_window_seconds": row.catchup_window_seconds,
        "jitter_seconds": row.jitter_seconds,
        "paused": row.paused,
        "pause_reason": row.pause_reason,
        "orphaned": row.orphaned,
        "next_scheduled_at": row.next_scheduled_at,
        "next_fire_at": row.next_fire_at,
        "last_scheduled_at": row.last_scheduled_at,
        "last_fired_at": row.last_fired_at,
        "last_run_id": row.last_run_id,
        "last_run": view.url("run-detail", str(row.last_run_id)) if row.last_run_id else None,
        "fired_count": row.fired_count,
        "skipped_count": row.skipped_count,
        "last_error": row.last_error,
        "url": view.url("schedule-detail", row.name),
    }
    if upcoming:
        data["upcoming"] = upcoming_times(row, 5)
        return s.ScheduleDetailSerializer(data).data
    return s.ScheduleSerializer(data).data


def _get_schedule(name: str) -> Any:
    from ..models import WorkflowSchedule

    row = WorkflowSchedule.objects.filter(pk=name[:200]).first()
    if row is None:
        raise APIError(f"Schedule {name[:200]!r} not found.", code="not_found", status_code=404)
    return row


def _schedule_errors(*codes: int) -> dict[int, OpenApiResponse]:
    out = _errors(*codes)
    if 404 in out:
        out[404] = OpenApiResponse(s.ErrorSerializer, description="unknown schedule")
    return out


class ScheduleListView(WorkflowsAPIView):
    required_permissions = {"GET": ["view_workflowschedule"]}

    @document(
        operation_id="schedules_list",
        summary="Schedules with their next fire times (synced from code first)",
        responses={200: s.ScheduleSerializer(many=True), **_schedule_errors()},
    )
    def get(self, request: Request) -> Response:
        from ..kernel.schedules import sync_schedules
        from ..models import WorkflowSchedule

        sync_schedules(get_kernel())
        rows = WorkflowSchedule.objects.order_by("name")
        return Response([_schedule_document(self, row) for row in rows])


class ScheduleDetailView(WorkflowsAPIView):
    required_permissions = {"GET": ["view_workflowschedule"]}

    @document(
        operation_id="schedules_retrieve",
        summary="One schedule with its next scheduled times",
        parameters=[SCHEDULE_NAME],
        responses={200: s.ScheduleDetailSerializer, **_schedule_errors(404)},
    )
    def get(self, request: Request, name: str) -> Response:
        return Response(_schedule_document(self, _get_schedule(name), upcoming=True))


class _ScheduleStateView(WorkflowsAPIView):
    required_permissions = {"POST": ["pause_workflowschedule"]}
    throttle_scope = "write"

    def change(self, request: Request, name: str, *, pause: bool) -> Response:
        from ..kernel.schedules import pause_schedule, resume_schedule

        row = _get_schedule(name)
        if pause:
            body = self.body(s.SchedulePauseSerializer)
            reason = body.get("reason") or f"paused over the API by {request.user.get_username()}"
            changed = pause_schedule(row.name, reason, kernel=get_kernel())
        else:
            self.body(s.EmptyBodySerializer)
            try:
                changed = resume_schedule(row.name, kernel=get_kernel())
            except InvalidCommandError as exc:  # field name: orphaned, its definition is gone
                raise APIError(str(exc), code="schedule_orphaned", status_code=409) from None
        row.refresh_from_db()
        return Response(
            s.SchedulePauseResultSerializer(
                {"paused": row.paused, "changed": changed, "next_fire_at": row.next_fire_at}
            ).data
        )


class SchedulePauseView(_ScheduleStateView):
    @document(
        operation_id="schedules_pause",
        summary="Pause a schedule (no firing until resumed)",
        parameters=[SCHEDULE_NAME],
        request=s.SchedulePauseSerializer,
        responses={200: s.SchedulePauseResultSerializer, **_schedule_errors(*_BODY_ERRORS, 404)},
    )
    def post(self, request: Request, name: str) -> Response:
        return self.change(request, name, pause=True)


class ScheduleResumeView(_ScheduleStateView):
    @document(
        operation_id="schedules_resume",
        summary="Resume a paused schedule (next firing: its next time after now)",
        parameters=[SCHEDULE_NAME],
        request=s.EmptyBodySerializer,
        responses={
            200: s.SchedulePauseResultSerializer,
            **_schedule_errors(*_BODY_ERRORS, 404, 409),
        },
    )
    def post(self, request: Request, name: str) -> Response:
        return self.change(request, name, pause=False)


class ScheduleTriggerView(WorkflowsAPIView):
    required_permissions = {"POST": ["trigger_workflowschedule"]}
    throttle_scope = "write"

    @document(
        operation_id="schedules_trigger",
        summary="Start one run of a schedule now (also when paused)",
        parameters=[SCHEDULE_NAME],
        request=s.EmptyBodySerializer,
        responses={
            201: s.ScheduleTriggerResultSerializer,
            **_schedule_errors(*_BODY_ERRORS, 404, 409),
        },
    )
    def post(self, request: Request, name: str) -> Response:
        from ..kernel.schedules import trigger_schedule

        row = _get_schedule(name)
        self.body(s.EmptyBodySerializer)
        try:
            run_id = trigger_schedule(
                row.name, kernel=get_kernel(), actor=f"api:{request.user.get_username()}"
            )
        except WorkflowError as exc:  # orphaned, or its workflow or input no longer fits
            orphaned = isinstance(exc, InvalidCommandError) and exc.field == "name"
            code = "schedule_orphaned" if orphaned else "schedule_broken"
            raise APIError(str(exc), code=code, status_code=409) from None
        return Response(
            s.ScheduleTriggerResultSerializer({"workflow_run_id": run_id}).data,
            status=http.HTTP_201_CREATED,
        )


class ScheduleBackfillView(WorkflowsAPIView):
    required_permissions = {"POST": ["backfill_workflowschedule"]}
    throttle_scope = "write"

    @document(
        operation_id="schedules_backfill",
        summary="Start one run per scheduled time in [start, end] (at most 1000)",
        parameters=[SCHEDULE_NAME],
        request=s.ScheduleBackfillSerializer,
        responses={
            200: s.ScheduleBackfillResultSerializer,
            **_schedule_errors(*_BODY_ERRORS, 404, 409),
        },
    )
    def post(self, request: Request, name: str) -> Response:
        from ..kernel.schedules import backfill_schedule

        row = _get_schedule(name)
        body = self.body(s.ScheduleBackfillSerializer)
        try:
            result = backfill_schedule(row.name, body["start"], body["end"], kernel=get_kernel())
        except InvalidCommandError as exc:
            if exc.field == "name":  # orphaned: its definition is gone
                raise APIError(str(exc), code="schedule_orphaned", status_code=409) from None
            raise kernel_error(exc) from None
        except WorkflowError as exc:
            raise APIError(str(exc), code="schedule_broken", status_code=409) from None
        return Response(
            s.ScheduleBackfillResultSerializer(
                {"times": result.times, "run_ids": result.run_ids, "existing": result.existing}
            ).data
        )
