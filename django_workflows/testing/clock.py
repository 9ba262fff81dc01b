"""The fake clock of the test kit (pure Python: no Django needed)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta


def _utc(when: datetime) -> datetime:
    """``when`` in UTC, so ``advance`` is elapsed-time arithmetic (a local zone's wall-clock
    arithmetic would run backwards across a DST change).

    Raises:
        ValueError: ``when`` is naive (its zone would be a guess).
    """
    if when.tzinfo is None or when.utcoffset() is None:
        raise ValueError(f"FakeClock needs a zone-aware datetime, got naive {when.isoformat()}")
    return when.astimezone(UTC)


class FakeClock:
    """A clock that only moves when told (Appendix C). Default start 2025-01-01T00:00:00Z.

    It also drives lease time (``drives_leases``): leases are stamped and judged with this
    clock instead of the database's, so a test can expire a lease by advancing it.
    ``FakeClock(start, drives_leases=False)`` leaves lease time to the database's clock, as in
    production: a test then sees a kernel whose clock disagrees with the lease clock (a host
    90 s ahead, issue 17).
    """

    drives_leases = True

    def __init__(self, start: datetime | None = None, *, drives_leases: bool = True) -> None:
        self._now = _utc(start or datetime(2025, 1, 1, tzinfo=UTC))
        self.drives_leases = drives_leases

    def now(self) -> datetime:
        """The current fake time, in UTC (the Clock port's promise)."""
        return self._now

    def advance(self, seconds: float = 0, **kwargs: float) -> datetime:
        """Move forward by ``seconds`` (plus ``timedelta`` keyword arguments)."""
        self._now += timedelta(seconds=seconds, **kwargs)
        return self._now

    def set(self, when: datetime) -> None:
        """Jump to ``when`` (zone-aware; converted to UTC).

        Raises:
            ValueError: ``when`` is naive.
        """
        self._now = _utc(when)
