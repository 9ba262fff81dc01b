"""The run list of the admin (:class:`~.runs.WorkflowRunAdmin`'s changelist): its filters
("attention": waiting for a human / has failures; creation-time ranges served by the indexes),
the changelist that attaches to a page of runs their progress, waiting reasons and errors in a
bounded number of queries, and the one-line texts of waiting reasons.
"""

from __future__ import annotations

import uuid
from collections import defaultdict
from datetime import UTC, datetime, timedelta
from typing import Any

from django.contrib import admin
from django.contrib.admin.views.main import ChangeList
from django.db.models import Exists, OuterRef, Q, QuerySet
from django.http import HttpRequest
from django.utils import timezone

from .. import approval
from ..models import (
    Status,
    WorkflowDefinitionVersion,
    WorkflowJob,
    WorkflowRun,
    WorkflowStage,
)
from ..runs import WaitingReason, run_error, waiting_reasons
from ..waiting import run_progress
from .display import (
    StatusFilter,
)


def waiting_text(reasons: list[WaitingReason]) -> str:
    """One line per reason (see :func:`waiting_line`)."""
    return "\n".join(waiting_line(w) for w in reasons)


def waiting_line(w: WaitingReason) -> str:
    """``stage: message; retry at 2026-12-01 10:42:03; queued behind N jobs``."""
    parts = [w.message]
    if w.at is not None:
        local = timezone.localtime(w.at)
        label = "retry at" if w.reason == "retry" else "next poll"
        if w.reason == "job_queued":
            label = "not before"
        parts.append(f"{label} {local:%Y-%m-%d %H:%M:%S}")
    if w.queued_ahead:
        more = "+" if w.queued_ahead >= 1000 else ""
        parts.append(f"queued behind {w.queued_ahead}{more} jobs")
    if w.worker_id:
        parts.append(f"worker {w.worker_id}")
    text = "; ".join(parts)
    return f"{w.stage_id}: {text}" if w.stage_id else text


class RunStatusFilter(StatusFilter):
    """The statuses a run can have: never SUSPENDED or SKIPPED (SM-8)."""

    statuses = (Status.PENDING, Status.RUNNING, Status.COMPLETED, Status.FAILED, Status.CANCELLED)


class WaitingFilter(admin.SimpleListFilter):
    """Runs waiting for a human (a SUSPENDED approval stage) and runs with failures (FAILED, or
    a FAILED stage / a job that is being retried)."""

    title = "attention"
    parameter_name = "attention"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [("human", "Waiting for a human"), ("failures", "Has failures")]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any] | None:
        if self.value() == "human":
            # Driven from the few SUSPENDED stages (status index), not from the runs.
            waiting = WorkflowStage.objects.filter(
                status=Status.SUSPENDED, suspended_state__kind=approval.APPROVAL_KIND
            ).values("run_id")
            return queryset.filter(status=Status.RUNNING, pk__in=waiting)
        if self.value() == "failures":
            return queryset.filter(
                Q(status=Status.FAILED)
                | Q(Exists(WorkflowStage.objects.filter(run=OuterRef("pk"), status=Status.FAILED)))
                | Q(
                    Exists(
                        WorkflowJob.objects.filter(
                            workflow_run_id=OuterRef("pk"),
                            status=Status.PENDING,
                            attempt__gt=0,
                        )
                    )
                )
            )
        return None


class CreatedFilter(admin.SimpleListFilter):
    """Creation-time ranges served by the ``created_at`` indexes (``date_hierarchy`` reads the
    whole table to list its years and months)."""

    title = "created"
    parameter_name = "created"
    RANGES = {
        "1h": ("Last hour", timedelta(hours=1)),
        "24h": ("Last 24 hours", timedelta(days=1)),
        "7d": ("Last 7 days", timedelta(days=7)),
        "30d": ("Last 30 days", timedelta(days=30)),
    }

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [(key, label) for key, (label, _) in self.RANGES.items()] + [
            ("older", "Older than 30 days")
        ]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any] | None:
        value = self.value()
        now = timezone.now()
        if value in self.RANGES:
            return queryset.filter(created_at__gte=now - self.RANGES[value][1])
        if value == "older":
            return queryset.filter(created_at__lt=now - timedelta(days=30))
        return None


class FinishedFilter(admin.SimpleListFilter):
    """Runs finished (``completed_at``) in the last hour / 24 hours / 7 / 30 days, or in an exact
    range ``?finished=<start>/<end>`` (ISO 8601 UTC, ``start`` included, ``end`` excluded; see
    :func:`finished_range`): the dashboard's links give the range of the buckets they count, so
    the list shows the same runs (served by ``wf_run_completed_idx``). A range that does not
    parse, or ends before it starts, is an
    :class:`~django.contrib.admin.options.IncorrectLookupParameters` (the admin's "?e=1")."""

    title = "finished"
    parameter_name = "finished"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        choices = [(key, label) for key, (label, _) in CreatedFilter.RANGES.items()]
        value = self.value()
        if value and value not in CreatedFilter.RANGES:  # a range: shown while it is in use
            bounds = parse_finished_range(value)
            if bounds:
                start, end = (timezone.localtime(b).strftime("%Y-%m-%d %H:%M") for b in bounds)
                choices.append((value, f"{start} to {end}"))
        return choices

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any] | None:
        value = self.value()
        if not value:
            return None
        if value in CreatedFilter.RANGES:
            since = timezone.now() - CreatedFilter.RANGES[value][1]
            return queryset.filter(completed_at__gte=since)
        bounds = parse_finished_range(value)
        if bounds is None:
            from django.contrib.admin.options import IncorrectLookupParameters

            raise IncorrectLookupParameters(f"finished={value[:80]!r} is not a range")
        return queryset.filter(completed_at__gte=bounds[0], completed_at__lt=bounds[1])


#: How :func:`finished_range` writes an instant (UTC, to the second).
RANGE_FORMAT = "%Y-%m-%dT%H:%M:%SZ"


def finished_range(start: datetime, end: datetime) -> str:
    """The ``?finished=`` value of the runs finished in ``[start, end)`` (aware datetimes):
    ``"2026-12-02T11:00:00Z/2026-12-03T11:00:00Z"`` (to the second; the dashboard's bucket
    boundaries are whole seconds)."""
    return "/".join(b.astimezone(UTC).strftime(RANGE_FORMAT) for b in (start, end))


def parse_finished_range(value: str) -> tuple[datetime, datetime] | None:
    """``(start, end)`` (aware, UTC) of a :func:`finished_range` value, ``None`` when it is not
    two ISO 8601 instants with ``start < end`` (an instant without an offset is UTC)."""
    from django.utils.dateparse import parse_datetime

    parts = value.split("/")
    if len(parts) != 2:
        return None
    try:
        bounds = [parse_datetime(p.strip()) for p in parts]
    except ValueError:  # well formed but out of range (month 13)
        return None
    if bounds[0] is None or bounds[1] is None:
        return None
    start, end = (b if b.tzinfo else b.replace(tzinfo=UTC) for b in bounds)
    return (start, end) if start < end else None


class FailedStageFilter(admin.SimpleListFilter):
    """``?failed_stage=<stage id>``: FAILED runs that this stage failed (``error["stage_id"]``;
    the dashboard's "most failing stages" link here). Shown only while it is in use."""

    title = "failed at stage"
    parameter_name = "failed_stage"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        value = self.value()
        return [(value, value)] if value else []

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any] | None:
        value = self.value()
        if value:
            return queryset.filter(status=Status.FAILED, error__stage_id=value[:200])
        return None


class ParentFilter(admin.SimpleListFilter):
    """Child runs (started by a child-workflow stage) or top-level runs (issue 18 item 5)."""

    title = "parent"
    parameter_name = "has_parent"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [("yes", "Child runs"), ("no", "Top-level runs")]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any] | None:
        if self.value() == "yes":
            return queryset.filter(parent_run_id__isnull=False)
        if self.value() == "no":
            return queryset.filter(parent_run_id__isnull=True)
        return None


class RunChangeList(ChangeList):
    """Attaches to the page's runs their stage counts and waiting reasons: two queries for the
    whole page (stages of the page's runs; open jobs of its active runs)."""

    def get_results(self, request: HttpRequest) -> None:
        super().get_results(request)
        runs = list(self.result_list)
        attach_page_data(runs)
        self.result_list = runs  # type: ignore[assignment]


def attach_page_data(runs: list[WorkflowRun]) -> None:
    """Set ``dw_progress`` (``(completed, stages)``), ``dw_waiting`` and ``dw_error`` on each
    run (5 queries at most, whatever the page size: stages, open jobs, live queues, live
    definition versions, the stored structures of the page's versions)."""
    if not runs:
        return
    ids = [r.pk for r in runs]
    stages: dict[Any, list[WorkflowStage]] = defaultdict(list)
    for stage in WorkflowStage.objects.filter(run_id__in=ids).defer(
        "input_data", "output_data", "config", "resume_data", "metrics", "embedding_info"
    ):
        stages[stage.run_id].append(stage)
    active = [r.pk for r in runs if r.status == Status.RUNNING]
    jobs: dict[Any, dict[str, WorkflowJob]] = defaultdict(dict)
    if active:
        for job in WorkflowJob.objects.filter(
            workflow_run_id__in=active, status__in=[Status.PENDING, Status.RUNNING]
        ).defer("payload"):
            jobs[job.workflow_run_id][job.stage_id] = job
    live: list[set[str]] = []

    def live_queues() -> set[str]:  # one presence query per page, only if a job is queued
        if not live:
            from ..kernel.routing import live_queues as read

            live.append(read())
        return live[0]

    versions: list[dict[str, set[str]]] = []

    def live_versions() -> dict[str, set[str]]:  # one query per page, only if versions matter
        if not versions:
            from ..kernel.runtime import get_kernel
            from ..kernel.versions import live_versions as read

            versions.append(read(lease_clock=get_kernel().lease_clock))
        return versions[0]

    structures = page_structures(runs)

    for run in runs:
        if "output" in run.get_deferred_fields():
            # the list read only output["error"]: enough for run_error(), no query per row
            error = getattr(run, "dw_output_error", None)
            run.output = None if error is None else {"error": error}
        records = sorted(stages[run.pk], key=lambda s: (s.execution_group, s.stage_number))
        run.dw_progress = run_progress(run, records, structures=structures)
        run.dw_waiting = waiting_reasons(
            run,
            records,
            jobs[run.pk],
            live_queues=live_queues,
            live_versions=live_versions,
            child_details=False,  # no query per row
        )
        run.dw_error = run_error(run, records) if run.status == Status.FAILED else None


def page_structures(runs: list[WorkflowRun]) -> Any:
    """``(workflow_id, version) -> stored structure`` for the versioned runs of a page (one
    query for all of them, on the first call)."""
    cache: dict[tuple[str, str], Any] = {}
    loaded: list[bool] = []

    def structures(workflow_id: str, version: str) -> Any:
        if not loaded:
            loaded.append(True)
            pairs = {(r.workflow_id, r.definition_version) for r in runs if r.definition_version}
            where = Q()
            for wf, v in pairs:
                where |= Q(workflow_id=wf, version=v)
            if pairs:
                for wf, v, structure in WorkflowDefinitionVersion.objects.filter(where).values_list(
                    "workflow_id", "version", "structure"
                ):
                    cache[(wf, v)] = structure
        return cache.get((workflow_id, version))

    return structures


def parse_uuid(text: str) -> uuid.UUID | None:
    try:
        return uuid.UUID(text.strip())
    except (ValueError, AttributeError):
        return None
