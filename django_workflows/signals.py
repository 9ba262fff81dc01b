"""Signals: named messages sent to a run from outside (issue 18 item 4, docs/signals.md).

:func:`send_signal` stores a signal durably (one transaction with a ``signal:received``
outbox event); a :func:`~django_workflows.wait_for_signal` stage of the run consumes it
exactly once and completes with its payload. Signals may be sent before the stage waits
(they are buffered) and are idempotent by ``key`` per run. The API
(``POST runs/{id}/signals/``), the CLI (``manage.py workflows_signal``) and the admin ("Send
signal" on the run page) all call :func:`send_signal`.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

from .definition.signal import SignalWait, wait_for_signal
from .kernel.commands import SendSignal, SendSignalResult

if TYPE_CHECKING:
    from .kernel.dispatch import Kernel


def send_signal(
    run_id: Any,
    name: str,
    payload: Any = None,
    *,
    key: str | None = None,
    actor: str | None = None,
    kernel: Kernel | None = None,
) -> SendSignalResult:
    """Send signal ``name`` with ``payload`` to a run.

    Args:
        run_id: the run (UUID or string).
        name: 1-200 letters, digits or ``._:-``, starting with a letter or digit.
        payload: any JSON value (at most 64 KiB as compact JSON); a waiting stage validates it
            against its ``payload`` model when it consumes it.
        key: idempotency key, unique per run: sending again with it stores nothing and
            answers ``stored=False`` with the first signal's id.
        actor: who sent it (free text, e.g. ``"user:alice"``).
        kernel: default: the process-wide kernel.

    Returns:
        :class:`~django_workflows.kernel.commands.SendSignalResult`: ``signal_id``,
        ``stored`` (``False``: a duplicate key), ``woke`` (a waiting stage was made due).

    Raises:
        InvalidCommandError: malformed run id, name, payload, key or actor (``.field``).
        RunNotFoundError: no such run.
        RunTerminalError: the run is COMPLETED, FAILED or CANCELLED.
    """
    from .kernel.runtime import get_kernel

    return (kernel or get_kernel()).dispatch(  # type: ignore[no-any-return]
        SendSignal(run_id, name, payload, key=key, actor=actor)
    )


@dataclass(frozen=True)
class SignalRecord:
    """One stored signal as :func:`list_signals` returns it (the API's shape)."""

    id: int
    name: str
    payload: Any
    key: str | None
    actor: str | None
    created_at: datetime
    consumed_at: datetime | None
    consumed_stage_id: str | None
    consumed_generation: int | None

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "name": self.name,
            "payload": self.payload,
            "key": self.key,
            "actor": self.actor,
            "created_at": self.created_at,
            "consumed_at": self.consumed_at,
            "consumed_stage_id": self.consumed_stage_id,
            "consumed_generation": self.consumed_generation,
        }


def list_signals(
    run_id: Any, *, name: str | None = None, pending: bool | None = None, limit: int = 500
) -> list[SignalRecord]:
    """The run's signals, oldest first.

    Args:
        name: only this signal name. pending: ``True`` only unconsumed, ``False`` only
            consumed. limit: at most this many (1-1000).

    Raises:
        InvalidCommandError: a malformed run id or limit. RunNotFoundError: no such run.
    """
    from .kernel.errors import InvalidCommandError, RunNotFoundError
    from .kernel.locking import parse_run_id
    from .models import WorkflowRun, WorkflowSignal

    rid = parse_run_id(run_id, field="run_id")
    if not isinstance(limit, int) or not 1 <= limit <= 1000:
        raise InvalidCommandError(f"limit: expected 1-1000, got {limit!r}", field="limit")
    if not WorkflowRun.objects.filter(pk=rid).exists():
        raise RunNotFoundError(rid)
    rows = WorkflowSignal.objects.filter(run_id=rid)
    if name is not None:
        rows = rows.filter(name=name)
    if pending is not None:
        rows = rows.filter(consumed_at__isnull=pending)
    return [
        SignalRecord(
            id=r.pk,
            name=r.name,
            payload=r.payload,
            key=r.idempotency_key,
            actor=r.actor,
            created_at=r.created_at,
            consumed_at=r.consumed_at,
            consumed_stage_id=r.consumed_stage_id,
            consumed_generation=r.consumed_generation,
        )
        for r in rows.order_by("created_at", "id")[:limit]
    ]


__all__ = [
    "SendSignalResult",
    "SignalRecord",
    "SignalWait",
    "list_signals",
    "send_signal",
    "wait_for_signal",
]
