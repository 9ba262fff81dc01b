"""Idempotency keys (K-10..14, DM-21/22). Keys are scoped by command type."""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Literal

from django.db import IntegrityError, transaction

from ..models import IdempotencyKey

State = IdempotencyKey.State


@dataclass(frozen=True)
class Acquired:
    outcome: Literal["acquired", "replay", "in_progress"]
    result: Any = None


def acquire(
    key: str, command_type: str, *, now: datetime, stale_after_seconds: float | None
) -> Acquired:
    """Take ``key`` for ``command_type`` (K-12).

    No row: insert an in-progress row stamped ``now`` -> ``acquired``. Completed row ->
    ``replay`` with its cached result. In-progress row older than ``stale_after_seconds`` ->
    re-stamped (one racer wins) -> ``acquired``; otherwise ``in_progress``.
    """
    try:
        # Inside a transaction a savepoint keeps a duplicate-key error from poisoning it; in
        # autocommit mode the single INSERT is atomic on its own.
        with (
            transaction.atomic() if transaction.get_connection().in_atomic_block else nullcontext()
        ):
            IdempotencyKey.objects.create(key=key, command_type=command_type, created_at=now)
        return Acquired("acquired")
    except IntegrityError:
        pass
    row = IdempotencyKey.objects.filter(key=key, command_type=command_type).first()
    if row is None:  # released meanwhile: try once more
        return acquire(key, command_type, now=now, stale_after_seconds=stale_after_seconds)
    if row.state == State.COMPLETED:
        return Acquired("replay", row.result)
    if stale_after_seconds is not None:
        cutoff = now - timedelta(seconds=stale_after_seconds)
        won = IdempotencyKey.objects.filter(
            pk=row.pk, state=State.IN_PROGRESS, created_at__lte=cutoff
        ).update(created_at=now)
        if won:
            return Acquired("acquired")
        row.refresh_from_db()
        if row.state == State.COMPLETED:
            return Acquired("replay", row.result)
    return Acquired("in_progress")


def complete(key: str, command_type: str, result: Any) -> None:
    """Store the result of a finished command (K-10)."""
    IdempotencyKey.objects.filter(key=key, command_type=command_type).update(
        state=State.COMPLETED, result=result
    )


def release(key: str, command_type: str) -> None:
    """Forget an in-progress key after the command raised (K-10)."""
    IdempotencyKey.objects.filter(
        key=key, command_type=command_type, state=State.IN_PROGRESS
    ).delete()


def lookup(
    key: str, command_type: str, *, now: datetime, stale_after_seconds: float | None
) -> Acquired:
    """Inside the command's transaction: ``replay`` with the cached result of a recorded key,
    ``acquired`` when there is none (the caller runs the command and :func:`record` s it).

    An ``in_progress`` row can only be left by an engine older than in-transaction keys (or a
    non-transactional command): when older than ``stale_after_seconds`` it is removed and the
    key is ``acquired``; otherwise ``in_progress``.
    """
    row = IdempotencyKey.objects.filter(key=key, command_type=command_type).first()
    if row is None:
        return Acquired("acquired")
    if row.state == State.COMPLETED:
        return Acquired("replay", row.result)
    if stale_after_seconds is not None and row.created_at <= now - timedelta(
        seconds=stale_after_seconds
    ):
        row.delete()
        return Acquired("acquired")
    return Acquired("in_progress")


def record(key: str, command_type: str, result: Any, now: datetime) -> None:
    """Record a finished command's key with its result, in the command's transaction.

    Raises:
        IntegrityError: another transaction recorded the key first (on PostgreSQL this waits
            for that transaction; the caller rolls back and replays its result).
    """
    IdempotencyKey.objects.create(
        key=key, command_type=command_type, created_at=now, state=State.COMPLETED, result=result
    )
