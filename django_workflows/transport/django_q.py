"""Workers on django-q2 (ARCHITECTURE §3, §5).

Our ``workflow_jobs`` table is the truth; django-q2 only carries wake-ups and runs schedules.
Every django-q2 delivery is treated as at-least-once and possibly duplicated: the job claim
(``SKIP LOCKED``) decides who works, and a duplicate wake-up finds nothing to claim.

Tasks:

* :func:`work` - make up to ``JOBS_PER_WAKEUP`` deliveries (:mod:`..kernel.delivery`): a
  worker continues each run it advances, claims PENDING runs when no job is ready, and hands
  leftover work to the next wake-up. Sent after commits that enqueued jobs nobody leased, or
  that created a run (at most ``max_pending_wakeups`` queued at once). Worker processes also
  flush the outbox right after their commits (:mod:`..kernel.flusher`).
* :func:`ticker` - run maintenance ticks every ``TICK_INTERVAL_SECONDS`` for up to
  ``TICKER_RUN_SECONDS`` while holding the ``ticker`` lease, so suspended stages are polled
  with sub-minute latency. It stops early once no run is PENDING or RUNNING. A django-q2
  schedule (every minute, installed by ``migrate`` or ``workflows_install_schedule``) starts it
  as the floor; a stage that suspends or a retry wakes it at once.

Routing (issue 8 item 5): a worker process serves the queues whose django-q2 cluster is its
own (:func:`served_queues`, from ``Conf.CLUSTER_NAME``, which ``Q_CLUSTER_NAME=gpu`` selects);
wake-ups for a queue's jobs go to that queue's cluster (``async_task(..., cluster=...)``), so
with the ORM broker they land in that cluster's ``list_key`` and with the Redis broker in its
``django_q:<cluster>:q`` list. Each worker process announces its queues
(:func:`announce_presence`) from a light timer thread so idle workers stay visible.

Cluster settings that matter (see README): ``timeout`` above your longest stage, ``retry``
above ``timeout``, ``max_attempts: 1`` (our table decides retries), ``save_limit: -1``, and
``CONN_MAX_AGE`` > 0 on the database.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import asdict
from typing import Any

from django.db import close_old_connections, connection

from ..conf import workflow_settings
from ..kernel import flusher, routing
from ..kernel.hosting import (
    LeaseKeeper,
    acquire_lease,
    default_worker_id,
    lease_heartbeat_seconds,
    lease_is_free,
    process_available_jobs,
    release_lease,
    renew_lease,
    run_maintenance_tick,
)
from ..kernel.runtime import get_kernel

logger = logging.getLogger("django_workflows.worker")

WORK_TASK = "django_workflows.transport.django_q.work"
TICKER_TASK = "django_workflows.transport.django_q.ticker"
TICKER_LEASE = "ticker"
SCHEDULE_NAME = "django_workflows.ticker"

_worker_id: str | None = None
_worker_id_lock = threading.Lock()


def worker_id() -> str:
    """This process's worker id (stable for the life of the django-q2 worker process)."""
    global _worker_id
    with _worker_id_lock:
        if _worker_id is None:
            _worker_id = default_worker_id()
        return _worker_id


def work(claim: bool = False) -> dict[str, Any]:
    """django-q2 task: deliver up to ``JOBS_PER_WAKEUP`` jobs, continuing each run this worker
    advances and claiming PENDING runs when no job is ready (:mod:`..kernel.delivery`).

    ``claim`` is kept for wake-ups queued by older versions; claiming is always on demand.
    """
    close_old_connections()
    kernel = get_kernel()
    flusher.enable(kernel)
    queues = served_queues()
    _presence.announce_if_due()
    limit = int(workflow_settings.JOBS_PER_WAKEUP)
    result = process_available_jobs(kernel, worker_id(), max_jobs=limit, queues=queues)
    if result.processed >= limit:
        for queue in sorted(queues):  # work may be left: hand it to the next free worker
            kernel.transport.wake_workers(1, queue=queue)
    return asdict(result)


def own_cluster() -> str:
    """This process's django-q2 cluster name (``django_q.conf.Conf.CLUSTER_NAME``: the
    ``Q_CLUSTER_NAME`` environment variable with ``Q_CLUSTER["ALT_CLUSTERS"]``, else
    ``Q_CLUSTER["name"]``).
    """
    from django_q.conf import Conf

    return str(Conf.CLUSTER_NAME)


def served_queues() -> frozenset[str]:
    """The queues this process's workers lease jobs of (:func:`..kernel.routing.queues_served_by`
    of :func:`own_cluster`).
    """
    return routing.queues_served_by(own_cluster())


def announce_presence() -> None:
    """Write this worker process's presence for every queue it serves
    (:func:`..kernel.routing.announce`). Callable from any thread; the caller's thread keeps
    its connection (close it when the thread idles).
    """
    queues = served_queues()
    if queues:
        routing.announce(worker_id(), queues)


class _PresenceTimer:
    """A daemon thread per process that calls :func:`announce_presence` every
    :func:`..kernel.routing.presence_interval_seconds` (closing its connection in between), so
    an idle worker stays visible. Started on django-q2's ``post_spawn`` signal (in each worker
    process; the ``work`` task also announces when due). Errors are logged and retried at the
    next interval.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._last = 0.0

    def ensure_started(self) -> None:
        with self._lock:
            if self._thread is not None and self._thread.is_alive():
                return
            self._thread = threading.Thread(target=self._loop, name="presence", daemon=True)
            self._thread.start()

    def announce_if_due(self) -> None:
        """Announce now unless this process announced within half an interval."""
        if time.monotonic() - self._last >= routing.presence_interval_seconds() / 2:
            self._announce()

    def _announce(self) -> None:
        try:
            announce_presence()
            self._last = time.monotonic()
        except Exception:
            logger.exception("Announcing worker presence failed")
            connection.close()

    def _loop(self) -> None:
        while True:
            self.announce_if_due()
            connection.close()  # hold no connection while idle
            time.sleep(max(0.05, routing.presence_interval_seconds() / 2))


_presence = _PresenceTimer()


def on_post_spawn(sender: Any = None, **kwargs: Any) -> None:
    """django-q2 ``post_spawn`` receiver: start the presence timer in a new worker process."""
    _presence.ensure_started()


def _has_live_runs() -> bool:
    from ..models import Status, WorkflowRun

    return WorkflowRun.objects.filter(status__in=[Status.PENDING, Status.RUNNING]).exists()


def ticker(run_seconds: float | None = None) -> dict[str, Any]:
    """django-q2 task: maintenance ticks every ``TICK_INTERVAL_SECONDS`` while holding the
    ``ticker`` lease; returns at once if another ticker holds it.

    It stops after ``run_seconds`` (default ``TICKER_RUN_SECONDS``), or after the first tick
    that began with no PENDING or RUNNING run - so the events written when the last run ended
    are flushed before it stops. The lease (:func:`ticker_lease_seconds`) is refreshed while the
    ticker runs; if it was lost to another ticker, this one stops.
    """
    close_old_connections()
    kernel = get_kernel()
    owner = worker_id() + "-ticker"
    duration = float(
        run_seconds if run_seconds is not None else workflow_settings.TICKER_RUN_SECONDS
    )
    interval = float(workflow_settings.TICK_INTERVAL_SECONDS)
    ttl = ticker_lease_seconds(duration)
    if not acquire_lease(kernel, TICKER_LEASE, owner, ttl):
        return {"ticks": 0, "skipped": True}
    ticks = 0
    deadline = time.monotonic() + duration
    try:
        with LeaseKeeper(kernel, TICKER_LEASE, owner, ttl, lease_heartbeat_seconds(ttl)):
            while time.monotonic() < deadline:
                # Read before the tick: the tick after the last run ended flushes its events.
                live = _has_live_runs()
                run_maintenance_tick(kernel, owner)
                ticks += 1
                if not live or not renew_lease(kernel, TICKER_LEASE, owner, ttl):
                    break
                time.sleep(interval)
    finally:
        release_lease(TICKER_LEASE, owner)
    return {"ticks": ticks, "skipped": False}


def ticker_lease_seconds(run_seconds: float) -> float:
    """TTL of the ``ticker`` lease: ``STALE_LEASE_SECONDS``, capped at the ticker's run time
    plus 30 s. The ticker refreshes it while it runs, so a ticker killed with its cluster
    stops blocking new tickers after this long.
    """
    return min(run_seconds + 30, float(workflow_settings.STALE_LEASE_SECONDS))


class DjangoQTransport:
    """Sends wake-ups as django-q2 tasks (``async_task``), after commit."""

    max_pending_wakeups = 8

    def _send(self, func: str, cluster: str, **kwargs: Any) -> None:
        from django_q.tasks import async_task

        options: dict[str, Any] = {"task_name": func.rsplit(".", 1)[-1], "cluster": cluster}
        try:
            async_task(func, q_options=options, **kwargs)
        except Exception:  # a lost wake-up only delays work: the tick re-wakes
            logger.exception("Could not send django-q2 wake-up %s to cluster %s", func, cluster)

    def _queued(self, cluster: str) -> int:
        """Tasks waiting in ``cluster``'s broker queue (ORM: its ``list_key``; Redis: its
        ``django_q:<cluster>:q`` list); 0 when the broker cannot tell.
        """
        try:
            from django_q.brokers import get_broker

            return int(get_broker(cluster).queue_size() or 0)
        except Exception:
            return 0

    def wake_workers(self, jobs: int, queue: str = routing.DEFAULT_QUEUE) -> None:
        """Send up to ``jobs`` ``work`` tasks to ``queue``'s cluster (at most
        ``max_pending_wakeups`` queued there); none for a queue no cluster serves.
        """
        cluster = routing.cluster_of(queue)
        if cluster is None:
            logger.debug("No django-q2 cluster serves queue %r (QUEUES); no wake-up sent", queue)
            return
        count = min(jobs, self.max_pending_wakeups - self._queued(cluster))
        for _ in range(max(0, count)):
            self._send(WORK_TASK, cluster)

    def wake_claimer(self) -> None:
        # Wake-ups are hints: enough of them are queued already when the queue holds
        # max_pending_wakeups (each busy worker hands its leftover work on). Any worker
        # claims a run; its first jobs then wake their own queues' clusters.
        cluster = routing.default_cluster()
        if self._queued(cluster) < self.max_pending_wakeups:
            self._send(WORK_TASK, cluster)

    def wake_ticker(self) -> None:
        if lease_is_free(get_kernel(), TICKER_LEASE):
            self._send(TICKER_TASK, routing.default_cluster())


def install_schedule() -> bool:
    """Create or update the one-minute django-q2 schedule that starts the ticker (idempotent).

    Returns ``True`` if the schedule row was created.
    """
    from django_q.models import Schedule

    _, created = Schedule.objects.update_or_create(
        name=SCHEDULE_NAME,
        defaults={
            "func": TICKER_TASK,
            "schedule_type": Schedule.MINUTES,
            "minutes": 1,
            "repeats": -1,
        },
    )
    return created
