"""The health checks of ``workflows_health`` and the readiness view (issue 20 item 4).

Each check judges one field of a :class:`~.state.StateSnapshot`:

=================  ===========================================================================
``database``       the database answered the snapshot's reads within their time budget
                   (``HEALTH_TIMEOUT_SECONDS``; a timeout fails it, detail ``timed out``)
``ticker``         while runs are live (PENDING or RUNNING), an unexpired ticker lease is held
                   by a live worker process, or has been missing no longer than
                   :func:`ticker_grace_seconds` (passes with no live run, and when
                   ``SUPERVISOR_TICKS`` is off: ticks then come from ``workflows_tick`` or
                   ``workflows_worker``, which hold no ticker lease)
``workers:<q>``    at least one live worker process serves queue ``q`` (every queue of
                   ``QUEUES`` plus ``"default"``, or the queues asked for)
``outbox``         the outbox lag is at most ``HEALTH_MAX_OUTBOX_LAG_SECONDS``
``dead_letters``   at most ``HEALTH_MAX_DEAD_LETTERS`` dead letters wait for an operator
=================  ===========================================================================

When the database is down only ``database`` is reported (the others cannot be judged).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

from ..conf import workflow_settings
from .state import StateSnapshot


@dataclass(frozen=True)
class CheckResult:
    """One check: ``name`` (``database``, ``ticker``, ``workers:<queue>``, ``outbox``,
    ``dead_letters``), ``ok``, the measured ``value`` (a number, a holder name or ``None``),
    the ``threshold`` it was judged against (``None``: none) and a one-line ``detail``."""

    name: str
    ok: bool
    value: Any
    threshold: Any
    detail: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class HealthReport:
    """All checks of one snapshot; ``healthy`` when every check passed."""

    snapshot: StateSnapshot
    checks: list[CheckResult]

    @property
    def healthy(self) -> bool:
        return all(c.ok for c in self.checks)

    @property
    def failing(self) -> list[str]:
        """Names of the failed checks, in check order."""
        return [c.name for c in self.checks if not c.ok]

    def to_dict(self, *, details: bool = True) -> dict[str, Any]:
        """``{"status": "healthy"|"unhealthy", "failing": [...], "checks": [...],
        "taken_at": ISO}``; ``details=False``: each check only ``{"name", "ok"}`` and no
        time (what an anonymous readiness probe sees). When the snapshot's reads timed out
        both forms also carry ``"reason": "timeout"``."""
        doc: dict[str, Any] = {
            "status": "healthy" if self.healthy else "unhealthy",
            "failing": self.failing,
        }
        if self.snapshot.timed_out:
            doc["reason"] = "timeout"
        if details:
            doc["taken_at"] = self.snapshot.taken_at.isoformat()
            doc["checks"] = [c.to_dict() for c in self.checks]
        else:
            doc["checks"] = [{"name": c.name, "ok": c.ok} for c in self.checks]
        return doc


def expected_queues() -> list[str]:
    """The queues that must have a live worker: the ``QUEUES`` setting's keys plus
    ``"default"`` (sorted)."""
    raw = workflow_settings.QUEUES or {}
    names = {str(q) for q in raw} if isinstance(raw, dict) else set()
    return sorted(names | {"default"})


def ticker_grace_seconds() -> float:
    """How long live runs may go without a live ticker before the ``ticker`` check fails:
    twice the takeover time (``TICKER_LEASE_SECONDS``, at most ``STALE_LEASE_SECONDS``, plus
    ``SUPERVISOR_INTERVAL_SECONDS``), so the first run of an idle cluster, a graceful stop
    and a dead holder's takeover do not make the check flap."""
    from ..kernel.leases import ticker_lease_seconds

    return 2 * (ticker_lease_seconds() + float(workflow_settings.SUPERVISOR_INTERVAL_SECONDS))


def evaluate(
    snap: StateSnapshot,
    *,
    queues: Iterable[str] | None = None,
    max_outbox_lag_seconds: float | None = ...,  # type: ignore[assignment]
    max_dead_letters: int | None = ...,  # type: ignore[assignment]
) -> HealthReport:
    """Judge ``snap``.

    Args:
        queues: the queues that need a live worker (default :func:`expected_queues`).
        max_outbox_lag_seconds: the outbox check's bound (seconds; default the setting
            ``HEALTH_MAX_OUTBOX_LAG_SECONDS``; ``None``: the check always passes).
        max_dead_letters: the dead-letter check's bound (default ``HEALTH_MAX_DEAD_LETTERS``;
            ``None``: always passes).
    """
    if max_outbox_lag_seconds is ...:
        max_outbox_lag_seconds = workflow_settings.HEALTH_MAX_OUTBOX_LAG_SECONDS
    if max_dead_letters is ...:
        max_dead_letters = workflow_settings.HEALTH_MAX_DEAD_LETTERS
    if snap.timed_out:
        budget = snap.timeout_seconds
        within = f" {budget:g} s (HEALTH_TIMEOUT_SECONDS)" if budget is not None else ""
        return HealthReport(
            snap,
            [CheckResult("database", False, None, budget, f"timed out: no answer within{within}")],
        )
    if not snap.database_ok:
        reason = snap.database_error or "error"
        return HealthReport(
            snap, [CheckResult("database", False, None, None, f"unreachable ({reason})")]
        )
    checks = [CheckResult("database", True, None, None, "reachable")]

    live = snap.live_runs
    if snap.ticker_live:
        checks.append(
            CheckResult("ticker", True, snap.ticker_holder, None, f"held by {snap.ticker_holder}")
        )
    elif not workflow_settings.SUPERVISOR_TICKS:
        checks.append(CheckResult("ticker", True, None, None, "SUPERVISOR_TICKS is off"))
    elif live == 0:
        checks.append(CheckResult("ticker", True, None, None, "not needed: no live run"))
    elif (snap.ticker_missing_seconds or 0.0) <= ticker_grace_seconds():
        missing = snap.ticker_missing_seconds or 0.0
        checks.append(
            CheckResult(
                "ticker",
                True,
                None,
                round(ticker_grace_seconds(), 3),
                f"starting: no ticker for {missing:.1f} s, within the takeover time",
            )
        )
    else:
        why = (
            f"held by {snap.ticker_holder}, whose worker process is gone"
            if snap.ticker_holder
            else "no live worker holds the ticker lease"
        )
        checks.append(
            CheckResult(
                "ticker",
                False,
                snap.ticker_holder,
                round(ticker_grace_seconds(), 3),
                f"{why} for {snap.ticker_missing_seconds or 0.0:.1f} s; {live} live runs",
            )
        )

    for queue in sorted(set(queues) if queues is not None else expected_queues()):
        versions = sorted({w.version or "unversioned" for w in snap.workers if w.queue == queue})
        count = snap.workers_for(queue)
        detail = (
            f"{count} worker{'' if count == 1 else 's'} (versions {', '.join(versions)})"
            if count
            else f"no live worker serves queue {queue!r}"
        )
        checks.append(CheckResult(f"workers:{queue}", count > 0, count, 1, detail))

    lag = snap.outbox_lag_seconds
    lag_ok = max_outbox_lag_seconds is None or lag is None or lag <= float(max_outbox_lag_seconds)
    lag_text = (
        "no undelivered event" if lag is None else f"oldest undelivered event {lag:.1f} s old"
    )
    checks.append(
        CheckResult(
            "outbox",
            lag_ok,
            None if lag is None else round(lag, 3),
            max_outbox_lag_seconds,
            f"{lag_text}, {snap.outbox_undelivered} undelivered",
        )
    )
    dead = snap.dead_letters
    dead_ok = max_dead_letters is None or dead <= int(max_dead_letters)
    checks.append(
        CheckResult(
            "dead_letters",
            dead_ok,
            dead,
            max_dead_letters,
            f"{dead} dead letters"
            + (
                f", {snap.outbox_blocked} events held back behind them"
                if snap.outbox_blocked
                else ""
            ),
        )
    )
    return HealthReport(snap, checks)
