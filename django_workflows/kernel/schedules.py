"""Schedules at run time: sync code definitions to rows, fire due schedules from the maintenance
tick, and the operator operations (pause, resume, trigger now, backfill) - issue 12 item 1.

Firing rides on the maintenance tick (:func:`.hosting.run_maintenance_tick`, step
``schedule.fire``), so it has the ticker's precision (``TICK_INTERVAL_SECONDS``) and the
ticker's failover; the supervisor takes the ticker when a schedule is due
(:func:`.supervisor.ticker_needed`). Each due schedule is fired in its own transaction: the
row is locked (``FOR UPDATE SKIP LOCKED`` on PostgreSQL), its runs are created with the
idempotency key ``schedule:<name>:<scheduled time ISO>`` and its ``next_fire_at`` advanced, all
committed together. Two clusters ticking at once, or a tick retried after a lost connection,
therefore create each firing's run once: the second either skips the locked row, finds it no
longer due, or replays the key.

Sync (:func:`sync_schedules`) runs at the start of the same step, on every tick, and once in
every worker process when its supervisor starts (so a schedule deployed to an idle cluster has
a row, and is due, although nothing else makes a tick run): one query
reads the rows' definition hashes; rows are written only when a definition is new, changed or
gone. A row whose definition is gone is kept, marked ``orphaned`` and paused. During a rolling
deploy the ticker's process decides which definitions are current.

Each run carries the annotations ``trigger.source = "schedule"``, ``trigger.actor.kind =
"schedule"``, ``trigger.actor.id``, :data:`SCHEDULE_ID` (``schedule.id``) and
:data:`SCHEDULED_AT` (``schedule.scheduled_at``, ISO-8601).
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

from django.core.serializers.json import DjangoJSONEncoder
from django.db import DatabaseError, IntegrityError, transaction

from ..annotations import IsoTimestamp, typed_key
from ..conventions import Trigger
from ..definition.schedule import (
    MAX_YEAR,
    MIN_YEAR,
    ON_TIME_SECONDS,
    ScheduleDefinition,
    ScheduleDefinitionError,
    check_against_workflow,
    definition_from_row,
    jitter_for,
)
from ..models import Status, WorkflowRun, WorkflowSchedule
from .commands import (
    AnnotationSpec,
    BackfillScheduleResult,
    CancelRun,
    CreateRun,
)
from .errors import (
    InvalidCommandError,
    ScheduleNotFoundError,
    ScheduleOrphanedError,
    WorkflowError,
)
from .locking import lock_due_schedule, lock_schedule

if TYPE_CHECKING:
    from .dispatch import Kernel

logger = logging.getLogger("django_workflows.schedules")

#: The schedule that started a run (its name).
SCHEDULE_ID = typed_key(
    "schedule.id", str, stability="experimental", description="Schedule that started the run"
)
#: The scheduled time of the firing that started a run (ISO-8601, UTC).
SCHEDULED_AT = typed_key(
    "schedule.scheduled_at",
    IsoTimestamp,
    stability="experimental",
    description="Scheduled time of the firing that started the run",
)
#: ``pause_reason`` of a row whose definition disappeared from code.
ORPHANED = "orphaned: no definition in code"
#: Most schedules fired by one tick (the rest are due on the next tick).
MAX_SCHEDULES_PER_TICK = 100
#: Most runs one schedule starts in one tick (``run_all`` catch-up continues on the next).
MAX_FIRINGS_PER_TICK = 100
#: Most scheduled times one backfill may create.
MAX_BACKFILL = 1000
#: Most upcoming times :func:`upcoming_times` lists (``workflows_schedule next --count``).
MAX_UPCOMING = 1000
#: Definition fields whose change moves the next firing (recomputed from now).
_TIMING_FIELDS = ("cron", "every_seconds", "tz", "anchor", "repeated_times", "jitter_seconds")


def known_schedule_names() -> list[str]:
    """The names of the schedule rows and of the registered schedule definitions, sorted (one
    query, in a savepoint; only the definitions when the table cannot be read)."""
    from ..definition.registry import registry

    names = set(registry.schedule_names())
    try:
        with transaction.atomic():
            names.update(WorkflowSchedule.objects.values_list("name", flat=True)[:10_000])
    except (DatabaseError, RuntimeError):  # RuntimeError: database access blocked (tests)
        pass
    return sorted(names)


def lock_operable(name: str, action: str) -> WorkflowSchedule:
    """Lock schedule ``name`` (in the caller's transaction) for an operator's ``action``
    ("resumed", "triggered").

    Raises:
        ScheduleNotFoundError: no such schedule.
        ScheduleOrphanedError: it is orphaned (its definition is gone from code).
    """
    row = lock_schedule(name)
    if row is None:
        raise ScheduleNotFoundError(name, known_schedule_names())
    if row.orphaned:
        raise ScheduleOrphanedError(name, action)
    return row


@dataclass
class SyncResult:
    """What :func:`sync_schedules` changed: schedule names per kind, and ``errors`` as
    ``{name: message}`` for definitions whose input or config no longer fit their workflow.
    """

    created: list[str] = field(default_factory=list)
    updated: list[str] = field(default_factory=list)
    orphaned: list[str] = field(default_factory=list)
    errors: dict[str, str] = field(default_factory=dict)


@dataclass
class FireResult:
    """Counts of one :func:`fire_due_schedules` pass."""

    schedules: int = 0
    started: int = 0
    skipped: int = 0
    buffered: int = 0
    cancelled: int = 0
    #: firings whose key existed already (their run was created before): not started again
    replayed: int = 0
    errors: int = 0
    run_ids: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def definition_hash(definition: ScheduleDefinition, error: str = "") -> str:
    """sha256 of a definition's stored fields and its validation ``error`` (a changed
    definition, or one whose validity changed, is re-synced)."""
    data = json.dumps([definition.to_row(), error], sort_keys=True, cls=DjangoJSONEncoder)
    return hashlib.sha256(data.encode()).hexdigest()


def fire_time(name: str, scheduled_at: datetime | None, jitter_seconds: float) -> datetime | None:
    """When the firing scheduled at ``scheduled_at`` is due: plus its deterministic jitter."""
    if scheduled_at is None:
        return None
    return scheduled_at + jitter_for(name, scheduled_at, jitter_seconds)


def _validate(kernel: Kernel, definition: ScheduleDefinition) -> str:
    workflow = kernel.registry.get(definition.workflow_id)
    if workflow is None:
        return f"workflow: {definition.workflow_id!r} is not a registered workflow"
    try:
        check_against_workflow(definition, workflow)
    except ScheduleDefinitionError as exc:
        return str(exc)
    return ""


def sync_schedules(kernel: Kernel, *, orphan: bool = True) -> SyncResult:
    """Bring ``WorkflowSchedule`` rows in line with ``kernel.registry.schedules()``.

    New definitions get a row whose first firing is the next scheduled time after now (no
    catch-up of the past); a definition whose timing changed gets its next firing recomputed
    from now; ``paused`` of a new row comes from the definition, later only operators change it.
    A definition whose input or config does not fit its workflow is stored with
    ``last_error`` set and no next firing (logged; fixed by the next deploy). Rows without a
    definition are marked orphaned and paused (and un-orphaned when the definition returns).
    Costs one query when nothing changed.

    Args:
        kernel: its registry holds the definitions; its clock says "now".
        orphan: whether rows without a definition are orphaned (``False``: the supervisor's
            sync at process start, which only adds and updates).
    """
    out = SyncResult()
    definitions = {d.name: d for d in kernel.registry.schedules()}
    stored = {
        name: (digest, orphaned)
        for name, digest, orphaned in WorkflowSchedule.objects.values_list(
            "name", "definition_hash", "orphaned"
        )
    }
    now = kernel.clock.now()
    for name, definition in definitions.items():
        # The hash covers the validation outcome too: a deploy that makes the workflow accept
        # (or refuse) the schedule's input re-syncs the row although the schedule is unchanged.
        error = _validate(kernel, definition)
        digest = definition_hash(definition, error)
        if name in stored and stored[name] == (digest, False):
            continue
        try:
            _sync_one(kernel, definition, digest, error, now, out)
        except IntegrityError:  # another process created the row at the same moment
            logger.info("Schedule %s was created concurrently; synced next tick", name)
    if not orphan or not len(kernel.registry):
        # A process that loaded no workflow at all (autodiscovery did not run) is no authority
        # on which definitions exist: orphan nothing.
        return out
    for name, (_, orphaned) in stored.items():
        if name not in definitions and not orphaned:
            WorkflowSchedule.objects.filter(pk=name).update(
                orphaned=True, paused=True, pause_reason=ORPHANED, updated_at=now
            )
            out.orphaned.append(name)
    return out


def _sync_one(
    kernel: Kernel,
    definition: ScheduleDefinition,
    digest: str,
    error: str,
    now: datetime,
    out: SyncResult,
) -> None:
    name = definition.name
    with transaction.atomic():
        row = lock_schedule(name)
        fields = definition.to_row()
        if row is None:
            row = WorkflowSchedule(name=name, created_at=now, paused=definition.paused, **fields)
            created = retime = True
        else:
            created = False
            retime = any(getattr(row, f) != fields[f] for f in _TIMING_FIELDS)
            for key, value in fields.items():
                setattr(row, key, value)
            if row.orphaned and row.pause_reason == ORPHANED:
                row.paused, row.pause_reason = False, ""
                retime = True
            row.orphaned = False
        row.definition_hash = digest
        row.updated_at = now
        if error:
            row.last_error = error
            row.next_scheduled_at = row.next_fire_at = None
            out.errors[name] = error
            logger.error("Schedule %s is not fired: %s", name, error)
        elif retime or row.next_scheduled_at is None:
            row.last_error = ""
            set_next(row, definition, definition.next_after(now))
        row.save(force_insert=created)
    (out.created if created else out.updated).append(name)


def set_next(row: WorkflowSchedule, definition: ScheduleDefinition, when: datetime | None) -> None:
    """Set ``row``'s next scheduled time to ``when`` and its next fire time (plus jitter)."""
    row.next_scheduled_at = when
    row.next_fire_at = fire_time(row.name, when, definition.jitter.total_seconds())


def idempotency_key(name: str, scheduled_at: datetime) -> str:
    """``schedule:<name>:<scheduled time, ISO-8601 UTC>``: the key of a firing's run."""
    return f"schedule:{name}:{scheduled_at.astimezone(UTC).isoformat()}"


def firing_annotations(
    name: str, scheduled_at: datetime, reason: str | None
) -> tuple[AnnotationSpec]:
    """The trigger and schedule annotations of a firing's run (see the module docstring)."""
    attributes: dict[Any, Any] = {
        Trigger.source: "schedule",
        Trigger.actor_kind: "schedule",
        Trigger.actor_id: name,
        SCHEDULE_ID: name,
        SCHEDULED_AT: scheduled_at.astimezone(UTC),
    }
    if reason:
        attributes[Trigger.reason] = reason
    return (AnnotationSpec(attributes, actor={"kind": "schedule", "id": name}),)


def start_firing(
    kernel: Kernel,
    row: WorkflowSchedule,
    scheduled_at: datetime,
    *,
    key: str | None = None,
    reason: str | None = None,
) -> tuple[str, bool]:
    """Create the firing's run; ``(run id, replayed)`` (``replayed``: the key existed, so
    another tick or a backfill created the run already)."""
    result = kernel.dispatch(
        CreateRun(
            workflow_id=row.workflow_id,
            input=row.input or {},
            config=row.config or None,
            priority=row.priority,
            idempotency_key=key or idempotency_key(row.name, scheduled_at),
            annotations=firing_annotations(row.name, scheduled_at, reason),
        )
    )
    return str(result.workflow_run_id), bool(result.replayed)


def _previous_live(row: WorkflowSchedule) -> bool:
    if row.last_run_id is None:
        return False
    return WorkflowRun.objects.filter(
        pk=row.last_run_id, status__in=[Status.PENDING, Status.RUNNING]
    ).exists()


def _due_times(
    definition: ScheduleDefinition, row: WorkflowSchedule, now: datetime
) -> tuple[list[datetime], int, datetime | None]:
    """``(times to fire, times passed over, next scheduled time)`` at ``now`` under the
    catch-up policy (see :func:`~django_workflows.define_schedule`).
    """
    first = row.next_scheduled_at
    assert first is not None
    jitter = definition.jitter.total_seconds()
    window = definition.catchup_window
    if definition.catchup == "run_all":
        starts = [max(first, now - window)]
    else:  # only the latest due time matters: look back progressively
        starts = [
            max(first, now - timedelta(seconds=s) - definition.jitter)
            for s in (3600, 86400, 32 * 86400, 400 * 86400)
        ] + [first]
    due: list[datetime] = []
    current: datetime | None = None
    for start in starts:
        current = first if start == first else definition.next_after(start - timedelta.resolution)
        due = []
        while current is not None and fire_time(row.name, current, jitter) <= now:  # type: ignore[operator]
            due.append(current)
            if definition.catchup == "run_all" and len(due) >= MAX_FIRINGS_PER_TICK:
                break
            if len(due) > 10_000:  # a fast schedule far behind: keep only the newest times
                due = due[-1:]
            current = definition.next_after(current)
        if due:
            break
    if definition.catchup == "run_all":
        if len(due) >= MAX_FIRINGS_PER_TICK:
            current = definition.next_after(due[-1])
        return due, 0, current
    if definition.catchup == "run_once":
        fire = due[-1:]
    else:  # skip to now: only a latest time found on time still fires
        fire = [
            t
            for t in due[-1:]
            if (now - t - jitter_for(row.name, t, jitter)).total_seconds() <= ON_TIME_SECONDS
        ]
    passed = max(0, len(due) - len(fire))
    return fire, passed, current


def _fire(kernel: Kernel, row: WorkflowSchedule, now: datetime, out: FireResult) -> None:
    """Fire one locked, due row (see :func:`fire_due_schedules`)."""
    definition = definition_from_row(row)
    due = row.next_fire_at is not None and row.next_fire_at <= now
    if row.buffered_at is not None:
        if _previous_live(row):
            if not due:
                return  # the buffered firing waits for the live run: nothing to write
        else:
            _run_firing(kernel, row, row.buffered_at, now, out)
            row.buffered_at = None
    if due:
        times, passed, upcoming = _due_times(definition, row, now)
        out.skipped += passed
        row.skipped_count += passed
        for scheduled_at in times:
            live = definition.overlap != "allow_all" and _previous_live(row)
            if live and definition.overlap == "skip":
                out.skipped += 1
                row.skipped_count += 1
                row.last_scheduled_at = scheduled_at
                continue
            if live and definition.overlap == "buffer_one":
                if row.buffered_at is None:
                    row.buffered_at = scheduled_at
                    out.buffered += 1
                else:
                    out.skipped += 1
                    row.skipped_count += 1
                row.last_scheduled_at = scheduled_at
                continue
            if live and definition.overlap == "cancel_previous":
                reason = f"replaced by schedule {row.name} firing at {scheduled_at.isoformat()}"
                if kernel.dispatch(CancelRun(row.last_run_id, reason)).cancelled:
                    out.cancelled += 1
            _run_firing(kernel, row, scheduled_at, now, out)
        set_next(row, definition, upcoming)
    row.updated_at = now
    row.save()


def _run_firing(
    kernel: Kernel, row: WorkflowSchedule, scheduled_at: datetime, now: datetime, out: FireResult
) -> None:
    try:
        run_id, replayed = start_firing(kernel, row, scheduled_at)
    except WorkflowError as exc:
        row.last_error = f"firing at {scheduled_at.isoformat()}: {exc}"
        out.errors += 1
        logger.error("Schedule %s could not start a run: %s", row.name, exc)
        return
    row.last_run_id = run_id  # type: ignore[assignment]
    row.last_scheduled_at = scheduled_at
    row.last_fired_at = now
    row.last_error = ""
    if replayed:
        out.replayed += 1
        return
    row.fired_count += 1
    out.started += 1
    out.run_ids.append(run_id)


def fire_due_schedules(
    kernel: Kernel, *, limit: int = MAX_SCHEDULES_PER_TICK, sync: bool = True
) -> FireResult:
    """Sync the definitions (:func:`sync_schedules`, unless ``sync=False``), then fire every
    unpaused schedule due at ``kernel.clock.now()`` (up to ``limit``), each in one
    transaction: lock the row (skipping one another tick holds), start the runs its catch-up
    and overlap policies ask for (idempotency key per schedule and scheduled time), advance
    ``next_fire_at``.

    A firing whose run cannot be created (its workflow is gone, its input no longer valid) is
    recorded in ``last_error`` and the schedule moves on to its next time.
    """
    if sync:
        sync_schedules(kernel)
    now = kernel.clock.now()
    out = FireResult()
    from django.db.models import Q

    names = list(
        WorkflowSchedule.objects.filter(paused=False)
        .filter(Q(next_fire_at__lte=now) | Q(buffered_at__isnull=False))
        .order_by("next_fire_at")
        .values_list("name", flat=True)[:limit]
    )
    for name in names:
        try:
            with transaction.atomic():
                row = lock_due_schedule(name, now)
                if row is None:
                    continue  # another tick holds it or fired it meanwhile
                out.schedules += 1
                _fire(kernel, row, now, out)
        except DatabaseError:
            raise  # the tick's step boundary reconnects and retries
        except Exception:  # one broken schedule must not stop the others
            out.errors += 1
            logger.exception("Firing schedule %s failed", name)
    return out


# --- operator operations ------------------------------------------------------------------------


def get_schedule(name: str) -> WorkflowSchedule:
    """The row ``name``. Raises :class:`ScheduleNotFoundError`."""
    row = WorkflowSchedule.objects.filter(pk=name).first()
    if row is None:
        raise ScheduleNotFoundError(name, known_schedule_names())
    return row


#: What :func:`backfill_schedule` returns (``times``, ``run_ids``, ``existing``, ``name``).
BackfillResult = BackfillScheduleResult


def check_backfill_range(start: datetime, end: datetime) -> None:
    """The argument check of :func:`backfill_schedule` (also used by the admin's form so its
    errors show at the field): both aware, in the years :data:`MIN_YEAR`-:data:`MAX_YEAR`
    (local and UTC), ``end`` not before ``start``.

    Raises:
        InvalidCommandError: ``field`` is ``start`` or ``end``; the message starts with it.
    """
    for label, value in (("start", start), ("end", end)):
        if not isinstance(value, datetime) or value.utcoffset() is None:
            raise InvalidCommandError(
                f"{label}: expected an aware datetime, got {value!r}", field=label
            )
        try:
            year = value.astimezone(UTC).year
        except OverflowError:  # e.g. 0001-01-01T00:00+01:00 is before datetime.min in UTC
            year = value.year
        if not MIN_YEAR <= year <= MAX_YEAR or not MIN_YEAR <= value.year <= MAX_YEAR:
            raise InvalidCommandError(
                f"{label}: {value.isoformat()} is outside the years {MIN_YEAR}-{MAX_YEAR}",
                field=label,
            )
    if end < start:
        raise InvalidCommandError(
            f"end: {end.isoformat()} is before start {start.isoformat()}", field="end"
        )


def upcoming_times(row: WorkflowSchedule, count: int = 5) -> list[datetime]:
    """The next ``count`` scheduled times of ``row`` from its next firing on (``[]`` when it
    has none).

    Raises:
        InvalidCommandError: field ``count`` not an integer in 1-:data:`MAX_UPCOMING`.
    """
    if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= MAX_UPCOMING:
        raise InvalidCommandError(
            f"count: expected an integer from 1 to {MAX_UPCOMING}, got {count!r}", field="count"
        )
    if row.next_scheduled_at is None:
        return []
    definition = definition_from_row(row)
    out = [row.next_scheduled_at]
    while len(out) < count:
        following = definition.next_after(out[-1])
        if following is None:
            break
        out.append(following)
    return out


__all__ = [
    "MAX_UPCOMING",
    "SCHEDULED_AT",
    "SCHEDULE_ID",
    "BackfillResult",
    "FireResult",
    "ScheduleNotFoundError",
    "ScheduleOrphanedError",
    "SyncResult",
    "check_backfill_range",
    "fire_due_schedules",
    "firing_annotations",
    "get_schedule",
    "idempotency_key",
    "lock_operable",
    "set_next",
    "start_firing",
    "sync_schedules",
    "upcoming_times",
]
