"""The admin of workflow runs: a list that says why each run waits, a read-only run page (stages
with not-started ones, rerun markers, the run's error and stage tracebacks, a Gantt chart, the
jobs and a capped timeline) and the operator operations, which dispatch kernel commands
(SPEC §4.4-4.5, §6; ARCHITECTURE §1-2; :mod:`.operations`).

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

import uuid
from collections import defaultdict
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from django.contrib import admin, messages
from django.contrib.admin.actions import delete_selected
from django.contrib.admin.utils import unquote
from django.contrib.admin.views.main import ChangeList
from django.core.exceptions import PermissionDenied
from django.db import transaction
from django.db.models import Exists, OuterRef, Q, QuerySet
from django.db.models.fields.json import KeyTransform
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseRedirect
from django.urls import URLPattern, path, reverse
from django.utils import timezone
from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString
from django.utils.translation import ngettext

from .. import approval
from ..definition.registry import registry
from ..kernel import timeouts
from ..kernel.commands import CancelRun, RerunFrom
from ..kernel.errors import WorkflowError
from ..kernel.runtime import get_kernel
from ..models import (
    ACTIVE_STAGE_STATUSES,
    TERMINAL_RUN_STATUSES,
    IdempotencyKey,
    OutboxEvent,
    Status,
    WorkflowJob,
    WorkflowRun,
    WorkflowStage,
)
from ..runs import WaitingReason, error_details, run_error, waiting_reasons
from .display import (
    CappedPaginationMixin,
    StatusFilter,
    WorkflowFilter,
    duration_display,
    format_duration_ms,
    pretty_json,
    short_id,
    short_json,
    status_badge,
)
from .gantt import build_gantt
from .operations import (
    AnnotateForm,
    CancelForm,
    DecisionForm,
    RerunForm,
    actor_of,
    has_operation_permission,
    log_operation,
    operation_page,
)
from .timeline import build_timeline

#: Ids named in one action message before "and N more".
MAX_IDS_IN_MESSAGE = 10

#: Jobs shown on the run page (a run has one per stage and delivery).
MAX_JOBS_SHOWN = 200

#: Runs one bulk cancel takes at once.
MAX_BULK_RUNS = 500

#: Timeline rows per source on one page of the run page (``?timeline_page=N`` for older).
TIMELINE_PAGE = 200


def _name_ids(items: list[tuple[Any, str]]) -> str:
    shown = ", ".join(f"{run_id} ({status})" for run_id, status in items[:MAX_IDS_IN_MESSAGE])
    rest = len(items) - MAX_IDS_IN_MESSAGE
    return f"{shown} and {rest} more" if rest > 0 else shown


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


class RunChangeList(ChangeList):
    """Attaches to the page's runs their stage counts and waiting reasons: two queries for the
    whole page (stages of the page's runs; open jobs of its active runs)."""

    def get_results(self, request: HttpRequest) -> None:
        super().get_results(request)
        runs = list(self.result_list)
        attach_page_data(runs)
        self.result_list = runs  # type: ignore[assignment]


def attach_page_data(runs: list[WorkflowRun]) -> None:
    """Set ``completed_stages``, ``stage_records``, ``dw_waiting`` and ``dw_error`` on each run
    (4 queries at most, whatever the page size: stages, open jobs, live queues, live
    definition versions)."""
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
            from ..kernel.versions import live_versions as read

            versions.append(read())
        return versions[0]

    for run in runs:
        if "output" in run.get_deferred_fields():
            # the list read only output["error"]: enough for run_error(), no query per row
            error = getattr(run, "dw_output_error", None)
            run.output = None if error is None else {"error": error}
        records = sorted(stages[run.pk], key=lambda s: (s.execution_group, s.stage_number))
        run.completed_stages = sum(1 for s in records if s.status == Status.COMPLETED)
        run.stage_records = len(records)
        run.dw_waiting = waiting_reasons(
            run, records, jobs[run.pk], live_queues=live_queues, live_versions=live_versions
        )
        run.dw_error = run_error(run, records) if run.status == Status.FAILED else None


def ms_time(at: Any) -> str:
    """``2026-12-01 14:00:27.125`` (local time, milliseconds); ``-`` for ``None``."""
    if at is None:
        return "-"
    return timezone.localtime(at).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]


def parse_uuid(text: str) -> uuid.UUID | None:
    try:
        return uuid.UUID(text.strip())
    except (ValueError, AttributeError):
        return None


@admin.register(WorkflowRun)
class WorkflowRunAdmin(CappedPaginationMixin, admin.ModelAdmin):
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
    list_filter = (RunStatusFilter, WaitingFilter, CreatedFilter, WorkflowFilter)
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
        """Completed stages / stages of the workflow (stage records when it is unregistered)."""
        completed = getattr(obj, "completed_stages", None)
        if completed is None:
            completed = obj.stages.filter(status=Status.COMPLETED).count()
        workflow = registry.get(obj.workflow_id)
        if workflow is not None:
            total = len(workflow.stages)
        else:
            total = getattr(obj, "stage_records", None)
            if total is None:
                total = obj.stages.count()
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
            return format_html("{}", "(unversioned: any definition runs it)")
        workflow = registry.get(obj.workflow_id)
        if workflow is None:
            note = "workflow not registered in this process"
        elif workflow.version == version:
            note = "the loaded definition"
        elif version in workflow.takes_over:
            note = f"taken over by the loaded version {workflow.version}"
        else:
            note = (
                f"not the loaded version {workflow.version}: only a worker with version "
                f"{version} runs it"
            )
        return format_html("<code>{}</code> ({})", version, note)

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

    # --- operations -------------------------------------------------------------------------

    def has_cancel_permission(self, request: HttpRequest) -> bool:
        """``cancel_workflowrun`` (and view): cancel single runs and the bulk action."""
        return has_operation_permission(request, "cancel")

    def has_rerun_permission(self, request: HttpRequest) -> bool:
        return has_operation_permission(request, "rerun")

    def has_approve_permission(self, request: HttpRequest) -> bool:
        return has_operation_permission(request, "approve")

    def has_annotate_permission(self, request: HttpRequest) -> bool:
        return has_operation_permission(request, "annotate")

    @admin.action(description="Cancel selected runs…", permissions=["cancel"])
    def cancel_runs(
        self, request: HttpRequest, queryset: QuerySet[WorkflowRun]
    ) -> HttpResponse | None:
        """A confirmation page listing the selected runs with a required reason; on confirm,
        ``run.cancel`` per active run (K-CA-1..3), History per cancelled run, terminal runs
        named and left alone."""
        selected = list(
            queryset.only("pk", "status", "workflow_id").order_by("created_at")[: MAX_BULK_RUNS + 1]
        )
        if len(selected) > MAX_BULK_RUNS:
            self.message_user(
                request,
                f"Select at most {MAX_BULK_RUNS} runs to cancel at once.",
                messages.ERROR,
            )
            return None
        form = CancelForm(request.POST if request.POST.get("confirm") == "yes" else None)
        hidden = [("action", "cancel_runs"), *(("_selected_action", str(r.pk)) for r in selected)]
        changelist = reverse(f"admin:{self.opts.app_label}_{self.opts.model_name}_changelist")
        active = [r for r in selected if r.status not in TERMINAL_RUN_STATUSES]
        return operation_page(
            self,
            request,
            operation="cancel",
            obj=None,
            title=ngettext("Cancel %d run?", "Cancel %d runs?", len(selected)) % len(selected),
            form=form,
            perform=lambda data: self._cancel(request, selected, data["reason"]),
            back_url=changelist,
            facts=[
                ngettext(
                    "%d selected run is active and will be cancelled with its open stages "
                    "and queued jobs.",
                    "%d selected runs are active and will be cancelled with their open stages "
                    "and queued jobs.",
                    len(active),
                )
                % len(active),
                "Terminal runs are left as they are. This cannot be undone.",
            ],
            objects=[f"{r.pk} · {r.workflow_id} · {r.status}" for r in selected],
            submit="Yes, cancel",
            hidden=hidden,
        )

    def _cancel(self, request: HttpRequest, runs: list[WorkflowRun], reason: str) -> None:
        """Dispatch ``run.cancel`` for each run; messages for cancelled, terminal, errors."""
        kernel = get_kernel()
        who = actor_of(request)
        cancelled: list[WorkflowRun] = []
        terminal: list[tuple[Any, str]] = []
        errors: list[str] = []
        for run in runs:
            if run.status in TERMINAL_RUN_STATUSES:
                terminal.append((run.pk, run.status))
                continue
            try:
                result = kernel.dispatch(
                    CancelRun(run.pk, reason=f"Cancelled in the admin by {who}: {reason}")
                )
            except WorkflowError as exc:
                errors.append(f"{run.pk}: {exc}")
                continue
            if result.cancelled:
                cancelled.append(run)
                log_operation(request, run, f"Cancelled (run.cancel). Reason: {reason}")
            else:  # it became terminal between the list and the command
                status = WorkflowRun.objects.filter(pk=run.pk).values_list("status", flat=True)
                terminal.append((run.pk, status.first() or "deleted"))
        if cancelled:
            self.message_user(
                request,
                ngettext("Cancelled %d run.", "Cancelled %d runs.", len(cancelled))
                % len(cancelled),
                messages.SUCCESS,
            )
        if terminal:
            self.message_user(
                request,
                ngettext(
                    "%(count)d run was already terminal and was left as it is: %(ids)s.",
                    "%(count)d runs were already terminal and were left as they are: %(ids)s.",
                    len(terminal),
                )
                % {"count": len(terminal), "ids": _name_ids(terminal)},
                messages.WARNING,
            )
        for error in errors:
            self.message_user(request, f"Could not cancel {error}", messages.ERROR)

    def get_actions(self, request: HttpRequest, action_location: Any = None) -> dict[str, Any]:
        # Django 6.1 passes ``action_location`` (and deprecates overrides without that
        # parameter); Django 5.2 knows no such argument.
        if action_location is None:
            actions = super().get_actions(request)
        else:
            actions = super().get_actions(request, action_location)  # type: ignore[call-arg]
        if "delete_selected" in actions:
            actions["delete_selected"] = (
                WorkflowRunAdmin.delete_terminal_runs,
                "delete_selected",
                "Delete selected terminal runs",
            )
        return actions

    def delete_terminal_runs(
        self, request: HttpRequest, queryset: QuerySet[WorkflowRun]
    ) -> HttpResponse | None:
        """Django's delete (with its confirmation page) restricted to terminal runs."""
        active = queryset.exclude(status__in=TERMINAL_RUN_STATUSES).count()
        if active and not request.POST.get("post"):
            self.message_user(
                request,
                ngettext(
                    "%d selected run is not terminal and will not be deleted (cancel it first).",
                    "%d selected runs are not terminal and will not be deleted "
                    "(cancel them first).",
                    active,
                )
                % active,
                messages.WARNING,
            )
        terminal = queryset.filter(status__in=TERMINAL_RUN_STATUSES)
        if not terminal.exists():
            return None
        return delete_selected(self, request, terminal)

    # --- detail page ------------------------------------------------------------------------

    def get_urls(self) -> list[URLPattern]:
        opts = self.opts
        views = (
            ("cancel", self.cancel_view),
            ("rerun", self.rerun_view),
            ("decide", self.decide_view),
            ("annotate", self.annotate_view),
        )
        return [
            *(
                path(
                    f"<path:object_id>/{name}/",
                    self.admin_site.admin_view(view),
                    name=f"{opts.app_label}_{opts.model_name}_{name}",
                )
                for name, view in views
            ),
            *super().get_urls(),
        ]

    def render_change_form(
        self,
        request: HttpRequest,
        context: dict[str, Any],
        add: bool = False,
        change: bool = False,
        form_url: str = "",
        obj: WorkflowRun | None = None,
    ) -> HttpResponse:
        if obj is not None:
            context.update(self.run_context(request, obj))
        return super().render_change_form(request, context, add, change, form_url, obj)

    def run_context(self, request: HttpRequest, run: WorkflowRun) -> dict[str, Any]:
        """Everything the run page shows besides its fields: the stage table (with the
        workflow's not-started stages), waiting reasons, the run error, rerun markers, the
        Gantt chart, jobs, a page of the timeline, dead letter and operation links."""
        stages = list(
            WorkflowStage.objects.filter(run=run)
            .defer("input_data", "output_data", "config", "resume_data", "embedding_info")
            .order_by("execution_group", "stage_number")
        )
        jobs = list(
            WorkflowJob.objects.filter(workflow_run_id=run.pk)
            .defer("payload")
            .order_by("created_at", "id")[: MAX_JOBS_SHOWN + 1]
        )
        open_jobs = {j.stage_id: j for j in jobs if j.status in (Status.PENDING, Status.RUNNING)}
        waiting = waiting_reasons(run, stages, open_jobs, count_queue=True)
        dead_letter = (
            OutboxEvent.objects.filter(
                workflow_run_id=run.pk, dlq_at__isnull=False, published_at__isnull=True
            )
            .order_by("sequence")
            .first()
        )
        try:
            page = max(1, int(request.GET.get("timeline_page", "1")))
        except ValueError:
            page = 1
        timeline = build_timeline(run, limit=TIMELINE_PAGE, page=page)
        rid = str(run.pk)
        opts = self.opts

        def url(name: str) -> str:
            return reverse(f"admin:{opts.app_label}_{opts.model_name}_{name}", args=[rid])

        active = not run.is_terminal
        return {
            "dw_stages": stage_rows(run, stages),
            "dw_waiting": [(w, waiting_line(w)) for w in waiting],
            "dw_error": run_error(run, stages),
            "dw_error_details": error_details(run),
            "dw_reruns": rerun_markers(run),
            "dw_gantt": build_gantt(run),
            "dw_timeline": timeline,
            "dw_timeline_page": page,
            "dw_jobs": [
                {
                    "job": job,
                    "status": status_badge(job.status),
                    "url": reverse("admin:django_workflows_workflowjob_change", args=[job.pk]),
                }
                for job in jobs[:MAX_JOBS_SHOWN]
            ],
            "dw_jobs_truncated": len(jobs) > MAX_JOBS_SHOWN,
            "dw_dead_letter": dead_letter,
            "dw_ops": [
                (label, url(name), name)
                for label, name, allowed in (
                    ("Cancel run", "cancel", active and self.has_cancel_permission(request)),
                    (
                        "Approve / reject",
                        "decide",
                        any(w.is_human for w in waiting) and self.has_approve_permission(request),
                    ),
                    (
                        "Rerun from a stage",
                        "rerun",
                        run.status in (Status.COMPLETED, Status.FAILED)
                        and self.has_rerun_permission(request),
                    ),
                    ("Annotate", "annotate", self.has_annotate_permission(request)),
                )
                if allowed
            ],
            "dw_can_cancel": active and self.has_cancel_permission(request),
            "dw_cancel_url": url("cancel"),
            "dw_links": {
                "events": reverse("admin:django_workflows_outboxevent_changelist")
                + f"?workflow_run_id={rid}",
                "jobs": reverse("admin:django_workflows_workflowjob_changelist")
                + f"?workflow_run_id={rid}",
                "logs": reverse("admin:django_workflows_workflowlog_changelist")
                + f"?run__id__exact={rid}",
                "annotations": reverse("admin:django_workflows_workflowannotation_changelist")
                + f"?run__id__exact={rid}",
            },
        }

    def _run_or_404(self, request: HttpRequest, object_id: str) -> WorkflowRun:
        run = self.get_object(request, unquote(object_id))
        if run is None:
            raise Http404(f"No workflow run with id {object_id!r}")
        return run

    def _change_url(self, run: WorkflowRun) -> str:
        return reverse(
            f"admin:{self.opts.app_label}_{self.opts.model_name}_change", args=[str(run.pk)]
        )

    def cancel_view(self, request: HttpRequest, object_id: str) -> HttpResponse:
        """Confirm (GET) and cancel (POST, with a reason) one run through ``run.cancel``."""
        if not self.has_cancel_permission(request):
            raise PermissionDenied
        run = self._run_or_404(request, object_id)
        change_url = self._change_url(run)
        if run.is_terminal:
            self.message_user(
                request,
                f"Run {run.pk} is already {run.status}; there is nothing to cancel.",
                messages.WARNING,
            )
            return HttpResponseRedirect(change_url)
        open_stages = run.stages.filter(status__in=ACTIVE_STAGE_STATUSES).count()
        facts = [
            f"Run {run.pk} of workflow “{run.workflow_id}” is {run.status}.",
            (
                ngettext(
                    "%d open stage is cancelled, with its queued jobs.",
                    "%d open stages are cancelled, with their queued jobs.",
                    open_stages,
                )
                % open_stages
                if open_stages
                else "No stage has started yet: no worker will pick the run up."
            ),
            "A stage that is executing right now finishes, but its result is discarded.",
            "This cannot be undone: a cancelled run is neither resumed nor rerun.",
        ]
        return operation_page(
            self,
            request,
            operation="cancel",
            obj=run,
            title="Cancel this run?",
            form=CancelForm(request.POST if request.method == "POST" else None),
            perform=lambda data: self._cancel(request, [run], data["reason"]),
            back_url=change_url,
            facts=facts,
            submit="Yes, cancel the run",
        )

    def rerun_view(self, request: HttpRequest, object_id: str) -> HttpResponse:
        """Rerun a COMPLETED or FAILED run from a chosen stage (``run.rerunFrom``, K-RR)."""
        if not self.has_rerun_permission(request):
            raise PermissionDenied
        run = self._run_or_404(request, object_id)
        change_url = self._change_url(run)
        workflow = registry.get(run.workflow_id)
        if workflow is None:
            self.message_user(
                request,
                f"Workflow {run.workflow_id!r} is not registered in this process; it cannot be "
                "rerun from here.",
                messages.ERROR,
            )
            return HttpResponseRedirect(change_url)
        if run.status not in (Status.COMPLETED, Status.FAILED):
            self.message_user(
                request,
                f"Run {run.pk} is {run.status}; only a COMPLETED or FAILED run can be rerun.",
                messages.WARNING,
            )
            return HttpResponseRedirect(change_url)
        choices = [
            (node.stage.id, f"{node.stage.id} (group {node.execution_group})")
            for node in (workflow.node(sid) for sid in workflow.stage_ids)
        ]
        initial = None
        failed = run.stages.filter(status=Status.FAILED).order_by("execution_group").first()
        if failed is not None:
            initial = {"from_stage_id": failed.stage_id}
        form = RerunForm(
            request.POST if request.method == "POST" else None, initial=initial, stages=choices
        )

        def perform(data: dict[str, Any]) -> str:
            reason = data["reason"] or ""
            result = get_kernel().dispatch(
                RerunFrom(
                    run.pk,
                    data["from_stage_id"],
                    actor=f"user:{actor_of(request)}",
                    reason=reason or None,
                )
            )
            deleted = ", ".join(result.deleted_stages) or "none"
            log_operation(
                request,
                run,
                f"Rerun from stage {data['from_stage_id']} (run.rerunFrom); deleted stage "
                f"records: {deleted}." + (f" Reason: {reason}" if reason else ""),
            )
            return (
                f"Rerunning run {run.pk} from stage {data['from_stage_id']}: "
                f"{len(result.deleted_stages)} stage record(s) replaced ({deleted})."
            )

        return operation_page(
            self,
            request,
            operation="rerun",
            obj=run,
            title="Rerun this run from a stage?",
            form=form,
            perform=perform,
            back_url=change_url,
            facts=[
                f"Run {run.pk} of workflow “{run.workflow_id}” is {run.status}.",
                "The chosen stage's execution group and every later group are deleted and run "
                "again as the next generation; earlier groups keep their outputs.",
                "The run's started_at is kept; the rerun is recorded with who, why and when.",
            ],
            submit="Yes, rerun",
        )

    def decide_view(self, request: HttpRequest, object_id: str) -> HttpResponse:
        """Approve or reject a waiting approval stage (``approval.decide``, as the user)."""
        if not self.has_approve_permission(request):
            raise PermissionDenied
        run = self._run_or_404(request, object_id)
        change_url = self._change_url(run)
        waiting = [w for w in waiting_reasons(run) if w.reason == "approval"]
        if not waiting:
            self.message_user(request, f"No approval is waiting in run {run.pk}.", messages.WARNING)
            return HttpResponseRedirect(change_url)
        choices = [
            (
                w.stage_id or "",
                w.stage_id
                + (
                    f" (approvers: {', '.join(w.allowed_approvers)})" if w.allowed_approvers else ""
                ),
            )
            for w in waiting
        ]
        data = request.POST if request.method == "POST" else None
        initial = {"outcome": request.GET.get("outcome") or "approved"}
        form = DecisionForm(data, initial=initial, stages=choices)

        def perform(data: dict[str, Any]) -> str:
            by = actor_of(request)
            comment = data["comment"] or None
            recorded = approval.decide(
                run.pk, data["outcome"], by=by, stage_id=data["stage_id"], rationale=comment
            )
            verb = "Approved" if recorded.outcome == "approved" else "Rejected"
            if not recorded.recorded:
                return f"Stage {recorded.stage_id} was already {recorded.outcome}; nothing changed."
            log_operation(
                request,
                run,
                f"{verb} stage {recorded.stage_id} (generation {recorded.generation})."
                + (f" Comment: {comment}" if comment else ""),
            )
            return (
                f"{verb} stage {recorded.stage_id} as {by}: the run resumes at the stage's "
                "next poll."
            )

        who = [
            f"{w.stage_id}: "
            + (
                f"may be decided by {', '.join(w.allowed_approvers)}"
                if w.allowed_approvers
                else "anyone with the approve permission may decide"
            )
            for w in waiting
        ]
        return operation_page(
            self,
            request,
            operation="approve",
            obj=run,
            title="Approve or reject",
            form=form,
            perform=perform,
            back_url=change_url,
            facts=[f"You decide as {actor_of(request)}; the first decision wins.", *who],
            submit="Record the decision",
        )

    def annotate_view(self, request: HttpRequest, object_id: str) -> HttpResponse:
        """Attach one annotation as the user (``kernel.annotations.attach``, AN-21)."""
        if not self.has_annotate_permission(request):
            raise PermissionDenied
        run = self._run_or_404(request, object_id)
        change_url = self._change_url(run)
        stages = [
            (sid, sid)
            for sid in run.stages.order_by("execution_group", "stage_number").values_list(
                "stage_id", flat=True
            )
        ]
        form = AnnotateForm(request.POST if request.method == "POST" else None, stages=stages)

        def perform(data: dict[str, Any]) -> str:
            options: dict[str, Any] = {
                "actor": {"kind": "user", "id": actor_of(request)},
                "emit_event": True,
            }
            if data["stage_id"]:
                options.update(scope="stage", scope_id=data["stage_id"])
            if data["comment"]:
                options["payload"] = {"comment": data["comment"]}
            result = get_kernel().annotations.attach(
                run.pk, {data["key"]: data["value"]}, **options
            )
            log_operation(
                request,
                run,
                f"Annotated {data['key']} = {short_json(data['value'], 200)}"
                + (f" on stage {data['stage_id']}" if data["stage_id"] else "")
                + ".",
            )
            return f"Attached {result.created} annotation(s) ({data['key']})."

        return operation_page(
            self,
            request,
            operation="annotate",
            obj=run,
            title="Attach an annotation",
            form=form,
            perform=perform,
            back_url=change_url,
            facts=[f"Written as actor user:{actor_of(request)}, with an annotation:created event."],
            submit="Attach",
        )


def _delete_run_rows(run_ids: list[Any]) -> None:
    """Delete the jobs and outbox rows of terminal runs being deleted (no foreign key to the
    run, DM-11, so no cascade)."""
    WorkflowJob.objects.filter(workflow_run_id__in=run_ids).delete()
    OutboxEvent.objects.filter(workflow_run_id__in=run_ids).delete()


@dataclass
class StageRow:
    """One row of the run page's stage table: a stage record, or a stage of the workflow that
    has no record yet (``record`` ``None``: "not started")."""

    stage_id: str
    name: str
    execution_group: int
    record: WorkflowStage | None
    #: The registered stage's effective timeouts, e.g. "timeout 600 s" ('' for none).
    limits: str = ""

    @property
    def status(self) -> SafeString | str:
        if self.record is None:
            return format_html('<span class="dw-muted dw-not-started">{}</span>', "not started")
        badge = status_badge(self.record.status)
        if self.record.status == Status.SUSPENDED and self.record.next_poll_at is not None:
            return format_html(
                '{}<br><span class="dw-muted">next poll {}</span>',
                badge,
                timezone.localtime(self.record.next_poll_at).strftime("%Y-%m-%d %H:%M:%S"),
            )
        return badge

    @property
    def progress(self) -> str:
        """Whole percent (``83%``), ``-`` when unknown."""
        rec = self.record
        if rec is None:
            return "-"
        value = rec.progress
        if value is None and rec.status == Status.COMPLETED:
            value = 100.0
        return "-" if value is None else f"{value:.0f}%"

    @property
    def duration(self) -> SafeString | str:
        rec = self.record
        if rec is None:
            return "-"
        if rec.duration_ms is not None:
            return (
                f"{rec.duration_ms:,} ms"
                if rec.duration_ms < 10_000
                else (format_duration_ms(rec.duration_ms))
            )
        return duration_display(None, rec.started_at, rec.status in ACTIVE_STAGE_STATUSES)

    @property
    def traceback(self) -> str | None:
        rec = self.record
        metrics = rec.metrics if rec is not None and isinstance(rec.metrics, dict) else {}
        value = metrics.get("traceback")
        return str(value) if value else None


def run_structure(run: WorkflowRun) -> list[list[dict[str, Any]]] | None:
    """The execution groups of the definition ``run`` started with (issue 12 item 3):
    ``[[{"id", "name", ...}, ...], ...]`` from its version's stored structure (one query),
    else from the registered definition if it has the run's version (or the run is
    unversioned), else ``None`` (the version's structure is unknown here).
    """
    workflow = registry.get(run.workflow_id)
    version = run.definition_version
    if version:
        from ..kernel.versions import stored_structure

        stored = stored_structure(run.workflow_id, version)
        if stored is not None and isinstance(stored.get("groups"), list):
            return stored["groups"]
        if workflow is None or workflow.version != version:
            return None
    if workflow is None:
        return None
    return workflow.structure()["groups"]


def stage_rows(run: WorkflowRun, stages: list[WorkflowStage]) -> list[StageRow]:
    """The stage records of ``run`` and, after them in workflow order, the stages of the
    definition the run started with (:func:`run_structure`: its version, not necessarily
    today's definition) that have no record yet (not started)."""
    by_id = {s.stage_id: s for s in stages}
    rows = [StageRow(s.stage_id, s.stage_name, s.execution_group, s) for s in stages]
    workflow = registry.get(run.workflow_id)
    if workflow is not None:
        for row in rows:
            defined = workflow.get_stage(row.stage_id)
            row.limits = timeouts.text(defined) if defined is not None else ""
    for group_number, group in enumerate(run_structure(run) or [], start=1):
        for entry in group if isinstance(group, list) else []:
            sid = str(entry.get("id", ""))
            if sid and sid not in by_id:
                defined = workflow.get_stage(sid) if workflow is not None else None
                limits = timeouts.text(defined) if defined is not None else ""
                rows.append(
                    StageRow(sid, str(entry.get("name") or sid), group_number, None, limits)
                )
    rows.sort(key=lambda r: r.execution_group)
    return rows


@dataclass
class RerunMarker:
    """A rerun of a run: when, from which stage, the new generation, who and why."""

    at: Any
    from_stage_id: str
    generation: int | None
    actor: str | None
    reason: str | None


def rerun_markers(run: WorkflowRun, limit: int = 50) -> list[RerunMarker]:
    """The run's reruns, newest first (its ``workflow:started`` events with a ``rerun``
    marker; one query on the run's outbox rows)."""
    out = []
    for event in (
        OutboxEvent.objects.filter(workflow_run_id=run.pk, event_type="workflow:started")
        .only("payload", "occurred_at")
        .order_by("-sequence")[:limit]
    ):
        payload = event.payload if isinstance(event.payload, dict) else {}
        marker = payload.get("rerun")
        if isinstance(marker, dict):
            out.append(
                RerunMarker(
                    event.occurred_at,
                    str(marker.get("from_stage_id") or ""),
                    marker.get("generation"),
                    marker.get("actor"),
                    marker.get("reason"),
                )
            )
    return out
