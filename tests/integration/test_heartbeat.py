"""Heartbeats: lease refresh (H-2, DM-46) and cancellation seen by a running stage (Part I 15)."""

from __future__ import annotations

from typing import Any

import pytest

from django_workflows.kernel import CancelRun, ClaimPendingRuns, CreateRun
from django_workflows.kernel.hosting import Heartbeat
from django_workflows.kernel.services import KernelStageServices
from django_workflows.models import Status, WorkflowJob
from tests.workflows import two_stage

pytestmark = pytest.mark.django_db(transaction=True)


def test_heartbeat_refreshes_lease_and_reports_cancel_to_the_stage(kernel_for: Any, clock) -> None:
    kernel = kernel_for(two_stage())
    run_id = kernel.dispatch(CreateRun("two-stage", {"value": 1})).workflow_run_id
    kernel.dispatch(ClaimPendingRuns("w"))
    job = kernel.queue.dequeue("w")
    assert job is not None
    leased_at = job.locked_at
    services = KernelStageServices(
        clock=clock,
        blobs=kernel.blobs,
        workflow_type="two-stage",
        run_id=job.workflow_run_id,
        stage_id=job.stage_id,
        stage_pk=None,
        cancel_check_interval_seconds=3600,
    )
    assert services.is_cancelled() is False  # read once; the next read is an hour away

    clock.advance(30)
    with Heartbeat(kernel, job.pk, interval_seconds=3600, run_id=job.workflow_run_id) as hb:
        hb.beat()
        assert WorkflowJob.objects.get(pk=job.pk).locked_at > leased_at
        assert services.is_cancelled() is False

        kernel.dispatch(CancelRun(run_id))
        assert services.is_cancelled() is False  # the throttled read has not come round yet
        hb.beat()
        assert services.is_cancelled() is True  # the heartbeat saw the cancel
    assert WorkflowJob.objects.get(pk=job.pk).status == Status.RUNNING  # K-CA-3


class _Beats:
    """A stand-in for :class:`Heartbeat` that records its beats (no database)."""

    def __init__(self, interval: float, timeout: float | None = None) -> None:
        import threading

        self.interval = interval
        self.timeout_seconds = timeout
        self.next_beat = 0.0
        self.deadline: float | None = None
        self.job_id = 0
        self.log_fields = {"run_id": None, "stage_id": None, "delivery": None, "generation": None}
        self.beaten = threading.Event()

    def check_deadline(self, now: float) -> bool:
        if self.deadline is not None and now >= self.deadline:
            self.beaten.set()  # the watchdog saw the deadline
            self.deadline = None
        return False

    def beat(self) -> None:
        self.beaten.set()


@pytest.mark.django_db(transaction=False)
def test_the_heartbeat_thread_wakes_only_for_a_beat_due_before_its_wait_ends(monkeypatch) -> None:
    """Issue 19: a delivery due after the thread's current wait costs no wake-up (most stages
    end long before their first beat); one due sooner - a shorter interval or a stage
    timeout - wakes it, and it beats on time."""
    from django_workflows.kernel import heartbeat

    beater = heartbeat._Beater()
    notified: list[int] = []
    real_notify = beater._cond.notify
    monkeypatch.setattr(beater._cond, "notify", lambda n=1: (notified.append(1), real_notify(n)))
    slow = _Beats(interval=60)
    beater.add(slow)  # starts the thread, which waits ~60 s for it
    for _ in range(100):
        if beater._wake_at > 0:
            break
        heartbeat.time.sleep(0.01)
    assert beater._wake_at > 0 and notified == []
    later = [_Beats(interval=120) for _ in range(5)]
    for b in later:
        beater.add(b)
        beater.remove(b)
    assert notified == []  # due after the wait ends: not woken, not even by the removals
    soon = _Beats(interval=0.05)
    beater.add(soon)
    assert notified == [1]
    assert soon.beaten.wait(5)  # beaten on time, not after the 60 s wait
    watched = _Beats(interval=60, timeout=0.05)
    beater.add(watched)
    assert watched.beaten.wait(5)  # its deadline woke the watchdog
    for b in (slow, soon, watched):
        beater.remove(b)
