"""The heartbeat of the stage path (H-2): one long-lived thread per process refreshes the lease
of every delivery being executed (step 2 of :mod:`.delivery`), fenced by its token, notes
runs that left RUNNING for ``ctx.is_cancelled()``, and is the watchdog of stage timeouts
(:mod:`.timeouts`).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from django.db import connection

from ..logging import current_fields, delivery_context
from ..models import Status, WorkflowRun
from . import timeouts
from .connections import discard_connection, retry_on_disconnect
from .services import forget_run, note_run_not_running

if TYPE_CHECKING:
    from .dispatch import Kernel

logger = logging.getLogger("django_workflows.worker")


class Heartbeat:
    """Refreshes a job's lease every ``interval_seconds`` while the ``with`` block runs (H-2),
    fenced by ``attempt`` when given. ``lost`` is set once the lease was found taken over; a run
    that left RUNNING is noted for ``ctx.is_cancelled()`` (Part I item 15).

    The beats are sent by one long-lived thread per process (:class:`_Beater`), with its own
    database connection, so a delivery costs no thread start and no new connection.
    """

    def __init__(
        self,
        kernel: Kernel,
        job_id: int,
        interval_seconds: float,
        run_id: object = None,
        *,
        attempt: int | None = None,
    ) -> None:
        self.kernel = kernel
        self.job_id = job_id
        self.run_id = run_id
        self.attempt = attempt
        self.interval = interval_seconds
        self.lost = threading.Event()
        self.next_beat = 0.0
        #: The stage timeout watched by the heartbeat thread (:meth:`watch`), in seconds.
        self.timeout_seconds: float | None = None
        #: Monotonic time of the deadline, then of the end of its grace (set when entered).
        self.deadline: float | None = None
        #: Set (by the heartbeat thread, only while the delivery executes) at the deadline.
        self.timed_out = threading.Event()
        #: Set once the grace ended with the body still running (``on_overdue`` was called).
        self.overdue = threading.Event()
        self._on_overdue: Callable[[], None] | None = None
        self._beater: _Beater | None = None
        #: The delivery's log fields (:mod:`django_workflows.logging`): the heartbeat
        #: thread's records about this delivery carry them too.
        self.log_fields = current_fields()

    def watch(self, timeout_seconds: float, on_overdue: Callable[[], None]) -> Heartbeat:
        """Watch a stage timeout (:mod:`.timeouts`): ``timeout_seconds`` after the block is
        entered, :attr:`timed_out` and :attr:`lost` are set (``ctx.is_cancelled()`` turns
        true); ``STAGE_TIMEOUT_GRACE_SECONDS`` later, if the block still runs,
        ``on_overdue()`` is called in the heartbeat thread. Leaving the block first (under the
        heartbeat thread's lock) ends the watch: a delivery is timed out or not, never both.
        """
        self.timeout_seconds = timeout_seconds
        self._on_overdue = on_overdue
        return self

    def check_deadline(self, now: float) -> bool:
        """Called by the heartbeat thread with the registry lock held: mark the delivery timed
        out at its deadline. Returns ``True`` when the grace has ended too (the caller then
        runs :meth:`fire_overdue` outside the lock)."""
        if self.deadline is None or now < self.deadline:
            return False
        if not self.timed_out.is_set():
            self.timed_out.set()
            self.lost.set()  # ctx.is_cancelled(): stop, the result will be discarded
            self.deadline = now + timeouts.grace_seconds()
            logger.warning(
                "Job %s delivery %s passed its timeout of %g s; cancelling it (grace %g s)",
                self.job_id,
                self.attempt,
                self.timeout_seconds,
                timeouts.grace_seconds(),
                extra=self.log_fields,
            )
            return False
        self.deadline = None
        self.overdue.set()
        return True

    def fire_overdue(self) -> None:
        """The grace ended with the body still running: call ``on_overdue``."""
        if self._on_overdue is not None:
            self._on_overdue()

    def beat(self) -> None:
        """Refresh the lease and note a run that left RUNNING (Part I item 15)."""
        if not self.kernel.queue.touch(self.job_id, attempt=self.attempt):
            if self.attempt is not None:
                self.lost.set()
        if (
            self.run_id is not None
            and not WorkflowRun.objects.filter(pk=self.run_id, status=Status.RUNNING).exists()
        ):
            note_run_not_running(self.run_id)

    def __enter__(self) -> Heartbeat:
        self._beater = _beater
        self._beater.add(self)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._beater is not None:
            self._beater.remove(self)
        if self.run_id is not None:
            forget_run(self.run_id)


class _Beater:
    """The process's heartbeat thread: beats every registered :class:`Heartbeat` when due, and
    is the watchdog of their stage timeouts (:meth:`Heartbeat.watch`). Beat errors are logged
    and ignored (H-2); the thread's connection is closed after one, so a terminated connection
    is never used again (:mod:`.connections`).

    ``thread=False`` (tests): no thread is started; the test calls :meth:`run_due` with the
    monotonic time it wants.
    """

    def __init__(self, *, thread: bool = True) -> None:
        self._cond = threading.Condition()
        self._beats: dict[int, Heartbeat] = {}
        self._thread: threading.Thread | None = None
        self._threaded = thread
        #: Monotonic time the thread's current wait ends; ``-inf`` while it is not waiting
        #: (it looks at every registered heartbeat before it waits again).
        self._wake_at = -math.inf
        #: The thread may hold a database connection (it beat or timed out since it last
        #: closed its connection).
        self._connected = False

    def add(self, beat: Heartbeat) -> None:
        """Register ``beat`` (its first beat one interval from now, its deadline from now).
        The thread is woken only when ``beat`` is due before the thread's wait ends: a
        delivery much shorter than the interval (most of them) costs no thread wake-up."""
        with self._cond:
            now = time.monotonic()
            beat.next_beat = now + beat.interval
            if beat.timeout_seconds is not None:
                beat.deadline = now + beat.timeout_seconds
            self._beats[id(beat)] = beat
            if self._threaded and (self._thread is None or not self._thread.is_alive()):
                self._wake_at = -math.inf
                self._thread = threading.Thread(target=self._loop, name="heartbeats", daemon=True)
                self._thread.start()
            if min(beat.next_beat, beat.deadline or beat.next_beat) < self._wake_at:
                self._cond.notify()

    def remove(self, beat: Heartbeat) -> None:
        """Unregister ``beat``; the last one out wakes the thread to close its connection,
        if it may hold one."""
        with self._cond:
            self._beats.pop(id(beat), None)
            if not self._beats and self._connected:
                self._cond.notify()

    def beats(self) -> list[Heartbeat]:
        with self._cond:
            return list(self._beats.values())

    def _due(self, now: float) -> tuple[list[Heartbeat], list[Heartbeat]]:
        """With the lock held: (heartbeats whose timeout grace ended, heartbeats due a beat);
        deadlines reached are marked on the way (:meth:`Heartbeat.check_deadline`)."""
        overdue = [b for b in self._beats.values() if b.check_deadline(now)]
        due = [b for b in self._beats.values() if b.next_beat <= now]
        for b in due:
            b.next_beat = now + b.interval
        return overdue, due

    def _wait_seconds(self, now: float) -> float:
        wake = min(
            (min(b.next_beat, b.deadline or b.next_beat) for b in self._beats.values()),
            default=now + 60,
        )
        return max(0.0, wake - now)

    def run_due(self, now: float) -> None:
        """One pass at monotonic time ``now``: mark deadlines, commit overdue timeouts, beat."""
        with self._cond:
            overdue, due = self._due(now)
        self._send(overdue, due)

    def _loop(self) -> None:
        while True:
            with self._cond:
                if not self._beats:
                    connection.close()  # idle: hold no connection (a test database may go)
                    self._connected = False
                now = time.monotonic()
                overdue, due = self._due(now)
                if not due and not overdue:
                    timeout = self._wait_seconds(now)
                    self._wake_at = now + timeout
                    self._cond.wait(timeout)
                    self._wake_at = -math.inf
                    continue
                self._connected = True
            self._send(overdue, due)

    def _send(self, overdue: list[Heartbeat], due: list[Heartbeat]) -> None:
        for b in overdue:
            with delivery_context(**b.log_fields):
                try:
                    b.fire_overdue()
                except Exception:
                    logger.exception("Committing the timeout of job %s failed", b.job_id)
                    discard_connection()
        for b in due:
            if id(b) not in self._beats:
                continue  # its delivery ended meanwhile
            with delivery_context(**b.log_fields):
                try:
                    # A dead connection is discarded and the beat sent again at once on a new
                    # one; if that fails too, the next beat tries again (a lease is several
                    # beats long, so one lost beat does not lose it).
                    retry_on_disconnect(
                        b.beat, what=f"heartbeat of job {b.job_id}", window_seconds=0
                    )
                except Exception:
                    logger.exception("Heartbeat for job %s failed", b.job_id)
                    discard_connection()


_beater = _Beater()


class NoHeartbeat(Heartbeat):
    """A :class:`Heartbeat` that never beats: for a delivery inside an enclosing transaction
    (see :func:`.stage_path.execute.execute`)."""

    def __enter__(self) -> Heartbeat:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


def in_flight() -> list[Heartbeat]:
    """The heartbeats of the deliveries this process is executing now (step 2), each with
    its job id, fencing ``attempt`` and ``lost`` flag (the graceful stop releases them).
    """
    return _beater.beats()
