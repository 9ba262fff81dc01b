"""The kernel's ports (K-1b): clock, blob store, job transport, event sink.

Adapters: :class:`SystemClock` here, ``testing.FakeClock``; ``blobs.DatabaseBlobStore``;
``transport.django_q.DjangoQTransport`` and, for tests, ``transport.inline.NullTransport`` /
``RecordingTransport``;
``plugins.PluginRunner``.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime
from typing import Any, Protocol, runtime_checkable

from django.utils import timezone


@runtime_checkable
class Clock(Protocol):
    """Where every engine timestamp comes from (Part I item 12)."""

    def now(self) -> datetime:
        """The current time, timezone-aware (UTC)."""
        ...


class SystemClock:
    """The real clock: ``django.utils.timezone.now()``."""

    def now(self) -> datetime:
        return timezone.now()


class BlobStore(Protocol):
    """JSON blobs by key (DM-50). ``get`` raises ``KeyError`` for a missing key."""

    def put(
        self, key: str, data: Any, *, run_id: str | None = None, stage_id: str | None = None
    ) -> None: ...

    def put_many(
        self,
        items: Iterable[tuple[str, Any]],
        *,
        run_id: str | None = None,
        stage_id: str | None = None,
    ) -> None: ...

    def get(self, key: str) -> Any: ...

    def get_many(self, keys: Iterable[str]) -> dict[str, Any]: ...

    def has(self, key: str) -> bool: ...

    def delete(self, key: str) -> None: ...

    def list(self, prefix: str) -> list[str]: ...

    def delete_stage_blobs(self, run_id: str, stage_ids: Iterable[str]) -> int: ...


class JobTransport(Protocol):
    """Carries wake-ups to workers. The job rows in the database are the truth; a lost wake-up
    only delays work until the next maintenance tick, a duplicate one finds nothing to claim.
    """

    def wake_workers(self, jobs: int, queue: str = "default") -> None:
        """Ask up to ``jobs`` workers of ``queue``'s pool to look for ready jobs (called after
        commit; issue 8 item 5: the django-q2 transport sends to the queue's cluster).
        """
        ...

    def wake_claimer(self) -> None:
        """Ask a worker to claim PENDING runs soon (called after ``run.create`` commits)."""
        ...

    def wake_ticker(self) -> None:
        """Ask for maintenance ticks soon (a stage suspended and needs polling)."""
        ...


class EventSink(Protocol):
    """Receives published outbox events (EV-31). ``emit`` may raise; the outbox retries."""

    max_retries: int

    def emit(self, event: dict[str, Any]) -> None: ...
