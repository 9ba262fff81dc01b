"""The per-process supervisor of a worker: prompt recovery and graceful stop (issue 8 items 2-3).

Every worker process runs one :class:`Supervisor` thread next to the thread that executes
stages. It runs *duties*, each of which says when it is next due; between duties the thread
sleeps (an idle process costs one cheap query per ``SUPERVISOR_INTERVAL_SECONDS``).

* :class:`TickerDuty` - sync the schedule definitions to their rows once when the process
  starts (so a schedule is due on an idle cluster), then compete for the ``ticker`` lease
  (TTL :func:`ticker_lease_seconds`, refreshed by the holder every third of it) and, while
  holding it and while a run is PENDING or RUNNING, run a maintenance tick every
  ``TICK_INTERVAL_SECONDS``. Every process looks every ``SUPERVISOR_INTERVAL_SECONDS``
  whether runs are live while nobody holds the lease, so a dead holder (SIGKILL, lost host)
  is replaced within the lease's TTL plus that interval, with any number of clusters alive
  and without waiting for django-q2's schedule.
* :class:`StopDuty` - watch the cluster's stop request (:class:`StopSignal`); once it is set,
  the ticker lease is given up at once (another process takes it within
  ``SUPERVISOR_INTERVAL_SECONDS``), the delivery loop leases nothing more, and after
  ``STOP_GRACE_SECONDS`` a delivery still executing is released (:func:`release_in_flight`)
  and the process exits, so the cluster can stop.

A duty that raises (a dropped connection, a database restart) is logged, the thread's
connection is closed so it is never reused, and the duty runs again on the next cycle.
Further duties (e.g. a presence heartbeat) are added with :meth:`Supervisor.add`.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from django.db import close_old_connections, connection
from django.db.models import Exists, OuterRef, QuerySet

from ..conf import workflow_settings
from ..models import MaintenanceLease, OutboxEvent, Status, WorkflowRun, WorkflowSchedule
from . import leases
from .connections import retry_on_disconnect
from .delivery import in_flight
from .leases import ticker_lease_seconds

if TYPE_CHECKING:
    from .dispatch import Kernel

logger = logging.getLogger("django_workflows.worker")

TICKER_LEASE = "ticker"
#: The longest the supervisor sleeps between two looks at its duties.
MAX_SLEEP_SECONDS = 60.0
#: How long :meth:`Supervisor.halt` waits for the thread to finish the duty it is in (seconds).
HALT_JOIN_SECONDS = 10.0
#: How often a stop request of the cluster is looked for (a lock-free read, no query).
STOP_POLL_SECONDS = 0.2
#: After a release, how long the stage body may take to notice ``ctx.is_cancelled()`` and
#: return before the process exits anyway.
RELEASE_EXIT_SECONDS = 1.0


class Duty(Protocol):
    """One periodic job of the supervisor thread."""

    name: str

    def run(self, now: float) -> float:
        """Do what is due at ``now`` (monotonic seconds); return seconds until next due."""

    def poke(self) -> None:
        """Something happened: be due at once."""

    def stop(self) -> None:
        """The process is stopping: give up what the duty holds; do no more work."""


def ticker_lease_name(kernel: Kernel) -> str:
    """The ``ticker`` lease of ``kernel``'s deploy (:func:`.versions.deploy_lease_name`: one
    ticker per set of definition versions, issue 12 item 3)."""
    from .versions import deploy_lease_name

    return deploy_lease_name(TICKER_LEASE, kernel.registry)


def ticker_needed(lease_clock: leases.LeaseClock, name: str = TICKER_LEASE) -> bool:
    """Whether there is maintenance to do - a run PENDING or RUNNING, an outbox event
    waiting to be published, or an unpaused schedule due (``next_fire_at`` passed; a schedule
    due hours from now does not count) - while nobody holds an unexpired ticker lease ``name``
    (expiry and due times judged in lease time, the database's clock). One query
    (``SELECT (EXISTS .. OR EXISTS .. OR EXISTS ..) AND NOT EXISTS ..``).

    The outbox counts: a process that committed a run's last events and stopped (SIGTERM)
    before its flusher published them leaves work that no run shows.
    """
    held = MaintenanceLease.objects.filter(name=name, expires_at__gt=lease_clock.now())
    due = WorkflowSchedule.objects.filter(paused=False, next_fire_at__lte=lease_clock.now())
    parts = [_exists(_live_runs()), _exists(_outbox_backlog()), _exists(due), _exists(held)]
    sql = f"SELECT ({parts[0][0]} OR {parts[1][0]} OR {parts[2][0]}) AND NOT {parts[3][0]}"
    with connection.cursor() as cursor:
        cursor.execute(sql, [p for _, params in parts for p in params])
        return bool(cursor.fetchone()[0])


def _exists(queryset: QuerySet[Any]) -> tuple[str, tuple[Any, ...]]:
    sql, params = queryset.values("pk")[:1].query.sql_with_params()
    return f"EXISTS ({sql})", tuple(params)


def _live_runs() -> QuerySet[WorkflowRun]:
    return WorkflowRun.objects.filter(status__in=[Status.PENDING, Status.RUNNING])


def _outbox_backlog() -> QuerySet[OutboxEvent]:
    """Events waiting to be published: unpublished, not dead letters, and not held back behind
    a dead letter of their run (strict per-run order; those wait for an operator, not for the
    ticker). Served by the partial ``wf_outbox_unpublished_idx``.
    """
    dead = OutboxEvent.objects.filter(
        workflow_run_id=OuterRef("workflow_run_id"),
        dlq_at__isnull=False,
        published_at__isnull=True,
    )
    return OutboxEvent.objects.filter(published_at__isnull=True, dlq_at__isnull=True).filter(
        ~Exists(dead)
    )


def _has_live_work() -> bool:
    """A live run or an outbox backlog (:func:`_outbox_backlog`)."""
    return _live_runs().exists() or _outbox_backlog().exists()


class TickerDuty:
    """Holds the ``ticker`` lease while runs are live and runs maintenance ticks meanwhile.

    Not holding: every ``SUPERVISOR_INTERVAL_SECONDS`` (or at once after :meth:`poke`) one
    query asks whether a run is live and the lease free (:func:`ticker_needed`); if so, take
    the lease. Holding: renew it every third of its TTL and tick every
    ``TICK_INTERVAL_SECONDS``; after a tick that began with no live run and really flushed the
    outbox (neither the tick nor its flush skipped for a lease another process holds), so the
    events written when the last run ended are published, give the lease up and go back to
    looking. A lease found taken over at a renewal is given up without ticking.

    A tick longer than the TTL may let another process take the ticker over meanwhile; ticks
    still never overlap (each holds the ``maintenance-tick`` lease, refreshed while it runs),
    and this process gives the ticker up at its next renewal.

    Args:
        kernel: a callable returning the kernel (read lazily: settings may change).
        owner: this process's lease owner name.
    """

    name = "ticker"

    def __init__(
        self,
        kernel: Callable[[], Kernel],
        owner: str,
    ) -> None:
        self._kernel = kernel
        self.owner = owner
        self.holding = False
        self._held_name = TICKER_LEASE
        self.stopped = False
        self.ticks = 0
        self._next_check = 0.0
        self._next_tick = 0.0
        self._next_renew = 0.0
        self.schedules_synced = False
        #: the kernel of the last tick, whose ``maintenance-tick`` lease is kept between ticks
        self._tick_kernel: Kernel | None = None
        self._lock = threading.Lock()

    def poke(self) -> None:
        self._next_check = 0.0

    def run(self, now: float) -> float:
        with self._lock:
            if self.stopped or not workflow_settings.SUPERVISOR_TICKS:
                return MAX_SLEEP_SECONDS
            check = float(workflow_settings.SUPERVISOR_INTERVAL_SECONDS)
            kernel = self._kernel()
            ttl = ticker_lease_seconds()
            name = ticker_lease_name(kernel)
            if not self.holding:
                if now < self._next_check:
                    return self._next_check - now
                self._next_check = now + check
                close_old_connections()
                if not self.schedules_synced:
                    self._sync_schedules(kernel)
                if not ticker_needed(kernel.lease_clock, name):
                    return check
                if not leases.acquire_lease(kernel.lease_clock, name, self.owner, ttl):
                    return check
                self.holding = True
                self._held_name = name
                self._next_tick = now
                self._next_renew = now + ttl / 3
                logger.info("%s holds the ticker lease", self.owner)
            if now >= self._next_renew:
                self._next_renew = now + ttl / 3
                if not leases.renew_lease(kernel.lease_clock, name, self.owner, ttl):
                    self._drop(release=False)
                    return check
            if now >= self._next_tick:
                from .hosting import run_maintenance_tick

                live = _has_live_work()  # read before the tick: its flush covers the last run
                self._tick_kernel = kernel  # before: a tick that raises may hold the lease
                tick = run_maintenance_tick(kernel, self.owner, keep_lease=True)
                self.ticks += 1
                self._next_tick = now + float(workflow_settings.TICK_INTERVAL_SECONDS)
                # A tick or flush skipped because another process holds its lease (maybe a
                # dead one, until the lease expires) did not flush the last run's events.
                # A tick that fired schedules made runs live: keep ticking for them.
                if (
                    not live
                    and not tick.skipped
                    and not tick.flush_skipped
                    and not tick.schedule_runs
                ):
                    self._drop(release=True)
                    self._next_check = now + check
                    return check
            return max(0.0, min(self._next_tick, self._next_renew) - now)

    def _sync_schedules(self, kernel: Kernel) -> None:
        """Once per process, before its first look: give this deploy's schedule definitions
        their rows (:func:`.schedules.sync_schedules`; one query when nothing changed), so a
        schedule deployed to an idle cluster is due by its first time although no tick runs
        (nothing else is live). Orphans nothing: a process of an older deploy restarting
        next to a newer one must not pause the newer one's schedules (the ticks decide).
        A failure is logged and retried at the next look.
        """
        from .schedules import sync_schedules

        try:
            sync_schedules(kernel, orphan=False)
        except Exception:
            connection.close()
            logger.exception("Could not sync the schedule definitions; retrying")
            return
        self.schedules_synced = True

    def _drop(self, *, release: bool) -> None:
        self.holding = False
        kernel, self._tick_kernel = self._tick_kernel, None
        if kernel is not None:  # the ticks kept their maintenance-tick lease
            from .hosting import release_tick_lease

            release_tick_lease(kernel, self.owner)
        if release:
            leases.release_lease(self._held_name, self.owner)

    def stop(self) -> None:
        with self._lock:
            self.stopped = True
            if self.holding:
                self._drop(release=True)


class StopSignal:
    """A stop request: set in this process (:meth:`set`) or by the cluster's main process.

    ``cluster_event`` is django-q2's ``stop_event`` (a ``multiprocessing.Event`` the main
    process sets on SIGTERM). It is read without taking its lock (the semaphore's value), so
    a worker process killed while reading it can never leave the lock held and wedge the
    cluster's own shutdown, and it is never waited on (a waiter killed inside ``wait()``
    would make ``set()`` block forever). Only ``is_set()`` is needed by the delivery loop.
    """

    def __init__(self, cluster_event: Any = None) -> None:
        self._local = threading.Event()
        self.cluster_event = cluster_event

    def set(self) -> None:
        self._local.set()

    def is_set(self) -> bool:
        if self._local.is_set():
            return True
        if self.cluster_event is not None and _peek(self.cluster_event):
            self._local.set()
            return True
        return False


def _peek(event: Any) -> bool:
    flag = getattr(event, "_flag", None)
    try:
        return bool(flag.get_value())  # type: ignore[union-attr]
    except (AttributeError, NotImplementedError):  # no sem_getvalue (macOS): take the lock
        return bool(event.is_set())


class StopDuty:
    """Graceful stop: once ``signal`` is set, stop the other duties, and past ``grace``
    seconds release what this process still executes, then end the process.

    Args:
        signal: the stop request to watch.
        others: the duties to stop when it is set (the ticker gives its lease up).
        exit_process: called once a delivery was released and the stage body did not return
            within ``RELEASE_EXIT_SECONDS`` (default ``os._exit(0)``).
    """

    name = "stop"

    def __init__(
        self,
        kernel: Callable[[], Kernel],
        signal: StopSignal,
        others: Callable[[], list[Duty]],
        *,
        exit_process: Callable[[], None] | None = None,
    ) -> None:
        self._kernel = kernel
        self.signal = signal
        self._others = others
        self._exit = exit_process or _exit_now
        self.stopping_since: float | None = None
        self.released: list[int] = []
        self._released_at: float | None = None

    def poke(self) -> None:
        return None

    def stop(self) -> None:
        return None

    def run(self, now: float) -> float:
        if self.stopping_since is None:
            if not self.signal.is_set():
                return STOP_POLL_SECONDS if self.signal.cluster_event is not None else 3600.0
            self.stopping_since = now
            logger.info("Worker %s: the cluster is stopping; no new job is leased", os.getpid())
            from .flusher import stop_holding

            stop_holding()
            for duty in self._others():
                if duty is not self:
                    duty.stop()
        grace = float(workflow_settings.STOP_GRACE_SECONDS)
        if self._released_at is not None:
            if not in_flight() or now >= self._released_at + RELEASE_EXIT_SECONDS:
                if in_flight():
                    logger.warning("Worker %s exits; its released stage still runs", os.getpid())
                    self._exit()
                return MAX_SLEEP_SECONDS
            return 0.1
        if now < self.stopping_since + grace:
            return self.stopping_since + grace - now
        beats = in_flight()
        if not beats:
            return 0.5  # nothing executing now (between transactions): look again shortly
        self.released = release_in_flight(self._kernel(), grace)
        self._released_at = now
        return 0.1


def exit_now() -> None:
    """End this worker process at once (``os._exit(0)`` after flushing the logs); django-q2's
    Sentinel starts a replacement unless the cluster is stopping."""
    logging.shutdown()
    os._exit(0)


_exit_now = exit_now


def release_in_flight(kernel: Kernel, grace_seconds: float) -> list[int]:
    """Release every delivery this process is executing (graceful stop past its grace).

    Each job goes back to PENDING fenced by its ``attempt`` (:meth:`JobQueue.release`), its
    ``ctx.is_cancelled()`` turns true, a WARN log names it, and one worker is woken for it;
    the late result of the stage body is discarded by the outcome transaction's fence.
    Returns the ids of the released jobs (a job whose outcome committed first is not).
    """
    from .store import write_log

    released = []
    for beat in in_flight():
        if beat.attempt is None:
            continue  # not fenced: cannot be released safely (never the case in delivery.work)
        job_id, attempt = beat.job_id, beat.attempt
        if not retry_on_disconnect(
            lambda job_id=job_id, attempt=attempt: kernel.queue.release(job_id, attempt=attempt),
            what=f"release of job {job_id}",
        ):
            continue
        beat.lost.set()
        released.append(beat.job_id)
        message = (
            f"Job {beat.job_id} delivery {beat.attempt} was released by a stopping worker "
            f"after STOP_GRACE_SECONDS={grace_seconds:g}; another worker runs it again"
        )
        logger.warning(message)
        try:
            write_log(
                kernel.clock.now(),
                "WARN",
                message,
                run_id=beat.run_id,
                metadata={"job_id": beat.job_id, "attempt": beat.attempt},
            )
        except Exception:
            logger.exception("Could not write the release log of job %s", beat.job_id)
    if released:
        from collections import Counter

        from ..models import WorkflowJob

        queues = Counter(
            WorkflowJob.objects.filter(pk__in=released).values_list("queue", flat=True)
        )
        for queue, count in sorted(queues.items()):  # wake the released jobs' own queues
            kernel.transport.wake_workers(count, queue=queue)
    return released


class Supervisor:
    """The supervisor thread of one worker process; see the module docstring.

    ``monotonic`` is the clock of the duties' schedule (tests pass a fake one and call
    :meth:`run_once` instead of starting the thread).
    """

    def __init__(self, monotonic: Callable[[], float] = time.monotonic) -> None:
        self.duties: list[Duty] = []
        self.monotonic = monotonic
        self._wake = threading.Event()
        self._halt = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def add(self, duty: Duty) -> Duty:
        """Run ``duty`` in this thread from its next cycle on; returns it."""
        with self._lock:
            self.duties.append(duty)
        self._wake.set()
        return duty

    def poke(self, name: str | None = None) -> None:
        """Make duty ``name`` (default: all) due now and wake the thread."""
        for duty in list(self.duties):
            if name is None or duty.name == name:
                duty.poke()
        self._wake.set()

    def start(self) -> Supervisor:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._halt.clear()
                self._thread = threading.Thread(target=self._loop, name="supervisor", daemon=True)
                self._thread.start()
        return self

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def halt(self, *, stop_duties: bool = True) -> None:
        """End the thread (tests), then stop the duties unless ``stop_duties`` is false (then
        nothing touches the database: a test kit tearing down after its database). The thread
        ends first so a duty's ``stop`` never races the same duty's ``run`` (on SQLite's
        shared in-memory test database that race fails with "database table is locked")."""
        self._halt.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=HALT_JOIN_SECONDS)
            if self._thread.is_alive():
                logger.warning(
                    "The supervisor thread is still inside a duty %s s after the halt; its "
                    "duties are stopped anyway",
                    HALT_JOIN_SECONDS,
                )
        if stop_duties:
            for duty in list(self.duties):
                duty.stop()

    def run_once(self) -> float:
        """Run every duty that is due; return seconds until the next one is."""
        wait = MAX_SLEEP_SECONDS
        for duty in list(self.duties):
            if self._halt.is_set():  # halting: the rest of the cycle is not started
                break
            wait = min(wait, self._run_duty(duty))
        return wait

    def _run_duty(self, duty: Duty) -> float:
        for retry in (False, True):
            try:
                return duty.run(self.monotonic())
            except Exception:
                # Never reuse a connection that failed: the next try opens a new one. One
                # retry at once covers a connection that died while idle.
                connection.close()
                if retry:
                    logger.exception("Supervisor duty %s failed; retrying next cycle", duty.name)
        return float(workflow_settings.SUPERVISOR_INTERVAL_SECONDS)

    def _loop(self) -> None:
        try:
            while not self._halt.is_set():
                wait = self.run_once()
                if self._wake.wait(max(0.0, wait)):
                    self._wake.clear()
        finally:
            connection.close()
