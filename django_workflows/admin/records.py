"""Read-only admins of the tables the kernel writes: jobs, outbox events, logs, annotations and
idempotency keys. The one operator command here, "Replay dead letters", dispatches
``plugin.replayDLQ`` (SPEC §4.11, EV-32).
"""

from __future__ import annotations

from typing import Any

from django.contrib import admin, messages
from django.db.models import Exists, OuterRef, QuerySet
from django.http import HttpRequest, HttpResponse
from django.utils.html import format_html
from django.utils.safestring import SafeString
from django.utils.text import Truncator
from django.utils.translation import ngettext

from ..kernel.commands import ReplayDeadLetters
from ..kernel.runtime import get_kernel
from ..models import (
    IdempotencyKey,
    OutboxEvent,
    Status,
    WorkflowAnnotation,
    WorkflowJob,
    WorkflowLog,
)
from .display import (
    ReadOnlyAdmin,
    StatusFilter,
    badge,
    pretty_json,
    run_link,
    short_json,
    status_badge,
)
from .timeline import event_state, event_summary

# --- jobs -------------------------------------------------------------------------------------


class JobStatusFilter(StatusFilter):
    """The statuses a job can have (the engine never skips a job)."""

    statuses = (
        Status.PENDING,
        Status.RUNNING,
        Status.SUSPENDED,
        Status.COMPLETED,
        Status.FAILED,
        Status.CANCELLED,
    )


@admin.register(WorkflowJob)
class WorkflowJobAdmin(ReadOnlyAdmin):
    """Queued units of work: one per stage execution, with lease and delivery count."""

    list_display = (
        "id",
        "run",
        "workflow_id",
        "stage_id",
        "status_badge",
        "deliveries",
        "priority",
        "worker_id",
        "locked_at",
        "next_poll_at",
        "created_at",
    )
    list_filter = (JobStatusFilter, "workflow_id", "stage_id")
    search_fields = ("workflow_run_id", "workflow_id", "stage_id", "worker_id")
    search_help_text = "Search by job id, run id, workflow id, stage id or worker id."
    ordering = ("-created_at", "-id")
    fields = (
        "id",
        "run",
        "workflow_id",
        "stage_id",
        "status_badge",
        "priority",
        "deliveries",
        "worker_id",
        "locked_at",
        "started_at",
        "completed_at",
        "next_poll_at",
        "created_at",
        "updated_at",
        "payload_json",
        "error",
    )
    readonly_fields = fields

    def get_search_results(
        self, request: HttpRequest, queryset: QuerySet[WorkflowJob], search_term: str
    ) -> tuple[QuerySet[WorkflowJob], bool]:
        """Also finds a job by its numeric id."""
        found, may_have_duplicates = super().get_search_results(request, queryset, search_term)
        term = search_term.strip()
        if term.isdigit():
            found = found | queryset.filter(pk=int(term))
        return found, may_have_duplicates

    @admin.display(description="run", ordering="workflow_run_id")
    def run(self, obj: WorkflowJob) -> SafeString | str:
        return run_link(obj.workflow_run_id)

    @admin.display(description="status", ordering="status")
    def status_badge(self, obj: WorkflowJob) -> SafeString | str:
        return status_badge(obj.status)

    @admin.display(description="attempt", ordering="attempt")
    def deliveries(self, obj: WorkflowJob) -> str:
        return f"{obj.attempt} / {obj.max_attempts}"

    @admin.display(description="payload")
    def payload_json(self, obj: WorkflowJob) -> SafeString | str:
        return pretty_json(obj.payload)

    @admin.display(description="last error")
    def error(self, obj: WorkflowJob) -> SafeString | str:
        if not obj.last_error:
            return "-"
        return format_html('<pre class="dw-json">{}</pre>', obj.last_error)


# --- outbox -----------------------------------------------------------------------------------


def _dead_letters() -> QuerySet[OutboxEvent]:
    return OutboxEvent.objects.filter(dlq_at__isnull=False, published_at__isnull=True)


class DeliveryFilter(admin.SimpleListFilter):
    """Published, unpublished (pending), dead-lettered, or blocked behind a dead letter."""

    title = "delivery"
    parameter_name = "delivery"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [
            ("published", "Published"),
            ("unpublished", "Unpublished"),
            ("dead_lettered", "Dead-lettered"),
            ("blocked", "Blocked behind a dead letter"),
        ]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any] | None:
        value = self.value()
        if value == "published":
            return queryset.filter(published_at__isnull=False)
        if value == "unpublished":
            return queryset.filter(published_at__isnull=True, dlq_at__isnull=True)
        if value == "dead_lettered":
            return queryset.filter(published_at__isnull=True, dlq_at__isnull=False)
        if value == "blocked":
            return queryset.filter(published_at__isnull=True, dlq_at__isnull=True).filter(
                Exists(_dead_letters().filter(workflow_run_id=OuterRef("workflow_run_id")))
            )
        return None


@admin.register(OutboxEvent)
class OutboxEventAdmin(ReadOnlyAdmin):
    """Events in per-run order with their delivery state (SPEC §5.2, Part I item 16)."""

    list_display = (
        "id",
        "run",
        "sequence",
        "event_type",
        "stage",
        "summary",
        "delivery",
        "retry_count",
        "short_error",
        "occurred_at",
    )
    list_filter = ("event_type", DeliveryFilter)
    search_fields = ("workflow_run_id", "event_type", "causation_id")
    search_help_text = "Search by run id (or part of it), event type or causation id."
    ordering = ("-id",)
    actions = ("replay_dead_letters",)
    date_hierarchy = "occurred_at"
    fields = (
        "id",
        "run",
        "sequence",
        "event_type",
        "delivery",
        "retry_count",
        "error",
        "occurred_at",
        "created_at",
        "published_at",
        "dlq_at",
        "skipped_at",
        "skip_note",
        "causation_id",
        "payload_json",
    )
    readonly_fields = fields

    def get_queryset(self, request: HttpRequest) -> QuerySet[OutboxEvent]:
        """Each row knows whether its run is blocked by a dead letter (no query per row)."""
        return (
            super()
            .get_queryset(request)
            .annotate(
                run_blocked=Exists(
                    _dead_letters().filter(workflow_run_id=OuterRef("workflow_run_id"))
                )
            )
        )

    def changelist_view(
        self, request: HttpRequest, extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        """Adds how many dead letters block how many runs (Part I item 16)."""
        dead = _dead_letters()
        context = {
            "dw_dead_letters": dead.count(),
            "dw_blocked_runs": dead.values("workflow_run_id").distinct().count(),
            **(extra_context or {}),
        }
        return super().changelist_view(request, extra_context=context)

    def has_replay_permission(self, request: HttpRequest) -> bool:
        return bool(request.user.has_perm("django_workflows.change_outboxevent")) or bool(
            request.user.has_perm("django_workflows.change_workflowrun")
        )

    @admin.display(description="run", ordering="workflow_run_id")
    def run(self, obj: OutboxEvent) -> SafeString | str:
        return run_link(obj.workflow_run_id)

    @admin.display(description="stage")
    def stage(self, obj: OutboxEvent) -> str:
        payload = obj.payload if isinstance(obj.payload, dict) else {}
        return str(payload.get("stage_id") or "-")

    @admin.display(description="summary")
    def summary(self, obj: OutboxEvent) -> str:
        return Truncator(event_summary(obj.payload)).chars(80) or "-"

    @admin.display(description="delivery")
    def delivery(self, obj: OutboxEvent) -> SafeString:
        return badge(event_state(obj, bool(getattr(obj, "run_blocked", False))))

    @admin.display(description="last error")
    def short_error(self, obj: OutboxEvent) -> str:
        """The first line of the latest delivery error, cut to 80 characters."""
        if not obj.last_error:
            return "-"
        return Truncator(obj.last_error.splitlines()[0]).chars(80)

    @admin.display(description="last error")
    def error(self, obj: OutboxEvent) -> SafeString | str:
        """Why the latest delivery failed (cleared by a replay, kept on a skip)."""
        if not obj.last_error:
            return "-"
        return format_html('<pre class="dw-json">{}</pre>', obj.last_error)

    @admin.display(description="payload")
    def payload_json(self, obj: OutboxEvent) -> SafeString | str:
        return pretty_json(obj.payload)

    @admin.action(description="Replay dead letters (all, in per-run order)", permissions=["replay"])
    def replay_dead_letters(self, request: HttpRequest, queryset: QuerySet[OutboxEvent]) -> None:
        """Dispatch ``plugin.replayDLQ`` for the whole dead-letter queue (EV-32).

        The command re-arms dead letters in per-run order and takes no selection: replaying a
        run's dead letter is what unblocks that run's later events.
        """
        pending = _dead_letters().count()
        if not pending:
            self.message_user(request, "There are no dead letters to replay.", messages.INFO)
            return
        result = get_kernel().dispatch(ReplayDeadLetters(max_events=pending))
        self.message_user(
            request,
            ngettext(
                "Replayed %d dead-lettered event: the next outbox flush delivers it.",
                "Replayed %d dead-lettered events: the next outbox flush delivers them.",
                result.replayed,
            )
            % result.replayed,
            messages.SUCCESS,
        )


# --- logs and annotations ---------------------------------------------------------------------


@admin.register(WorkflowLog)
class WorkflowLogAdmin(ReadOnlyAdmin):
    """Log lines written by stages and the kernel."""

    list_display = ("created_at", "level_badge", "short_message", "run_link", "stage_id")
    list_filter = ("level",)
    search_fields = ("message", "run__id", "run__workflow_id")
    list_select_related = ("stage",)
    ordering = ("-created_at", "-id")
    date_hierarchy = "created_at"
    fields = ("created_at", "level_badge", "run_link", "stage_id", "message", "metadata_json")
    readonly_fields = fields

    @admin.display(description="level", ordering="level")
    def level_badge(self, obj: WorkflowLog) -> SafeString:
        return badge(obj.level)

    @admin.display(description="message")
    def short_message(self, obj: WorkflowLog) -> str:
        return Truncator(obj.message).chars(120)

    @admin.display(description="run", ordering="run_id")
    def run_link(self, obj: WorkflowLog) -> SafeString | str:
        return run_link(obj.run_id)

    @admin.display(description="stage")
    def stage_id(self, obj: WorkflowLog) -> str:
        return obj.stage.stage_id if obj.stage is not None else "-"

    @admin.display(description="metadata")
    def metadata_json(self, obj: WorkflowLog) -> SafeString | str:
        return pretty_json(obj.metadata)


@admin.register(WorkflowAnnotation)
class WorkflowAnnotationAdmin(ReadOnlyAdmin):
    """Typed facts about runs and stages (SPEC §6)."""

    list_display = (
        "created_at",
        "key",
        "short_value",
        "scope_display",
        "actor",
        "run_link",
        "stage",
    )
    list_filter = ("key", "scope", "actor_kind")
    search_fields = ("key", "actor_id", "scope_id", "idempotency_key", "run__id")
    list_select_related = ("stage_record",)
    ordering = ("-created_at", "-id")
    date_hierarchy = "created_at"
    fields = (
        "created_at",
        "run_link",
        "stage",
        "attempt",
        "key",
        "value_json",
        "scope_display",
        "actor",
        "actor_version",
        "idempotency_key",
        "payload_json",
    )
    readonly_fields = fields

    @admin.display(description="value")
    def short_value(self, obj: WorkflowAnnotation) -> str:
        return short_json(obj.value)

    @admin.display(description="scope", ordering="scope")
    def scope_display(self, obj: WorkflowAnnotation) -> str:
        return f"{obj.scope}:{obj.scope_id}" if obj.scope_id else obj.scope

    @admin.display(description="actor", ordering="actor_kind")
    def actor(self, obj: WorkflowAnnotation) -> str:
        return ":".join(p for p in (obj.actor_kind, obj.actor_id) if p) or "-"

    @admin.display(description="run", ordering="run_id")
    def run_link(self, obj: WorkflowAnnotation) -> SafeString | str:
        return run_link(obj.run_id)

    @admin.display(description="stage")
    def stage(self, obj: WorkflowAnnotation) -> str:
        return obj.stage_record.stage_id if obj.stage_record is not None else "-"

    @admin.display(description="value")
    def value_json(self, obj: WorkflowAnnotation) -> SafeString | str:
        return pretty_json(obj.value)

    @admin.display(description="payload")
    def payload_json(self, obj: WorkflowAnnotation) -> SafeString | str:
        return pretty_json(obj.payload)


# --- idempotency keys -------------------------------------------------------------------------


@admin.register(IdempotencyKey)
class IdempotencyKeyAdmin(ReadOnlyAdmin):
    """Command idempotency keys and their cached results (K-10..14)."""

    list_display = ("key", "command_type", "state", "created_at")
    list_filter = ("command_type", "state")
    search_fields = ("key",)
    ordering = ("-created_at", "-id")
    fields = ("key", "command_type", "state", "created_at", "result_json")
    readonly_fields = fields

    @admin.display(description="result")
    def result_json(self, obj: IdempotencyKey) -> SafeString | str:
        return pretty_json(obj.result)
