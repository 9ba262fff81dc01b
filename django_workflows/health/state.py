"""What the engine's tables say about its health right now (issue 20 items 2 and 4).

:func:`snapshot` reads, in a handful of indexed queries, everything the health checks
(:mod:`.checks`), the Prometheus endpoint (:mod:`.prometheus`) and the OpenTelemetry
observable gauges report: ready and running jobs per queue and the age of the oldest ready
one, live workers per queue and deploy version, the outbox backlog and its lag, dead
letters, the schedule lag, the ticker lease, live runs by status and the runs finished
recently. Every age is measured against the lease clock (the **database's** clock, the one
leases are stamped with), read once per snapshot.

Where each number comes from:

* ready / running: ``workflow_jobs`` rows PENDING whose retry back-off has passed
  (``next_poll_at`` unset or due) / RUNNING, grouped by ``queue`` (``wf_job_queue_claim_idx``,
  which leads with ``status, queue``, bounds the scan to live jobs). A ready job's age counts
  from its ``next_poll_at`` when it waited out a back-off, else from its ``created_at``.
* workers: the presence rows ``worker:<queue>:<digest>`` in ``workflow_maintenance_leases``
  (:func:`django_workflows.kernel.routing.announce`) that have not expired, joined with the
  worker's advertised versions (``workflow_worker_versions``). A worker's *version* is its
  deploy: the 12 hex digits that also name its deploy's ticker lease (``ticker@<digest>``,
  :func:`django_workflows.kernel.versions.deploy_lease_name`), ``""`` for a worker that
  advertises no versions.
* outbox: *undelivered* = ``published_at`` and ``dlq_at`` both empty (served by the partial
  ``wf_outbox_unpublished_idx``); a *dead letter* = ``dlq_at`` set and ``published_at``
  empty (``wf_outbox_dead_letter_idx``; a skipped one has ``published_at`` set and no longer
  counts). The lag is the age of the oldest undelivered event that is not held back behind a
  dead letter of its run (those wait for an operator, and count as ``outbox_blocked``).
* schedule lag: how long past its ``next_fire_at`` the most overdue unpaused schedule is (0
  when none is due; ``None`` without unpaused schedules; ``wf_schedule_due_idx``).
* ticker: the unexpired ``ticker`` / ``ticker@<digest>`` lease; *live* when its holder's
  worker process (the owner without its ``-ticker`` suffix) still advertises its versions,
  or, for a holder that never does, while the lease itself is unexpired (the holder renews
  it every third of its TTL).
"""

from __future__ import annotations

import hashlib
import json
import math
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from django.db import DatabaseError, connection
from django.db.models import Count, F, Min, OuterRef, Q, Subquery, Sum
from django.db.models.functions import Coalesce

from ..conf import workflow_settings
from ..models import (
    MaintenanceLease,
    OutboxEvent,
    Status,
    WorkflowJob,
    WorkflowRun,
    WorkflowSchedule,
    WorkflowStage,
    WorkflowWorkerVersions,
)

if TYPE_CHECKING:
    from ..kernel.leases import LeaseClock

#: Run statuses counted in :attr:`StateSnapshot.runs_by_status` (the engine never writes
#: SUSPENDED on a run).
LIVE_RUN_STATUSES = (Status.PENDING, Status.RUNNING)
#: Terminal run statuses counted in :attr:`StateSnapshot.finished_recently`.
FINISHED_RUN_STATUSES = (Status.COMPLETED, Status.FAILED, Status.CANCELLED)
#: At most this many of the newest stages / runs finished in the window are read for the
#: duration summaries (:attr:`StateSnapshot.stage_durations`, ``run_durations``): an index
#: range bounded by a LIMIT, however busy the window was.
DURATION_SAMPLE_LIMIT = 5_000
TICKER_LEASE = "ticker"
#: :attr:`StateSnapshot.database_error` of a snapshot whose time budget ran out.
TIMEOUT_ERROR = "timeout"
#: PostgreSQL's SQLSTATE of a statement cancelled by ``statement_timeout`` (query_canceled).
QUERY_CANCELED = "57014"
TICKER_SUFFIX = "-ticker"
PRESENCE_PREFIX = "worker:"


@dataclass(frozen=True)
class QueueState:
    """One queue's jobs: ``ready`` (PENDING, back-off passed), ``running`` (RUNNING) and
    ``oldest_ready_age_seconds`` (``None`` when nothing is ready), lease-clock seconds."""

    queue: str
    ready: int
    running: int
    oldest_ready_age_seconds: float | None


@dataclass(frozen=True)
class WorkerState:
    """``count`` live worker processes serve ``queue`` with deploy ``version`` (12 hex digits
    of their runnable definition versions, ``""`` when they advertise none)."""

    queue: str
    version: str
    count: int


@dataclass(frozen=True)
class FinishedState:
    """``count`` runs of ``workflow_id`` reached ``status`` (COMPLETED, FAILED, CANCELLED)
    within the last ``window_seconds``."""

    workflow_id: str
    status: str
    count: int


@dataclass(frozen=True)
class RedeliveryState:
    """``count`` deliveries beyond the first (``attempt - 1`` summed) of the jobs of
    ``workflow_id`` / ``stage_id`` finished within the window."""

    workflow_id: str
    stage_id: str
    count: int


@dataclass(frozen=True)
class DurationState:
    """Durations of the stages (``stage_id`` set) or runs (``stage_id`` ``""``) of
    ``workflow_id`` finished in the window: ``count`` samples, nearest-rank ``p50`` and
    ``p95`` and the ``max``, seconds."""

    workflow_id: str
    stage_id: str
    count: int
    p50: float
    p95: float
    max: float


def summarize(
    samples: dict[tuple[str, str], list[int]],
) -> list[DurationState]:
    """:class:`DurationState` rows, sorted by key, of ``{(workflow_id, stage_id): [duration
    ms, ...]}`` (nearest-rank percentiles: the ``ceil(q * n)``-th smallest)."""
    out = []
    for (wf, stage), values in sorted(samples.items()):
        ordered = sorted(values)
        n = len(ordered)
        # ceil(percent * n / 100) in integers (no float rounding at 0.95 * n).
        p50, p95 = (ordered[max(0, -(-pct * n // 100) - 1)] / 1000.0 for pct in (50, 95))
        out.append(DurationState(wf, stage, n, p50, p95, ordered[-1] / 1000.0))
    return out


@dataclass(frozen=True)
class StateSnapshot:
    """The engine's state at ``taken_at`` (the lease clock: the database's clock).

    When the database cannot be read, ``database_ok`` is ``False``, ``database_error`` says
    why (the exception's class name, or :data:`TIMEOUT_ERROR` when the reads ran out of their
    time budget: ``timed_out`` is then true) and every other field is empty (lists empty,
    counts 0, ages ``None``, ``ticker_live`` false).

    Fields:
        taken_at: when it was read (aware datetime, database clock).
        database_ok: the database answered.
        queues: every queue with a live job or a live worker, every queue of ``QUEUES`` and
            ``"default"``, by name.
        workers: live worker processes per (queue, deploy version), by queue then version.
        outbox_undelivered: outbox events neither published nor dead-lettered.
        outbox_lag_seconds: age of the oldest deliverable undelivered event, ``None``: none.
        dead_letters: dead-lettered events not yet replayed or skipped.
        schedule_lag_seconds: how overdue the most overdue unpaused schedule is (0.0: none
            due), ``None`` when there is no unpaused schedule.
        ticker_holder: owner of the unexpired ticker lease (``worker-...-ticker``), or ``None``.
        ticker_live: the ticker lease is held by a live worker process.
        runs_by_status: ``{"PENDING": n, "RUNNING": n}`` (both keys always present).
        outbox_blocked: undelivered events held back behind a dead letter of their run.
        finished_recently: runs finished within ``finished_window_seconds`` per workflow and
            status (sorted).
        finished_window_seconds: the window of ``finished_recently``
            (``HEALTH_FINISHED_WINDOW_SECONDS``).
        ticker_leases: ``{lease name: owner}`` of every unexpired ticker lease (one per
            deploy).
        database_error: why the database could not be read (``""`` when it could).
        oldest_live_run_age_seconds: age of the oldest PENDING or RUNNING run (``None``: none).
        ticker_missing_seconds: with live runs and no live ticker, how long the ticker has
            been missing: since the latest ticker lease expired (or its holder's process
            stopped advertising), at most the oldest live run's age (a released lease:
            that age); ``None`` when the ticker is live or no run is live.
        stage_durations: durations of the stages finished within
            ``finished_window_seconds`` per workflow and stage (sorted), from at most the
            :data:`DURATION_SAMPLE_LIMIT` newest.
        run_durations: the same of runs per workflow (``stage_id`` ``""``).
        redeliveries: deliveries beyond the first of the jobs finished within the window, per
            workflow and stage (sorted):
            ``attempt - 1`` summed (failed deliveries retried, expired leases redelivered,
            and deliveries released by a graceful stop alike).
        duration_samples_truncated: the window held more than :data:`DURATION_SAMPLE_LIMIT`
            finished stages or runs, so the durations describe only the newest.
        timed_out: the reads did not finish within their time budget (``timeout_seconds``
            of :func:`snapshot`, ``HEALTH_TIMEOUT_SECONDS``); ``database_ok`` is then false.
        timeout_seconds: that budget (seconds; ``None``: the reads were not bounded).
    """

    taken_at: datetime
    database_ok: bool
    queues: list[QueueState]
    workers: list[WorkerState]
    outbox_undelivered: int
    outbox_lag_seconds: float | None
    dead_letters: int
    schedule_lag_seconds: float | None
    ticker_holder: str | None
    ticker_live: bool
    runs_by_status: dict[str, int] = field(default_factory=dict)
    outbox_blocked: int = 0
    finished_recently: list[FinishedState] = field(default_factory=list)
    finished_window_seconds: float = 0.0
    ticker_leases: dict[str, str] = field(default_factory=dict)
    database_error: str = ""
    oldest_live_run_age_seconds: float | None = None
    ticker_missing_seconds: float | None = None
    stage_durations: list[DurationState] = field(default_factory=list)
    run_durations: list[DurationState] = field(default_factory=list)
    duration_samples_truncated: bool = False
    redeliveries: list[RedeliveryState] = field(default_factory=list)
    timed_out: bool = False
    timeout_seconds: float | None = None

    @property
    def live_runs(self) -> int:
        """PENDING + RUNNING runs."""
        return sum(self.runs_by_status.values())

    def workers_for(self, queue: str) -> int:
        """Live worker processes serving ``queue`` (any version)."""
        return sum(w.count for w in self.workers if w.queue == queue)


def deploy_version(versions: Any) -> str:
    """The deploy version of an advertised versions map ``{workflow_id: [version, ...]}``:
    12 hex digits of the SHA-1 of its sorted ``(workflow_id, version)`` pairs, as in the
    deploy's ticker lease name; ``""`` for an empty or malformed map."""
    if not isinstance(versions, dict):
        return ""
    pairs = sorted((str(wf), str(v)) for wf, listed in versions.items() for v in listed or ())
    if not pairs:
        return ""
    return hashlib.sha1(json.dumps(pairs).encode()).hexdigest()[:12]


def _seconds(now: datetime, then: datetime | None) -> float | None:
    if then is None:
        return None
    return max(0.0, (now - then).total_seconds())


def _lease_clock() -> LeaseClock:
    from ..kernel.runtime import get_kernel

    return get_kernel().lease_clock


def empty_snapshot(
    taken_at: datetime,
    error: str,
    *,
    timed_out: bool = False,
    timeout_seconds: float | None = None,
) -> StateSnapshot:
    """A snapshot of a database that could not be read (``database_ok`` false); with
    ``timed_out`` (``error`` is then :data:`TIMEOUT_ERROR`) because the reads ran out of
    their ``timeout_seconds`` budget."""
    return StateSnapshot(
        taken_at=taken_at,
        database_ok=False,
        queues=[],
        workers=[],
        outbox_undelivered=0,
        outbox_lag_seconds=None,
        dead_letters=0,
        schedule_lag_seconds=None,
        ticker_holder=None,
        ticker_live=False,
        runs_by_status={s.value: 0 for s in LIVE_RUN_STATUSES},
        database_error=error,
        timed_out=timed_out,
        timeout_seconds=timeout_seconds,
    )


class _BudgetSpent(DatabaseError):
    """The health reads' time budget ran out before a statement could start (raised by
    :class:`Budget`, caught by :func:`snapshot`)."""


def is_timeout(exc: BaseException) -> bool:
    """``exc`` (a Django ``DatabaseError``) is a :class:`_BudgetSpent` or PostgreSQL
    cancelling a statement (SQLSTATE ``57014``: ``statement_timeout`` fired)."""
    if isinstance(exc, _BudgetSpent):
        return True
    cause = exc.__cause__
    code = getattr(cause, "sqlstate", None) or getattr(cause, "pgcode", None)
    return code == QUERY_CANCELED


class Budget:
    """A total time bound on a sequence of statements, as a Django execute wrapper
    (``with connection.execute_wrapper(Budget(...))``).

    Before each statement: raises :class:`_BudgetSpent` once ``deadline`` (``time.monotonic``
    seconds) has passed; on PostgreSQL, inside the caller's transaction, lowers
    ``statement_timeout`` with ``set_config(..., true)`` (``SET LOCAL``: it ends with the
    transaction, so no setting leaks into a pooled session, as behind PgBouncer in
    transaction mode) to what is left of the budget, never above ``statement_timeout_ms``.
    On SQLite a statement cannot be interrupted: the budget is checked between statements.

    Args:
        deadline: monotonic time the statements must end by (``None``: no total bound).
        statement_timeout_ms: each statement's own bound (ms; ``None``: only the budget's).
        postgres: set ``statement_timeout`` (the caller holds a transaction).
    """

    def __init__(
        self, deadline: float | None, statement_timeout_ms: int | None, *, postgres: bool
    ) -> None:
        self.deadline = deadline
        self.statement_timeout_ms = statement_timeout_ms
        self.postgres = postgres
        self.current_ms: int | None = None

    def bound_ms(self) -> int:
        """The next statement's ``statement_timeout`` (ms, at least 1; 0: no bound at all).

        Raises:
            _BudgetSpent: the budget is spent.
        """
        bounds = []
        if self.deadline is not None:
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise _BudgetSpent("the health reads' time budget ran out")
            bounds.append(max(1, math.ceil(left * 1000)))
        if self.statement_timeout_ms is not None:
            bounds.append(max(1, int(self.statement_timeout_ms)))
        return min(bounds) if bounds else 0

    def apply(self, cursor: Any) -> None:
        """Set the next statement's bound on ``cursor`` (a DB-API cursor) if it changed."""
        ms = self.bound_ms()
        if self.postgres and ms != self.current_ms:
            cursor.execute("SELECT set_config('statement_timeout', %s, true)", [str(ms)])
            self.current_ms = ms

    def __call__(self, execute: Any, sql: Any, params: Any, many: bool, context: Any) -> Any:
        self.apply(context["cursor"].cursor)
        return execute(sql, params, many, context)


def snapshot(
    *,
    lease_clock: LeaseClock | None = None,
    statement_timeout_ms: int | None = None,
    timeout_seconds: float | None = None,
) -> StateSnapshot:
    """Read the engine's state (about twelve indexed queries, on the default connection).

    Args:
        lease_clock: whose time ages and expiries are judged in (default: the default
            kernel's, i.e. the database's clock; a test's ``FakeClock`` that drives leases).
        statement_timeout_ms: on PostgreSQL, each read's ``statement_timeout`` (ms; the
            readiness view's ``HEALTH_DB_TIMEOUT_SECONDS``); ``None``: no per-read limit.
        timeout_seconds: the total time all the reads may take (seconds,
            ``HEALTH_TIMEOUT_SECONDS``); ``None``: no total limit. When it runs out the
            snapshot says ``timed_out`` (see :class:`Budget`: PostgreSQL cancels the
            statement running then; SQLite stops before the next one).

    With either bound on PostgreSQL the reads run in one transaction (a savepoint inside a
    request's own transaction, as with ``ATOMIC_REQUESTS``) whose ``statement_timeout`` is
    set with ``SET LOCAL`` semantics and put back after the reads.

    Returns:
        A :class:`StateSnapshot`; never raises for a database error: ``database_ok`` is then
        false (a lost connection is closed, so the next request reconnects).
    """
    from django.db import transaction
    from django.utils import timezone

    deadline = None if timeout_seconds is None else time.monotonic() + float(timeout_seconds)
    try:
        clock = lease_clock or _lease_clock()
        if statement_timeout_ms is None and deadline is None:
            return _read(clock)
        postgres = connection.vendor == "postgresql"
        budget = Budget(deadline, statement_timeout_ms, postgres=postgres)
        if not postgres:
            with connection.execute_wrapper(budget):
                return _read(clock)
        # Local to this transaction (a savepoint inside a request's own transaction: put
        # back after the reads; a failed block's rollback reverts it by itself).
        with transaction.atomic():
            first = budget.bound_ms()
            with connection.cursor() as cursor:
                cursor.execute(
                    "SELECT current_setting('statement_timeout'), "
                    "set_config('statement_timeout', %s, true)",
                    [str(first)],
                )
                previous = cursor.fetchone()[0]
            budget.current_ms = first
            with connection.execute_wrapper(budget):
                snap = _read(clock)
            with connection.cursor() as cursor:
                cursor.execute("SELECT set_config('statement_timeout', %s, true)", [previous])
            return snap
    except DatabaseError as exc:
        if not connection.in_atomic_block:
            connection.close()
        if is_timeout(exc):
            return empty_snapshot(
                timezone.now(), TIMEOUT_ERROR, timed_out=True, timeout_seconds=timeout_seconds
            )
        return empty_snapshot(timezone.now(), type(exc).__name__)


def _positive(value: Any, default: float) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        return default
    return number if number > 0 and math.isfinite(number) else default


def db_timeout_seconds() -> float:
    """``HEALTH_DB_TIMEOUT_SECONDS`` as a positive float (default 2): the bound on connecting
    to the database and on each health read."""
    return _positive(workflow_settings.HEALTH_DB_TIMEOUT_SECONDS, 2.0)


def health_timeout_seconds() -> float:
    """``HEALTH_TIMEOUT_SECONDS`` as a positive float (default 4): the bound on the total time
    of one readiness probe, metrics scrape or ``workflows_health`` run."""
    return _positive(workflow_settings.HEALTH_TIMEOUT_SECONDS, 4.0)


_cache_lock = threading.Lock()
_cached: tuple[float, StateSnapshot] | None = None


def cached_snapshot(max_age_seconds: float = 5.0) -> StateSnapshot:
    """:func:`snapshot`, reused while it is younger than ``max_age_seconds`` (monotonic time,
    per process): for callers that read several numbers of one collection, such as
    OpenTelemetry observable gauges, each of whose callbacks would otherwise take its own
    snapshot. Thread-safe; at most one snapshot is taken at a time. Bounded like the
    readiness view: ``HEALTH_DB_TIMEOUT_SECONDS`` per read, ``HEALTH_TIMEOUT_SECONDS`` in
    all."""
    global _cached
    with _cache_lock:
        now = time.monotonic()
        if _cached is not None and now - _cached[0] < max_age_seconds:
            return _cached[1]
        snap = snapshot(
            statement_timeout_ms=int(db_timeout_seconds() * 1000),
            timeout_seconds=health_timeout_seconds(),
        )
        _cached = (time.monotonic(), snap)
        return snap


def forget_cached_snapshot() -> None:
    """Drop the snapshot :func:`cached_snapshot` keeps (tests)."""
    global _cached
    with _cache_lock:
        _cached = None


def _read(clock: LeaseClock) -> StateSnapshot:
    now = clock.read()
    runs, oldest_live_age = _runs_by_status(now)
    leases = _leases()
    versions = _versions()
    return StateSnapshot(
        taken_at=now,
        database_ok=True,
        **_jobs_and_workers(now, leases, versions),
        **_outbox(now),
        schedule_lag_seconds=_schedule_lag(now),
        **_ticker(now, oldest_live_age, leases, versions),
        runs_by_status=runs,
        oldest_live_run_age_seconds=oldest_live_age,
        **_finished(now),
    )


def _leases() -> list[tuple[str, str, datetime]]:
    """``(name, owner, expires_at)`` of every presence and ticker lease (one query on the
    small named-leases table; expired rows included)."""
    return list(
        MaintenanceLease.objects.filter(
            Q(name__startswith=PRESENCE_PREFIX)
            | Q(name=TICKER_LEASE)
            | Q(name__startswith=f"{TICKER_LEASE}@")
        ).values_list("name", "owner", "expires_at")
    )


def _versions() -> dict[str, tuple[Any, datetime]]:
    """``{worker_id: (advertised versions, expires_at)}`` (one query, one row per worker
    process; expired rows are deleted by the next announcement)."""
    return {
        worker_id: (listed, expires)
        for worker_id, listed, expires in WorkflowWorkerVersions.objects.values_list(
            "worker_id", "versions", "expires_at"
        )
    }


def _jobs_and_workers(
    now: datetime,
    leases: list[tuple[str, str, datetime]],
    versions: dict[str, tuple[Any, datetime]],
) -> dict[str, Any]:
    # Live jobs only: the status filter is the leading column of several job indexes. A
    # ready job is ready since its back-off ended (next_poll_at), else since it was created.
    pending = Q(status=Status.PENDING)
    ready_q = pending & (Q(next_poll_at__isnull=True) | Q(next_poll_at__lte=now))
    rows = (
        WorkflowJob.objects.filter(ready_q | Q(status=Status.RUNNING))
        .order_by()
        .values_list("queue")
        .annotate(
            ready=Count("id", filter=pending),
            running=Count("id", filter=Q(status=Status.RUNNING)),
            since=Min(Coalesce("next_poll_at", "created_at"), filter=pending),
        )
    )
    counts = {queue: (ready, running, since) for queue, ready, running, since in rows}

    deploys = {
        worker_id: deploy_version(listed)
        for worker_id, (listed, expires) in versions.items()
        if expires > now
    }
    per: dict[tuple[str, str], set[str]] = {}
    for name, owner, expires in leases:
        if name.startswith(PRESENCE_PREFIX) and expires > now:
            queue = name[len(PRESENCE_PREFIX) :].rsplit(":", 1)[0]
            per.setdefault((queue, deploys.get(owner, "")), set()).add(owner)
    workers = [WorkerState(q, v, len(ids)) for (q, v), ids in sorted(per.items())]

    configured = workflow_settings.QUEUES if isinstance(workflow_settings.QUEUES, dict) else {}
    names = set(counts) | {w.queue for w in workers} | {str(q) for q in configured} | {"default"}
    queues = []
    for q in sorted(names):
        ready, running, since = counts.get(q, (0, 0, None))
        queues.append(
            QueueState(
                queue=q,
                ready=ready,
                running=running,
                oldest_ready_age_seconds=_seconds(now, since) if ready else None,
            )
        )
    return {"queues": queues, "workers": workers}


def _outbox(now: datetime) -> dict[str, Any]:
    undelivered = OutboxEvent.objects.filter(published_at__isnull=True, dlq_at__isnull=True)
    dead_letters = OutboxEvent.objects.filter(
        published_at__isnull=True, dlq_at__isnull=False
    ).count()
    if not dead_letters:  # the common case: two statements
        found = undelivered.aggregate(n=Count("id"), t=Min("created_at"))
        total, blocked, oldest = found["n"], 0, found["t"]
    else:
        dead_runs = OutboxEvent.objects.filter(
            published_at__isnull=True, dlq_at__isnull=False
        ).values("workflow_run_id")
        behind = Q(workflow_run_id__in=dead_runs)
        found = undelivered.aggregate(
            n=Count("id"), blocked=Count("id", filter=behind), t=Min("created_at", filter=~behind)
        )
        total, blocked, oldest = found["n"], found["blocked"], found["t"]
    return {
        "outbox_undelivered": total,
        "outbox_lag_seconds": _seconds(now, oldest),
        "dead_letters": dead_letters,
        "outbox_blocked": blocked,
    }


def _schedule_lag(now: datetime) -> float | None:
    found = WorkflowSchedule.objects.filter(paused=False).aggregate(
        t=Min("next_fire_at"), n=Count("pk")
    )
    if not found["n"]:
        return None
    first = found["t"]
    return _seconds(now, first) if first is not None and first <= now else 0.0


def _ticker(
    now: datetime,
    oldest_live_age: float | None,
    leases: list[tuple[str, str, datetime]],
    versions: dict[str, tuple[Any, datetime]],
) -> dict[str, Any]:
    rows = sorted(
        (
            (name, owner, expires)
            for name, owner, expires in leases
            if name == TICKER_LEASE or name.startswith(f"{TICKER_LEASE}@")
        ),
        key=lambda row: row[2],
        reverse=True,
    )
    held = [(name, owner) for name, owner, expires in rows if expires > now]
    holder = held[0][1] if held else None
    live = False
    gone_since: datetime | None = None
    if held:
        workers = [
            owner[: -len(TICKER_SUFFIX)] if owner.endswith(TICKER_SUFFIX) else owner
            for _, owner in held
        ]
        # The unexpired lease says its holder renewed it within its TTL; a holder whose
        # process's advertised versions expired is a stale process all the same.
        live = any(w not in versions or versions[w][1] > now for w in workers)
        if not live:
            gone_since = max(versions[w][1] for w in workers)
    elif rows:
        gone_since = rows[0][2]  # the latest lease expired then (a released one is deleted)
    missing: float | None = None
    if not live and oldest_live_age is not None:
        # Missing since the lease lapsed, but not for longer than a run has been live (an
        # idle cluster holds no ticker); released or never held: since the oldest live run.
        missing = oldest_live_age
        if gone_since is not None:
            missing = min(missing, _seconds(now, gone_since) or 0.0)
    return {
        "ticker_holder": holder,
        "ticker_live": live,
        "ticker_leases": dict(held),
        "ticker_missing_seconds": missing,
    }


def _runs_by_status(now: datetime) -> tuple[dict[str, int], float | None]:
    """``({status: live runs}, age of the oldest live run or None)``."""
    counts = {s.value: 0 for s in LIVE_RUN_STATUSES}
    oldest: datetime | None = None
    rows = (
        WorkflowRun.objects.filter(status__in=LIVE_RUN_STATUSES)
        .order_by()
        .values_list("status")
        .annotate(n=Count("id"), t=Min("created_at"))
    )
    for status, n, t in rows:
        counts[status] = n
        if t is not None and (oldest is None or t < oldest):
            oldest = t
    return counts, _seconds(now, oldest)


def _finished(now: datetime) -> dict[str, Any]:
    window = float(workflow_settings.HEALTH_FINISHED_WINDOW_SECONDS or 0)
    if window <= 0:
        return {"finished_recently": [], "finished_window_seconds": 0.0}
    rows = (
        WorkflowRun.objects.filter(
            completed_at__gte=now - timedelta(seconds=window), status__in=FINISHED_RUN_STATUSES
        )
        .order_by()
        .values_list("workflow_id", "status")
        .annotate(n=Count("id"))
    )
    found = [FinishedState(wf, status, n) for wf, status, n in sorted(rows)]
    return {
        "finished_recently": found,
        "finished_window_seconds": window,
        **_durations(now - timedelta(seconds=window)),
    }


def _durations(since: datetime) -> dict[str, Any]:
    """Stage and run durations of those finished since ``since``: two statements, each an
    index range (``wf_stage_completed_idx`` / ``wf_run_completed_idx``, newest first) stopped
    by a LIMIT of :data:`DURATION_SAMPLE_LIMIT` rows (a stage's workflow: one probe of the
    runs' primary key per stage read)."""
    limit = DURATION_SAMPLE_LIMIT
    # The stage's workflow by a correlated probe of the runs' primary key per row read: a
    # plain join lets PostgreSQL hash-join a sequential scan of every run instead.
    workflow_of_run = (
        WorkflowRun.objects.filter(pk=OuterRef("run_id")).order_by().values("workflow_id")
    )
    stage_rows = list(
        WorkflowStage.objects.filter(completed_at__gte=since, duration_ms__isnull=False)
        .annotate(wf=Subquery(workflow_of_run[:1]))
        .order_by("-completed_at")
        .values_list("wf", "stage_id", "duration_ms")[: limit + 1]
    )
    run_rows = list(
        WorkflowRun.objects.filter(
            completed_at__gte=since,
            duration_ms__isnull=False,
            status__in=FINISHED_RUN_STATUSES,
        )
        .order_by("-completed_at")
        .values_list("workflow_id", "duration_ms")[: limit + 1]
    )
    stages: dict[tuple[str, str], list[int]] = {}
    for wf, stage, ms in stage_rows[:limit]:
        stages.setdefault((wf, stage), []).append(ms)
    runs: dict[tuple[str, str], list[int]] = {}
    for wf, ms in run_rows[:limit]:
        runs.setdefault((wf, ""), []).append(ms)
    redelivered = (
        WorkflowJob.objects.filter(completed_at__gte=since, attempt__gt=1)
        .order_by()
        .values_list("workflow_id", "stage_id")
        .annotate(n=Sum(F("attempt") - 1))  # a job's deliveries beyond its first
    )
    return {
        "redeliveries": [RedeliveryState(wf, st, n) for wf, st, n in sorted(redelivered)],
        "stage_durations": summarize(stages),
        "run_durations": summarize(runs),
        "duration_samples_truncated": len(stage_rows) > limit or len(run_rows) > limit,
    }


def register_gauges(meter: Any, *, max_age_seconds: float = 1.0) -> list[Any]:
    """The OpenTelemetry observable gauges of :func:`snapshot` on ``meter`` (an
    ``opentelemetry.metrics.Meter``): queue depth and age per queue, workers per queue and
    version, outbox lag and backlog, schedule lag, database and ticker up (names in
    :func:`django_workflows.telemetry.register_state_gauges`). One snapshot serves every gauge
    of a collection (taken again when older than ``max_age_seconds``). Returns the gauges.

    Raises:
        RuntimeError: ``opentelemetry`` is not installed.
    """
    from ..telemetry import register_state_gauges

    return register_state_gauges(meter, snapshot, max_age_seconds=max_age_seconds)
