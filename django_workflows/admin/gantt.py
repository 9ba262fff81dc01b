"""The Gantt chart of a run, drawn server-side as HTML/CSS (no front-end build step).

Built from the run's stage events in the outbox (one bounded query on the
``(workflow_run_id, sequence)`` index): each ``stage:started`` opens a bar for that stage, the
stage's next ``stage:completed`` / ``stage:failed`` / ``stage:suspended`` closes it; a
suspension is a shaded segment up to the stage's next event (its resume or completion). A
``workflow:started`` event with a rerun marker starts the next generation, so a rerun's stages get
their own rows; a second ``stage:started`` of a stage in the same generation is its next
delivery (a retry). Bars still open end at ``now``. Times are shown to the millisecond.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from django.utils import timezone
from django.utils.dateparse import parse_datetime

from ..models import OutboxEvent, WorkflowRun, WorkflowStage
from .display import format_duration_ms

#: Stage events read for one chart (the oldest first); longer runs show a note.
MAX_EVENTS = 2000

_TYPES = (
    "workflow:started",
    "stage:started",
    "stage:completed",
    "stage:failed",
    "stage:suspended",
    "stage:skipped",
)


@dataclass
class Segment:
    """A part of a bar: ``kind`` is ``running``, ``suspended``, ``completed`` (a finished running
    part), ``failed``, or ``skipped`` (a SKIPPED stage's marker, no duration);
    ``left``/``width`` are percentages of the chart's time axis."""

    kind: str
    start: datetime
    end: datetime
    open: bool = False
    left: float = 0.0
    width: float = 0.0

    @property
    def duration_ms(self) -> int:
        return int((self.end - self.start).total_seconds() * 1000)

    @property
    def title(self) -> str:
        state = f"{self.kind} (still open)" if self.open else self.kind
        return f"{state}: {_ms_text(self.start)} → {_ms_text(self.end)} ({self.duration_ms:,} ms)"


@dataclass
class Row:
    """One bar: one stage, in one generation (rerun), in one delivery."""

    stage_id: str
    execution_group: int
    generation: int
    delivery: int
    segments: list[Segment] = field(default_factory=list)
    outcome: str = "running"

    @property
    def label(self) -> str:
        parts = [self.stage_id]
        if self.generation:
            parts.append(f"gen {self.generation}")
        if self.delivery > 1:
            parts.append(f"delivery {self.delivery}")
        return " · ".join(parts)

    @property
    def start(self) -> datetime:
        return self.segments[0].start

    @property
    def end(self) -> datetime:
        return self.segments[-1].end


@dataclass
class Gantt:
    """The chart: rows ordered by generation, execution group, stage, delivery; ``ticks`` are
    ``(left %, label)`` pairs of the time axis; ``truncated`` when ``MAX_EVENTS`` was reached."""

    rows: list[Row]
    start: datetime | None
    end: datetime | None
    ticks: list[tuple[float, str]]
    truncated: bool = False

    @property
    def span_ms(self) -> int:
        if self.start is None or self.end is None:
            return 0
        return int((self.end - self.start).total_seconds() * 1000)


def _ms_text(at: datetime) -> str:
    return timezone.localtime(at).strftime("%H:%M:%S.%f")[:-3]


def _at(event: OutboxEvent) -> datetime:
    payload = event.payload if isinstance(event.payload, dict) else {}
    parsed = parse_datetime(str(payload.get("timestamp") or "")) if payload else None
    return parsed or event.occurred_at


def build_gantt(run: WorkflowRun, now: datetime | None = None) -> Gantt:
    """The Gantt chart of ``run`` (one query; see the module docstring)."""
    now = now or timezone.now()
    events = list(
        OutboxEvent.objects.filter(workflow_run_id=run.pk, event_type__in=_TYPES)
        .only("sequence", "event_type", "payload", "occurred_at")
        .order_by("sequence")[: MAX_EVENTS + 1]
    )
    truncated = len(events) > MAX_EVENTS
    events = events[:MAX_EVENTS]
    groups = dict(WorkflowStage.objects.filter(run=run).values_list("stage_id", "execution_group"))
    generation = 0
    rows: list[Row] = []
    open_rows: dict[str, Row] = {}
    deliveries: dict[tuple[str, int], int] = {}
    for event in events:
        payload = event.payload if isinstance(event.payload, dict) else {}
        at = _at(event)
        kind = event.event_type
        if kind == "workflow:started":
            marker = payload.get("rerun")
            if isinstance(marker, dict):
                for row in open_rows.values():
                    _close(row, at, "cancelled")
                open_rows.clear()
                generation = int(marker.get("generation") or generation + 1)
            continue
        stage_id = str(payload.get("stage_id") or "")
        if not stage_id:
            continue
        row = open_rows.get(stage_id)
        if kind == "stage:skipped":  # issue 18: a marker, no time spent
            row = Row(stage_id, groups.get(stage_id, 0), generation, 1, outcome="skipped")
            row.segments.append(Segment("skipped", at, at))
            rows.append(row)
            continue
        if kind == "stage:started":
            if row is not None:  # a redelivery: the previous delivery ended unseen
                _close(row, at, "retried")
            number = deliveries.get((stage_id, generation), 0) + 1
            deliveries[(stage_id, generation)] = number
            row = Row(stage_id, groups.get(stage_id, 0), generation, number)
            row.segments.append(Segment("running", at, at, open=True))
            rows.append(row)
            open_rows[stage_id] = row
            continue
        if row is None:
            continue
        if kind == "stage:suspended":
            _close(row, at, "completed")  # its execute() finished; now it waits
            row.segments.append(Segment("suspended", at, at, open=True))
            row.outcome = "suspended"
        elif kind in ("stage:completed", "stage:failed"):
            row.outcome = "running"
            outcome = "completed" if kind == "stage:completed" else "failed"
            _close(row, at, outcome)
            open_rows.pop(stage_id, None)
    for row in open_rows.values():
        last = row.segments[-1]
        last.end = max(now, last.start)
    if not rows:
        return Gantt([], None, None, [], truncated)
    start = min(r.start for r in rows)
    end = max(r.end for r in rows)
    span = max((end - start).total_seconds(), 0.001)
    for row in rows:
        for seg in row.segments:
            seg.left = round((seg.start - start).total_seconds() / span * 100, 3)
            seg.width = round(max((seg.end - seg.start).total_seconds() / span * 100, 0.3), 3)
    rows.sort(key=lambda r: (r.generation, r.execution_group, r.start, r.stage_id, r.delivery))
    ticks = [(round(i * 20.0, 1), f"+{format_duration_ms(span * 1000 * i / 5)}") for i in range(6)]
    return Gantt(rows, start, end, ticks, truncated)


def _close(row: Row, at: datetime, outcome: str | None) -> None:
    last = row.segments[-1]
    if last.open:
        last.end = max(at, last.start)
        last.open = False
        if last.kind == "running" and outcome in ("completed", "failed"):
            last.kind = outcome
    if outcome is not None:
        row.outcome = outcome


__all__: list[Any] = ["Gantt", "Row", "Segment", "build_gantt"]
