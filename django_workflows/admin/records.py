"""Read-only admins of the tables the kernel writes: jobs, outbox events, logs, annotations and
idempotency keys. The one operator command here, "Replay dead letters", dispatches
``plugin.replayDLQ`` (SPEC §4.11, EV-32).
"""

from __future__ import annotations

import uuid
from typing import Any

from django.contrib import admin, messages
from django.contrib.admin.utils import unquote
from django.core.exceptions import PermissionDenied
from django.db.models import Exists, OuterRef, Q, QuerySet
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseRedirect
from django.urls import URLPattern, path, reverse
from django.utils.html import format_html
from django.utils.safestring import SafeString
from django.utils.text import Truncator
from django.utils.translation import ngettext

from ..kernel import commands as kernel_commands
from ..kernel.commands import ReplayDeadLetters, SkipDeadLetter
from ..kernel.events import EVENT_TYPES
from ..kernel.runtime import get_kernel
from ..models import (
    IdempotencyKey,
    OutboxEvent,
    Status,
    WorkflowAnnotation,
    WorkflowJob,
    WorkflowLog,
    WorkflowSignal,
)
from .display import (
    ReadOnlyAdmin,
    StatusFilter,
    WorkflowFilter,
    badge,
    compact_time,
    fixed_choices_filter,
    pretty_json,
    run_link,
    short_json,
    status_badge,
)
from .operations import NoteForm, has_operation_permission, log_operation, operation_page
from .timeline import event_state, event_summary


def _uuid(text: str) -> uuid.UUID | None:
    try:
        return uuid.UUID(text)
    except ValueError:
        return None


class ExactSearch:
    """Admin search by exact values only - index lookups, never ``LIKE '%...%'``: a term
    matches a row whose ``exact_search_fields`` equal it, whose id equals it (``search_by_id``;
    ASCII digits only: ``"²".isdigit()`` is true but not an int, so it is searched as text),
    or whose ``run_id_field`` is the full run id it spells.
    """

    exact_search_fields: tuple[str, ...] = ()
    search_by_id = False
    run_id_field = "workflow_run_id"

    def get_search_results(
        self, request: HttpRequest, queryset: QuerySet[Any], search_term: str
    ) -> tuple[QuerySet[Any], bool]:
        term = search_term.strip()
        if not term:
            return queryset, False
        match = Q()
        for field in self.exact_search_fields:
            match |= Q(**{field: term})
        if self.search_by_id and term.isascii() and term.isdigit() and len(term) < 19:
            match |= Q(pk=int(term))
        run_id = _uuid(term)
        if run_id is not None:
            match |= Q(**{self.run_id_field: run_id})
        return queryset.filter(match), False


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
class WorkflowJobAdmin(ExactSearch, ReadOnlyAdmin):
    """Queued units of work: one per stage execution, with lease and delivery count."""

    list_display = (
        "id",
        "run",
        "stage",
        "status_badge",
        "deliveries",
        "lease",
        "next_poll",
        "created",
    )
    list_filter = (JobStatusFilter, WorkflowFilter)  # ?stage_id=... works too
    search_fields = ("workflow_id",)  # get_search_results: exact matches only
    search_help_text = "Search by job id, full run id, or exact workflow, stage or worker id."
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

    # A job id, a full run id, or an exact workflow / stage / worker id.
    exact_search_fields = ("workflow_id", "stage_id", "worker_id")
    search_by_id = True

    @admin.display(description="run", ordering="workflow_run_id")
    def run(self, obj: WorkflowJob) -> SafeString | str:
        return run_link(obj.workflow_run_id)

    @admin.display(description="stage", ordering="stage_id")
    def stage(self, obj: WorkflowJob) -> SafeString:
        """The stage id over its workflow id."""
        return format_html('{}<br><span class="dw-muted">{}</span>', obj.stage_id, obj.workflow_id)

    @admin.display(description="lease", ordering="locked_at")
    def lease(self, obj: WorkflowJob) -> SafeString | str:
        """The worker holding the lease and when it was last renewed."""
        if not obj.worker_id:
            return "-"
        return format_html("{}<br>{}", obj.worker_id, compact_time(obj.locked_at))

    @admin.display(description="next poll / retry at", ordering="next_poll_at")
    def next_poll(self, obj: WorkflowJob) -> SafeString | str:
        return compact_time(obj.next_poll_at)

    @admin.display(description="created", ordering="created_at")
    def created(self, obj: WorkflowJob) -> SafeString | str:
        return compact_time(obj.created_at)

    @admin.display(description="status", ordering="status")
    def status_badge(self, obj: WorkflowJob) -> SafeString | str:
        return status_badge(obj.status)

    @admin.display(description="deliveries", ordering="attempt")
    def deliveries(self, obj: WorkflowJob) -> str:
        """Deliveries so far / the delivery limit (``WorkflowJob.attempt``, SM-31)."""
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
class OutboxEventAdmin(ExactSearch, ReadOnlyAdmin):
    """Events in per-run order with their delivery state (SPEC §5.2, Part I item 16)."""

    list_display = (
        "id",
        "run",
        "event",
        "summary",
        "delivery",
        "retries",
        "short_error",
        "occurred",
    )
    list_filter = (fixed_choices_filter("event_type", "event type", EVENT_TYPES), DeliveryFilter)
    search_fields = ("event_type",)  # get_search_results: exact matches only
    search_help_text = "Search by full run id, event id, event type or causation id."
    ordering = ("-id",)
    actions = ("replay_dead_letters",)
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
            "dw_replay_all_url": (
                self._url("replay_all") if self.has_replay_permission(request) else None
            ),
            **(extra_context or {}),
        }
        return super().changelist_view(request, extra_context=context)

    # A full run id, an event id, or an exact event type / causation id.
    exact_search_fields = ("event_type", "causation_id")
    search_by_id = True

    def has_replay_permission(self, request: HttpRequest) -> bool:
        """``replay_outboxevent`` (and view)."""
        return has_operation_permission(request, "replay")

    def has_skip_permission(self, request: HttpRequest) -> bool:
        """``skip_outboxevent`` (and view)."""
        return has_operation_permission(request, "skip")

    def get_urls(self) -> list[URLPattern]:
        opts = self.opts
        name = f"{opts.app_label}_{opts.model_name}"
        return [
            path(
                "replay-all/",
                self.admin_site.admin_view(self.replay_all_view),
                name=f"{name}_replay_all",
            ),
            path(
                "<path:object_id>/replay/",
                self.admin_site.admin_view(self.replay_view),
                name=f"{name}_replay",
            ),
            path(
                "<path:object_id>/skip/",
                self.admin_site.admin_view(self.skip_view),
                name=f"{name}_skip",
            ),
            *super().get_urls(),
        ]

    def _url(self, name: str, *args: Any) -> str:
        opts = self.opts
        return reverse(f"admin:{opts.app_label}_{opts.model_name}_{name}", args=args)

    def changeform_view(
        self,
        request: HttpRequest,
        object_id: str | None = None,
        form_url: str = "",
        extra_context: dict[str, Any] | None = None,
    ) -> HttpResponse:
        """The event page offers Replay / Skip while the event is a dead letter."""
        context = dict(extra_context or {})
        event = OutboxEvent.objects.filter(pk=_int(unquote(object_id or ""))).first()
        ops = []
        if event is not None and event.dlq_at is not None and event.published_at is None:
            if self.has_replay_permission(request):
                ops.append(("Replay", self._url("replay", event.pk), "replay"))
            if self.has_skip_permission(request):
                ops.append(("Skip", self._url("skip", event.pk), "skip"))
        context["dw_ops"] = ops
        return super().changeform_view(request, object_id, form_url, context)

    def _dead_letter_or_404(self, object_id: str) -> OutboxEvent:
        event = OutboxEvent.objects.filter(pk=_int(unquote(object_id))).first()
        if event is None:
            raise Http404(f"No outbox event with id {object_id!r}")
        return event

    def _replay(self, request: HttpRequest, events: list[OutboxEvent], note: str) -> str:
        """Dispatch ``plugin.replayDLQ`` for exactly ``events``; a History record per event
        keeps the retry count and error the replay clears (EV-32)."""
        result = get_kernel().dispatch(
            ReplayDeadLetters(max_events=len(events), event_ids=tuple(e.pk for e in events))
        )
        replayed = OutboxEvent.objects.filter(
            pk__in=[e.pk for e in events], dlq_at__isnull=True, published_at__isnull=True
        ).values_list("pk", flat=True)
        done = set(replayed)
        for event in events:
            if event.pk in done:
                log_operation(
                    request,
                    event,
                    f"Replayed dead letter (plugin.replayDLQ); it had failed "
                    f"{event.retry_count} time(s), last error: {event.last_error or '-'}"
                    + (f". Note: {note}" if note else ""),
                )
        return (
            ngettext(
                "Replayed %d dead-lettered event: the next outbox flush delivers it.",
                "Replayed %d dead-lettered events: the next outbox flush delivers them.",
                result.replayed,
            )
            % result.replayed
        )

    def replay_view(self, request: HttpRequest, object_id: str) -> HttpResponse:
        """Replay one dead letter (confirmation, optional note)."""
        if not self.has_replay_permission(request):
            raise PermissionDenied
        event = self._dead_letter_or_404(object_id)
        back = self._url("change", event.pk)
        if event.dlq_at is None or event.published_at is not None:
            self.message_user(
                request, f"Outbox event {event.pk} is not a dead letter.", messages.WARNING
            )
            return HttpResponseRedirect(back)
        return operation_page(
            self,
            request,
            operation="replay",
            obj=event,
            title="Replay this dead letter?",
            form=NoteForm(request.POST if request.method == "POST" else None),
            perform=lambda data: self._replay(request, [event], data["note"]),
            back_url=back,
            facts=[
                f"{event.event_type} #{event.sequence} of run {event.workflow_run_id} failed "
                f"{event.retry_count} time(s); last error: {event.last_error or '-'}",
                "The next outbox flush delivers it again (retry count starts over); the run's "
                "later events follow in order. The error is kept in History.",
            ],
            submit="Yes, replay",
        )

    def replay_all_view(self, request: HttpRequest) -> HttpResponse:
        """Replay every dead letter (confirmation listing how many, per-run order)."""
        if not self.has_replay_permission(request):
            raise PermissionDenied
        back = self._url("changelist")
        dead = list(_dead_letters().order_by("workflow_run_id", "sequence")[:MAX_REPLAY])
        if not dead:
            self.message_user(request, "There are no dead letters to replay.", messages.INFO)
            return HttpResponseRedirect(back)
        return operation_page(
            self,
            request,
            operation="replay",
            obj=None,
            title=ngettext("Replay %d dead letter?", "Replay %d dead letters?", len(dead))
            % len(dead),
            form=NoteForm(request.POST if request.method == "POST" else None),
            perform=lambda data: self._replay(request, dead, data["note"]),
            back_url=back,
            facts=[
                "Every dead letter is re-armed; the next outbox flush delivers them in per-run "
                "order. Each replay is recorded in the event's History with its last error."
            ],
            objects=[_describe(e) for e in dead[:50]],
            submit="Yes, replay all",
        )

    def skip_view(self, request: HttpRequest, object_id: str) -> HttpResponse:
        """Skip one dead letter for good (``outbox.skipDeadLetter``, a required note)."""
        if not self.has_skip_permission(request):
            raise PermissionDenied
        event = self._dead_letter_or_404(object_id)
        back = self._url("change", event.pk)

        def perform(data: dict[str, Any]) -> str:
            result = get_kernel().dispatch(SkipDeadLetter(event_id=event.pk, note=data["note"]))
            log_operation(
                request,
                event,
                f"Skipped dead letter (outbox.skipDeadLetter). Note: {data['note']}",
            )
            return (
                f"Skipped #{result.event_id} ({result.event_type} #{result.sequence} of run "
                f"{result.workflow_run_id}); {result.unblocked} later event(s) of the run will "
                "be delivered."
            )

        return operation_page(
            self,
            request,
            operation="skip",
            obj=event,
            title="Skip this dead letter?",
            form=NoteForm(request.POST if request.method == "POST" else None, required=True),
            perform=perform,
            back_url=back,
            facts=[
                _describe(event),
                "It is never delivered; the row stays for audit with your note, and the run's "
                "later events flow again.",
            ],
            submit="Yes, skip it",
        )

    @admin.display(description="run", ordering="workflow_run_id")
    def run(self, obj: OutboxEvent) -> SafeString | str:
        return run_link(obj.workflow_run_id)

    @admin.display(description="event #sequence · stage", ordering="event_type")
    def event(self, obj: OutboxEvent) -> SafeString:
        """``stage:completed #7`` over the stage id."""
        return format_html(
            '<span class="dw-nowrap">{} <span class="dw-muted">#{}</span></span><br>'
            '<span class="dw-muted">{}</span>',
            obj.event_type,
            obj.sequence,
            self.stage(obj),
        )

    @admin.display(description="retries", ordering="retry_count")
    def retries(self, obj: OutboxEvent) -> int:
        """Failed deliveries so far (``retry_count``)."""
        return obj.retry_count

    @admin.display(description="occurred", ordering="occurred_at")
    def occurred(self, obj: OutboxEvent) -> SafeString | str:
        return compact_time(obj.occurred_at)

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

    @admin.action(description="Replay selected dead letters…", permissions=["replay"])
    def replay_dead_letters(
        self, request: HttpRequest, queryset: QuerySet[OutboxEvent]
    ) -> HttpResponse | None:
        """Replay the selected dead letters only (a confirmation page first; rows that are not
        dead letters are named and left alone)."""
        selected = list(queryset.order_by("workflow_run_id", "sequence")[: MAX_REPLAY + 1])
        dead = [e for e in selected if e.dlq_at is not None and e.published_at is None]
        if not dead:
            self.message_user(
                request, "None of the selected events is a dead letter.", messages.INFO
            )
            return None
        others = len(selected) - len(dead)
        hidden = [
            ("action", "replay_dead_letters"),
            *(("_selected_action", str(e.pk)) for e in selected),
        ]
        return operation_page(
            self,
            request,
            operation="replay",
            obj=None,
            title=ngettext("Replay %d dead letter?", "Replay %d dead letters?", len(dead))
            % len(dead),
            form=NoteForm(request.POST if request.POST.get("confirm") == "yes" else None),
            perform=lambda data: self._replay(request, dead, data["note"]),
            back_url=self._url("changelist"),
            facts=[
                "The selected dead letters are re-armed; the next flush delivers them.",
                *(
                    [f"{others} selected event(s) are not dead letters and are left alone."]
                    if others
                    else []
                ),
            ],
            objects=[_describe(e) for e in dead[:50]],
            submit="Yes, replay",
            hidden=hidden,
        )


#: The command types that take idempotency keys (the key list's filter choices).
COMMAND_TYPES: tuple[str, ...] = tuple(
    sorted(
        {
            cls.type
            for cls in vars(kernel_commands).values()
            if isinstance(cls, type) and isinstance(getattr(cls, "type", None), str)
        }
    )
)

#: Dead letters one replay page takes at once.
MAX_REPLAY = 1000


def _int(text: str) -> int:
    return int(text) if text.isascii() and text.isdigit() and len(text) < 19 else 0


def _describe(event: OutboxEvent) -> str:
    return (
        f"#{event.pk} {event.event_type} seq {event.sequence} of run {event.workflow_run_id}; "
        f"failed {event.retry_count}x; last error: {event.last_error or '-'}"
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
class WorkflowAnnotationAdmin(ExactSearch, ReadOnlyAdmin):
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
    # ?key=..., ?actor_kind=... and other scopes work too (no DISTINCT sidebar)
    list_filter = (fixed_choices_filter("scope", "scope", ("run", "stage")),)
    search_fields = ("key",)  # get_search_results: exact matches only
    search_help_text = "Search by exact key, actor id, idempotency key or full run id."
    list_select_related = ("stage_record",)
    ordering = ("-created_at", "-id")
    fields = (
        "created_at",
        "run_link",
        "stage",
        "generation",
        "key",
        "value_json",
        "scope_display",
        "actor",
        "actor_version",
        "idempotency_key",
        "payload_json",
    )
    readonly_fields = fields

    # An exact key, actor id, scope id or idempotency key, or a full run id.
    exact_search_fields = ("key", "actor_id", "idempotency_key", "scope_id")
    run_id_field = "run_id"

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


# --- signals ----------------------------------------------------------------------------------


@admin.register(WorkflowSignal)
class WorkflowSignalAdmin(ExactSearch, ReadOnlyAdmin):
    """Signals sent to runs (``send_signal``; docs/signals.md), pending and consumed."""

    list_display = (
        "created_at",
        "name",
        "short_payload",
        "state",
        "actor",
        "run_link",
        "consumed_stage_id",
    )
    search_fields = ("name",)  # get_search_results: exact matches only
    search_help_text = "Search by exact name, actor, idempotency key or full run id."
    ordering = ("-created_at", "-id")
    fields = (
        "created_at",
        "run_link",
        "name",
        "payload_json",
        "idempotency_key",
        "actor",
        "consumed_at",
        "consumed_stage_id",
        "consumed_generation",
    )
    readonly_fields = fields
    exact_search_fields = ("name", "actor", "idempotency_key")
    run_id_field = "run_id"

    @admin.display(description="payload")
    def short_payload(self, obj: WorkflowSignal) -> str:
        return short_json(obj.payload)

    @admin.display(description="state", ordering="consumed_at")
    def state(self, obj: WorkflowSignal) -> str:
        return "consumed" if obj.consumed_at is not None else "pending"

    @admin.display(description="run", ordering="run_id")
    def run_link(self, obj: WorkflowSignal) -> SafeString | str:
        return run_link(obj.run_id)

    @admin.display(description="payload")
    def payload_json(self, obj: WorkflowSignal) -> SafeString | str:
        return pretty_json(obj.payload)


# --- idempotency keys -------------------------------------------------------------------------


@admin.register(IdempotencyKey)
class IdempotencyKeyAdmin(ReadOnlyAdmin):
    """Command idempotency keys and their cached results (K-10..14)."""

    list_display = ("key", "command_type", "state", "created_at")
    list_filter = (fixed_choices_filter("command_type", "command type", COMMAND_TYPES), "state")
    search_fields = ("key",)
    ordering = ("-created_at", "-id")
    fields = ("key", "command_type", "state", "created_at", "result_json")
    readonly_fields = fields

    @admin.display(description="result")
    def result_json(self, obj: IdempotencyKey) -> SafeString | str:
        return pretty_json(obj.result)
