"""The admin of workflow runs: list, read-only detail with stages, timeline and jobs, and the
operator actions, which dispatch kernel commands (SPEC §4.4; ARCHITECTURE §1-2).

The kernel owns every status column, so nothing here saves a run, stage or job: the detail page
is view-only, runs are created by the kernel (``start_run``, ``workflows_run``), cancelling
dispatches ``run.cancel``, and only terminal runs can be deleted.
"""

from __future__ import annotations

from typing import Any

from django.contrib import admin, messages
from django.contrib.admin.actions import delete_selected
from django.contrib.admin.utils import unquote
from django.core.exceptions import PermissionDenied
from django.db.models import Count, IntegerField, OuterRef, QuerySet, Subquery
from django.db.models.functions import Coalesce
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import URLPattern, path, reverse
from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString
from django.utils.text import Truncator
from django.utils.translation import ngettext

from ..definition.registry import registry
from ..kernel.commands import CancelRun
from ..kernel.errors import WorkflowError
from ..kernel.runtime import get_kernel
from ..models import (
    ACTIVE_STAGE_STATUSES,
    TERMINAL_RUN_STATUSES,
    OutboxEvent,
    Status,
    WorkflowAnnotation,
    WorkflowJob,
    WorkflowLog,
    WorkflowRun,
    WorkflowStage,
)
from .display import StatusFilter, duration_display, pretty_json, short_id, status_badge
from .timeline import build_timeline

#: Ids named in one action message before "and N more".
MAX_IDS_IN_MESSAGE = 10

#: Jobs shown on the detail page (a run has one per stage and delivery).
MAX_JOBS_SHOWN = 200


def _stage_count(status: str | None = None) -> Coalesce:
    stages = WorkflowStage.objects.filter(run=OuterRef("pk"))
    if status is not None:
        stages = stages.filter(status=status)
    counted = stages.order_by().values("run").annotate(n=Count("pk")).values("n")
    return Coalesce(Subquery(counted, output_field=IntegerField()), 0)


def _name_ids(items: list[tuple[Any, str]]) -> str:
    shown = ", ".join(f"{run_id} ({status})" for run_id, status in items[:MAX_IDS_IN_MESSAGE])
    rest = len(items) - MAX_IDS_IN_MESSAGE
    return f"{shown} and {rest} more" if rest > 0 else shown


def can_operate_runs(request: HttpRequest) -> bool:
    """Operator commands (cancel) need the ``change`` permission of runs."""
    return bool(request.user.has_perm("django_workflows.change_workflowrun"))


class RunStatusFilter(StatusFilter):
    """The statuses a run can have: never SUSPENDED or SKIPPED (SM-8)."""

    statuses = (Status.PENDING, Status.RUNNING, Status.COMPLETED, Status.FAILED, Status.CANCELLED)


class WorkflowStageInline(admin.TabularInline):
    """The stage records of a run, in execution order; read-only."""

    model = WorkflowStage
    extra = 0
    can_delete = False
    verbose_name = "stage"
    verbose_name_plural = "stages"
    fields = readonly_fields = (
        "stage",
        "execution_group",
        "status_badge",
        "attempt",
        "progress_bar",
        "started_at",
        "duration",
        "error",
    )

    def has_view_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        opts = WorkflowRun._meta
        return request.user.has_perm(f"{opts.app_label}.view_{opts.model_name}") or (
            can_operate_runs(request)
        )

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    @admin.display(description="stage")
    def stage(self, obj: WorkflowStage) -> SafeString:
        if obj.stage_name and obj.stage_name != obj.stage_id:
            return format_html(
                '<strong>{}</strong><br><span class="dw-muted">{}</span>',
                obj.stage_id,
                obj.stage_name,
            )
        return format_html("<strong>{}</strong>", obj.stage_id)

    @admin.display(description="status")
    def status_badge(self, obj: WorkflowStage) -> SafeString | str:
        badge = status_badge(obj.status)
        if obj.status == Status.SUSPENDED and obj.next_poll_at is not None:
            return format_html(
                '{}<br><span class="dw-muted">next poll {}</span>',
                badge,
                obj.next_poll_at.strftime("%Y-%m-%d %H:%M:%S"),
            )
        return badge

    @admin.display(description="progress")
    def progress_bar(self, obj: WorkflowStage) -> SafeString | str:
        value = obj.progress
        if value is None and obj.status == Status.COMPLETED:
            value = 100.0
        if value is None:
            return "-"
        bar = format_html(
            '<progress max="100" value="{}" style="width:80px"></progress> {}%',
            f"{value:.0f}",
            f"{value:.0f}",
        )
        if obj.progress_message:
            return format_html(
                '{}<br><span class="dw-muted">{}</span>',
                bar,
                Truncator(obj.progress_message).chars(80),
            )
        return bar

    @admin.display(description="duration")
    def duration(self, obj: WorkflowStage) -> SafeString | str:
        return duration_display(
            obj.duration_ms, obj.started_at, obj.status in ACTIVE_STAGE_STATUSES
        )

    @admin.display(description="error")
    def error(self, obj: WorkflowStage) -> SafeString | str:
        message = obj.error_message
        if not message:
            return "-"
        if len(message) <= 160:
            return format_html('<span class="dw-error">{}</span>', message)
        return format_html(
            '<details><summary class="dw-error">{}</summary><pre class="dw-json">{}</pre>'
            "</details>",
            Truncator(message).chars(120),
            message,
        )


@admin.register(WorkflowRun)
class WorkflowRunAdmin(admin.ModelAdmin):
    """Runs: list with live progress, view-only detail, cancel through the kernel."""

    list_display = (
        "run_id",
        "workflow_id",
        "status_badge",
        "progress_summary",
        "priority",
        "created_at",
        "started_at",
        "duration",
    )
    list_filter = (RunStatusFilter, "workflow_id")
    search_fields = ("id", "workflow_id")
    search_help_text = "Search by run id (or part of it) or workflow id."
    date_hierarchy = "created_at"
    ordering = ("-created_at",)
    list_per_page = 50
    actions = ("cancel_runs",)
    inlines = (WorkflowStageInline,)
    fieldsets = (
        (
            None,
            {
                "fields": (
                    "id",
                    "workflow",
                    "status_badge",
                    "progress_summary",
                    "priority",
                    "version",
                )
            },
        ),
        (
            "Timing",
            {
                "fields": (
                    "created_at",
                    "started_at",
                    "completed_at",
                    "duration",
                    "updated_at",
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
        "priority",
        "version",
        "created_at",
        "started_at",
        "completed_at",
        "duration",
        "updated_at",
        "input_json",
        "config_json",
        "output_json",
        "total_cost",
        "total_tokens",
        "metadata_json",
    )

    # --- queries ----------------------------------------------------------------------------

    def get_queryset(self, request: HttpRequest) -> QuerySet[WorkflowRun]:
        """Runs with their stage counts as subqueries: one query for a whole page."""
        return (
            super()
            .get_queryset(request)
            .annotate(
                completed_stages=_stage_count(Status.COMPLETED),
                stage_records=_stage_count(),
            )
        )

    # --- permissions ------------------------------------------------------------------------

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        if obj is not None and obj.status not in TERMINAL_RUN_STATUSES:
            return False
        return super().has_delete_permission(request, obj)

    def has_cancel_permission(self, request: HttpRequest) -> bool:
        return can_operate_runs(request)

    def get_deleted_objects(self, objs: Any, request: HttpRequest) -> Any:
        """The run's stages, logs and annotations go with it (foreign-key cascade): deleting
        a terminal run needs only the run's delete permission.
        """
        deleted, model_count, perms_needed, protected = super().get_deleted_objects(objs, request)
        cascaded = {
            str(model._meta.verbose_name)
            for model in (WorkflowStage, WorkflowLog, WorkflowAnnotation)
        }
        return deleted, model_count, set(perms_needed) - cascaded, protected

    # --- columns and fields -----------------------------------------------------------------

    @admin.display(description="id", ordering="id")
    def run_id(self, obj: WorkflowRun) -> SafeString:
        return short_id(obj.pk)

    @admin.display(description="status", ordering="status")
    def status_badge(self, obj: WorkflowRun) -> SafeString | str:
        return status_badge(obj.status)

    @admin.display(description="progress", ordering="completed_stages")
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
            '<progress max="{}" value="{}" style="width:60px"></progress> {} / {}</span>',
            completed,
            total,
            max(total, 1),
            completed,
            completed,
            total,
        )

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

    # --- actions ----------------------------------------------------------------------------

    @admin.action(description="Cancel selected runs", permissions=["cancel"])
    def cancel_runs(self, request: HttpRequest, queryset: QuerySet[WorkflowRun]) -> None:
        """Dispatch ``run.cancel`` for each selected run; report the terminal ones (K-CA-1..3)."""
        kernel = get_kernel()
        reason = f"Cancelled in the admin by {request.user.get_username()}"
        cancelled: list[WorkflowRun] = []
        terminal: list[tuple[Any, str]] = []
        errors: list[str] = []
        for run in queryset.only("pk", "status", "workflow_id").order_by("created_at"):
            if run.status in TERMINAL_RUN_STATUSES:
                terminal.append((run.pk, run.status))
                continue
            try:
                result = kernel.dispatch(CancelRun(run.pk, reason=reason))
            except WorkflowError as exc:
                errors.append(f"{run.pk}: {exc}")
                continue
            if result.cancelled:
                cancelled.append(run)
                self.log_change(request, run, "Cancelled (run.cancel).")
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

    def get_actions(self, request: HttpRequest) -> dict[str, Any]:
        actions = super().get_actions(request)
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
        return [
            path(
                "<path:object_id>/cancel/",
                self.admin_site.admin_view(self.cancel_view),
                name=f"{opts.app_label}_{opts.model_name}_cancel",
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
        """Timeline, jobs, dead letter and operator links of ``run`` for the template."""
        jobs = list(
            WorkflowJob.objects.filter(workflow_run_id=run.pk).order_by("created_at", "id")[
                : MAX_JOBS_SHOWN + 1
            ]
        )
        dead_letter = (
            OutboxEvent.objects.filter(
                workflow_run_id=run.pk, dlq_at__isnull=False, published_at__isnull=True
            )
            .order_by("sequence")
            .first()
        )
        rid = str(run.pk)
        return {
            "dw_timeline": build_timeline(run),
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
            "dw_can_cancel": not run.is_terminal and self.has_cancel_permission(request),
            "dw_cancel_url": reverse(
                f"admin:{self.opts.app_label}_{self.opts.model_name}_cancel", args=[rid]
            ),
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

    def cancel_view(self, request: HttpRequest, object_id: str) -> HttpResponse:
        """Confirm (GET) and cancel (POST) one run through ``run.cancel``."""
        if not self.has_cancel_permission(request):
            raise PermissionDenied
        run = self.get_object(request, unquote(object_id))
        if run is None:
            raise Http404(f"No workflow run with id {object_id!r}")
        change_url = reverse(
            f"admin:{self.opts.app_label}_{self.opts.model_name}_change", args=[str(run.pk)]
        )
        if run.is_terminal:
            self.message_user(
                request,
                f"Run {run.pk} is already {run.status}; there is nothing to cancel.",
                messages.WARNING,
            )
            return HttpResponseRedirect(change_url)
        if request.method == "POST":
            self.cancel_runs(request, WorkflowRun.objects.filter(pk=run.pk))
            return HttpResponseRedirect(change_url)
        context = {
            **self.admin_site.each_context(request),
            "title": "Cancel this run?",
            "subtitle": None,
            "opts": self.opts,
            "original": run,
            "object": run,
            "change_url": change_url,
            "open_stages": run.stages.filter(status__in=ACTIVE_STAGE_STATUSES).count(),
            "has_view_permission": self.has_view_permission(request, run),
        }
        return TemplateResponse(
            request, "admin/django_workflows/workflowrun/cancel_confirmation.html", context
        )
