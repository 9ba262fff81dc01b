"""``schedules/``: list, detail, pause, resume, trigger and backfill (issue 12)."""

from __future__ import annotations

from typing import Any

from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse
from rest_framework import status as http
from rest_framework.request import Request
from rest_framework.response import Response

from ...kernel.errors import (
    InvalidCommandError,
    WorkflowError,
)
from ...kernel.runtime import get_kernel
from .. import serializers as s
from ..errors import APIError, kernel_error
from .base import (
    _BODY_ERRORS,
    WorkflowsAPIView,
    _errors,
    document,
    has_control_characters,
)

SCHEDULE_NAME = OpenApiParameter(
    "name", OpenApiTypes.STR, OpenApiParameter.PATH, description="the schedule's name"
)


def _schedule_document(view: WorkflowsAPIView, row: Any, *, upcoming: bool = False) -> Any:
    from ...kernel.schedules import upcoming_times

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
    from ...models import WorkflowSchedule

    row = (
        None
        if has_control_characters(name)  # no schedule name holds one; PostgreSQL refuses NUL
        else WorkflowSchedule.objects.filter(pk=name[:200]).first()
    )
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
        from ...kernel.schedules import sync_schedules
        from ...models import WorkflowSchedule

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
        from ...kernel.commands import PauseSchedule, ResumeSchedule
        from ...kernel.errors import ScheduleOrphanedError

        row = _get_schedule(name)
        if pause:
            body = self.body(s.SchedulePauseSerializer)
            reason = body.get("reason") or f"paused over the API by {request.user.get_username()}"
            changed = get_kernel().dispatch(PauseSchedule(row.name, reason)).changed
        else:
            self.body(s.EmptyBodySerializer)
            try:
                changed = get_kernel().dispatch(ResumeSchedule(row.name)).changed
            except ScheduleOrphanedError as exc:
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
        from ...kernel.commands import TriggerSchedule
        from ...kernel.errors import ScheduleOrphanedError

        row = _get_schedule(name)
        self.body(s.EmptyBodySerializer)
        try:
            run_id = (
                get_kernel()
                .dispatch(TriggerSchedule(row.name, actor=f"api:{request.user.get_username()}"))
                .workflow_run_id
            )
        except ScheduleOrphanedError as exc:
            raise APIError(str(exc), code="schedule_orphaned", status_code=409) from None
        except WorkflowError as exc:  # its workflow or input no longer fits
            raise APIError(str(exc), code="schedule_broken", status_code=409) from None
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
        from ...kernel.commands import BackfillSchedule
        from ...kernel.errors import ScheduleOrphanedError

        row = _get_schedule(name)
        body = self.body(s.ScheduleBackfillSerializer)
        try:
            result = get_kernel().dispatch(BackfillSchedule(row.name, body["start"], body["end"]))
        except ScheduleOrphanedError as exc:
            raise APIError(str(exc), code="schedule_orphaned", status_code=409) from None
        except InvalidCommandError as exc:
            raise kernel_error(exc) from None
        except WorkflowError as exc:
            raise APIError(str(exc), code="schedule_broken", status_code=409) from None
        return Response(
            s.ScheduleBackfillResultSerializer(
                {"times": result.times, "run_ids": result.run_ids, "existing": result.existing}
            ).data
        )
