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
* :func:`ticker` - the floor of prompt recovery: make sure this worker process's supervisor
  thread runs and let it look at once (returns in milliseconds, so it never delays a stop). A
  django-q2 schedule (every minute, installed by ``migrate`` or ``workflows_install_schedule``)
  sends it.

Worker processes (:func:`on_post_spawn`, connected to django-q2's ``post_spawn`` signal, and
lazily from each task) run a supervisor thread (:mod:`..kernel.supervisor`): the process that
holds the ``ticker`` lease runs maintenance ticks every ``TICK_INTERVAL_SECONDS`` while runs
are live, every other process notices a dead holder within the lease's TTL, and the cluster's
SIGTERM is seen there (graceful stop: no new lease, release past ``STOP_GRACE_SECONDS``).

Routing (issue 8 item 5): a worker process serves the queues whose django-q2 cluster is its
own (:func:`served_queues`, from ``Conf.CLUSTER_NAME``, which ``Q_CLUSTER_NAME=gpu`` selects);
wake-ups for a queue's jobs go to that queue's cluster (``async_task(..., cluster=...)``), so
with the ORM broker they land in that cluster's ``list_key`` and with the Redis broker in its
``django_q:<cluster>:q`` list. Each worker process announces its queues
(:func:`announce_presence`) from its supervisor thread (:class:`PresenceDuty`) so idle
workers stay visible.

Cluster settings that matter (see README): ``timeout`` above your longest stage, ``retry``
above ``timeout``, ``max_attempts: 1`` (our table decides retries), ``save_limit: -1``, and
``CONN_MAX_AGE`` > 0 on the database.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from dataclasses import asdict
from typing import Any

from django.db import close_old_connections

from ..conf import workflow_settings
from ..kernel import flusher, routing, timeouts, wakeup
from ..kernel.hosting import (
    ProcessResult,
    default_worker_id,
    lease_is_free,
    process_available_jobs,
)
from ..kernel.runtime import get_kernel
from ..kernel.supervisor import (
    StopDuty,
    StopSignal,
    Supervisor,
    TickerDuty,
    exit_now,
    ticker_lease_name,
)
from ..kernel.supervisor import (
    ticker_lease_seconds as ticker_lease_seconds,
)
from ..retention import RetentionDuty

logger = logging.getLogger("django_workflows.worker")

WORK_TASK = "django_workflows.transport.django_q.work"
TICKER_TASK = "django_workflows.transport.django_q.ticker"
SCHEDULE_NAME = "django_workflows.ticker"

_worker_id: tuple[int, str] | None = None
_worker_id_lock = threading.Lock()


def worker_id() -> str:
    """This process's worker id (stable for the life of the django-q2 worker process; a
    forked child makes its own, so two processes never share one - it names lease owners).
    """
    global _worker_id
    with _worker_id_lock:
        if _worker_id is None or _worker_id[0] != os.getpid():
            _worker_id = (os.getpid(), default_worker_id())
        return _worker_id[1]


def work(claim: bool = False) -> dict[str, Any]:
    """django-q2 task: lease and deliver jobs while work is ready, continuing each run this
    worker advances and claiming PENDING runs when no job is ready (:mod:`..kernel.delivery`).

    With wake-ups on ``NOTIFY`` (:mod:`..kernel.wakeup`, PostgreSQL) the task lingers: having
    found no ready job it waits up to ``WORKER_LINGER_SECONDS`` for a notification and leases
    again, and it keeps leasing for up to :func:`..kernel.wakeup.work_task_seconds`, then
    hands on with one wake-up if work may be left. While its lease loops come back full it keeps
    its listener deaf (``UNLISTEN``: every listening connection costs the server a transaction
    per notification), and it listens again and looks once more before it lingers; a task that
    leaves deaf hands on. Without it the task makes up to
    ``JOBS_PER_WAKEUP`` deliveries and hands leftover work to the next wake-up.

    Once the cluster is stopping (:func:`stop_signal`) no further job is leased and no next
    stage is continued; a wake-up taken after that returns at once, and either hands one
    wake-up on (to a cluster that is not stopping).

    ``claim`` is kept for wake-ups queued by older versions; claiming is always on demand.
    """
    stop = stop_signal()
    if stop.is_set():
        # A wake-up prefetched by a stopping cluster: hand it on to a cluster that is not
        # stopping (this cluster's pusher fetches nothing more) instead of working.
        transport = get_kernel().transport
        for queue in sorted(served_queues()):
            transport.wake_workers(1, queue=queue)
        return asdict(ProcessResult())
    ensure_supervisor()
    close_old_connections()
    kernel = get_kernel()
    flusher.enable(kernel)
    queues = served_queues()
    limit = int(workflow_settings.JOBS_PER_WAKEUP)
    listener = ensure_listener()
    total = ProcessResult()
    hand_on = False
    if listener is None:
        total = process_available_jobs(
            kernel, worker_id(), max_jobs=limit, stop=stop, queues=queues
        )
        hand_on = total.processed >= limit or stop.is_set()
    else:
        linger = float(workflow_settings.WORKER_LINGER_SECONDS)
        deadline = time.monotonic() + wakeup.work_task_seconds()
        with listener.busy():
            while True:
                listener.clear()
                done = process_available_jobs(
                    kernel, worker_id(), max_jobs=limit, stop=stop, queues=queues
                )
                total.processed += done.processed
                total.succeeded += done.succeeded
                total.failed += done.failed
                more = done.processed >= limit
                if stop.is_set() or time.monotonic() >= deadline:
                    # A deaf task heard nothing of what was notified meanwhile: hand on.
                    hand_on = more or stop.is_set() or listener.deaf
                    break
                if more:
                    # Busy: a notification would be thrown away at the next clear(), and
                    # costs the server one transaction of the listener (kernel/wakeup.py).
                    listener.deafen()
                    continue
                if listener.deaf or not listener.listening.is_set():
                    # That look was deaf (this task's, or the task before it in this process
                    # left deaf and its LISTEN is not in effect yet): listen, then look once
                    # more before waiting. A listener whose connection is down cannot: wait
                    # anyway - once reconnected it looks for waiting work itself.
                    if listener.hear():
                        continue
                wait = min(linger, deadline - time.monotonic())
                if linger <= 0 or not listener.wait(wait, stop):
                    hand_on = stop.is_set()
                    break
                close_old_connections()
    if hand_on and not (listener is not None and not stop.is_set() and _wake_locally()):
        # Work may be left: hand it to the next free worker. With a listener, a new task in
        # this cluster's own queue takes over at once (a NOTIFY sent now would not reach this
        # process's listener while it is deaf); otherwise, and in a stopping cluster, through
        # the transport (a NOTIFY other clusters hear, or a broker row).
        for queue in sorted(queues):
            kernel.transport.wake_workers(1, queue=queue)
    return asdict(total)


def ensure_listener() -> wakeup.Listener | None:
    """This worker process's wake-up listener (:class:`..kernel.wakeup.Listener`), started if
    it is not running; ``None`` when wake-ups do not travel as ``NOTIFY``. A notification that
    finds no ``work`` task running here becomes one django-q2 wake-up of this cluster.
    """
    cluster = own_cluster()
    return wakeup.process_listener(cluster, lambda: _idle_wake(cluster))


def _idle_wake(cluster: str) -> None:
    """A notification reached this process while no ``work`` task runs here: start one on this
    host - put straight into this cluster's own task queue (:func:`_wake_locally`), else (not
    a django-q2 worker process, queue full) sent through the broker.
    """
    if stop_signal().is_set():
        return
    if cluster == own_cluster() and _wake_locally():
        return
    transport = get_kernel().transport
    if not isinstance(transport, DjangoQTransport):
        transport = DjangoQTransport()
    transport._wake_by_broker(1, cluster)


def local_task_queue() -> Any | None:
    """The task queue of this worker process's cluster - the ``multiprocessing`` queue its
    pusher fills with tasks taken from the broker and its worker processes read - or ``None``
    outside a django-q2 worker process.

    django-q2 forks each worker process with ``django_q.worker.worker(task_queue,
    result_queue, timer, timeout)`` as its target, and the forked child's ``Process`` object
    still holds those arguments.
    """
    import multiprocessing

    from django_q.worker import worker

    process = multiprocessing.current_process()
    args = getattr(process, "_args", ())
    if getattr(process, "_target", None) is not worker or not args:
        return None
    return args[0]


def _wake_locally() -> bool:
    """Put one ``work`` task into this cluster's own task queue (:func:`local_task_queue`);
    ``False`` if there is none or it is full (``queue_limit``: work enough is queued).

    The wake-up never leaves the host: with several hosts on one broker, a wake-up sent
    through the broker for an idle host could be taken by another host's pusher while this
    host's workers stay idle (issue 19: one host of three ran 1-6 % of the stages). It costs
    no database statement and starts at once, not at the pusher's next broker poll. The task
    runs in django-q2's worker loop like any other: its timeout, the monitor, the guard; it
    has no broker row to acknowledge. Once this process has begun to exit, ``False``
    (:func:`_close_local_wake_at_exit`).
    """
    task_queue = local_task_queue()
    if task_queue is None:
        return False
    with _local_wake_lock:
        if _local_wake_closed:
            return False
        _close_local_wake_at_exit()
        return _put_work_task(task_queue)


#: Serialises local puts against the process's exit (:func:`_close_local_wake_at_exit`).
_local_wake_lock = threading.Lock()
_local_wake_closed = False
_local_wake_finalizer_pid: int | None = None


def _close_local_wake_at_exit() -> None:
    """Make this process's exit stop local puts before ``multiprocessing`` closes the task
    queue's feeder (``Queue._finalize_close``, exit priority 10): a put after that would be
    queued behind the feeder's end marker and never sent, and the slot it took of the queue's
    ``queue_limit`` would never be given back - after ``queue_limit`` such losses (a worker
    recycled while its listener put) the cluster's pusher would block for good. Registered once
    per process (call with ``_local_wake_lock`` held)."""
    global _local_wake_finalizer_pid
    import multiprocessing.util

    if _local_wake_finalizer_pid == os.getpid():
        return
    _local_wake_finalizer_pid = os.getpid()
    multiprocessing.util.Finalize(None, _local_wake_closes, exitpriority=100)


def _local_wake_closes() -> None:
    global _local_wake_closed
    with _local_wake_lock:  # a put under way completes first, so the feeder still sends it
        _local_wake_closed = True


def _put_work_task(task_queue: Any) -> bool:
    import queue as queue_module
    import uuid

    from django.utils import timezone
    from django_q.conf import Conf

    task = {
        "id": uuid.uuid4().hex,
        "name": WORK_TASK.rsplit(".", 1)[-1],
        "func": WORK_TASK,
        "args": (),
        "kwargs": {},
        "started": timezone.now(),
        "cluster": Conf.CLUSTER_NAME,
    }
    try:
        task_queue.put(task, block=False)
    except queue_module.Full:
        return False
    return True


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


class PresenceDuty:
    """Supervisor duty (:mod:`..kernel.supervisor`): announce this worker process's queues
    every :func:`..kernel.routing.presence_interval_seconds` (stage routing presence), so an
    idle worker stays visible; a stopping process withdraws its presence at once.
    """

    name = "presence"

    def __init__(self) -> None:
        self._due = 0.0
        self._stopped = False

    def poke(self) -> None:
        self._due = 0.0

    def stop(self) -> None:
        if not self._stopped:
            self._stopped = True
            queues = served_queues()
            if queues:
                routing.withdraw(worker_id(), queues)

    def run(self, now: float) -> float:
        if self._stopped:
            return routing.presence_interval_seconds()
        if now >= self._due:
            announce_presence()
            self._due = now + routing.presence_interval_seconds()
        return max(0.0, self._due - now)


def ticker(run_seconds: float | None = None) -> dict[str, Any]:
    """django-q2 task: start this worker process's supervisor thread if it is not running and
    make its ticker duty look at once (take the ``ticker`` lease if runs are live and nobody
    holds it). Returns at once: ``{"supervisor": pid}``.

    ``run_seconds`` is accepted (and ignored) for ticker tasks queued by older versions, which
    ran the ticks in the task itself.
    """
    supervisor = ensure_supervisor()
    supervisor.poke(TickerDuty.name)
    return {"supervisor": os.getpid()}


# --- the worker process: supervisor thread and the cluster's stop --------------------------------

_stop = StopSignal()
_supervisor: Supervisor | None = None
_supervisor_pid: int | None = None
_supervisor_lock = threading.Lock()


def stop_signal() -> StopSignal:
    """This process's stop request (set once its django-q2 cluster is stopping)."""
    return _stop


def find_cluster_stop_event() -> Any | None:
    """django-q2's ``stop_event`` of the cluster this worker process belongs to, or ``None``.

    django-q2 (1.x, fork start method) forks worker processes from its ``Sentinel``, so the
    forked child's call stack still holds the ``Sentinel`` frames (``spawn_cluster`` or
    ``reincarnate`` -> ``spawn_worker``): the stack is walked from the caller (the
    ``post_spawn`` receiver) up to a frame whose ``self`` is a ``Sentinel``, and its
    ``stop_event`` (set by the cluster's main process on SIGTERM) is returned. ``None`` when
    not found (another start method, another django-q2 version, not a worker process): then
    the graceful stop is not available and django-q2's own stop applies (the worker finishes
    its current task, which may lease up to ``JOBS_PER_WAKEUP`` jobs).
    """
    try:
        from django_q.cluster import Sentinel
    except Exception:  # pragma: no cover - django-q2 not importable
        return None
    frame = sys._getframe(1)
    while frame is not None:
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, Sentinel):
            return getattr(candidate, "stop_event", None)
        frame = frame.f_back
    return None


def ensure_supervisor(cluster_stop: Any = None) -> Supervisor:
    """This process's supervisor thread, started if it is not running (after a fork it is
    made anew). ``cluster_stop``: the cluster's stop event, when known (:func:`on_post_spawn`).
    """
    global _supervisor, _supervisor_pid, _stop
    with _supervisor_lock:
        pid = os.getpid()
        if _supervisor is None or _supervisor_pid != pid:
            if _supervisor_pid != pid and _supervisor_pid is not None:
                _stop = StopSignal()  # inherited from the forking process: not ours
            if cluster_stop is not None:
                _stop.cluster_event = cluster_stop
            supervisor = Supervisor()
            supervisor.add(TickerDuty(get_kernel, worker_id() + "-ticker"))
            supervisor.add(PresenceDuty())
            supervisor.add(RetentionDuty(get_kernel, worker_id() + "-retention"))
            supervisor.add(StopDuty(get_kernel, _stop, lambda: list(supervisor.duties)))
            _supervisor, _supervisor_pid = supervisor, pid
        return _supervisor.start()


def current_supervisor() -> Supervisor | None:
    """The supervisor of this process, if one was started here."""
    if _supervisor is not None and _supervisor_pid == os.getpid() and _supervisor.alive:
        return _supervisor
    return None


def on_post_spawn(sender: Any = None, **kwargs: Any) -> None:
    """Receiver of django-q2's ``post_spawn`` (sent by each new worker process): start the
    supervisor thread with the cluster's stop event (:func:`find_cluster_stop_event`), and
    make a stage body that ignores its timeout end the process (:func:`.timeouts.set_recycle`).
    """
    # A stage body still running past its timeout and grace ends this process: the
    # Sentinel starts a fresh worker (kernel/timeouts.py).
    timeouts.set_recycle(exit_now)
    event = find_cluster_stop_event()
    if event is None:
        logger.warning(
            "Worker %s: django-q2's stop event was not found; a stopping cluster may still "
            "lease jobs (graceful stop unavailable)",
            os.getpid(),
        )
    try:
        ensure_supervisor(event)
    except Exception:  # never keep a worker from starting; the tasks start it lazily
        logger.exception("Could not start the workflow supervisor thread")
    try:
        ensure_listener()
    except Exception:  # the tasks start it lazily; the tick re-wakes meanwhile
        logger.exception("Could not start the wake-up listener")


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
        ``max_pending_wakeups`` queued there); none for a queue no cluster serves. With
        wake-ups on ``NOTIFY`` (:func:`..kernel.wakeup.notify_enabled`) one notification of
        that cluster instead (its lingering workers lease at once; an idle process turns it
        into one task).
        """
        cluster = routing.cluster_of(queue)
        if cluster is None:
            logger.debug("No django-q2 cluster serves queue %r (QUEUES); no wake-up sent", queue)
            return
        if wakeup.notify_enabled():
            self._notify(cluster)
            return
        self._wake_by_broker(jobs, cluster)

    def wake_workers_by_broker(self, jobs: int, queue: str = routing.DEFAULT_QUEUE) -> None:
        """Like :meth:`wake_workers`, always as django-q2 tasks: the tick's wake-up for jobs
        that stayed ready too long (:func:`..kernel.hosting.wake_ready_jobs`), which with
        NOTIFY means no listener heard them (a half-open listener socket, a pooler that drops
        notifications)."""
        cluster = routing.cluster_of(queue)
        if cluster is not None:
            self._wake_by_broker(jobs, cluster)

    def _wake_by_broker(self, jobs: int, cluster: str) -> None:
        count = min(jobs, self.max_pending_wakeups - self._queued(cluster))
        for _ in range(max(0, count)):
            self._send(WORK_TASK, cluster)

    def wake_claimer(self) -> None:
        # Wake-ups are hints: enough of them are queued already when the queue holds
        # max_pending_wakeups (each busy worker hands its leftover work on). Any worker
        # claims a run; its first jobs then wake their own queues' clusters.
        cluster = routing.default_cluster()
        if wakeup.notify_enabled():
            self._notify(cluster)
        elif self._queued(cluster) < self.max_pending_wakeups:
            self._send(WORK_TASK, cluster)

    def wake_in_transaction(self, jobs: int, queue: str | None = None) -> bool:
        """Wake ``queue``'s workers (``None``: a claimer of the default cluster) from inside
        the current transaction: with wake-ups on ``NOTIFY``, the notification rides its
        commit (one statement, no commit of its own; none more for the same cluster in the
        same transaction, :func:`..kernel.wakeup.notify_once_in_transaction`) and ``True`` is
        returned; otherwise ``False`` and nothing is done (the caller wakes after commit).
        """
        from django.db import connection

        if not connection.in_atomic_block or not wakeup.notify_enabled():
            return False
        cluster = routing.default_cluster() if queue is None else routing.cluster_of(queue)
        if cluster is not None:
            # once per transaction and cluster; an error aborts the transaction: let it raise
            wakeup.notify_once_in_transaction(cluster)
        return True

    def _notify(self, cluster: str) -> None:
        try:
            wakeup.notify(cluster)
        except Exception:  # a lost wake-up only delays work: the tick re-wakes
            logger.exception("Could not notify cluster %s's workers", cluster)

    def wake_ticker(self) -> None:
        supervisor = current_supervisor()
        if supervisor is not None:  # a worker process: its own supervisor looks at once
            supervisor.poke(TickerDuty.name)
        elif lease_is_free(get_kernel(), ticker_lease_name(get_kernel())):
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
