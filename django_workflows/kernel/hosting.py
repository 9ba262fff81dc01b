"""Host logic shared by every way of running the engine (SPEC §7.2-7.3, §7.6).

* :func:`execute_job` - run one leased job with heartbeats, apply its outcome and transition
  the run in one transaction (H-1..H-8).
* :func:`process_available_jobs` - lease and deliver ready jobs until none is left or a limit
  is reached (H-42); the path itself is :mod:`django_workflows.kernel.delivery`.
* :func:`run_maintenance_tick` - fire due schedules, claim pending runs, poll suspended stages,
  reap stale leases, flush the outbox, reap stuck runs, fail jobs past their queue-wait limit
  (:func:`.timeouts.fail_unstarted_jobs`); each step in its own error boundary (H-10, H-11),
  retried once on a new connection after a dead one (:mod:`.connections`).

The django-q2 transport, the ``workflows_tick`` command and the test kit all call these.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import uuid
import weakref
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any

from django.db import close_old_connections, connection
from django.db.models import Q

from ..conf import workflow_settings
from ..models import Status, WorkflowJob
from . import delivery, leases, timeouts
from .commands import (
    ClaimPendingRuns,
    PollSuspendedStages,
    ReapStaleLeases,
    ReapStuckRuns,
    TransitionRun,
)
from .connections import retry_on_disconnect
from .delivery import Heartbeat as Heartbeat
from .dispatch import Kernel
from .flusher import flush_outbox
from .flusher import holding as flusher_holding
from .leases import LeaseKeeper as LeaseKeeper
from .leases import lease_heartbeat_seconds as lease_heartbeat_seconds
from .stage_path.lease import lease_job

logger = logging.getLogger("django_workflows.worker")


def default_worker_id() -> str:
    """``worker-{host}-{pid}-{random}`` (DM-49)."""
    return f"worker-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


@dataclass
class JobOutcome:
    """How one delivery ended (see :class:`.delivery.Outcome`)."""

    outcome: str
    error: str | None = None


def execute_job(kernel: Kernel, job: WorkflowJob) -> JobOutcome:
    """Execute a job leased by :meth:`JobQueue.dequeue` and apply its outcome (H-3..H-8), the
    outcome's job settlement and the run's transition in one transaction: the production
    stage path (:mod:`.delivery`) entered at one given job
    (:func:`.stage_path.lease.lease_job`, fenced by the job's ``attempt``). The next stage is
    not continued here: its jobs are queued.

    A job whose workflow or stage the loaded definition lacks is failed with its run at once
    (``DefinitionMismatch`` / ``WorkflowNotFound``; :func:`.delivery.begin`).
    """
    started, _ = lease_job(kernel, job.pk, job.worker_id or "", attempt=job.attempt)
    if started is None:
        return JobOutcome(
            "failed",
            "Job settled without executing (run not RUNNING, done, its workflow or stage "
            "missing from the loaded definition, or no longer this lease's)",
        )
    result = delivery.deliver(kernel, started, None)
    return JobOutcome(result.outcome, result.error)


@dataclass
class ProcessResult:
    processed: int = 0
    succeeded: int = 0
    failed: int = 0


def process_available_jobs(
    kernel: Kernel,
    worker_id: str,
    *,
    max_jobs: int = 1,
    stop: threading.Event | None = None,
    queues: frozenset[str] | None = None,
) -> ProcessResult:
    """Deliver ready jobs until the queue is empty, ``max_jobs`` were processed, or ``stop`` is
    set (H-42; Part I item 18: a stop request finishes the in-flight job first). A worker
    continues the run it just advanced (:func:`.delivery.work`) and claims PENDING runs when
    no job is ready. ``queues``: the queues this worker serves (``None``: all; issue 8 item 5).
    """
    done = delivery.work(kernel, worker_id, max_jobs=max_jobs, stop=stop, queues=queues)
    return ProcessResult(done.processed, done.succeeded, done.failed)


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
    #: ready jobs no worker of their queue leased within their queue-wait limit: failed
    queue_timed_out: int = 0
    workers_woken: int = 0
    #: runs started by due schedules (:mod:`.schedules`)
    schedule_runs: int = 0
    errors: int = 0
    skipped: bool = False
    #: the outbox flush did not run (another process held the ``outbox-flush`` lease)
    flush_skipped: bool = False

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def did_work(self) -> bool:
        return any(
            (
                self.schedule_runs,
                self.claimed,
                self.resumed,
                self.stale_released,
                self.stale_given_up,
                self.events_flushed,
                self.stuck_reaped,
                self.queue_timed_out,
            )
        )


def acquire_lease(kernel: Kernel, name: str, owner: str, ttl_seconds: float) -> bool:
    """Take (or renew) the named lease for ``ttl_seconds`` in lease time (the database's
    clock); ``False`` if another owner holds an unexpired one.
    """
    return leases.acquire_lease(kernel.lease_clock, name, owner, ttl_seconds)


def renew_lease(kernel: Kernel, name: str, owner: str, ttl_seconds: float) -> bool:
    """Extend a lease that ``owner`` still holds; ``False`` if it is no longer theirs."""
    return leases.renew_lease(kernel.lease_clock, name, owner, ttl_seconds)


release_lease = leases.release_lease


def maintenance_lease_seconds() -> float:
    """TTL of the ``maintenance-tick`` lease: the ticker lease's TTL
    (:func:`.leases.ticker_lease_seconds`, at most ``STALE_LEASE_SECONDS``), so a process
    that dies mid-tick blocks maintenance no longer than a dead ticker does.
    """
    return leases.ticker_lease_seconds()


def lease_is_free(kernel: Kernel, name: str) -> bool:
    """Whether nobody holds an unexpired lease ``name``."""
    return leases.lease_is_free(kernel.lease_clock, name)


def wake_ready_jobs(kernel: Kernel, *, older_than_seconds: float, limit: int = 8) -> int:
    """Wake workers for ready PENDING jobs not updated for ``older_than_seconds``: up to
    ``limit`` wake-ups in all, each sent to its job's queue (issue 8 item 5). Returns the
    number of wake-ups asked for. Jobs that waited (``older_than_seconds`` > 0) are woken
    through the transport's broker when it has one (``wake_workers_by_broker``).
    """
    now = kernel.clock.now()
    queues = list(
        WorkflowJob.objects.filter(
            Q(next_poll_at__isnull=True) | Q(next_poll_at__lte=kernel.lease_clock.now()),
            status=Status.PENDING,
            updated_at__lte=now - timedelta(seconds=older_than_seconds),
        ).values_list("queue", flat=True)[:limit]
    )
    counts: dict[str, int] = {}
    for queue in queues:
        counts[queue] = counts.get(queue, 0) + 1
    # A job ready this long was not heard: wake through the broker where the transport can
    # (with NOTIFY wake-ups, a listener may be deaf; issue 19).
    wake = kernel.transport.wake_workers
    if older_than_seconds > 0:
        wake = getattr(kernel.transport, "wake_workers_by_broker", wake)
    for queue, count in counts.items():
        wake(count, queue=queue)
    return len(queues)


TICK_LEASE = "maintenance-tick"


def tick_lease_name(kernel: Kernel) -> str:
    """The ``maintenance-tick`` lease of ``kernel``'s deploy
    (:func:`.versions.deploy_lease_name`)."""
    from .versions import deploy_lease_name

    return deploy_lease_name(TICK_LEASE, kernel.registry)


#: A ready job older than this without a worker gets a fresh wake-up from the tick.
WAKE_AFTER_SECONDS = 2.0


def run_maintenance_tick(kernel: Kernel, worker_id: str, *, keep_lease: bool = False) -> TickResult:
    """One maintenance tick (H-10), each step in its own error boundary.

    Ticks of one deploy never overlap (Part I item 18): a tick that cannot take the
    ``maintenance-tick`` lease (:func:`tick_lease_name`: one per set of definition versions,
    issue 12 item 3) returns at once with ``skipped=True``. The lease lasts
    :func:`maintenance_lease_seconds` and is refreshed while the tick runs
    (:class:`LeaseKeeper`), so a tick may take longer than that, and a tick whose process died
    stops blocking the others after that long.

    ``keep_lease``: do not give the lease up after the tick (the ticker duty, which ticks
    again within ``TICK_INTERVAL_SECONDS``, releases it when it stops ticking:
    :func:`release_tick_lease`); the next tick then renews it with one statement instead of
    taking it anew with three (issue 19).
    """
    out = TickResult()
    if not connection.in_atomic_block:
        # Inside an enclosing transaction (a test's atomic block) this would close the
        # connection that transaction lives on.
        close_old_connections()
    ttl = maintenance_lease_seconds()
    name = tick_lease_name(kernel)
    taken = retry_on_disconnect(
        lambda: acquire_lease(kernel, name, worker_id, ttl), what="maintenance lease"
    )
    if not taken:
        out.skipped = True
        return out
    try:
        if connection.in_atomic_block:  # nobody else can see the lease before the commit
            _tick_steps(kernel, worker_id, out)
        else:
            with LeaseKeeper(kernel, name, worker_id, ttl, lease_heartbeat_seconds(ttl)):
                _tick_steps(kernel, worker_id, out)
    finally:
        if not keep_lease:
            release_tick_lease(kernel, worker_id)
    return out


def release_tick_lease(kernel: Kernel, worker_id: str) -> None:
    """Give up ``worker_id``'s ``maintenance-tick`` lease of ``kernel``'s deploy (a no-op if it
    holds none)."""
    name = tick_lease_name(kernel)
    retry_on_disconnect(lambda: release_lease(name, worker_id), what="maintenance lease release")


#: When each kernel's ticks last ran the stuck-run reaper (kernel clock).
_last_stuck_reap: weakref.WeakKeyDictionary[Kernel, Any] = weakref.WeakKeyDictionary()


def stuck_reap_interval(threshold_seconds: float) -> float:
    """How often the tick runs the stuck-run reaper (seconds, kernel clock): a tenth of the
    stuck threshold, at most 30 s. A run is reaped at most that long after it became stuck;
    the reaper's query grows with the live runs (about 50 ms at 10,000 live, issue 19's
    scale bench), so it does not run every tick.
    """
    return min(30.0, max(0.0, float(threshold_seconds)) / 10)


def _tick_steps(kernel: Kernel, worker_id: str, out: TickResult) -> None:

    def step(name: str, fn: Any) -> None:
        try:
            # A dead connection is replaced and the step run once more (each step is its own
            # transaction); the tick's other steps never inherit a dead connection.
            retry_on_disconnect(fn, what=f"maintenance step {name}", window_seconds=0)
        except Exception:
            out.errors += 1
            logger.exception("Maintenance step %s failed", name)

    def fire_schedules() -> None:
        from .schedules import fire_due_schedules

        out.schedule_runs = fire_due_schedules(kernel).started

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
            wake_ready_jobs(kernel, older_than_seconds=0.0)

    def flush() -> None:
        if flusher_holding():  # this process's flusher is publishing everyone's events
            out.flush_skipped = True
            return
        published = flush_outbox(
            kernel, worker_id, max_events=int(workflow_settings.MAX_OUTBOX_FLUSH_PER_TICK)
        )
        out.flush_skipped = published is None
        out.events_flushed = published or 0

    def reap_stuck() -> None:
        threshold = workflow_settings.stuck_threshold_seconds
        now = kernel.clock.now()
        last = _last_stuck_reap.get(kernel)
        if last is not None and (now - last).total_seconds() < stuck_reap_interval(threshold):
            return
        res = kernel.dispatch(ReapStuckRuns(stuck_threshold_seconds=threshold))
        _last_stuck_reap[kernel] = now
        out.stuck_reaped = res.failed

    def fail_unstarted() -> None:
        out.queue_timed_out = timeouts.fail_unstarted_jobs(kernel)

    def wake_ready() -> None:
        out.workers_woken = wake_ready_jobs(kernel, older_than_seconds=WAKE_AFTER_SECONDS)

    step("schedule.fire", fire_schedules)  # first: the runs it creates are claimed at once
    step("run.claimPending", claim)
    step("stage.pollSuspended", poll)
    step("lease.reapStale", reap_leases)
    step("outbox.flush", flush)
    step("run.reapStuck", reap_stuck)
    step("job.queueTimeout", fail_unstarted)
    step("wake", wake_ready)
