"""Maintenance leases after a crash: the tick and ticker leases follow ``TICKER_LEASE_SECONDS``
(at most ``STALE_LEASE_SECONDS``)
and are refreshed while held; the ticker's last tick flushes the events of the last run.

A cluster killed with SIGKILL mid-tick leaves both leases behind. They used to last
``max(60 s, STALE_LEASE_SECONDS)`` and ``TICKER_RUN_SECONDS + 30 s`` whatever lease the
operator chose, blocking lease reaping, polls and the outbox that long (H-10, H-11, Part I
item 18). The real-process versions are in ``tests/acceptance/test_crash_recovery.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from django_workflows.kernel import CancelRun, ClaimPendingRuns, CreateRun, Kernel, hosting
from django_workflows.kernel.hosting import (
    LeaseKeeper,
    acquire_lease,
    maintenance_lease_seconds,
    run_maintenance_tick,
    tick_lease_name,
)
from django_workflows.kernel.supervisor import TickerDuty
from django_workflows.models import MaintenanceLease, OutboxEvent, Status, WorkflowRun
from django_workflows.testing import CollectingSink, FakeClock
from django_workflows.transport import django_q
from tests.workflows import two_stage

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def short_lease(settings: Any) -> None:
    settings.DJANGO_WORKFLOWS = {
        **settings.DJANGO_WORKFLOWS,
        "STALE_LEASE_SECONDS": 3,
        "HEARTBEAT_INTERVAL_SECONDS": 1.0,
        "TICK_INTERVAL_SECONDS": 0.01,
    }


def test_tick_lease_of_a_dead_ticker_expires_after_stale_lease_seconds(
    short_lease: None, kernel_for: Callable[..., Kernel], clock: FakeClock
) -> None:
    """H-10, Part I item 18: a tick whose process died (its lease never released) blocks other
    ticks only until ``STALE_LEASE_SECONDS`` have passed, not for a fixed 60 s.
    """
    kernel = kernel_for(two_stage())
    assert acquire_lease(
        kernel, tick_lease_name(kernel), "dead-ticker", maintenance_lease_seconds()
    )

    assert run_maintenance_tick(kernel, "new-ticker").skipped is True
    clock.advance(2.5)
    assert run_maintenance_tick(kernel, "new-ticker").skipped is True
    clock.advance(1)
    assert run_maintenance_tick(kernel, "new-ticker").skipped is False
    assert not MaintenanceLease.objects.filter(
        name=tick_lease_name(kernel)
    ).exists()  # released after


def test_lease_keeper_refreshes_only_its_own_lease(
    short_lease: None, kernel_for: Callable[..., Kernel], clock: FakeClock
) -> None:
    """H-2 applied to the tick lease: a refreshed lease outlives its TTL (a long tick keeps it,
    so ticks never overlap), and a lease taken over by another owner is never refreshed.
    """
    kernel = kernel_for(two_stage())
    assert acquire_lease(kernel, tick_lease_name(kernel), "a", 3)
    keeper = LeaseKeeper(kernel, tick_lease_name(kernel), "a", 3, 1)
    for _ in range(4):
        clock.advance(2)
        assert keeper.beat() is True
        assert acquire_lease(kernel, tick_lease_name(kernel), "b", 3) is False
    clock.advance(3.5)  # "a" stopped refreshing: dead
    assert acquire_lease(kernel, tick_lease_name(kernel), "b", 3) is True
    expires = MaintenanceLease.objects.get(name=tick_lease_name(kernel)).expires_at
    assert keeper.beat() is False
    lease = MaintenanceLease.objects.get(name=tick_lease_name(kernel))
    assert (lease.owner, lease.expires_at) == ("b", expires)


def test_ticker_lease_follows_stale_lease_seconds(settings: Any) -> None:
    """The ticker lease lasts ``TICKER_LEASE_SECONDS``, at most ``STALE_LEASE_SECONDS`` (a dead
    host holding a job and the ticker lease is replaced as a ticker by the time its job is
    stale). It no longer depends on a ticker task's run time: the ticker now runs in each
    worker process's supervisor thread.
    """
    settings.DJANGO_WORKFLOWS = {**settings.DJANGO_WORKFLOWS, "STALE_LEASE_SECONDS": 3}
    assert django_q.ticker_lease_seconds() == 3
    settings.DJANGO_WORKFLOWS = {**settings.DJANGO_WORKFLOWS, "STALE_LEASE_SECONDS": 300}
    assert django_q.ticker_lease_seconds() == 10
    settings.DJANGO_WORKFLOWS = {**settings.DJANGO_WORKFLOWS, "TICKER_LEASE_SECONDS": 45}
    assert django_q.ticker_lease_seconds() == 45


def test_ticker_flushes_the_events_of_a_run_that_ended_after_its_last_tick(
    short_lease: None,
    kernel_for: Callable[..., Kernel],
    sink: CollectingSink,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """EV-4, H-10: the ticker stops once no run is live, but only after a tick that began with
    no live run and no event left to publish - so ``workflow:cancelled`` of a run cancelled
    just after a tick's flush is published before the ticker gives its lease up.
    """
    kernel = kernel_for(two_stage())
    run_id = kernel.dispatch(CreateRun("two-stage", {"value": 1})).workflow_run_id
    kernel.dispatch(ClaimPendingRuns("w"))
    real_tick = hosting.run_maintenance_tick
    calls: list[int] = []

    def tick_then_cancel(k: Kernel, owner: str, **kwargs: Any) -> Any:
        out = real_tick(k, owner, **kwargs)
        calls.append(1)
        if len(calls) == 1:  # the run ends between the flush and the ticker's next check
            k.dispatch(CancelRun(run_id, reason="after the flush"))
        return out

    monkeypatch.setattr(hosting, "run_maintenance_tick", tick_then_cancel)
    duty = TickerDuty(lambda: kernel, "ticker-1")
    now = 0.0
    for _ in range(5):
        duty.run(now)
        now += 1
    assert WorkflowRun.objects.get(pk=run_id).status == Status.CANCELLED
    # tick 1 (the run is cancelled after it), tick 2 flushes `workflow:cancelled` (it began
    # with that event unpublished), tick 3 begins with nothing left to do and lets go.
    assert duty.ticks == 3 and duty.holding is False
    assert not OutboxEvent.objects.filter(published_at=None).exists()
    assert sink.types(run_id)[-1] == "workflow:cancelled"
    assert not MaintenanceLease.objects.exists()  # both leases released


def test_the_ticker_keeps_its_maintenance_tick_lease_between_ticks(
    kernel_for: Callable[..., Kernel],
) -> None:
    """Issue 19: while runs are live the ticker duty's ticks renew one ``maintenance-tick``
    lease (one UPDATE each) instead of taking and deleting it per tick; the lease is given up
    with the ticker lease once nothing is live."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    kernel = kernel_for(two_stage())
    run_id = kernel.dispatch(CreateRun("two-stage", {"value": 1})).workflow_run_id
    duty = TickerDuty(lambda: kernel, "ticker-1")
    with CaptureQueriesContext(connection) as queries:
        for now in (0.0, 1.0, 2.0, 3.0):
            duty.run(now)
    lease_sql = [q["sql"] for q in queries if "workflow_maintenance_leases" in q["sql"]]
    tick_name = tick_lease_name(kernel)
    inserts = [s for s in lease_sql if s.startswith("INSERT") and tick_name in s]
    deletes = [s for s in lease_sql if s.startswith("DELETE") and tick_name in s]
    assert duty.ticks == 4 and len(inserts) == 1 and deletes == []
    assert MaintenanceLease.objects.filter(name=tick_name, owner="ticker-1").exists()
    kernel.dispatch(CancelRun(run_id, reason="done"))
    for now in (4.0, 5.0, 6.0):
        duty.run(now)
    assert duty.holding is False
    assert not MaintenanceLease.objects.filter(name=tick_name).exists()
