"""``run.cancel`` against the database (SPEC §4.4; catalogue A.4 and the H cascade gap)."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

import pytest

from django_workflows import StageContext, define_stage, define_workflow
from django_workflows.definition import Workflow
from django_workflows.kernel import CancelRun, ClaimPendingRuns, CreateRun, Kernel
from django_workflows.kernel.commands import ExecuteJob, ExecuteJobResult, FlushOutbox
from django_workflows.models import OutboxEvent, Status, WorkflowJob, WorkflowRun, WorkflowStage
from django_workflows.testing import CollectingSink, FakeClock, run_to_completion
from tests.workflows import Num, add, async_stage, two_stage

pytestmark = pytest.mark.django_db(transaction=True)

KernelFor = Callable[..., Kernel]


def _crash(ctx: StageContext[Num, Any]) -> Num:
    raise ValueError("bad data")


def _wide() -> Workflow:
    """One parallel group whose stages end up in every state, then a last stage."""
    return (
        define_workflow(id="wide", input=Num)
        .parallel(
            [
                async_stage("batch"),
                add(1, "done"),
                define_stage(id="failing", input=Num, output=Num, execute=_crash),
                add(2, "running"),
                add(3, "waiting"),
            ]
        )
        .pipe(add(4, "after"))
        .build()
    )


def _create(kernel: Kernel, workflow_id: str = "two-stage") -> uuid.UUID:
    res = kernel.dispatch(CreateRun(workflow_id=workflow_id, input={"value": 1}))
    return uuid.UUID(res.workflow_run_id)


def _claim(kernel: Kernel) -> None:
    assert kernel.dispatch(ClaimPendingRuns(worker_id="w-1")).claimed


def _execute(kernel: Kernel, job: WorkflowJob) -> ExecuteJobResult:
    result: ExecuteJobResult = kernel.dispatch(
        ExecuteJob(
            workflow_run_id=job.workflow_run_id,
            workflow_id=job.workflow_id,
            stage_id=job.stage_id,
            config=(job.payload or {}).get("config") or {},
        )
    )
    return result


def _lease(kernel: Kernel, stage_id: str) -> WorkflowJob:
    job = kernel.queue.dequeue("w-1")
    assert job is not None and job.stage_id == stage_id, job
    return job


def _outbox_types(run_id: uuid.UUID) -> list[str]:
    return list(
        OutboxEvent.objects.filter(workflow_run_id=run_id)
        .order_by("sequence")
        .values_list("event_type", flat=True)
    )


def test_cancel_running_run(kernel_for: KernelFor, clock: FakeClock, sink: CollectingSink) -> None:
    """K-CA-2, SM-3, Part I item 14: ``cancelled=True``; run CANCELLED with ``completed_at``,
    duration from ``started_at`` and a bumped version; exactly one ``workflow:cancelled``
    carrying the reason.
    """
    kernel = kernel_for(two_stage())
    run_id = _create(kernel)
    clock.advance(2)
    _claim(kernel)
    version = WorkflowRun.objects.get(pk=run_id).version
    clock.advance(3)

    result = kernel.dispatch(CancelRun(run_id, reason="user asked"))

    assert result.cancelled is True
    run = WorkflowRun.objects.get(pk=run_id)
    assert run.status == Status.CANCELLED
    assert run.completed_at == clock.now()
    assert run.duration_ms == 3000
    assert run.version > version
    kernel.dispatch(FlushOutbox())
    assert sink.types(run_id) == ["workflow:created", "workflow:started", "workflow:cancelled"]
    assert sink.events[-1]["reason"] == "user asked"


def test_cancel_pending_run(kernel_for: KernelFor, clock: FakeClock) -> None:
    """SM-3, K-CA-2: a PENDING run can be cancelled; it never started, so it has no duration
    and a later claim does not pick it up.
    """
    kernel = kernel_for(two_stage())
    run_id = _create(kernel)

    assert kernel.dispatch(CancelRun(str(run_id))).cancelled is True

    run = WorkflowRun.objects.get(pk=run_id)
    assert run.status == Status.CANCELLED
    assert run.completed_at == clock.now()
    assert run.duration_ms is None
    assert _outbox_types(run_id) == ["workflow:created", "workflow:cancelled"]
    assert kernel.dispatch(ClaimPendingRuns(worker_id="w-1")).claimed == []
    assert WorkflowJob.objects.count() == 0


@pytest.mark.parametrize("terminal", ["completed", "cancelled"])
def test_cancel_terminal_run_is_refused(kernel_for: KernelFor, terminal: str) -> None:
    """K-CA-1: a COMPLETED (or already CANCELLED) run -> ``cancelled=False``, no writes (same
    status and version), no events.
    """
    kernel = kernel_for(two_stage())
    run_id = _create(kernel)
    if terminal == "completed":
        assert run_to_completion(kernel, run_id).status == Status.COMPLETED
    else:
        assert kernel.dispatch(CancelRun(run_id)).cancelled is True
    before = WorkflowRun.objects.values("status", "version", "updated_at").get(pk=run_id)
    events = _outbox_types(run_id)

    assert kernel.dispatch(CancelRun(run_id, reason="again")).cancelled is False

    assert WorkflowRun.objects.values("status", "version", "updated_at").get(pk=run_id) == before
    assert _outbox_types(run_id) == events
    assert events.count("workflow:cancelled") == (terminal == "cancelled")


def test_cancel_unknown_run_is_refused(kernel_for: KernelFor) -> None:
    """K-CA-1: a run that does not exist -> ``cancelled=False``, nothing written."""
    kernel = kernel_for(two_stage())
    assert kernel.dispatch(CancelRun(uuid.uuid4())).cancelled is False
    assert OutboxEvent.objects.count() == 0


def test_cancel_cascades_to_open_stages_and_queued_jobs(
    kernel_for: KernelFor, clock: FakeClock
) -> None:
    """K-CA-2, K-CA-3, DM-47 (catalogue H): non-terminal records (PENDING, RUNNING, SUSPENDED)
    become CANCELLED with ``completed_at`` and ``next_poll_at`` cleared; COMPLETED and FAILED
    records keep their state; PENDING and SUSPENDED jobs become CANCELLED; the RUNNING job is
    left alone (lease kept); another run's jobs and records are untouched.
    """
    kernel = kernel_for(_wide(), two_stage())
    run_id = _create(kernel, "wide")
    _claim(kernel)
    other_id = _create(kernel)
    _claim(kernel)

    batch = _lease(kernel, "batch")
    suspended = _execute(kernel, batch)
    assert suspended.outcome == "suspended"
    kernel.queue.suspend(batch.pk, suspended.next_poll_at)
    done = _lease(kernel, "done")
    assert _execute(kernel, done).outcome == "completed"  # the outcome completed the job
    failing = _lease(kernel, "failing")
    WorkflowJob.objects.filter(pk=failing.pk).update(max_attempts=1)  # no retry: FAILED
    assert _execute(kernel, failing).outcome == "failed"
    running = _lease(kernel, "running")
    WorkflowStage.objects.filter(run_id=run_id, stage_id="running").update(
        status=Status.RUNNING, started_at=clock.now()
    )  # its Phase 1 committed; the stage body is executing
    stage_before = {s.stage_id: s for s in WorkflowStage.objects.filter(run_id=run_id)}
    assert stage_before["batch"].next_poll_at is not None
    other_before = (
        sorted(WorkflowStage.objects.filter(run_id=other_id).values_list("stage_id", "status")),
        sorted(WorkflowJob.objects.filter(workflow_run_id=other_id).values_list("pk", "status")),
    )
    clock.advance(10)

    assert kernel.dispatch(CancelRun(run_id)).cancelled is True

    stages = {s.stage_id: s for s in WorkflowStage.objects.filter(run_id=run_id)}
    assert {sid: s.status for sid, s in stages.items()} == {
        "batch": Status.CANCELLED,
        "done": Status.COMPLETED,
        "failing": Status.FAILED,
        "running": Status.CANCELLED,
        "waiting": Status.CANCELLED,
    }
    for sid in ("batch", "running", "waiting"):
        assert stages[sid].completed_at == clock.now()
        assert stages[sid].next_poll_at is None
        assert stages[sid].version == stage_before[sid].version + 1
    for sid in ("done", "failing"):
        assert stages[sid].completed_at == stage_before[sid].completed_at
        assert stages[sid].version == stage_before[sid].version

    jobs = {j.stage_id: j for j in WorkflowJob.objects.filter(workflow_run_id=run_id)}
    assert {sid: j.status for sid, j in jobs.items()} == {
        "batch": Status.CANCELLED,
        "done": Status.COMPLETED,
        "failing": Status.FAILED,
        "running": Status.RUNNING,
        "waiting": Status.CANCELLED,
    }
    assert (jobs["running"].worker_id, jobs["running"].locked_at) == ("w-1", running.locked_at)
    assert jobs["waiting"].completed_at == clock.now()

    assert other_before == (
        sorted(WorkflowStage.objects.filter(run_id=other_id).values_list("stage_id", "status")),
        sorted(WorkflowJob.objects.filter(workflow_run_id=other_id).values_list("pk", "status")),
    )
    assert WorkflowRun.objects.get(pk=other_id).status == Status.RUNNING


def test_cancel_discards_the_result_of_a_running_job(kernel_for: KernelFor) -> None:
    """K-CA-3, K-JE-3, K-JE-15: the job that was RUNNING at cancel time finishes as a ghost: no
    stage write, no stage event, and the run stays CANCELLED.
    """
    kernel = kernel_for(two_stage())
    run_id = _create(kernel)
    _claim(kernel)
    job = _lease(kernel, "add-1")
    assert kernel.dispatch(CancelRun(run_id)).cancelled is True
    events = _outbox_types(run_id)

    result = _execute(kernel, job)

    assert (result.outcome, result.ghost, result.retryable) == ("failed", True, False)
    record = WorkflowStage.objects.get(run_id=run_id)
    assert record.status == Status.CANCELLED
    assert record.output_data is None
    assert _outbox_types(run_id) == events
    assert WorkflowRun.objects.get(pk=run_id).status == Status.CANCELLED
