"""A ready job passed over because another transaction holds its run (issue 19).

Two workers could both miss a ready job: the one committing an outcome of the run skips the
job row the other has locked (``SKIP LOCKED``), while the other finds the run locked and
gives the job up. The second one now learns that it passed a job over (``_BUSY``) and looks
again shortly, so the job is leased as soon as the run's lock is gone, not left for the tick.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
from django.db import connection, transaction

from django_workflows.kernel import ClaimPendingRuns, CreateRun
from django_workflows.kernel.stage_path import lease as lease_module
from django_workflows.models import Status, WorkflowJob, WorkflowRun
from django_workflows.testing import make_kernel
from tests.markers import postgres_only
from tests.workflows import two_stage

pytestmark = [postgres_only, pytest.mark.django_db(transaction=True)]


def _ready_job(kernel: Any) -> WorkflowRun:
    run_id = kernel.dispatch(CreateRun("two-stage", {"value": 1})).workflow_run_id
    kernel.dispatch(ClaimPendingRuns("claimer", max_claims=1))
    run = WorkflowRun.objects.get(pk=run_id)
    assert run.status == Status.RUNNING
    assert WorkflowJob.objects.filter(workflow_run_id=run_id, status=Status.PENDING).count() == 1
    return run


def test_a_job_whose_run_is_locked_is_passed_over_as_busy_and_leased_once_free(
    monkeypatch: Any,
) -> None:
    kernel = make_kernel(two_stage())
    run = _ready_job(kernel)
    held, release, done = threading.Event(), threading.Event(), threading.Event()

    def hold() -> None:  # another worker's outcome transaction of that run
        try:
            with transaction.atomic():
                list(WorkflowRun.objects.filter(pk=run.pk).select_for_update())
                held.set()
                release.wait(10)
        finally:
            connection.close()
            done.set()

    thread = threading.Thread(target=hold, daemon=True)
    thread.start()
    assert held.wait(10)
    try:
        with transaction.atomic():
            assert lease_module.lease_within(kernel, "w1") is lease_module._BUSY
        # lease() looks again while the run is locked, and leases the job once it is free.
        waits: list[float] = []

        def sleep(seconds: float) -> None:
            waits.append(seconds)
            if len(waits) == 3:
                release.set()
                assert done.wait(10)

        monkeypatch.setattr(lease_module.time, "sleep", sleep)
        delivery = lease_module.lease(kernel, "w1")
    finally:
        release.set()
        thread.join(10)
    assert delivery is not None and delivery.job.workflow_run_id == run.pk
    assert waits == [lease_module.BUSY_RETRY_SECONDS] * 3


def test_a_run_locked_for_long_gives_up_after_the_retries(monkeypatch: Any) -> None:
    kernel = make_kernel(two_stage())
    run = _ready_job(kernel)
    monkeypatch.setattr(lease_module, "try_lock_run", lambda run_id: lease_module.LOCKED)
    waits: list[float] = []
    monkeypatch.setattr(lease_module.time, "sleep", waits.append)
    assert lease_module.lease(kernel, "w1") is None
    assert len(waits) == lease_module.BUSY_RETRIES
    assert WorkflowJob.objects.get(workflow_run_id=run.pk).status == Status.PENDING
