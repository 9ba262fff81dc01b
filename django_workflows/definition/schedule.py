"""Schedules: start a workflow's runs at cron times or fixed intervals (issue 12 item 1).

Pure Python (no models): :func:`define_schedule` builds and validates a
:class:`ScheduleDefinition`; :func:`~django_workflows.register` adds it to the registry next to
the workflows; the maintenance tick (:mod:`django_workflows.kernel.schedules`) syncs the
definitions to ``WorkflowSchedule`` rows and fires them.

Time rules (the contract the tests check):

* **Cron** (5 fields: minute hour day-of-month month day-of-week, or ``@hourly``, ``@daily``,
  ``@weekly``, ``@monthly``, ``@yearly``) is matched against the wall clock of the schedule's
  zone (``tz``, an IANA name). Each wall-clock time fires once. A time that does not exist
  (spring forward: 02:30 in Europe/Berlin on the last Sunday of March) fires at the next valid
  instant (03:00 local, the end of the gap); several non-existent times collapse into that one
  firing. A repeated wall-clock time (fall back) fires once, at its first occurrence, unless
  ``repeated_times="both"``.
* **Cron days** follow cronie and Vixie cron: if either day field starts with ``*`` (``*``,
  ``*/2``) a day must match both; only two restricted fields (``13`` and ``fri``) match
  either (croniter ORs ``*/n``; this engine does not).
* **Intervals** (``every=`` seconds or a ``timedelta``) are elapsed time: ``anchor + k * every``
  in UTC arithmetic, whatever the zone's DST does.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any, Literal
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from .stage import WorkflowDefinitionError

if TYPE_CHECKING:
    from .workflow import Workflow


class ScheduleDefinitionError(WorkflowDefinitionError):
    """A schedule definition is malformed. ``field`` names the offending argument (``cron``,
    ``tz``, ``input``, ...); the message starts with it.
    """

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        super().__init__(f"{field}: {message}")


#: What happens to a firing while the schedule's previous run is still PENDING or RUNNING.
OVERLAP_POLICIES = ("skip", "buffer_one", "allow_all", "cancel_previous")
#: Which of the times missed during downtime fire when the ticker is back.
CATCHUP_POLICIES = ("skip", "run_once", "run_all")
OverlapPolicy = Literal["skip", "buffer_one", "allow_all", "cancel_previous"]
CatchupPolicy = Literal["skip", "run_once", "run_all"]
#: A firing found at most this late counts as on time (the ``skip`` catch-up policy fires it).
ON_TIME_SECONDS = 60.0
#: The furthest a cron search looks ahead: a 29 February schedule needs up to 8 years (2096 ->
#: 2104), 29 February on one weekday (``0 0 29 2 */7``: both day fields must match) up to 40.
MAX_SEARCH_YEARS = 41
#: Years a backfill range (and the API's date-times) may name, inclusive: far enough from
#: ``datetime.min``/``max`` that a cron search or an interval step cannot overflow.
MIN_YEAR, MAX_YEAR = 1900, 9000
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,179}$")

_ALIASES = {
    "@yearly": "0 0 1 1 *",
    "@annually": "0 0 1 1 *",
    "@monthly": "0 0 1 * *",
    "@weekly": "0 0 * * 0",
    "@daily": "0 0 * * *",
    "@midnight": "0 0 * * *",
    "@hourly": "0 * * * *",
}
_MONTHS = {m: i for i, m in enumerate("jan feb mar apr may jun jul aug sep oct nov dec".split(), 1)}
_DAYS = {d: i for i, d in enumerate("sun mon tue wed thu fri sat".split())}
_FIELDS = (
    ("minute", 0, 59, {}),
    ("hour", 0, 23, {}),
    ("day of month", 1, 31, {}),
    ("month", 1, 12, _MONTHS),
    ("day of week", 0, 7, _DAYS),
)


@dataclass(frozen=True)
class CronExpression:
    """A parsed 5-field cron expression, with cronie's (and Vixie cron's) day rule: when
    either the day-of-month or the day-of-week field starts with ``*`` (``*``, ``*/2``), a day
    must match both fields; only when both are restricted without a leading ``*``
    (``1,15`` and ``mon``) does a day match either (``days_either``). Day of week 0 and 7
    are Sunday; names (``jan``-``dec``, ``sun``-``sat``) in any case.

    Raises:
        ScheduleDefinitionError: (field ``cron``) wrong field count, an unknown name, a value
            out of range (the message names the cron field), or an expression that never fires.
    """

    text: str
    minutes: frozenset[int]
    hours: frozenset[int]
    days: frozenset[int]
    months: frozenset[int]
    weekdays: frozenset[int]
    days_either: bool

    @classmethod
    def parse(cls, text: str) -> CronExpression:
        if not isinstance(text, str):
            raise ScheduleDefinitionError("cron", f"expected a string, got {type(text).__name__}")
        expr = _ALIASES.get(text.strip().lower(), text.strip())
        if expr.startswith("@"):
            raise ScheduleDefinitionError(
                "cron",
                f"{text!r} is not supported (a schedule fires by the clock, not at start-up); "
                f"the aliases are {', '.join(_ALIASES)}",
            )
        parts = expr.split()
        if len(parts) != 5:
            raise ScheduleDefinitionError(
                "cron",
                f"{text!r} has {len(parts)} fields; expected 5 (minute hour day-of-month month "
                "day-of-week) or an alias such as @hourly",
            )
        sets = [_parse_field(part, *spec) for part, spec in zip(parts, _FIELDS, strict=True)]
        weekdays = frozenset(0 if d == 7 else d for d in sets[4])
        cron = cls(
            text=text.strip(),
            minutes=sets[0],
            hours=sets[1],
            days=sets[2],
            months=sets[3],
            weekdays=weekdays,
            days_either=not (parts[2].startswith("*") or parts[4].startswith("*")),
        )
        # Every date falls on every weekday in some year: with both day fields required, the
        # expression fires iff one of its dates exists (2024 is a leap year); with either,
        # the day-of-week field alone makes it fire.
        if not cron.days_either and not any(
            _date_exists(2024, m, d) for m in cron.months for d in cron.days
        ):
            raise ScheduleDefinitionError("cron", f"{text!r} never fires (no such day)")
        return cron

    def _day_matches(self, year: int, month: int, day: int) -> bool:
        try:
            weekday = (datetime(year, month, day).isoweekday()) % 7
        except ValueError:
            return False
        if month not in self.months:
            return False
        if self.days_either:
            return day in self.days or weekday in self.weekdays
        return day in self.days and weekday in self.weekdays

    def wall_times(self, start: datetime) -> Iterator[datetime]:
        """Matching naive wall-clock times at or after naive ``start``, in order."""
        day = datetime(start.year, start.month, start.day)
        limit = day + timedelta(days=366 * MAX_SEARCH_YEARS)
        hours, minutes = sorted(self.hours), sorted(self.minutes)
        while day < limit:
            if self._day_matches(day.year, day.month, day.day):
                for h in hours:
                    for m in minutes:
                        when = day.replace(hour=h, minute=m)
                        if when >= start:
                            yield when
            day += timedelta(days=1)


def _date_exists(year: int, month: int, day: int) -> bool:
    try:
        datetime(year, month, day)
    except ValueError:
        return False
    return True


def _parse_field(
    text: str, name: str, low: int, high: int, names: dict[str, int]
) -> frozenset[int]:
    def value(token: str) -> int:
        token = token.strip().lower()
        if token in names:
            return names[token]
        if not token.isdigit():
            raise ScheduleDefinitionError("cron", f"{name} field: {token!r} is not a number")
        number = int(token)
        if not low <= number <= high:
            raise ScheduleDefinitionError(
                "cron", f"{name} field: {number} is out of range {low}-{high}"
            )
        return number

    out: set[int] = set()
    for item in text.split(","):
        step = 1
        if "/" in item:
            item, step_text = item.split("/", 1)
            if not step_text.isdigit() or int(step_text) == 0:
                raise ScheduleDefinitionError(
                    "cron", f"{name} field: step {step_text!r} must be a positive number"
                )
            step = int(step_text)
        if item == "*":
            first, last = low, high
        elif "-" in item:
            a, b = item.split("-", 1)
            first, last = value(a), value(b)
            if first > last:
                raise ScheduleDefinitionError(
                    "cron", f"{name} field: range {item!r} runs backwards"
                )
        else:
            first = value(item)
            last = high if step > 1 else first
        out.update(range(first, last + 1, step))
    if not out:
        raise ScheduleDefinitionError("cron", f"{name} field {text!r} matches nothing")
    return frozenset(out)


def _resolve(wall: datetime, zone: ZoneInfo, both: bool) -> list[datetime]:
    """The UTC instants at which naive wall time ``wall`` of ``zone`` fires.

    Normal time: one. Non-existent (gap): the end of the gap. Repeated (fold): the first
    occurrence, or both when ``both``.
    """
    first = wall.replace(tzinfo=zone, fold=0).astimezone(UTC)
    second = wall.replace(tzinfo=zone, fold=1).astimezone(UTC)
    if first.astimezone(zone).replace(tzinfo=None) != wall:
        # A gap: fold=0 reads the time with the offset before the change (later instant),
        # fold=1 with the offset after. The gap ends at the first instant in between whose
        # wall time is past ``wall``; offsets change on whole minutes.
        low, high = min(first, second), max(first, second)
        while high - low > timedelta(minutes=1):
            mid = low + (high - low) / 2
            mid = mid.replace(second=0, microsecond=0)
            if mid <= low:
                break
            if mid.astimezone(zone).replace(tzinfo=None) > wall:
                high = mid
            else:
                low = mid
        return [high]
    if first != second:
        return [first, second] if both else [first]
    return [first]


@dataclass(frozen=True)
class ScheduleDefinition:
    """A built schedule: which workflow to start when, with what input, under which policies.

    Build one with :func:`define_schedule`; see there for the fields.
    """

    name: str
    workflow_id: str
    cron: CronExpression | None
    every: timedelta | None
    tz: str
    input: dict[str, Any] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)
    priority: int = 5
    overlap: OverlapPolicy = "skip"
    catchup: CatchupPolicy = "run_once"
    catchup_window: timedelta = timedelta(days=1)
    jitter: timedelta = timedelta(0)
    repeated_times: Literal["once", "both"] = "once"
    anchor: datetime = datetime(2000, 1, 1, tzinfo=UTC)
    paused: bool = False
    description: str = ""

    @property
    def zone(self) -> ZoneInfo:
        return ZoneInfo(self.tz)

    @property
    def spec_text(self) -> str:
        """``"cron 0 * * * *"`` or ``"every 900s"``."""
        if self.cron is not None:
            return f"cron {self.cron.text}"
        assert self.every is not None
        return f"every {_seconds_text(self.every)}s"

    def to_row(self) -> dict[str, Any]:
        """The JSON-able fields a ``WorkflowSchedule`` row stores."""
        return {
            "workflow_id": self.workflow_id,
            "cron": self.cron.text if self.cron else "",
            "every_seconds": self.every.total_seconds() if self.every else None,
            "tz": self.tz,
            "input": self.input,
            "config": self.config,
            "priority": self.priority,
            "overlap": self.overlap,
            "catchup": self.catchup,
            "catchup_window_seconds": self.catchup_window.total_seconds(),
            "jitter_seconds": self.jitter.total_seconds(),
            "repeated_times": self.repeated_times,
            "anchor": self.anchor,
            "description": self.description,
        }

    def next_after(self, after: datetime) -> datetime | None:
        """The first scheduled time strictly after ``after`` (aware), in UTC; ``None`` if the
        cron expression has no time within :data:`MAX_SEARCH_YEARS`.
        """
        after = after.astimezone(UTC)
        if self.every is not None:
            step = self.every
            elapsed = after - self.anchor
            count = elapsed // step + 1 if elapsed >= timedelta(0) else 0
            return self.anchor + step * count
        assert self.cron is not None
        zone = self.zone
        both = self.repeated_times == "both"
        # Start three hours of wall clock early: after a fall back the same wall time maps to
        # a later instant, and a gap's times resolve forward.
        local = after.astimezone(zone).replace(tzinfo=None, second=0, microsecond=0)
        best: datetime | None = None
        best_wall: datetime | None = None
        for wall in self.cron.wall_times(local - timedelta(hours=3)):
            if best_wall is not None and wall > best_wall + timedelta(hours=3):
                break
            for instant in _resolve(wall, zone, both):
                if instant > after and (best is None or instant < best):
                    best, best_wall = instant, best_wall or wall
        return best

    def times_between(self, start: datetime, end: datetime, limit: int = 10_000) -> list[datetime]:
        """Scheduled times ``t`` with ``start <= t <= end`` in order, at most ``limit``."""
        out: list[datetime] = []
        current = self.next_after(start - timedelta(microseconds=1))
        while current is not None and current <= end and len(out) < limit:
            out.append(current)
            current = self.next_after(current)
        return out


def jitter_for(schedule_id: str, scheduled_at: datetime, jitter_seconds: float) -> timedelta:
    """The deterministic delay of one firing: a hash of ``schedule_id`` and the scheduled time
    mapped to ``[0, jitter_seconds)``, so every process and every retried tick agrees.
    """
    if jitter_seconds <= 0:
        return timedelta(0)
    digest = hashlib.sha256(f"{schedule_id}|{scheduled_at.isoformat()}".encode()).digest()
    fraction = int.from_bytes(digest[:8], "big") / 2**64
    return timedelta(seconds=round(fraction * jitter_seconds, 3))


def _seconds_text(value: timedelta) -> str:
    seconds = value.total_seconds()
    return str(int(seconds)) if seconds == int(seconds) else str(seconds)


#: The shortest ``every=`` interval: the ticker looks for due schedules about once a second.
MIN_EVERY_SECONDS = 1.0
#: The longest ``every=``, ``jitter`` and ``catchup_window`` (seconds): about 100 years.
MAX_DURATION_SECONDS = 100 * 366 * 86400.0


def _duration(field_name: str, value: Any, *, allow_zero: bool) -> timedelta:
    if isinstance(value, bool) or not isinstance(value, int | float | timedelta):
        raise ScheduleDefinitionError(
            field_name, f"expected seconds (a number) or a timedelta, got {value!r}"
        )
    if not isinstance(value, timedelta) and not math.isfinite(value):
        raise ScheduleDefinitionError(
            field_name, f"expected a finite number of seconds, got {value!r}"
        )
    if isinstance(value, timedelta) or abs(value) <= MAX_DURATION_SECONDS:
        result = value if isinstance(value, timedelta) else timedelta(seconds=value)
    else:
        result = timedelta.min if value < 0 else timedelta.max
    if result > timedelta(seconds=MAX_DURATION_SECONDS):
        raise ScheduleDefinitionError(
            field_name,
            f"at most {int(MAX_DURATION_SECONDS)} seconds (about 100 years), got {value!r}",
        )
    if result < timedelta(0) or (not allow_zero and result == timedelta(0)):
        raise ScheduleDefinitionError(
            field_name, f"must be {'zero or ' if allow_zero else ''}positive, got {value!r}"
        )
    return result


def validate_zone(tz: Any) -> str:
    """``tz`` if it names an IANA time zone. Raises :class:`ScheduleDefinitionError` (``tz``)."""
    if not isinstance(tz, str) or not tz:
        raise ScheduleDefinitionError("tz", f"expected an IANA time zone name, got {tz!r}")
    try:
        ZoneInfo(tz)
    except (ZoneInfoNotFoundError, ValueError):
        raise ScheduleDefinitionError(
            "tz", f"unknown time zone {tz!r} (expected an IANA name such as 'Europe/Berlin')"
        ) from None
    return tz


def check_against_workflow(schedule: ScheduleDefinition, workflow: Workflow) -> None:
    """Validate the schedule's ``input`` and ``config`` against ``workflow`` (the checks of
    ``run.create``, so every firing's run can be created).

    Raises:
        ScheduleDefinitionError: field ``input`` or ``config``.
    """
    error = workflow.input_errors(schedule.input)
    if error:
        raise ScheduleDefinitionError(
            "input", f"invalid input for workflow {workflow.id!r}: {error}"
        )
    unknown = sorted(set(schedule.config) - set(workflow.stage_ids))
    if unknown:
        raise ScheduleDefinitionError(
            "config",
            f"unknown stage ids {', '.join(unknown)}; valid stage ids of {workflow.id!r}: "
            f"{', '.join(workflow.stage_ids)}",
        )
    errors = workflow.validate_config(workflow.merge_config(schedule.config))
    if errors:
        raise ScheduleDefinitionError(
            "config", "; ".join(f"{stage_id}: {message}" for stage_id, message in errors)
        )


def define_schedule(
    name: str,
    workflow: Workflow | str,
    *,
    cron: str | None = None,
    every: float | timedelta | None = None,
    tz: str = "UTC",
    input: Mapping[str, Any] | None = None,
    config: Mapping[str, Any] | None = None,
    priority: int = 5,
    overlap: OverlapPolicy = "skip",
    catchup: CatchupPolicy = "run_once",
    catchup_window: float | timedelta = timedelta(days=1),
    jitter: float | timedelta = 0,
    repeated_times: Literal["once", "both"] = "once",
    anchor: datetime | None = None,
    paused: bool = False,
    description: str = "",
) -> ScheduleDefinition:
    """Build a schedule that starts runs of ``workflow``; register it with
    :func:`~django_workflows.register` (or ``registry.register_schedule``).

    Args:
        name: the schedule's id: letters, digits, ``_ . : -``, at most 180 characters (so
            the idempotency key ``schedule:<name>:<iso time>`` fits 255).
        workflow: a built :class:`Workflow` (input and config are checked now) or a workflow
            id (checked when the schedule is synced to its row).
        cron: a 5-field cron expression or alias, read in ``tz`` (exactly one of ``cron`` and
            ``every``).
        every: a fixed interval, in seconds or as a ``timedelta`` (elapsed time): finite, at
            least :data:`MIN_EVERY_SECONDS` (1 s), at most :data:`MAX_DURATION_SECONDS`.
        tz: IANA time zone of the cron expression (default ``UTC``).
        input: the workflow input of every run (a JSON object; default ``{}``).
        config: the ``{stage_id: {...}}`` config of every run.
        priority: run priority (higher sooner).
        overlap: while the previous run is PENDING or RUNNING, a firing is ``skip`` ped,
            buffered (``buffer_one``: at most one, started when the previous run ends),
            started anyway (``allow_all``) or started after cancelling the previous run
            (``cancel_previous``).
        catchup: which times missed while no ticker ran fire when it is back: none
            (``skip``: skip to now; a time found less than 60 s late still fires), the latest
            one (``run_once``), or every one within ``catchup_window`` (``run_all``).
        catchup_window: how far back ``run_all`` catches up (seconds or ``timedelta``; finite,
            zero or positive).
        jitter: up to this long (seconds or ``timedelta``) after its scheduled time each firing
            is delayed, by a deterministic amount per schedule and time (finite, zero or
            positive; shorter than ``every``).
        repeated_times: a repeated wall-clock time at a DST fall back fires ``once`` (its first
            occurrence) or ``both`` times.
        anchor: the origin of an ``every`` schedule (aware; default 2000-01-01T00:00Z).
        paused: (a ``bool``) the schedule's row starts paused (only when the row is created;
            later pauses and resumes are made on the row, by an operator).
        description: shown in the admin and the API.

    Raises:
        ScheduleDefinitionError: a bad argument; ``field`` and the message name it.
    """
    from .workflow import Workflow

    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise ScheduleDefinitionError(
            "name", f"{name!r} must be 1-180 letters, digits or _ . : - (starting alphanumeric)"
        )
    if isinstance(workflow, Workflow):
        workflow_id = workflow.id
    elif isinstance(workflow, str) and workflow:
        workflow_id = workflow
    else:
        raise ScheduleDefinitionError(
            "workflow", f"expected a built Workflow or a workflow id, got {workflow!r}"
        )
    if (cron is None) == (every is None):
        raise ScheduleDefinitionError("cron", "give exactly one of cron= and every=")
    parsed = CronExpression.parse(cron) if cron is not None else None
    interval = _duration("every", every, allow_zero=False) if every is not None else None
    if interval is not None and interval < timedelta(seconds=MIN_EVERY_SECONDS):
        raise ScheduleDefinitionError(
            "every",
            f"at least {MIN_EVERY_SECONDS:g} second (the ticker looks for due schedules about "
            f"once a second), got {every!r}",
        )
    window = _duration("catchup_window", catchup_window, allow_zero=True)
    spread = _duration("jitter", jitter, allow_zero=True)
    if interval is not None and spread >= interval:
        raise ScheduleDefinitionError(
            "jitter",
            f"must be shorter than the interval every={_seconds_text(interval)}s, got "
            f"{_seconds_text(spread)}s (a delayed firing would pass the next one)",
        )
    if not isinstance(paused, bool):
        raise ScheduleDefinitionError("paused", f"expected True or False, got {paused!r}")
    tz = validate_zone(tz)
    if input is None:
        input = {}
    if not isinstance(input, Mapping):
        raise ScheduleDefinitionError(
            "input", f"expected a JSON object, got {type(input).__name__}"
        )
    if config is None:
        config = {}
    if not isinstance(config, Mapping) or not all(isinstance(v, Mapping) for v in config.values()):
        raise ScheduleDefinitionError("config", "expected an object keyed by stage id")
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise ScheduleDefinitionError("priority", f"expected an integer, got {priority!r}")
    if overlap not in OVERLAP_POLICIES:
        raise ScheduleDefinitionError(
            "overlap", f"{overlap!r} is not one of {', '.join(OVERLAP_POLICIES)}"
        )
    if catchup not in CATCHUP_POLICIES:
        raise ScheduleDefinitionError(
            "catchup", f"{catchup!r} is not one of {', '.join(CATCHUP_POLICIES)}"
        )
    if repeated_times not in ("once", "both"):
        raise ScheduleDefinitionError(
            "repeated_times", f"{repeated_times!r} is not one of once, both"
        )
    if anchor is None:
        anchor = datetime(2000, 1, 1, tzinfo=UTC)
    if not isinstance(anchor, datetime) or anchor.utcoffset() is None:
        raise ScheduleDefinitionError("anchor", f"expected an aware datetime, got {anchor!r}")
    definition = ScheduleDefinition(
        name=name,
        workflow_id=workflow_id,
        cron=parsed,
        every=interval,
        tz=tz,
        input=dict(input),
        config={k: dict(v) for k, v in config.items()},
        priority=priority,
        overlap=overlap,
        catchup=catchup,
        catchup_window=window,
        jitter=spread,
        repeated_times=repeated_times,
        anchor=anchor.astimezone(UTC),
        paused=paused,
        description=str(description),
    )
    if isinstance(workflow, Workflow):
        check_against_workflow(definition, workflow)
    return definition


def definition_from_row(row: Any) -> ScheduleDefinition:
    """The :class:`ScheduleDefinition` a ``WorkflowSchedule`` row describes (its stored fields,
    whatever code defines today).
    """
    return ScheduleDefinition(
        name=row.name,
        workflow_id=row.workflow_id,
        cron=CronExpression.parse(row.cron) if row.cron else None,
        every=timedelta(seconds=row.every_seconds) if row.every_seconds else None,
        tz=row.tz,
        input=row.input or {},
        config=row.config or {},
        priority=row.priority,
        overlap=row.overlap,
        catchup=row.catchup,
        catchup_window=timedelta(seconds=row.catchup_window_seconds),
        jitter=timedelta(seconds=row.jitter_seconds),
        repeated_times=row.repeated_times,
        anchor=row.anchor,
    )


__all__ = [
    "CATCHUP_POLICIES",
    "MAX_DURATION_SECONDS",
    "MAX_YEAR",
    "MIN_EVERY_SECONDS",
    "MIN_YEAR",
    "OVERLAP_POLICIES",
    "CronExpression",
    "ScheduleDefinition",
    "ScheduleDefinitionError",
    "check_against_workflow",
    "define_schedule",
    "jitter_for",
    "validate_zone",
]
