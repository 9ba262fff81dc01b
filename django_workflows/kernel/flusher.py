"""Prompt outbox delivery (EV-4..7).

Events must reach plugins within about a second of their commit, whether or not runs are live
and however many wake-ups are queued. Two things deliver them:

* :func:`flush_outbox` publishes while holding the ``outbox-flush`` lease, so two processes
  never deliver the same event at once; the maintenance tick calls it.
* In worker processes (:func:`enable`), every commit that appended events wakes a
  background :class:`Flusher` thread, which flushes until nothing is left. A flusher that
  finds the lease held retries shortly, so an event committed while another process was
  finishing its flush is not left for the next tick.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import TYPE_CHECKING

from django.db import close_old_connections, connection

from ..models import OutboxEvent
from . import leases, outbox
from .commands import FlushOutbox

if TYPE_CHECKING:
    from .dispatch import Kernel

logger = logging.getLogger("django_workflows.outbox")

FLUSH_LEASE = "outbox-flush"
#: Events published per pass while the flusher holds the lease.
FLUSH_BATCH = 500
#: How long the flusher waits after a wake-up, so one pass covers a burst of commits (a
#: busy worker commits every few milliseconds; each pass costs a handful of statements).
COALESCE_SECONDS = 0.1
#: How often a flusher retries while another holds the lease and events are waiting: just
#: over the holder's :data:`HOLD_SECONDS`, so the retry after the holder's last pass finds
#: the lease free. Commits of this process meanwhile do not make it retry sooner.
RETRY_SECONDS = 0.6


def flush_lease_seconds() -> float:
    """TTL of the ``outbox-flush`` lease, in seconds: the ticker lease's
    (:func:`.leases.ticker_lease_seconds`: ``TICKER_LEASE_SECONDS``, at most
    ``STALE_LEASE_SECONDS``). A flusher whose host died or was cut off holding it stops
    blocking event delivery after this long; a live one refreshes it while it flushes.
    """
    return leases.ticker_lease_seconds()


def flush_outbox(kernel: Kernel, owner: str, *, max_events: int = FLUSH_BATCH) -> int | None:
    """Publish up to ``max_events`` events under the ``outbox-flush`` lease; returns how many
    were published, or ``None`` when another process holds the lease.

    The lease lasts :func:`flush_lease_seconds` and is refreshed while the pass runs (a
    :class:`.leases.LeaseKeeper`; slow plugins may make a pass longer than the TTL), so a
    partitioned or dead holder blocks the other processes' flushes at most that long
    (issue 17; it was a fixed 30 s).
    """
    from django.db import connection

    ttl = flush_lease_seconds()
    if not leases.acquire_lease(kernel.lease_clock, FLUSH_LEASE, owner, ttl):
        return None
    try:
        if connection.in_atomic_block:  # nobody else sees the lease before the commit
            return int(kernel.dispatch(FlushOutbox(max_events=max_events)).published)
        with leases.LeaseKeeper(
            kernel, FLUSH_LEASE, owner, ttl, leases.lease_heartbeat_seconds(ttl)
        ):
            return int(kernel.dispatch(FlushOutbox(max_events=max_events)).published)
    finally:
        leases.release_lease(FLUSH_LEASE, owner)


class Flusher:
    """A daemon thread of a worker process that flushes ``kernel``'s outbox after commits."""

    def __init__(self, kernel: Kernel) -> None:
        self.kernel = kernel
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self.owner = f"flusher-{os.getpid()}-{id(self):x}"

    def notify(self) -> None:
        """Ask for a flush soon (cheap; called after every commit that appended events)."""
        if self._thread is None or not self._thread.is_alive():
            with self._lock:
                if self._thread is None or not self._thread.is_alive():
                    self._thread = threading.Thread(
                        target=self._loop, name="outbox-flusher", daemon=True
                    )
                    self._thread.start()
        self._wake.set()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                self._wake.wait()
                if self._stop.wait(COALESCE_SECONDS):
                    return
                self._wake.clear()
                try:
                    close_old_connections()
                    self._flush_all(self.kernel)
                except Exception:
                    logger.exception("Outbox flush failed; the maintenance tick will retry")
                    connection.close()
        finally:
            connection.close()

    def _flush_all(self, kernel: Kernel) -> None:
        """Take the ``outbox-flush`` lease once and publish pass after pass while events keep
        coming (this process's commits wake it, other processes' show up in the next pass),
        holding the lease until a pass finds nothing and no commit of this process follows
        within :data:`HOLD_SECONDS`; a pass costs two statements, the lease two more per busy
        period instead of per pass (issue 19).
        """
        busy_passes = 0
        while True:
            held = hold_and_flush(kernel, self.owner, self._wake, self._stop)
            if held:
                return
            # Another process holds the lease: it may finish its last pass before our
            # events committed, so look again shortly (the tick is the backstop).
            busy_passes += 1
            if busy_passes > MAX_BUSY_PASSES or not _unpublished_waiting():
                return
            if self._stop.wait(RETRY_SECONDS):
                return
            self._wake.clear()


#: How long a flusher keeps the ``outbox-flush`` lease after a pass that found nothing,
#: waiting for this process's next commit (a busy worker commits every few milliseconds).
HOLD_SECONDS = 0.5


def hold_and_flush(
    kernel: Kernel, owner: str, wake: threading.Event, stop: threading.Event
) -> bool:
    """Publish under the ``outbox-flush`` lease until idle (see :meth:`Flusher._flush_all`);
    ``False`` at once, publishing nothing, if another process holds the lease.
    """
    ttl = flush_lease_seconds()
    if not leases.acquire_lease(kernel.lease_clock, FLUSH_LEASE, owner, ttl):
        return False
    _holding.set()
    try:
        with leases.LeaseKeeper(
            kernel, FLUSH_LEASE, owner, ttl, leases.lease_heartbeat_seconds(ttl)
        ) as keeper:
            while not keeper.lost:
                published = int(kernel.dispatch(FlushOutbox(max_events=FLUSH_BATCH)).published)
                if published >= FLUSH_BATCH:
                    continue
                if published == 0 and (_no_hold.is_set() or not wake.wait(HOLD_SECONDS)):
                    return True
                wake.clear()
                if stop.wait(COALESCE_SECONDS):  # one pass covers a burst of commits
                    return True
    finally:
        _holding.clear()
        leases.release_lease(FLUSH_LEASE, owner)
    return True


_holding = threading.Event()
_no_hold = threading.Event()


def stop_holding() -> None:
    """The process is stopping: this process's flusher gives the ``outbox-flush`` lease up
    after its next pass that finds nothing, instead of holding it (a process that exits holding
    it would block the other flushers for the lease's TTL). Later commits still flush, one
    pass per lease."""
    _no_hold.set()
    if _flusher is not None:
        _flusher._wake.set()


def holding() -> bool:
    """Whether this process's flusher holds the ``outbox-flush`` lease right now (it then
    publishes every process's events pass after pass; the tick need not try)."""
    return _holding.is_set()


#: Retries of a flusher that finds the lease held (``RETRY_SECONDS`` apart) before it leaves
#: the rest to the next wake-up or tick.
MAX_BUSY_PASSES = 8


def _unpublished_waiting() -> bool:
    return OutboxEvent.objects.filter(published_at__isnull=True, dlq_at__isnull=True).exists()


_flusher: Flusher | None = None


def enable(kernel: Kernel) -> None:
    """Flush ``kernel``'s outbox after commits in this process (worker processes call this;
    a second call with another kernel replaces the first).
    """
    global _flusher
    if _flusher is None or _flusher.kernel is not kernel:
        disable()
        _no_hold.clear()
        _flusher = Flusher(kernel)


def disable() -> None:
    """Stop flushing after commits in this process (its thread ends)."""
    global _flusher
    if _flusher is not None:
        _flusher.stop()
    _flusher = None


def events_committed() -> None:
    """``transaction.on_commit`` hook of every append: wake this process's flusher, if any."""
    if _flusher is not None:
        _flusher.notify()


outbox.committed_hooks.append(events_committed)
