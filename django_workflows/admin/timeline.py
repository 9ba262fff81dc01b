"""The data of a run's timeline: outbox events, annotations and logs merged in time order.

Three queries, whatever the size of the run: each source is read newest first up to ``limit``
rows (``page`` 2, 3, ... reads the next older rows), then the three lists are merged oldest
first. Entries at the same instant keep a stable
order: events (by sequence), then logs, then annotations (each by id).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any

from django.db.models import QuerySet
from django.utils.safestring import SafeString

from ..models import OutboxEvent, WorkflowAnnotation, WorkflowLog, WorkflowRun
from .display import badge, bounded_json, cut_text, format_duration_ms, short_json

#: Rows read per source for one page; older rows are reachable through the filtered lists.
DEFAULT_LIMIT = 500

_RANK = {"event": 0, "log": 1, "annotation": 2}


@dataclass(frozen=True)
class TimelineEntry:
    """One line of the timeline.

    Attributes:
        at: when it happened (event ``occurred_at``, log/annotation ``created_at``).
        kind: ``event``, ``log`` or ``annotation``.
        label: the event type, log level or annotation key.
        stage_id: the stage it concerns, when it concerns one.
        summary: one human line (error, message, value, ...).
        detail: JSON shown on demand (event payload, log metadata, annotation payload).
        state: event delivery state (``published``, ``pending``, ``retrying``,
            ``dead-lettered``, ``blocked``) or log level; ``None`` for annotations.
        order: the tie-breaker within ``kind`` (event sequence, row id).
        offset: the time since the run was created, formatted.
    """

    at: datetime
    kind: str
    label: str
    stage_id: str | None
    summary: str
    detail: Any = None
    state: str | None = None
    order: int = 0
    offset: str = ""

    @property
    def kind_badge(self) -> SafeString:
        return badge(self.kind)

    @property
    def state_badge(self) -> SafeString | str:
        return badge(self.state) if self.state else ""

    @property
    def detail_json(self) -> str:
        """The detail as indented JSON, cut to ``MAX_JSON_CHARS`` characters with a note."""
        return bounded_json(self.detail)

    @property
    def sort_key(self) -> tuple[datetime, int, int]:
        return (self.at, _RANK[self.kind], self.order)


@dataclass
class Timeline:
    """The merged entries and, per source, whether older rows were left out."""

    entries: list[TimelineEntry] = field(default_factory=list)
    truncated: list[str] = field(default_factory=list)
    limit: int = DEFAULT_LIMIT
    page: int = 1

    @property
    def has_older(self) -> bool:
        return bool(self.truncated)


def event_state(event: OutboxEvent, run_blocked: bool) -> str:
    """The delivery state of an outbox row (SPEC §5.2, Part I item 16).

    A run with an unpublished dead letter is skipped whole by ``outbox.flush``: its other
    unpublished rows are ``blocked`` until the dead letter is replayed or skipped by an
    operator (``skipped``: never delivered, kept for audit).
    """
    if getattr(event, "skipped_at", None) is not None:
        return "skipped"
    if event.published_at is not None:
        return "published"
    if event.dlq_at is not None:
        return "dead-lettered"
    if run_blocked:
        return "blocked"
    if event.retry_count:
        return "retrying"
    return "pending"


def event_summary(payload: Any) -> str:
    """One line from an event payload: its error, reason, progress or annotation key."""
    if not isinstance(payload, dict):
        return ""
    for key in ("error", "reason"):
        if payload.get(key):
            return str(payload[key])
    if "progress" in payload:
        message = payload.get("message") or ""
        try:
            percent = f"{float(payload['progress']):.0f}%"
        except (TypeError, ValueError):
            percent = str(payload["progress"])
        return f"{percent} {message}".strip()
    if payload.get("next_poll_at"):
        return f"next poll at {payload['next_poll_at']}"
    if payload.get("key"):
        return f"{payload['key']}"
    return ""


def _latest(
    qs: QuerySet[Any], order: tuple[str, ...], limit: int, offset: int = 0
) -> tuple[list[Any], bool]:
    rows = list(qs.order_by(*(f"-{f}" for f in order))[offset : offset + limit + 1])
    truncated = len(rows) > limit
    return list(reversed(rows[:limit])), truncated


def build_timeline(run: WorkflowRun, limit: int = DEFAULT_LIMIT, page: int = 1) -> Timeline:
    """The timeline of ``run``: page ``page`` (1 = newest) of at most ``limit`` rows of each
    source. ``annotation:created`` events are left out: the annotation rows they announce are
    shown themselves (once each)."""
    timeline = Timeline(limit=limit, page=page)
    offset = (max(1, page) - 1) * limit
    events, cut = _latest(
        OutboxEvent.objects.filter(workflow_run_id=run.pk).exclude(event_type="annotation:created"),
        ("sequence",),
        limit,
        offset,
    )
    if cut:
        timeline.truncated.append("events")
    blocked = any(e.dlq_at is not None and e.published_at is None for e in events)
    if not blocked and cut:
        blocked = OutboxEvent.objects.filter(
            workflow_run_id=run.pk, dlq_at__isnull=False, published_at__isnull=True
        ).exists()
    for e in events:
        payload = e.payload if isinstance(e.payload, dict) else {}
        timeline.entries.append(
            TimelineEntry(
                at=e.occurred_at,
                kind="event",
                label=e.event_type,
                stage_id=payload.get("stage_id"),
                summary=cut_text(event_summary(payload)),
                detail=e.payload,
                state=event_state(e, blocked),
                order=e.sequence,
            )
        )
    logs, cut = _latest(
        WorkflowLog.objects.filter(run=run).select_related("stage"),
        ("created_at", "id"),
        limit,
        offset,
    )
    if cut:
        timeline.truncated.append("logs")
    for log in logs:
        timeline.entries.append(
            TimelineEntry(
                at=log.created_at,
                kind="log",
                label=log.level,
                stage_id=log.stage.stage_id if log.stage is not None else None,
                summary=cut_text(log.message),
                detail=log.metadata,
                state=log.level,
                order=log.pk,
            )
        )
    annotations, cut = _latest(
        WorkflowAnnotation.objects.filter(run=run).select_related("stage_record"),
        ("created_at", "id"),
        limit,
        offset,
    )
    if cut:
        timeline.truncated.append("annotations")
    for a in annotations:
        actor = ":".join(p for p in (a.actor_kind, a.actor_id) if p)
        summary = short_json(a.value, limit=120)
        stage_id = a.stage_record.stage_id if a.stage_record is not None else None
        if stage_id is None and a.scope == "stage":
            stage_id = a.scope_id
        if actor:
            summary = f"{summary}  (by {actor})"
        timeline.entries.append(
            TimelineEntry(
                at=a.created_at,
                kind="annotation",
                label=a.key,
                stage_id=stage_id,
                summary=summary,
                detail=a.payload,
                order=a.pk,
            )
        )
    timeline.entries.sort(key=lambda entry: entry.sort_key)
    timeline.entries = [
        replace(entry, offset=format_duration_ms(_ms_between(run.created_at, entry.at)))
        for entry in timeline.entries
    ]
    return timeline


def _ms_between(start: datetime, end: datetime) -> float:
    return (end - start).total_seconds() * 1000
