"""The schedules admin (issue 12 item 1): a list with next fire times, state and the last run;
a read-only schedule page with its next scheduled times; operations pause, resume, trigger now
and backfill, each with a confirmation page, a History record and its own permission
(``pause_workflowschedule``, ``trigger_workflowschedule``, ``backfill_workflowschedule``,
shared with the HTTP API; each also needs ``view_workflowschedule``).

Rows are synced from the code definitions by the workers (when a worker process starts, and
on every maintenance tick) and by ``workflows_schedule``; showing a page writes nothing (no
admin GET writes). The admin never saves a schedule row itself: each operation dispatches its
kernel command (``schedule.pause``, ``schedule.resume``, ``schedule.trigger``,
``schedule.backfill``).
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from django import forms
from django.contrib import admin
from django.contrib.admin.utils import quote, unquote
from django.core.exceptions import PermissionDenied
from django.db.models import QuerySet
from django.http import Http404, HttpRequest, HttpResponse
from django.urls import URLPattern, path, reverse
from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString

from ..kernel.commands import BackfillSchedule, PauseSchedule, ResumeSchedule, TriggerSchedule
from ..kernel.errors import InvalidCommandError
from ..kernel.runtime import get_kernel
from ..kernel.schedules import MAX_BACKFILL, check_backfill_range, upcoming_times
from ..models import WorkflowSchedule
from .display import ReadOnlyAdmin, badge, compact_time, run_link
from .operations import (
    _reason_field,
    actor_of,
    has_operation_permission,
    log_operation,
    operation_page,
)


class PauseForm(forms.Form):
    """``reason``: why the schedule is paused (optional; shown in the list and History)."""

    reason = _reason_field("Reason", False, "Shown in the schedule list and kept in History.")


class ConfirmForm(forms.Form):
    """No fields: the confirmation is the whole form."""


class BackfillForm(forms.Form):
    """``start`` and ``end``: the range of scheduled times (inclusive, ISO-8601 with offset)."""

    start = forms.CharField(label="From", help_text="ISO-8601 with offset, e.g. 2025-01-01T00:00Z")
    end = forms.CharField(label="Until", help_text="Inclusive. At most 1000 scheduled times.")

    def _aware(self, name: str) -> datetime:
        text = self.cleaned_data[name].strip()
        try:
            value = datetime.fromisoformat(text)
        except ValueError:
            raise forms.ValidationError(f"{text!r} is not an ISO-8601 date-time") from None
        if value.utcoffset() is None:
            raise forms.ValidationError("add a UTC offset (Z or +01:00)")
        return value

    def clean_start(self) -> datetime:
        return self._aware("start")

    def clean_end(self) -> datetime:
        return self._aware("end")

    def clean(self) -> dict[str, Any]:
        """The kernel's range check (years, order) as an error at the field it names."""
        data = super().clean()
        if isinstance(data.get("start"), datetime) and isinstance(data.get("end"), datetime):
            try:
                check_backfill_range(data["start"], data["end"])
            except InvalidCommandError as exc:
                field = exc.field if exc.field in ("start", "end") else None
                message = str(exc)
                if field and message.startswith(f"{field}: "):
                    message = message[len(field) + 2 :]
                self.add_error(field, message)
        return data


class ScheduleStateFilter(admin.SimpleListFilter):
    title = "state"
    parameter_name = "state"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [("active", "active"), ("paused", "paused"), ("orphaned", "orphaned")]

    def queryset(
        self, request: HttpRequest, queryset: QuerySet[WorkflowSchedule]
    ) -> QuerySet[WorkflowSchedule]:
        value = self.value()
        if value == "active":
            return queryset.filter(paused=False)
        if value == "paused":
            return queryset.filter(paused=True, orphaned=False)
        if value == "orphaned":
            return queryset.filter(orphaned=True)
        return queryset


@admin.register(WorkflowSchedule)
class WorkflowScheduleAdmin(ReadOnlyAdmin):
    """Schedules with their next fire time, state and last run."""

    list_display = (
        "name",
        "workflow_id",
        "spec",
        "state",
        "next_fire",
        "last_fired",
        "last_run",
        "counts",
        "error",
    )
    list_filter = (ScheduleStateFilter, "overlap", "catchup")
    search_fields = ("name", "workflow_id")
    ordering = ("name",)
    fields = (
        "name",
        "workflow_id",
        "description",
        "spec",
        "state",
        "pause_reason",
        "overlap",
        "catchup",
        "catchup_window_seconds",
        "jitter_seconds",
        "repeated_times",
        "priority",
        "input",
        "config",
        "next_fire",
        "upcoming",
        "last_scheduled_at",
        "last_fired",
        "last_run",
        "fired_count",
        "skipped_count",
        "last_error",
        "created_at",
        "updated_at",
    )
    readonly_fields = fields

    @admin.display(description="spec")
    def spec(self, obj: WorkflowSchedule) -> SafeString:
        if obj.cron:
            return format_html(
                '<span class="dw-nowrap">cron <code>{}</code></span><br>{}', obj.cron, obj.tz
            )
        return format_html('<span class="dw-nowrap">{}</span>', obj.spec_text)

    @admin.display(description="fired / skipped")
    def counts(self, obj: WorkflowSchedule) -> str:
        return f"{obj.fired_count} / {obj.skipped_count}"

    @admin.display(description="state")
    def state(self, obj: WorkflowSchedule) -> SafeString:
        if obj.orphaned:
            return badge("orphaned", "FAILED")
        if obj.paused:
            return badge("paused", "SUSPENDED")
        return badge("active", "COMPLETED")

    @admin.display(description="next fire", ordering="next_fire_at")
    def next_fire(self, obj: WorkflowSchedule) -> SafeString | str:
        return compact_time(obj.next_fire_at)

    @admin.display(description="last fired", ordering="last_fired_at")
    def last_fired(self, obj: WorkflowSchedule) -> SafeString | str:
        return compact_time(obj.last_fired_at)

    @admin.display(description="last run")
    def last_run(self, obj: WorkflowSchedule) -> SafeString | str:
        return run_link(obj.last_run_id)

    @admin.display(description="last error")
    def error(self, obj: WorkflowSchedule) -> str:
        return (obj.last_error[:80] + "…") if len(obj.last_error) > 80 else obj.last_error

    @admin.display(description="next scheduled times")
    def upcoming(self, obj: WorkflowSchedule) -> SafeString | str:
        times = upcoming_times(obj, 5)
        if not times:
            return "-"
        return format_html(
            "<ul class='dw-upcoming'>{}</ul>",
            format_html_join("", "<li>{}</li>", ((t.isoformat(),) for t in times)),
        )

    # --- pages ------------------------------------------------------------------------------

    def changeform_view(
        self,
        request: HttpRequest,
        object_id: str | None = None,
        form_url: str = "",
        extra_context: dict[str, Any] | None = None,
    ) -> HttpResponse:
        """The schedule page offers the operations the user may perform."""
        context = dict(extra_context or {})
        row = WorkflowSchedule.objects.filter(pk=unquote(object_id or "")).first()
        ops = []
        if row is not None:
            if has_operation_permission(request, "pause"):
                if row.paused and not row.orphaned:
                    ops.append(("Resume", self._url("resume", row.pk), "resume"))
                elif not row.paused:
                    ops.append(("Pause", self._url("pause", row.pk), "pause"))
            if has_operation_permission(request, "trigger"):
                ops.append(("Trigger now", self._url("trigger", row.pk), "trigger"))
            if has_operation_permission(request, "backfill"):
                ops.append(("Backfill", self._url("backfill", row.pk), "backfill"))
        context["dw_ops"] = ops
        return super().changeform_view(request, object_id, form_url, context)

    def get_urls(self) -> list[URLPattern]:
        opts = self.opts
        name = f"{opts.app_label}_{opts.model_name}"
        views = {
            "pause": self.pause_view,
            "resume": self.resume_view,
            "trigger": self.trigger_view,
            "backfill": self.backfill_view,
        }
        return [
            *(
                path(
                    f"<path:object_id>/{op}/",
                    self.admin_site.admin_view(view),
                    name=f"{name}_{op}",
                )
                for op, view in views.items()
            ),
            *super().get_urls(),
        ]

    def _url(self, name: str, *args: Any) -> str:
        opts = self.opts
        return reverse(
            f"admin:{opts.app_label}_{opts.model_name}_{name}", args=[quote(a) for a in args]
        )

    def _row_or_404(self, object_id: str) -> WorkflowSchedule:
        row = WorkflowSchedule.objects.filter(pk=unquote(object_id)).first()
        if row is None:
            raise Http404(f"No schedule {object_id!r}")
        return row

    def _facts(self, row: WorkflowSchedule) -> list[str]:
        return [
            f"Schedule {row.name}: {row.spec_text}, starts {row.workflow_id}; "
            f"{'paused' if row.paused else 'next fire at ' + str(row.next_fire_at)}."
        ]

    def pause_view(self, request: HttpRequest, object_id: str) -> HttpResponse:
        """Pause (confirmation, optional reason)."""
        if not has_operation_permission(request, "pause"):
            raise PermissionDenied
        row = self._row_or_404(object_id)
        back = self._url("change", row.pk)

        def perform(data: dict[str, Any]) -> str:
            reason = data["reason"] or f"paused in the admin by {actor_of(request)}"
            if not get_kernel().dispatch(PauseSchedule(row.name, reason)).changed:
                return f"Schedule {row.name} was paused already."
            log_operation(request, row, f"Paused the schedule. Reason: {reason}")
            return f"Paused schedule {row.name}: it fires no more until resumed."

        return operation_page(
            self,
            request,
            operation="pause",
            obj=row,
            title="Pause this schedule?",
            form=PauseForm(request.POST if request.method == "POST" else None),
            perform=perform,
            back_url=back,
            facts=[*self._facts(row), "Runs already started are not affected."],
            submit="Yes, pause",
        )

    def resume_view(self, request: HttpRequest, object_id: str) -> HttpResponse:
        """Resume (confirmation)."""
        if not has_operation_permission(request, "pause"):
            raise PermissionDenied
        row = self._row_or_404(object_id)
        back = self._url("change", row.pk)

        def perform(data: dict[str, Any]) -> str:
            if not get_kernel().dispatch(ResumeSchedule(row.name)).changed:
                return f"Schedule {row.name} was not paused."
            log_operation(request, row, "Resumed the schedule.")
            row.refresh_from_db()
            return f"Resumed schedule {row.name}; next fire at {row.next_fire_at}."

        return operation_page(
            self,
            request,
            operation="pause",
            obj=row,
            title="Resume this schedule?",
            form=ConfirmForm(request.POST if request.method == "POST" else None),
            perform=perform,
            back_url=back,
            facts=[
                *self._facts(row),
                "It fires next at its next scheduled time after now; times that passed while "
                "it was paused are not caught up (use Backfill for those).",
            ],
            submit="Yes, resume",
        )

    def trigger_view(self, request: HttpRequest, object_id: str) -> HttpResponse:
        """Start one run now (confirmation)."""
        if not has_operation_permission(request, "trigger"):
            raise PermissionDenied
        row = self._row_or_404(object_id)
        back = self._url("change", row.pk)

        def perform(data: dict[str, Any]) -> str:
            run_id = (
                get_kernel()
                .dispatch(TriggerSchedule(row.name, actor=actor_of(request)))
                .workflow_run_id
            )
            log_operation(request, row, f"Triggered the schedule now: run {run_id}.")
            return f"Started run {run_id} of {row.workflow_id}."

        return operation_page(
            self,
            request,
            operation="trigger",
            obj=row,
            title="Start a run of this schedule now?",
            form=ConfirmForm(request.POST if request.method == "POST" else None),
            perform=perform,
            back_url=back,
            facts=[
                *self._facts(row),
                "One run starts now with the schedule's input and config (also when paused; "
                "the overlap policy is not applied). Its next scheduled firing is unchanged.",
            ],
            submit="Yes, start a run",
        )

    def backfill_view(self, request: HttpRequest, object_id: str) -> HttpResponse:
        """One run per scheduled time in a range (confirmation with the range)."""
        if not has_operation_permission(request, "backfill"):
            raise PermissionDenied
        row = self._row_or_404(object_id)
        back = self._url("change", row.pk)

        def perform(data: dict[str, Any]) -> str:
            result = get_kernel().dispatch(BackfillSchedule(row.name, data["start"], data["end"]))
            log_operation(
                request,
                row,
                f"Backfilled {data['start'].isoformat()} to {data['end'].isoformat()}: "
                f"{len(result.run_ids)} run(s) started, {result.existing} existed.",
            )
            return (
                f"{len(result.times)} scheduled time(s): started {len(result.run_ids)} run(s), "
                f"{result.existing} had a run already."
            )

        return operation_page(
            self,
            request,
            operation="backfill",
            obj=row,
            title="Backfill this schedule?",
            form=BackfillForm(request.POST if request.method == "POST" else None),
            perform=perform,
            back_url=back,
            facts=[
                *self._facts(row),
                f"One run per scheduled time in the range (at most {MAX_BACKFILL}); a time that "
                "already has a run (fired, or backfilled before) is not started again.",
            ],
            submit="Backfill",
        )


__all__ = ["WorkflowScheduleAdmin"]
