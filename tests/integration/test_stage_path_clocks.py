"""The production stage path (:mod:`django_workflows.kernel.delivery`) when the kernel's clock
is not the lease clock (issue 17): the kernel runs 90 s ahead of, or behind, the database clock
that stamps and judges leases. Lease, heartbeat, outcome and stale release must all judge
leases in database time; a mixed-clock judgement would release a live lease (kernel behind:
the reaper's threshold lands in the lease's past) or keep a stale one.

Also the ghost branches of the production path, in process on either database.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.db.models import F

from django_workflows import StageContext, define_stage, define_workflow
from django_workflows.kernel import (
    CancelRun,
    ClaimPendingRuns,
    CreateRun,
    ReapStaleLeases,
    delivery,
)
from django_workflows.kernel.hosting import process_available_jobs
from django_workflows.models import OutboxEvent, Status, WorkflowJob, WorkflowRun, WorkflowStage
from tests.workflows import Num, add

pytestmark = pytest.mark.django_db(transaction=True)

#: The reaper's threshold: shorter than the skew, so a mixed-clock judgement shows.
THRESHOLD = 60.0


def _start(kernel: Any, workflow_id: str) -> str:
    run_id = kernel.dispatch(CreateRun(workflow_id, {"value": 1})).workflow_run_id
    kernel.dispatch(ClaimPendingRuns("claimer"))
    return str(run_id)


def _database_now() -> Any:
    from django_workflows.kernel.leases import LeaseClock

    return LeaseClock(object()).read()  # type: ignore[arg-type]


def test_a_skewed_kernel_runs_a_workflow_to_completion(skewed_kernel_for: Any) -> None:
    wf = define_workflow(id="skew", input=Num).pipe(add(1, "a")).pipe(add(2, "b")).build()
    kernel = skewed_kernel_for(wf)
    assert kernel.lease_clock.uses_database
    run_id = _start(kernel, "skew")
    assert process_available_jobs(kernel, "w", max_jobs=5).processed == 2
    run = WorkflowRun.objects.get(pk=run_id)
    assert (run.status, run.output) == (Status.COMPLETED, {"value": 4})


def test_a_fresh_lease_is_never_stale_and_a_stale_one_is_released(
    skewed_kernel_for: Any,
) -> None:
    """The lease is stamped in database time; the reaper judges it in database time: a lease
    taken now is fresh whatever the kernel's clock says, one older than the threshold (in
    database time) is released and its late outcome discarded."""
    wf = define_workflow(id="skew-lease", input=Num).pipe(add(1, "a")).build()
    kernel = skewed_kernel_for(wf)
    _start(kernel, "skew-lease")
    d = delivery.lease(kernel, "w1")
    assert d is not None
    job = WorkflowJob.objects.get(pk=d.job.pk)
    assert abs((job.locked_at - _database_now()).total_seconds()) < 30  # not the kernel's time

    assert kernel.dispatch(ReapStaleLeases(stale_threshold_seconds=THRESHOLD)).released == 0

    outcome, services = delivery.execute(kernel, d)
    WorkflowJob.objects.filter(pk=d.job.pk).update(
        locked_at=F("locked_at") - timedelta(seconds=THRESHOLD + 30)
    )
    assert kernel.dispatch(ReapStaleLeases(stale_threshold_seconds=THRESHOLD)).released == 1
    late = delivery.commit_outcome(kernel, d, outcome, services, "w1")
    assert late.outcome == "discarded"
    assert WorkflowJob.objects.get(pk=d.job.pk).status == Status.PENDING


def test_a_heartbeat_refreshes_the_lease_in_database_time(skewed_kernel_for: Any) -> None:
    """A beat of a lease that aged (in database time) stamps it fresh in database time, so the
    reaper then leaves it alone; the outcome commits."""
    wf = define_workflow(id="skew-beat", input=Num).pipe(add(1, "a")).build()
    kernel = skewed_kernel_for(wf)
    run_id = _start(kernel, "skew-beat")
    d = delivery.lease(kernel, "w1")
    assert d is not None
    WorkflowJob.objects.filter(pk=d.job.pk).update(
        locked_at=F("locked_at") - timedelta(seconds=THRESHOLD + 30)
    )
    beat = delivery.Heartbeat(kernel, d.job.pk, 30.0, d.run.pk, attempt=d.job.attempt)
    beat.beat()
    assert not beat.lost.is_set()
    job = WorkflowJob.objects.get(pk=d.job.pk)
    assert abs((job.locked_at - _database_now()).total_seconds()) < 30
    assert kernel.dispatch(ReapStaleLeases(stale_threshold_seconds=THRESHOLD)).released == 0
    assert delivery.deliver(kernel, d, None).outcome == "completed"
    assert WorkflowRun.objects.get(pk=run_id).status == Status.COMPLETED


# --- Ghosts on the production path (either database) -----------------------------------------


def test_a_run_cancelled_while_its_stage_ran_makes_the_outcome_a_ghost(kernel_for: Any) -> None:
    """K-JE-15 on the production path: the run left RUNNING during execution; the outcome
    fails only the job (no retry), writes no record outcome and no stage event."""
    calls: list[str] = []

    def body(ctx: StageContext[Num, Any]) -> Num:
        calls.append("ran")
        return Num(value=ctx.input.value)

    wf = (
        define_workflow(id="ghost", input=Num)
        .pipe(define_stage(id="s", input=Num, output=Num, execute=body))
        .build()
    )
    kernel = kernel_for(wf)
    run_id = _start(kernel, "ghost")
    d = delivery.lease(kernel, "w")
    assert d is not None
    outcome, services = delivery.execute(kernel, d)
    kernel.dispatch(CancelRun(run_id))

    result = delivery.commit_outcome(kernel, d, outcome, services, "w")

    assert calls == ["ran"]
    assert result.outcome == "ghost" and "CANCELLED" in (result.error or "")
    job = WorkflowJob.objects.get(pk=d.job.pk)
    assert (job.status, job.attempt) == (Status.FAILED, 1)
    assert WorkflowStage.objects.get(pk=d.record.pk).status != Status.COMPLETED
    types = list(
        OutboxEvent.objects.filter(workflow_run_id=run_id).values_list("event_type", flat=True)
    )
    assert "stage:completed" not in types


def test_a_job_of_a_run_that_is_no_longer_running_is_failed_at_lease(kernel_for: Any) -> None:
    """K-JE-3 on the production path: a ready job whose run is not RUNNING is failed in the
    lease transaction without running its stage."""
    ran: list[int] = []

    def body(ctx: StageContext[Num, Any]) -> Num:
        ran.append(1)
        return ctx.input

    wf = (
        define_workflow(id="ghost-lease", input=Num)
        .pipe(define_stage(id="s", input=Num, output=Num, execute=body))
        .build()
    )
    kernel = kernel_for(wf)
    run_id = _start(kernel, "ghost-lease")
    WorkflowRun.objects.filter(pk=run_id).update(status=Status.FAILED)

    assert delivery.lease(kernel, "w") is None

    assert ran == []
    job = WorkflowJob.objects.get(workflow_run_id=run_id)
    assert job.status == Status.FAILED and "not RUNNING" in (job.last_error or "")
