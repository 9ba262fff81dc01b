"""Waking idle workers with PostgreSQL ``LISTEN``/``NOTIFY`` (issue 19).

Without it every commit that leaves a job for another worker (a parallel group's second stage,
a new run) writes a django-q2 broker row, which the cluster's pusher polls for, a worker takes
and the monitor deletes: three or four more commits per wake-up, and a latency of the broker's
``poll`` interval. With it (``WAKE_WITH_NOTIFY``, on by default on PostgreSQL):

* **Sender.** The transaction that enqueued the job (or created the run) also runs
  ``SELECT pg_notify('django_workflows_wake', <cluster>)`` (:func:`notify`): one statement, no
  commit of its own, delivered by PostgreSQL when that transaction commits and dropped with it
  when it rolls back. No broker row is written.
* **Listener.** Every worker process keeps one extra connection (``application_name``
  ``django_workflows.listener``) that ``LISTEN``\\ s on the channel in a daemon thread
  (:class:`Listener`); a notification for its cluster sets an event.
* **Lingering worker.** A django-q2 ``work`` task that found no ready job does not return: it
  waits up to ``WORKER_LINGER_SECONDS`` for that event and leases again when it is set, so a
  busy or recently busy cluster needs no broker traffic at all. A task also keeps leasing while
  work is ready (``JOBS_PER_WAKEUP`` per lease loop, the loop repeated until the task has run
  for :func:`work_task_seconds`), then hands on with one wake-up.
* **Idle process.** A notification that reaches a process not running a ``work`` task (its
  linger ran out) is turned into one django-q2 ``work`` task by its listener (at most one per
  :data:`IDLE_WAKE_INTERVAL_SECONDS` per process), put straight into the process's own
  cluster's task queue (``transport.django_q._wake_locally``: no broker row, no wait for the
  pusher's poll, and with several hosts on one broker each host wakes its own workers); the
  broker is the floor when that queue is full or the process is not a django-q2 worker.
* **Deaf while busy.** PostgreSQL signals *every* backend that listens in the database
  on every ``NOTIFY`` commit (whatever the channel) and each of them reads the queue in a
  transaction of its own: one more server-counted commit per notification per listening
  process (measured: 100 notifications, 2 listeners, 306 commits). A ``work`` task that keeps
  leasing because work is ready (a full lease loop) would only throw those notifications away
  at its next look, so it asks its listener to ``UNLISTEN`` (:meth:`Listener.deafen`); before
  the task lingers it listens again and then looks once more (:meth:`Listener.hear`), so a
  notification sent while it was deaf is never needed (issue 19: about 1 server commit per
  stage in a busy cluster).

A notification nobody hears (no worker process connected, a listener reconnecting) is not lost
work: the job stays PENDING in our table, a reconnected listener wakes its process once, and the
maintenance tick re-wakes ready jobs older than ``hosting.WAKE_AFTER_SECONDS``.
"""

from __future__ import annotations

import logging
import os
import select
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from django.db import DEFAULT_DB_ALIAS, connections

from ..conf import workflow_settings

logger = logging.getLogger("django_workflows.worker")

#: The ``LISTEN``/``NOTIFY`` channel; the payload is the django-q2 cluster name to wake.
CHANNEL = "django_workflows_wake"
#: ``application_name`` of the listener connections (seen in ``pg_stat_activity``).
LISTENER_APPLICATION_NAME = "django_workflows.listener"
#: A process not running a ``work`` task sends at most one django-q2 wake-up this often.
IDLE_WAKE_INTERVAL_SECONDS = 1.0
#: How long the listener blocks on its socket per look (seconds): its stop latency.
LISTEN_POLL_SECONDS = 1.0
#: Back-off of a listener whose connection failed (seconds, doubling).
RECONNECT_MIN_SECONDS, RECONNECT_MAX_SECONDS = 0.5, 10.0
#: How long :meth:`Listener.hear` waits for the listener thread's ``LISTEN`` (seconds).
HEAR_TIMEOUT_SECONDS = 1.0


def notify_enabled() -> bool:
    """Whether wake-ups travel as ``NOTIFY`` (``WAKE_WITH_NOTIFY``: ``"auto"`` - on when the
    default database is PostgreSQL -, ``True`` or ``False``).

    Raises:
        ImproperlyConfigured: ``WAKE_WITH_NOTIFY`` is ``True`` on a database that is not
            PostgreSQL (system check E031 reports it at start-up).
    """
    value = workflow_settings.WAKE_WITH_NOTIFY
    is_pg = connections[DEFAULT_DB_ALIAS].vendor == "postgresql"
    if value == "auto":
        return is_pg
    if value and not is_pg:
        from django.core.exceptions import ImproperlyConfigured

        raise ImproperlyConfigured(
            "DJANGO_WORKFLOWS['WAKE_WITH_NOTIFY'] is True but the default database is not "
            "PostgreSQL (LISTEN/NOTIFY needs PostgreSQL); use 'auto' or False"
        )
    return bool(value)


def notify(cluster: str) -> None:
    """Ask the worker processes of django-q2 cluster ``cluster`` to lease: one
    ``SELECT pg_notify(...)`` on the default connection. Inside a transaction PostgreSQL
    delivers it at commit (and never, on rollback); outside one, at once. Duplicate
    notifications of one transaction are folded into one by PostgreSQL.
    """
    with connections[DEFAULT_DB_ALIAS].cursor() as cursor:
        cursor.execute("SELECT pg_notify(%s, %s)", [CHANNEL, cluster])


class _Notified:
    """An ``on_commit`` callback that does nothing: its presence among the transaction's
    callbacks says that ``cluster`` was notified in this transaction (see
    :func:`notify_once_in_transaction`)."""

    __slots__ = ("cluster",)

    def __init__(self, cluster: str) -> None:
        self.cluster = cluster

    def __call__(self) -> None:
        return None


def notify_once_in_transaction(cluster: str) -> None:
    """:func:`notify` ``cluster`` from inside the current transaction of the default
    connection, unless this transaction already did (issue 19).

    PostgreSQL folds a transaction's duplicate notifications into one at commit, but each
    ``pg_notify`` is still a round trip: ``start_run`` called for 300 runs in one
    ``transaction.atomic()`` sent 300 of them. The first notification registers a
    :class:`_Notified` marker with ``transaction.on_commit``; Django keeps it exactly as long as
    PostgreSQL keeps the notification - dropped when the transaction or the savepoint it was
    sent in rolls back, run (as a no-op) and cleared at the commit - so a later wake-up in the
    same transaction finds it and sends nothing, and one after a rollback to a savepoint sends
    again.

    Raises:
        django.db.DatabaseError: the ``pg_notify`` failed (the transaction is then aborted).
    """
    from django.db import transaction

    pending = connections[DEFAULT_DB_ALIAS].run_on_commit  # (savepoint ids, func, robust)
    if any(isinstance(f, _Notified) and f.cluster == cluster for _, f, _ in pending):
        return
    notify(cluster)
    transaction.on_commit(_Notified(cluster))


def wake_workers_at_commit(transport: Any, jobs: int, queue: str) -> None:
    """Wake ``jobs`` workers of ``queue`` once the current transaction commits: inside it when
    the transport can (``wake_in_transaction``: a ``NOTIFY`` riding the commit), else with
    ``transport.wake_workers`` from ``transaction.on_commit``."""
    from django.db import transaction

    early = getattr(transport, "wake_in_transaction", None)
    if early is None or not early(jobs, queue):
        transaction.on_commit(lambda: transport.wake_workers(jobs, queue=queue))


def wake_claimer_at_commit(transport: Any) -> None:
    """Wake one worker to claim a PENDING run once the current transaction commits (see
    :func:`wake_workers_at_commit`)."""
    from django.db import transaction

    early = getattr(transport, "wake_in_transaction", None)
    if early is None or not early(1, None):
        transaction.on_commit(transport.wake_claimer)


def work_task_seconds() -> float:
    """How long one django-q2 ``work`` task keeps leasing before it hands on (seconds):
    ``WORK_TASK_SECONDS``, at most half of django-q2's ``timeout`` (so a stage started near the
    end still finishes well inside the task's timeout) and half of its ``retry`` (after which
    the ORM broker would hand the still-running task out again).
    """
    budget = float(workflow_settings.WORK_TASK_SECONDS)
    try:
        from django_q.conf import Conf

        timeout = getattr(Conf, "TIMEOUT", None)
        retry = getattr(Conf, "RETRY", None)
    except Exception:  # pragma: no cover - django-q2 not importable
        timeout = retry = None
    for limit in (timeout, retry):  # retry: the ORM broker hands a task out again after it
        if limit:
            budget = min(budget, float(limit) / 2)
    return max(budget, 0.0)


class Listener:
    """One worker process's ``LISTEN`` connection, in a daemon thread.

    Args:
        cluster: the django-q2 cluster whose notifications concern this process.
        idle_wake: called (from the listener thread) when a notification arrives while no
            ``work`` task of this process is running (:meth:`busy`); sends a django-q2
            wake-up. At most once per :data:`IDLE_WAKE_INTERVAL_SECONDS`.
        connect: makes the connection (default: :func:`connect_listener`, from the default
            database's settings); tests pass their own.
    """

    def __init__(
        self,
        cluster: str,
        idle_wake: Callable[[], None],
        connect: Callable[[], Any] | None = None,
    ) -> None:
        self.cluster = cluster
        self._idle_wake = idle_wake
        self._connect = connect or connect_listener
        self._event = threading.Event()
        self._stop = threading.Event()
        self._busy = 0
        self._lock = threading.Lock()
        self._last_idle_wake = float("-inf")
        self._thread: threading.Thread | None = None
        self.connected = threading.Event()
        #: whether the worker side wants the connection to LISTEN (see :meth:`deafen`)
        self._want_listen = True
        #: orders a wish against the thread clearing :attr:`listening` before an UNLISTEN
        self._wish_lock = threading.Lock()
        #: set while a LISTEN is in effect on the connection
        self.listening = threading.Event()
        #: wakes the thread from its wait on the socket (a request to (UN)LISTEN, a stop);
        #: closed when the thread ends (or at :meth:`stop` when none runs), ``-1`` then
        self._pipe_lock = threading.Lock()
        self._pipe_r, self._pipe_w = -1, -1
        self._open_pipe()
        #: notifications received for this cluster (for tests and the bench)
        self.received = 0
        #: successful LISTENs (the first connection and every reconnection)
        self.connects = 0
        #: UNLISTENs sent at :meth:`deafen` requests (for tests and the bench)
        self.deafened = 0

    # -- the worker side ------------------------------------------------------------------

    @contextmanager
    def busy(self) -> Iterator[None]:
        """While inside, this process runs a ``work`` task: notifications only set the event."""
        with self._lock:
            self._busy += 1
        try:
            yield
        finally:
            with self._lock:
                self._busy -= 1
                idle = self._busy == 0
            if idle and self.deaf:
                # A process without a work task must hear (its listener turns a notification
                # into a django-q2 wake-up); a task that left deaf handed its work on.
                self.hear(timeout=0)
            if idle and self._event.is_set():
                # Heard while the task was leaving (after its last look): nobody will read
                # the event now, so hand it on as an idle process would.
                self._idle_wake_throttled()

    def clear(self) -> None:
        """Forget earlier notifications; call before looking for work, so one that arrives
        between the look and :meth:`wait` is not missed."""
        self._event.clear()

    @property
    def deaf(self) -> bool:
        """Whether :meth:`deafen` was asked for and :meth:`hear` not since."""
        return not self._want_listen

    def deafen(self) -> None:
        """Stop listening (``UNLISTEN``, sent by the listener thread; returns at once): the
        calling ``work`` task keeps leasing while work is ready, so a notification would only
        cost the server one transaction of this connection and be thrown away at the task's
        next :meth:`clear`. The task must :meth:`hear` before it waits (and look once more).
        """
        with self._wish_lock:
            if not self._want_listen:
                return
            self._want_listen = False
        self._poke()

    def hear(self, timeout: float = HEAR_TIMEOUT_SECONDS) -> bool:
        """Listen again after :meth:`deafen` and return once the ``LISTEN`` is in effect
        (``True``), or after ``timeout`` seconds (``False``: the connection is down; once it
        is back the thread looks for waiting work itself). Look for work after this: what
        was notified while deaf was not heard.
        """
        with self._wish_lock:
            poke = not self._want_listen
            self._want_listen = True
        if poke:
            self._poke()
        return self.listening.wait(timeout)

    def _poke(self) -> None:
        with self._pipe_lock:  # never a write to a closed pipe's number, reused elsewhere
            if self._pipe_w < 0:
                return  # no thread to wake
            try:
                os.write(self._pipe_w, b"x")
            except (BlockingIOError, OSError):  # full: already poked
                pass

    def _open_pipe(self) -> None:
        with self._pipe_lock:
            if self._pipe_r < 0:
                self._pipe_r, self._pipe_w = os.pipe()
                os.set_blocking(self._pipe_r, False)
                os.set_blocking(self._pipe_w, False)

    def close_pipe(self, *, lock: bool = True) -> None:
        """Close the wake pipe's two file descriptors (idempotent). Called when the thread
        ends, by :meth:`stop` when no thread runs, and (``lock=False``: the lock may have been
        held by a thread of the parent at the fork) for a listener inherited by a forked
        process, whose thread does not run there; :meth:`start` opens a new pipe."""
        if lock:
            with self._pipe_lock:
                fds, self._pipe_r, self._pipe_w = (self._pipe_r, self._pipe_w), -1, -1
        else:
            fds, self._pipe_r, self._pipe_w = (self._pipe_r, self._pipe_w), -1, -1
        for fd in fds:
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass

    def wait(self, seconds: float, stop: Any = None) -> bool:
        """Wait up to ``seconds`` for a notification; ``False`` if none came or ``stop``
        (anything with ``is_set()``) was set. Looks at ``stop`` every 0.2 s.
        """
        deadline = time.monotonic() + seconds
        while True:
            if stop is not None and stop.is_set():
                return False
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            if self._event.wait(min(remaining, 0.2)):
                return not (stop is not None and stop.is_set())

    # -- the thread -----------------------------------------------------------------------

    def start(self) -> Listener:
        if self._thread is None or not self._thread.is_alive():
            self._stop.clear()
            self._open_pipe()
            self._thread = threading.Thread(
                target=self._run, name="django-workflows-listener", daemon=True
            )
            self._thread.start()
        return self

    def stop(self) -> None:
        """Ask the thread to end (it closes its connection and the wake pipe); with no
        thread running the pipe is closed here."""
        self._stop.set()
        self._poke()
        if not self.alive:
            self.close_pipe()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _run(self) -> None:
        try:
            self._listen_until_stopped()
        finally:
            self.close_pipe()

    def _listen_until_stopped(self) -> None:
        backoff = RECONNECT_MIN_SECONDS
        while not self._stop.is_set():
            conn = None
            try:
                conn = self._connect()
                conn.execute(f"LISTEN {CHANNEL}")
                self.listening.set()
                self.connects += 1
                self.connected.set()
                backoff = RECONNECT_MIN_SECONDS
                # Notifications sent while this connection was down are gone: look once (a
                # django-q2 wake-up only if work is waiting: a cluster that starts with
                # nothing to do keeps its django-q2 workers free for other tasks).
                self._event.set()
                if _work_waiting_or_unknown(conn):
                    self._notified()
                while not self._stop.is_set():
                    self._follow_wish(conn)
                    for note in self._wait_for_notes(conn):
                        if note.payload == self.cluster:
                            self._notified()
            except Exception as exc:
                self.connected.clear()
                self.listening.clear()
                if self._stop.is_set():
                    break
                logger.warning(
                    "Wake-up listener lost its connection (%s); reconnecting in %.1f s",
                    exc,
                    backoff,
                )
                self._stop.wait(backoff)
                backoff = min(backoff * 2, RECONNECT_MAX_SECONDS)
            finally:
                self.connected.clear()
                self.listening.clear()
                if conn is not None:
                    try:
                        conn.close()
                    except Exception:
                        pass

    def _follow_wish(self, conn: Any) -> None:
        """``LISTEN`` or ``UNLISTEN`` so the connection matches :meth:`deafen` / :meth:`hear`
        (each one autocommit statement)."""
        with self._wish_lock:  # a hear() after this sees listening cleared and waits
            want = self._want_listen
            unlisten = not want and self.listening.is_set()
            if unlisten:
                self.listening.clear()
        if want and not self.listening.is_set():
            conn.execute(f"LISTEN {CHANNEL}")
            self.listening.set()
        elif unlisten:
            conn.execute(f"UNLISTEN {CHANNEL}")
            self.deafened += 1

    def _wait_for_notes(self, conn: Any) -> list[Any]:
        """Block up to :data:`LISTEN_POLL_SECONDS` until the connection's socket or the wake
        pipe is readable; return the notifications received (none after a poke)."""
        # Notifications that arrived with a statement's answer (LISTEN, the look) are already
        # buffered: the socket may stay quiet, so read them first.
        pending = list(conn.notifies(timeout=0))
        if pending:
            return pending
        sock = conn.fileno()
        poller = select.poll()  # not select(): a worker process may hold fds past FD_SETSIZE
        poller.register(sock, select.POLLIN)
        poller.register(self._pipe_r, select.POLLIN)
        readable = {fd for fd, _ in poller.poll(LISTEN_POLL_SECONDS * 1000)}
        if self._pipe_r in readable:
            try:
                while os.read(self._pipe_r, 64):
                    pass
            except (BlockingIOError, OSError):
                pass
        if sock in readable:  # data, or an error / hang-up (then reading raises)
            # Reads what arrived (an error here - the server went away - reconnects).
            return list(conn.notifies(timeout=0))
        return []

    def _notified(self) -> None:
        self.received += 1
        self._event.set()
        self._idle_wake_throttled()

    def _idle_wake_throttled(self) -> None:
        with self._lock:
            if self._busy:
                return
            now = time.monotonic()
            if now - self._last_idle_wake < IDLE_WAKE_INTERVAL_SECONDS:
                return
            self._last_idle_wake = now
        try:
            self._idle_wake()
        except Exception:  # a lost wake-up only delays work: the tick re-wakes
            logger.exception("Could not turn a notification into a django-q2 wake-up")


def _work_waiting_or_unknown(conn: Any) -> bool:
    """:func:`_work_waiting`, ``True`` when the look itself fails (logged): a spare wake-up
    costs one lease, a missed one strands work."""
    try:
        return _work_waiting(conn)
    except Exception:
        logger.exception("Wake-up listener could not look for waiting work; waking anyway")
        return True


def _work_waiting(conn: Any) -> bool:
    """Whether a ready job or a PENDING run is waiting (one query on the listener's own
    connection; a job of a queue this process does not serve counts too: a spare wake-up
    finds nothing and costs one lease)."""
    from ..models import Status, WorkflowJob, WorkflowRun

    jobs, runs = WorkflowJob._meta.db_table, WorkflowRun._meta.db_table
    row = conn.execute(
        f"SELECT EXISTS (SELECT 1 FROM {jobs} WHERE status = %s AND "
        "(next_poll_at IS NULL OR next_poll_at <= CURRENT_TIMESTAMP)) "
        f"OR EXISTS (SELECT 1 FROM {runs} WHERE status = %s)",
        [Status.PENDING, Status.PENDING],
    ).fetchone()
    return bool(row and row[0])


def connect_listener() -> Any:
    """A new autocommit psycopg connection to the default database (its settings and
    ``OPTIONS``), named :data:`LISTENER_APPLICATION_NAME`."""
    import psycopg

    params = dict(connections[DEFAULT_DB_ALIAS].get_connection_params())
    for key in ("cursor_factory", "context", "prepare_threshold"):
        params.pop(key, None)
    params.setdefault("application_name", LISTENER_APPLICATION_NAME)
    params.setdefault("connect_timeout", 10)
    # The listener only reads: without keepalives a half-open socket (a failover, a moved
    # address) would look like a quiet channel for hours.
    params.setdefault("keepalives", 1)
    params.setdefault("keepalives_idle", 10)
    params.setdefault("keepalives_interval", 5)
    params.setdefault("keepalives_count", 3)
    params.setdefault("tcp_user_timeout", 30000)
    return psycopg.connect(**params, autocommit=True)


_listener: tuple[int, Listener] | None = None
_listener_lock = threading.Lock()


def process_listener(cluster: str, idle_wake: Callable[[], None]) -> Listener | None:
    """This process's :class:`Listener` for ``cluster``, started on first use (made anew after
    a fork); ``None`` when :func:`notify_enabled` is false."""
    import os

    global _listener
    if not notify_enabled():
        return None
    with _listener_lock:
        pid = os.getpid()
        if _listener is None or _listener[0] != pid or _listener[1].cluster != cluster:
            if _listener is not None and _listener[0] == pid:
                _listener[1].stop()  # another cluster's listener of this process: end it
            elif _listener is not None:  # the parent's, inherited at a fork: no thread here
                _listener[1].close_pipe(lock=False)
            _listener = (pid, Listener(cluster, idle_wake))
        return _listener[1].start()
