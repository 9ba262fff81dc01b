"""Lease time and named leases.

Leases must not depend on hosts agreeing on the time (a worker whose clock runs 90 s ahead
must not make a live worker's job look stale). Every lease is therefore stamped and judged
with the **database's** clock: :class:`LeaseClock` hands out ``Now()`` expressions, which the
database evaluates (PostgreSQL ``CURRENT_TIMESTAMP``, SQLite ``'now'``). A test clock that
declares ``drives_leases = True`` (:class:`~django_workflows.testing.FakeClock`) is used
instead, so tests can move lease time by hand.

Named leases (``workflow_maintenance_leases``) keep maintenance ticks, the ticker and the
outbox flusher from overlapping (Part I item 18): :func:`acquire_lease`, :func:`renew_lease`,
:func:`release_lease`, :func:`lease_is_free`, and :class:`LeaseKeeper`, the thread that keeps
a held one fresh.
"""

from __future__ import annotations

import logging
import threading
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from django.db import IntegrityError, connection, transaction
from django.db.models import Q
from django.db.models.functions import Now

from ..conf import workflow_settings
from ..models import MaintenanceLease
from ..ports import Clock

if TYPE_CHECKING:
    from .dispatch import Kernel

logger = logging.getLogger("django_workflows.worker")

#: A moment in lease time: a datetime (test clocks) or a database expression (``Now()``).
LeaseTime = Any


class LeaseClock:
    """Lease time for a kernel clock: the database's clock unless ``clock.drives_leases``."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock

    @property
    def uses_database(self) -> bool:
        return not getattr(self.clock, "drives_leases", False)

    def now(self) -> LeaseTime:
        """Now, in lease time (an expression evaluated by the database, or a datetime)."""
        return Now() if self.uses_database else self.clock.now()

    def offset(self, seconds: float) -> LeaseTime:
        """``now + seconds`` in lease time (negative ``seconds``: in the past)."""
        return self.now() + timedelta(seconds=seconds)

    def read(self) -> datetime:
        """The current lease time as a value (one query when the database's clock is used)."""
        if not self.uses_database:
            return self.clock.now()
        from django.db import connection

        with connection.cursor() as cursor:
            cursor.execute("SELECT CURRENT_TIMESTAMP")
            value = cursor.fetchone()[0]
        if isinstance(value, str):  # SQLite: 'YYYY-MM-DD HH:MM:SS', UTC
            from datetime import UTC

            value = datetime.fromisoformat(value).replace(tzinfo=UTC)
        return value


def acquire_lease(lease_clock: LeaseClock, name: str, owner: str, ttl_seconds: float) -> bool:
    """Take (or renew) the named lease for ``ttl_seconds``; ``False`` if another owner holds an
    unexpired one. Expiry is judged in lease time (the database's clock).
    """
    expires = lease_clock.offset(ttl_seconds)
    if (
        MaintenanceLease.objects.filter(name=name)
        .filter(Q(expires_at__lte=lease_clock.now()) | Q(owner=owner))
        .update(owner=owner, expires_at=expires)
    ):
        return True
    try:
        with transaction.atomic():
            MaintenanceLease.objects.create(name=name, owner=owner, expires_at=expires)
    except IntegrityError:
        return False
    return True


def renew_lease(lease_clock: LeaseClock, name: str, owner: str, ttl_seconds: float) -> bool:
    """Extend a lease that ``owner`` still holds to ``now + ttl_seconds``; ``False`` if it is
    no longer theirs (it expired and another owner took it, or it was released).
    """
    return bool(
        MaintenanceLease.objects.filter(name=name, owner=owner).update(
            expires_at=lease_clock.offset(ttl_seconds)
        )
    )


def release_lease(name: str, owner: str) -> None:
    """Give the named lease up (a no-op if ``owner`` no longer holds it)."""
    MaintenanceLease.objects.filter(name=name, owner=owner).delete()


def lease_is_free(lease_clock: LeaseClock, name: str) -> bool:
    """Whether nobody holds an unexpired lease ``name``."""
    return not MaintenanceLease.objects.filter(name=name, expires_at__gt=lease_clock.now()).exists()


def ticker_lease_seconds() -> float:
    """TTL of the ``ticker`` lease (and of the ``maintenance-tick`` lease), in seconds:
    ``TICKER_LEASE_SECONDS``, at most ``STALE_LEASE_SECONDS``.

    A dead host may hold both a job and the ticker lease; capping the ticker's TTL at the job
    lease's threshold means a new ticker is up by the time the dead worker's job is stale, so
    the job is re-delivered within about ``STALE_LEASE_SECONDS`` + ``SUPERVISOR_INTERVAL_SECONDS``
    + one tick.
    """
    return min(
        float(workflow_settings.TICKER_LEASE_SECONDS), float(workflow_settings.STALE_LEASE_SECONDS)
    )


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
    passed without a refresh. Refresh errors are logged and the thread's connection is closed
    (the next refresh reconnects); the thread stops once the lease is no longer the owner's.
    """

    def __init__(
        self, kernel: Kernel, name: str, owner: str, ttl_seconds: float, interval_seconds: float
    ) -> None:
        self.kernel = kernel
        self.name = name
        self.owner = owner
        self.ttl = ttl_seconds
        self.interval = interval_seconds
        #: Set once a refresh found the lease taken over (the holder must stop its work).
        self.lost = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"lease-{name}", daemon=True)

    def beat(self) -> bool:
        """Refresh the lease now; ``False`` (and :attr:`lost` true) if it is no longer the
        owner's.
        """
        if renew_lease(self.kernel.lease_clock, self.name, self.owner, self.ttl):
            return True
        self.lost = True
        return False

    def _loop(self) -> None:
        try:
            while not self._stop.wait(self.interval):
                try:
                    if not self.beat():
                        return
                except Exception:
                    # Never reuse a connection that failed: the next beat opens a new one.
                    logger.exception("Refreshing the %s lease failed", self.name)
                    connection.close()
        finally:
            connection.close()

    def __enter__(self) -> LeaseKeeper:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
