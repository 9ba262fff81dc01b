"""Signal races that need real row locks (PostgreSQL only; skipped on SQLite).

* Concurrent sends with one key: one row, one ``signal:received``, the others duplicates with
  the first signal's id (the run-row lock serialises the key look-up; the unique constraint
  backs it up).
* Concurrent pollers of one waiting stage: the signal is consumed once and the stage completes
  once (the poll's run-row lock without waiting, the fenced ``consumed_at IS NULL`` update and
  the fenced stage update).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
from django.db import connection

from django_workflows import define_workflow, send_signal, wait_for_signal
from django_workflows.kernel import CreateRun, Kernel, PollSuspendedStages, TransitionRun
from django_workflows.kernel import events as ev
from django_workflows.models import OutboxEvent, Status, WorkflowSignal, WorkflowStage
from django_workflows.testing import drive
from tests.markers import postgres_only

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.postgres, postgres_only]

KernelFor = Callable[..., Kernel]
THREADS = 4


def _race(fn: Callable[[], Any]) -> list[Any]:
    """Run ``fn`` in THREADS threads released together, each on its own connection."""
    barrier = threading.Barrier(THREADS)
    out: list[Any] = [None] * THREADS

    def main(i: int) -> None:
        try:
            barrier.wait(10)
            out[i] = fn()
        except BaseException as exc:  # reported by the assertions
            out[i] = exc
        finally:
            connection.close()

    threads = [threading.Thread(target=main, args=(i,), daemon=True) for i in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
        assert not t.is_alive(), "a thread hung"
    return out


def _waiting(kernel: Kernel) -> str:
    run_id = str(kernel.dispatch(CreateRun(workflow_id="pg-signal")).workflow_run_id)
    drive(kernel, run_id, rounds=3, advance_seconds=0)
    assert WorkflowStage.objects.get(run_id=run_id).status == Status.SUSPENDED
    return run_id


@pytest.fixture
def kernel(kernel_for: KernelFor) -> Kernel:
    return kernel_for(
        define_workflow(id="pg-signal")
        .pipe(wait_for_signal(id="go", poll_interval_seconds=3600))
        .build()
    )


def test_concurrent_sends_with_one_key_store_one_signal(kernel: Kernel) -> None:
    run_id = _waiting(kernel)
    results = _race(lambda: send_signal(run_id, "go", {"n": 1}, key="k", kernel=kernel))
    assert not [r for r in results if isinstance(r, BaseException)], results
    stored = [r for r in results if r.stored]
    assert len(stored) == 1
    assert {r.signal_id for r in results} == {stored[0].signal_id}
    assert WorkflowSignal.objects.filter(run_id=run_id).count() == 1
    received = OutboxEvent.objects.filter(workflow_run_id=run_id, event_type=ev.SIGNAL_RECEIVED)
    assert received.count() == 1


def test_concurrent_pollers_consume_the_signal_once(kernel: Kernel) -> None:
    run_id = _waiting(kernel)
    send_signal(run_id, "go", {"n": 7}, kernel=kernel)
    results = _race(lambda: kernel.dispatch(PollSuspendedStages()))
    assert not [r for r in results if isinstance(r, BaseException)], results
    assert sum(r.resumed for r in results) == 1
    stage = WorkflowStage.objects.get(run_id=run_id)
    assert stage.status == Status.COMPLETED
    signal = WorkflowSignal.objects.get(run_id=run_id)
    assert signal.consumed_by_id == stage.pk
    completed = OutboxEvent.objects.filter(
        workflow_run_id=run_id, event_type=ev.STAGE_COMPLETED, payload__stage_id="go"
    )
    assert completed.count() == 1
    kernel.dispatch(TransitionRun(run_id))  # what the tick does for the runs it resumed
    assert drive(kernel, run_id, rounds=3).output == {"n": 7}
