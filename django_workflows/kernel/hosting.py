"""Host logic shared by every way of running the engine (SPEC §7.2-7.3, §7.6).

* :func:`execute_job` - run one leased job with heartbeats and apply its outcome to the queue,
  then transition the run (H-1..H-8).
* :func:`process_available_jobs` - lease and execute ready jobs until none is left or a limit
  is reached (H-42).
* :func:`run_maintenance_tick` - claim pending runs, poll suspended stages, reap stale leases,
  flush the outbox, reap stuck runs; each step in its own error boundary (H-10, H-11).

The django-q2 transport, the ``workflows_tick`` command and the test kit all call these.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import uuid
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any

from django.db import IntegrityError, close_old_connections, connection, transaction
from django.db.models import Q

from ..conf import workflow_settings
from ..models import MaintenanceLease, Status, WorkflowJob, WorkflowRun
from .commands import (
    ClaimPendingRuns,
    ExecuteJob,
    FlushOutbox,
    PollSuspendedStages,
    ReapStaleLeases,
    ReapStuckRuns,
    TransitionRun,
)
from .dispatch import Kernel
from .services import forget_run, note_run_not_running

logger = logging.getLogger("django_workflows.worker")


def default_worker_id() -> str:
    """``worker-{host}-{pid}-{random}`` (DM-49)."""
    return f"worker-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class Heartbeat:
    """Refreshes a job's lease every ``interval_seconds`` in a background thread (H-2)."""

    def __init__(
        self, kernel: Kernel, job_id: int, interval_seconds: float, run_id: object = None
    ) -> None:
        self.kernel = kernel
        self.job_id = job_id
        self.run_id = run_id
        self.interval = interval_seconds
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"heartbeat-{job_id}", daemon=True)

    def beat(self) -> None:
        """Refresh the lease and note a run that left RUNNING (Part I item 15)."""
        self.kernel.queue.touch(self.job_id)
        if (
            self.run_id is not None
            and not WorkflowRun.objects.filter(pk=self.run_id, status=Status.RUNNING).exists()
        ):
            note_run_not_running(self.run_id)

    def _loop(self) -> None:
        try:
            while not self._stop.wait(self.interval):
                try:
                    self.beat()
                except Exception:  # heartbeat errors are ignored (H-2)
                    logger.exception("Heartbeat for job %s failed", self.job_id)
        finally:
            connection.close()

    def __enter__(self) -> Heartbeat:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        if self.run_id is not None:
            forget_run(self.run_id)


@dataclass
class JobOutcome:
    outcome: str
    error: str | None = None


def execute_job(kernel: Kernel, job: WorkflowJob) -> JobOutcome:
    """Execute a leased (RUNNING) job and apply the outcome (H-3..H-8).

    completed -> job COMPLETED, ``run.transition``; suspended -> job SUSPENDED; failed -> retry
    with back-off while ``retryable`` and deliveries remain, else job FAILED and
    ``run.transition`` (so the run fails with the real stage error, H-7). Ghost results never
    retry and never transition. If ``job.execute`` raises, the job stays RUNNING and is
    recovered by lease expiry (H-4); the error propagates.
    """
    interval = float(workflow_settings.HEARTBEAT_INTERVAL_SECONDS)
    with Heartbeat(kernel, job.pk, interval, job.workflow_run_id):
        result = kernel.dispatch(
            ExecuteJob(
                workflow_run_id=job.workflow_run_id,
                workflow_id=job.workflow_id,
                stage_id=job.stage_id,
                config=(job.payload or {}).get("config") or {},
                idempotency_key=f"job:{job.pk}:attempt:{job.attempt}",
                job_id=job.pk,
            )
        )
    if result.outcome == "completed":
        kernel.queue.complete(job.pk)
        kernel.dispatch(TransitionRun(job.workflow_run_id))
    elif result.outcome == "suspended":
        kernel.queue.suspend(job.pk, result.next_poll_at)
        if not WorkflowRun.objects.filter(pk=job.workflow_run_id, status=Status.RUNNING).exists():
            # A cancel committed between Phase 3 and the suspend above could not see this job
            # (it was RUNNING, K-CA-3): cancel it now so no SUSPENDED job outlives its run.
            kernel.queue.cancel_by_run(job.workflow_run_id)
        kernel.transport.wake_ticker()
    else:
        can_retry = (
            not result.ghost and result.retryable is not False and job.attempt < job.max_attempts
        )
        kernel.queue.fail(job.pk, result.error or "Unknown error", should_retry=can_retry)
        if not can_retry and not result.ghost:
            try:
                kernel.dispatch(TransitionRun(job.workflow_run_id))
            except Exception:
                logger.exception("Transition after failed job %s failed", job.pk)
        elif can_retry:
            kernel.transport.wake_ticker()
    return JobOutcome(result.outcome, result.error)


@dataclass
class ProcessResult:
    processed: int = 0
    succeeded: int = 0
    failed: int = 0


def process_available_jobs(
    kernel: Kernel, worker_id: str, *, max_jobs: int = 1, stop: threading.Event | None = None
) -> ProcessResult:
    """Lease and execute ready jobs until the queue is empty, ``max_jobs`` were processed, or
    ``stop`` is set (H-42; Part I item 18: a stop request finishes the in-flight job first).
    """
    out = ProcessResult()
    while out.processed < max_jobs and not (stop and stop.is_set()):
        job = kernel.queue.dequeue(worker_id)
        if job is None:
            break
        outcome = execute_job(kernel, job)
        out.processed += 1
        if outcome.outcome == "failed":
            out.failed += 1
        else:
            out.succeeded += 1
    return out


@dataclass
class TickResult:
    """Counts of one maintenance tick (H-11); a failed step leaves its count 0."""

    claimed: int = 0
    suspended_checked: int = 0
    resumed: int = 0
    stale_released: int = 0
    #: stale jobs whose deliveries were used up: failed instead of released (Part I item 3)
    stale_given_up: int = 0
    events_flushed: int = 0
    stuck_reaped: int = 0
    workers_woken: int = 0
    errors: int = 0
    skipped: bool = False

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def did_work(self) -> bool:
        return any(
            (
                self.claimed,
                self.resumed,
                self.stale_released,
                self.stale_given_up,
                self.events_flushed,
                self.stuck_reaped,
            )
        )


def acquire_lease(kernel: Kernel, name: str, owner: str, ttl_seconds: float) -> bool:
    """Take (or renew) the named lease for ``ttl_seconds``; ``False`` if another owner holds an
    unexpired one.
    """
    now = kernel.clock.now()
    expires = now + timedelta(seconds=ttl_seconds)
    if (
        MaintenanceLease.objects.filter(name=name)
        .filter(Q(expires_at__lte=now) | Q(owner=owner))
        .update(owner=owner, expires_at=expires)
    ):
        return True
    try:
        with transaction.atomic():
            MaintenanceLease.objects.create(name=name, owner=owner, expires_at=expires)
    except IntegrityError:
        return False
    return True


def renew_lease(kernel: Kernel, name: str, owner: str, ttl_seconds: float) -> bool:
    """Extend a lease that ``owner`` still holds to ``now + ttl_seconds``; ``False`` if it is
    no longer theirs (it expired and another owner took it, or it was released).
    """
    expires = kernel.clock.now() + timedelta(seconds=ttl_seconds)
    return bool(MaintenanceLease.objects.filter(name=name, owner=owner).update(expires_at=expires))


def release_lease(name: str, owner: str) -> None:
    MaintenanceLease.objects.filter(name=name, owner=owner).delete()


def maintenance_lease_seconds() -> float:
    """TTL of the ``maintenance-tick`` lease: ``STALE_LEASE_SECONDS``, like a job's lease, so a
    process that dies mid-tick blocks maintenance no longer than a dead worker blocks its job.
    """
    return float(workflow_settings.STALE_LEASE_SECONDS)


def lease_heartbeat_seconds(ttl_seconds: float) -> float:
    """How often a held maintenance lease is refreshed: ``HEARTBEAT_INTERVAL_SECONDS``, at most
    a third of the lease's TTL.
    """
    return min(float(workflow_settings.HEARTBEAT_INTERVAL_SECONDS), ttl_seconds / 3)


class LeaseKeeper:
    """Refreshes a held maintenance lease every ``interval_seconds`` in a background thread
    (the H-2 heartbeat, applied to the tick and ticker leases).

    A lease's TTL can therefore be short: a holder that works longer than the TTL keeps its
    lease, and a holder that dies (SIGKILL, lost machine) is noticed once ``ttl_seconds`` have
    passed without a refresh. Refresh errors are logged and ignored; the thread stops once the
    lease is no longer the owner's.
    """

    def __init__(
        self, kernel: Kernel, name: str, owner: str, ttl_seconds: float, interval_seconds: float
    ) -> None:
        self.kernel = kernel
        self.name = name
        self.owner = owner
        self.ttl = ttl_seconds
        self.interval = interval_seconds
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"lease-{name}", daemon=True)

    def beat(self) -> bool:
        """Refresh the lease now; ``False`` if it is no longer the owner's."""
        return renew_lease(self.kernel, self.name, self.owner, self.ttl)

    def _loop(self) -> None:
        try:
            while not self._stop.wait(self.interval):
                try:
                    if not self.beat():
                        return
                except Exception:
                    logger.exception("Refreshing the %s lease failed", self.name)
        finally:
            connection.close()

    def __enter__(self) -> LeaseKeeper:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def lease_is_free(kernel: Kernel, name: str) -> bool:
    return not MaintenanceLease.objects.filter(
        name=name, expires_at__gt=kernel.clock.now()
    ).exists()


TICK_LEASE = "maintenance-tick"
#: A ready job older than this without a worker gets a fresh wake-up from the tick.
WAKE_AFTER_SECONDS = 2.0


def run_maintenance_tick(kernel: Kernel, worker_id: str) -> TickResult:
    """One maintenance tick (H-10), each step in its own error boundary.

    Ticks never overlap (Part I item 18): a tick that cannot take the ``maintenance-tick``
    lease returns at once with ``skipped=True``. The lease lasts ``STALE_LEASE_SECONDS`` and is
    refreshed while the tick runs (:class:`LeaseKeeper`), so a tick may take longer than that,
    and a tick whose process died stops blocking the others after ``STALE_LEASE_SECONDS``.
    """
    out = TickResult()
    close_old_connections()
    ttl = maintenance_lease_seconds()
    if not acquire_lease(kernel, TICK_LEASE, worker_id, ttl):
        out.skipped = True
        return out
    try:
        with LeaseKeeper(kernel, TICK_LEASE, worker_id, ttl, lease_heartbeat_seconds(ttl)):
            _tick_steps(kernel, worker_id, out)
    finally:
        release_lease(TICK_LEASE, worker_id)
    return out


def _tick_steps(kernel: Kernel, worker_id: str, out: TickResult) -> None:

    def step(name: str, fn: Any) -> None:
        try:
            fn()
        except Exception:
            out.errors += 1
            logger.exception("Maintenance step %s failed", name)

    def claim() -> None:
        res = kernel.dispatch(
            ClaimPendingRuns(worker_id, max_claims=int(workflow_settings.MAX_CLAIMS_PER_TICK))
        )
        out.claimed = len(res.claimed)

    def poll() -> None:
        res = kernel.dispatch(
            PollSuspendedStages(max_checks=int(workflow_settings.MAX_SUSPENDED_CHECKS_PER_TICK))
        )
        out.suspended_checked, out.resumed = res.checked, res.resumed
        for run_id in res.resumed_workflow_run_ids:
            kernel.dispatch(TransitionRun(run_id))

    def reap_leases() -> None:
        res = kernel.dispatch(
            ReapStaleLeases(stale_threshold_seconds=float(workflow_settings.STALE_LEASE_SECONDS))
        )
        out.stale_released, out.stale_given_up = res.released, res.failed
        if res.released:
            kernel.transport.wake_workers(res.released)

    def flush() -> None:
        res = kernel.dispatch(
            FlushOutbox(max_events=int(workflow_settings.MAX_OUTBOX_FLUSH_PER_TICK))
        )
        out.events_flushed = res.published

    def reap_stuck() -> None:
        res = kernel.dispatch(
            ReapStuckRuns(stuck_threshold_seconds=workflow_settings.stuck_threshold_seconds)
        )
        out.stuck_reaped = res.failed

    def wake_ready() -> None:
        now = kernel.clock.now()
        waiting = WorkflowJob.objects.filter(
            Q(next_poll_at__isnull=True) | Q(next_poll_at__lte=now),
            status=Status.PENDING,
            updated_at__lte=now - timedelta(seconds=WAKE_AFTER_SECONDS),
        )[:8].count()
        if waiting:
            kernel.transport.wake_workers(waiting)
        out.workers_woken = waiting

    step("run.claimPending", claim)
    step("stage.pollSuspended", poll)
    step("lease.reapStale", reap_leases)
    step("outbox.flush", flush)
    step("run.reapStuck", reap_stuck)
    step("wake", wake_ready)
