"""The admin of workflow runs: a list that says why each run waits, a read-only run page (stages
with not-started ones, rerun markers, the run's error and stage tracebacks, a Gantt chart, the
jobs and a capped timeline) and the operator operations, which dispatch kernel commands
(SPEC §4.4-4.5, §6; ARCHITECTURE §1-2; :mod:`.operations`).

This module holds the admin class (its columns and fields, queries and permissions); the list's
filters and page data are in :mod:`.run_list`, the run page in :mod:`.run_page`, the
operations in :mod:`.run_operations`.

The kernel owns every status column, so nothing here saves a run, stage or job: the run page is
view-only, runs are created by the kernel (``start_run``, ``workflows_run``), operations
dispatch commands, and only terminal runs can be deleted (with their jobs and outbox rows,
which have no foreign key to the run, DM-11).

At scale (1,000,000 runs on PostgreSQL) the list reads one page through the
``(created_at, id)`` / ``(status, created_at, id)`` / ``(workflow_id, created_at, id)``
indexes, counts at most ``MAX_COUNT`` rows (:class:`~.display.CappedPaginator`), filters dates
by ranges instead of ``date_hierarchy``, and searches by exact run id, idempotency key or
workflow id prefix; the stage counts and waiting reasons of a page cost two more queries.
"""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.contrib.admin.views.main import ChangeList
from django.db import transaction
from django.db.models import QuerySet
from django.db.models.fields.json import KeyTransform
from django.http import HttpRequest
from django.utils import timezone
from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString

from ..definition.registry import registry
from ..models import (
    TERMINAL_RUN_STATUSES,
    IdempotencyKey,
    OutboxEvent,
    WorkflowJob,
    WorkflowRun,
)
from ..runs import error_details, run_error
from ..waiting import run_progress, version_note
from .display import (
    CappedPaginationMixin,
    WorkflowFilter,
    duration_display,
    pretty_json,
    short_id,
    status_badge,
)
from .run_list import (
    CreatedFilter,
    FailedStageFilter,
    FinishedFilter,
    ParentFilter,
    RunChangeList,
    RunStatusFilter,
    WaitingFilter,
    attach_page_data,
    parse_uuid,
    waiting_line,
    waiting_text,
)
from .run_operations import MAX_BULK_RUNS, RunOperationsMixin, _delete_run_rows
from .run_page import (
    MAX_JOBS_SHOWN,
    TIMELINE_PAGE,
    RerunMarker,
    RunPageMixin,
    StageRow,
    ms_time,
    rerun_markers,
    run_structure,
    stage_rows,
)


@admin.register(WorkflowRun)
class WorkflowRunAdmin(RunOperationsMixin, RunPageMixin, CappedPaginationMixin, admin.ModelAdmin):
    """Runs: list with why each waits, view-only run page, operations through the kernel."""

    list_display = (
        "run_id",
        "workflow_id",
        "status_badge",
        "progress_summary",
        "waiting",
        "created",
        "duration",
    )
    list_filter = (
        RunStatusFilter,
        WaitingFilter,
        CreatedFilter,
        FinishedFilter,
        WorkflowFilter,
        ParentFilter,
        FailedStageFilter,
    )
    search_fields = ()  # get_search_results: exact id, idempotency key, workflow id prefix
    search_help_text = (
        "Search by full run id, run.create idempotency key, or workflow id (or its start)."
    )
    ordering = ("-created_at", "-id")
    list_per_page = 50
    show_full_result_count = False
    show_facets = admin.ShowFacets.NEVER  # a COUNT per filter choice over the whole table
    actions = ("cancel_runs",)
    fieldsets = (
        (
            None,
            {
                "fields": (
                    "id",
                    "workflow",
                    "status_badge",
                    "progress_summary",
                    "error_summary",
                    "priority",
                    "definition_version_summary",
                    "concurrency_key",
                    "version",
                )
            },
        ),
        (
            "Timing",
            {
                "fields": (
                    "created_ms",
                    "started_ms",
                    "completed_ms",
                    "duration",
                    "updated_ms",
                )
            },
        ),
        ("Data", {"fields": ("input_json", "config_json", "output_json")}),
        (
            "Usage and metadata",
            {
                "classes": ("collapse",),
                "fields": ("total_cost", "total_tokens", "metadata_json"),
            },
        ),
    )
    readonly_fields = (
        "id",
        "workflow",
        "status_badge",
        "progress_summary",
        "error_summary",
        "priority",
        "definition_version_summary",
        "concurrency_key",
        "version",
        "created_ms",
        "started_ms",
        "completed_ms",
        "duration",
        "updated_ms",
        "input_json",
        "config_json",
        "output_json",
        "total_cost",
        "total_tokens",
        "metadata_json",
    )

    # --- queries ----------------------------------------------------------------------------

    def get_changelist(self, request: HttpRequest, **kwargs: Any) -> type[ChangeList]:
        return RunChangeList

    def get_queryset(self, request: HttpRequest) -> QuerySet[WorkflowRun]:
        """The list reads only the columns it shows (no JSON blobs)."""
        qs = super().get_queryset(request)
        if getattr(request, "resolver_match", None) and (
            request.resolver_match.url_name or ""
        ).endswith("_changelist"):
            # Only the error member of the output is read (the run-level error of FAILED runs).
            qs = qs.defer("input", "output", "config", "metadata").annotate(
                dw_output_error=KeyTransform("error", "output")
            )
        return qs

    def get_search_results(
        self, request: HttpRequest, queryset: QuerySet[WorkflowRun], search_term: str
    ) -> tuple[QuerySet[WorkflowRun], bool]:
        """A full run id, an idempotency key of ``run.create``, or a workflow id (exact, or the
        start of registered workflow ids) - each an index lookup (no ``LIKE`` over the
        table)."""
        term = search_term.strip()
        if not term:
            return queryset, False
        run_id = parse_uuid(term)
        if run_id is not None:
            return queryset.filter(pk=run_id), False
        keyed = (
            IdempotencyKey.objects.filter(key=term, command_type="run.create")
            .values_list("result", flat=True)
            .first()
        )
        if isinstance(keyed, dict) and parse_uuid(str(keyed.get("workflow_run_id", ""))):
            return queryset.filter(pk=parse_uuid(str(keyed["workflow_run_id"]))), False
        # A workflow id, or the start of registered ones: an IN list on the workflow index.
        ids = {term, *(wf.id for wf in registry if wf.id.startswith(term))}
        return queryset.filter(workflow_id__in=sorted(ids)), False

    # --- permissions ------------------------------------------------------------------------

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        if obj is not None and obj.status not in TERMINAL_RUN_STATUSES:
            return False
        return super().has_delete_permission(request, obj)

    def get_deleted_objects(self, objs: Any, request: HttpRequest) -> Any:
        """The run's stages, logs and annotations go with it (foreign-key cascade), and so do its
        jobs and outbox rows (no foreign key, DM-11; listed on the confirmation page and removed
        by :meth:`delete_queryset` / :meth:`delete_model`): deleting a terminal run needs only
        the run's delete permission.
        """
        deleted, model_count, _perms, protected = super().get_deleted_objects(objs, request)
        ids = [o.pk for o in objs]
        jobs = WorkflowJob.objects.filter(workflow_run_id__in=ids).count()
        events = OutboxEvent.objects.filter(workflow_run_id__in=ids).count()
        if jobs:
            model_count[str(WorkflowJob._meta.verbose_name_plural)] = jobs
            deleted.append(f"{jobs} job row(s) of these runs")
        if events:
            model_count[str(OutboxEvent._meta.verbose_name_plural)] = events
            deleted.append(f"{events} outbox event row(s) of these runs")
        return deleted, model_count, set(), protected

    def delete_model(self, request: HttpRequest, obj: WorkflowRun) -> None:
        with transaction.atomic():
            _delete_run_rows([obj.pk])
            super().delete_model(request, obj)

    def delete_queryset(self, request: HttpRequest, queryset: QuerySet[WorkflowRun]) -> None:
        with transaction.atomic():
            _delete_run_rows(list(queryset.values_list("pk", flat=True)))
            super().delete_queryset(request, queryset)

    # --- columns and fields -----------------------------------------------------------------

    @admin.display(description="id", ordering="id")
    def run_id(self, obj: WorkflowRun) -> SafeString:
        return short_id(obj.pk)

    @admin.display(description="status", ordering="status")
    def status_badge(self, obj: WorkflowRun) -> SafeString | str:
        return status_badge(obj.status)

    @admin.display(description="created", ordering="created_at")
    def created(self, obj: WorkflowRun) -> SafeString:
        """``2026-12-01`` over ``14:00:27`` (local time, to the second; ISO time as a tooltip)."""
        local = timezone.localtime(obj.created_at)
        return format_html(
            '<span class="dw-nowrap" title="{}">{}<br>{}</span>',
            obj.created_at.isoformat(),
            local.strftime("%Y-%m-%d"),
            local.strftime("%H:%M:%S"),
        )

    @admin.display(description="why / waiting for")
    def waiting(self, obj: WorkflowRun) -> SafeString | str:
        """The waiting reasons (active runs) or the run-level error (FAILED runs)."""
        error = getattr(obj, "dw_error", None)
        if error:
            first = error.splitlines()[0] if error else ""
            return format_html('<span class="dw-error" title="{}">{}</span>', error, first[:120])
        reasons = getattr(obj, "dw_waiting", None)
        if not reasons:
            return "-"
        return format_html_join(
            "",
            '<div class="dw-why dw-why-{}">{}</div>',
            ((w.reason, waiting_line(w)) for w in reasons),
        )

    @admin.display(description="progress")
    def progress_summary(self, obj: WorkflowRun) -> SafeString:
        """Completed stages / stages of the definition the run started with
        (:func:`django_workflows.waiting.run_progress`: its version's stored structure, not
        today's definition)."""
        progress = getattr(obj, "dw_progress", None)
        completed, total = progress if progress is not None else run_progress(obj)
        return format_html(
            '<span class="dw-progress" style="white-space:nowrap" '
            'title="{} of {} stages completed">'
            '<progress max="{}" value="{}" style="width:40px"></progress> {} / {}</span>',
            completed,
            total,
            max(total, 1),
            completed,
            completed,
            total,
        )

    @admin.display(description="error")
    def error_summary(self, obj: WorkflowRun) -> SafeString | str:
        """The run-level error of a FAILED run: the failing stage and its message."""
        error = run_error(obj)
        if not error:
            return "-"
        details = error_details(obj)
        if details:
            error = f"{error}\n({details})"
        return format_html('<pre class="dw-json dw-error" id="dw-run-error">{}</pre>', error)

    @admin.display(description="created at")
    def created_ms(self, obj: WorkflowRun) -> str:
        return ms_time(obj.created_at)

    @admin.display(description="started at (first start; reruns keep it)")
    def started_ms(self, obj: WorkflowRun) -> str:
        return ms_time(obj.started_at)

    @admin.display(description="completed at")
    def completed_ms(self, obj: WorkflowRun) -> str:
        return ms_time(obj.completed_at)

    @admin.display(description="updated at")
    def updated_ms(self, obj: WorkflowRun) -> str:
        return ms_time(obj.updated_at)

    @admin.display(description="duration", ordering="duration_ms")
    def duration(self, obj: WorkflowRun) -> SafeString | str:
        return duration_display(obj.duration_ms, obj.started_at, not obj.is_terminal)

    @admin.display(description="workflow")
    def workflow(self, obj: WorkflowRun) -> SafeString:
        parts = [obj.workflow_id]
        if obj.workflow_name and obj.workflow_name != obj.workflow_id:
            parts.append(obj.workflow_name)
        note = "" if obj.workflow_id in registry else " (not registered in this process)"
        return format_html(
            "<strong>{}</strong>{}{}",
            parts[0],
            format_html_join("", " — {}", ((p,) for p in parts[1:])),
            note,
        )

    @admin.display(description="definition version")
    def definition_version_summary(self, obj: WorkflowRun) -> SafeString:
        """The definition version the run started with and whether this process runs it."""
        version = obj.definition_version
        if not version:
            return format_html("({})", version_note(obj))
        return format_html("<code>{}</code> ({})", version, version_note(obj))

    @admin.display(description="input")
    def input_json(self, obj: WorkflowRun) -> SafeString | str:
        return pretty_json(obj.input)

    @admin.display(description="config")
    def config_json(self, obj: WorkflowRun) -> SafeString | str:
        return pretty_json(obj.config)

    @admin.display(description="output")
    def output_json(self, obj: WorkflowRun) -> SafeString | str:
        return pretty_json(obj.output)

    @admin.display(description="metadata")
    def metadata_json(self, obj: WorkflowRun) -> SafeString | str:
        return pretty_json(obj.metadata)


__all__ = [
    "MAX_BULK_RUNS",
    "MAX_JOBS_SHOWN",
    "TIMELINE_PAGE",
    "CreatedFilter",
    "RerunMarker",
    "RunChangeList",
    "RunStatusFilter",
    "StageRow",
    "WaitingFilter",
    "WorkflowRunAdmin",
    "attach_page_data",
    "ms_time",
    "parse_uuid",
    "rerun_markers",
    "run_structure",
    "stage_rows",
    "waiting_line",
    "waiting_text",
]
