"""Prompt outbox delivery (issue 7): a worker process's flusher thread publishes events right
after the commit that appended them, and two flushers never deliver the same event."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from django_workflows.kernel import CreateRun, flusher, leases
from django_workflows.models import OutboxEvent
from django_workflows.testing import CollectingSink, make_kernel
from tests.markers import postgres_only
from tests.workflows import two_stage

pytestmark = pytest.mark.django_db(transaction=True)


class SignallingSink(CollectingSink):
    def __init__(self) -> None:
        super().__init__()
        self.arrived = threading.Event()

    def emit(self, event: dict[str, Any]) -> None:
        super().emit(event)
        self.arrived.set()


def test_events_are_delivered_within_a_second_of_their_commit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No tick runs: the commit itself wakes the flusher, which delivers the event and marks
    it published."""
    sink = SignallingSink()
    kernel = make_kernel(two_stage(), event_sink=sink)
    flushed = threading.Event()
    real_flush = flusher.hold_and_flush

    def flush_and_signal(*args: Any, **kwargs: Any) -> bool:
        held = real_flush(*args, **kwargs)
        flushed.set()
        return held

    monkeypatch.setattr(flusher, "hold_and_flush", flush_and_signal)
    flusher.enable(kernel)
    committed = time.monotonic()
    run_id = kernel.dispatch(CreateRun("two-stage", {"value": 1})).workflow_run_id
    assert sink.arrived.wait(5), "the flusher did not deliver the event"
    assert time.monotonic() - committed < 1.0
    assert flushed.wait(5), "the flush did not finish"
    assert sink.types(run_id) == ["workflow:created"]
    assert not OutboxEvent.objects.filter(published_at=None).exists()


def test_a_flusher_that_finds_the_lease_held_leaves_the_events_to_the_holder() -> None:
    """Only the holder of the ``outbox-flush`` lease delivers (no double delivery)."""
    sink = CollectingSink()
    kernel = make_kernel(two_stage(), event_sink=sink)
    kernel.dispatch(CreateRun("two-stage", {"value": 1}))
    assert leases.acquire_lease(kernel.lease_clock, flusher.FLUSH_LEASE, "other", 30)

    assert flusher.flush_outbox(kernel, "me") is None
    assert sink.events == []
    leases.release_lease(flusher.FLUSH_LEASE, "other")
    assert flusher.flush_outbox(kernel, "me") == 1
    assert [e["type"] for e in sink.events] == ["workflow:created"]


@postgres_only  # SQLite's shared in-memory test database locks tables across threads
def test_one_busy_period_takes_the_flush_lease_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 19: a flusher keeps the ``outbox-flush`` lease across passes while this process
    keeps committing (two statements per pass instead of four), and gives it up once idle."""
    sink = SignallingSink()
    kernel = make_kernel(two_stage(), event_sink=sink)
    taken: list[str] = []
    real_acquire = leases.acquire_lease

    def counting_acquire(clock: Any, name: str, owner: str, ttl: float) -> bool:
        if name == flusher.FLUSH_LEASE:
            taken.append(owner)
        return real_acquire(clock, name, owner, ttl)

    monkeypatch.setattr(flusher.leases, "acquire_lease", counting_acquire)
    monkeypatch.setattr(flusher, "HOLD_SECONDS", 10.0)
    flusher.enable(kernel)
    try:
        for value in (1, 2, 3):
            sink.arrived.clear()
            kernel.dispatch(CreateRun("two-stage", {"value": value}))
            assert sink.arrived.wait(5), "the flusher did not deliver the event"
        assert len(taken) == 1
        held = leases.MaintenanceLease.objects.filter(name=flusher.FLUSH_LEASE)
        assert held.count() == 1
    finally:
        thread = flusher._flusher._thread if flusher._flusher else None
        flusher.disable()
    assert thread is not None
    thread.join(5)  # the stopped flusher gives the lease up
    assert not leases.MaintenanceLease.objects.filter(name=flusher.FLUSH_LEASE).exists()
    assert len(sink.events) == 3
