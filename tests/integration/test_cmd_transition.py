"""``run.transition`` against the database (SPEC §4.3; catalogue A.3; Part I item 17)."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest
from django.db import connection, transaction
from pydantic import BaseModel

from django_workflows import StageContext, define_stage, define_workflow
from django_workflows.definition import Workflow
from django_workflows.kernel import ClaimPendingRuns, CreateRun, Kernel, TransitionRun
from django_workflows.kernel.commands import ExecuteJob, ExecuteJobResult, FlushOutbox
from django_workflows.kernel.store import update_run, update_stage
from django_workflows.models import OutboxEvent, Status, WorkflowJob, WorkflowRun, WorkflowStage
from django_workflows.testing import CollectingSink, FakeClock, run_to_completion
from tests.markers import postgres_only
from tests.workflows import Num, add, two_stage

pytestmark = pytest.mark.django_db(transaction=True)

KernelFor = Callable[..., Kernel]


class Pair(BaseModel):
    a: Num
    b: Num


def _fan_out(first: Any | None = None) -> Workflow:
    """``[a | b] -> join``; ``first`` replaces stage ``a``."""
    return (
        define_workflow(id="fan-out", input=Num)
        .parallel([first or add(1, "a"), add(2, "b")])
        .pipe(
            define_stage(
                id="join", input=Pair, output=Num, execute=lambda ctx: Num(value=ctx.input.b.value)
            )
        )
        .build()
    )


def _flaky(stage_id: str = "a", *, failures: int = 1) -> Any:
    """A stage that raises (retryable) on its first ``failures`` calls, then adds 1."""
    calls = {"n": 0}

    def execute(ctx: StageContext[Num, Any]) -> Num:
        calls["n"] += 1
        if calls["n"] <= failures:
            raise RuntimeError(f"boom {calls['n']}")
        return Num(value=ctx.input.value + 1)

    return define_stage(id=stage_id, input=Num, output=Num, execute=execute)


def _start(kernel: Kernel, workflow_id: str = "two-stage") -> uuid.UUID:
    """Create and claim a run: RUNNING with its group-1 records and jobs PENDING."""
    res = kernel.dispatch(CreateRun(workflow_id=workflow_id, input={"value": 1}))
    claimed = kernel.dispatch(ClaimPendingRuns(worker_id="w-1")).claimed
    assert [c.workflow_run_id for c in claimed] == [res.workflow_run_id]
    return uuid.UUID(res.workflow_run_id)


def _execute_next(kernel: Kernel, stage_id: str) -> ExecuteJobResult:
    """Lease the next ready job (it must be ``stage_id``'s) and execute it: ``job.execute``
    enters the production stage path, whose outcome transaction settles the job and
    transitions the run (the same rules as ``run.transition``).
    """
    job = kernel.queue.dequeue("w-1")
    assert job is not None and job.stage_id == stage_id, job
    result: ExecuteJobResult = kernel.dispatch(
        ExecuteJob(
            workflow_run_id=job.workflow_run_id,
            workflow_id=job.workflow_id,
            stage_id=job.stage_id,
            config=(job.payload or {}).get("config") or {},
        )
    )
    return result


def _undo_advance(run_id: uuid.UUID, group: int) -> None:
    """Take back what the outcome's transition created for ``group`` (its records and jobs):
    the state "earlier groups COMPLETED, not yet transitioned" that ``run.transition`` decides
    on (after a crash between an outcome and its transition in older versions).
    """
    WorkflowJob.objects.filter(
        workflow_run_id=run_id,
        stage_id__in=WorkflowStage.objects.filter(run_id=run_id, execution_group=group).values(
            "stage_id"
        ),
    ).delete()
    WorkflowStage.objects.filter(run_id=run_id, execution_group=group).delete()


def _snapshot(run_id: uuid.UUID) -> tuple[Any, ...]:
    """Everything a noop must leave alone."""
    run = WorkflowRun.objects.filter(pk=run_id).values("status", "version", "updated_at").first()
    stages = sorted(WorkflowStage.objects.filter(run_id=run_id).values_list("stage_id", "status"))
    return (
        run,
        stages,
        WorkflowJob.objects.count(),
        OutboxEvent.objects.count(),
    )


def _outbox_types(run_id: uuid.UUID) -> list[str]:
    return list(
        OutboxEvent.objects.filter(workflow_run_id=run_id)
        .order_by("sequence")
        .values_list("event_type", flat=True)
    )


# --- noop (K-TR-1, K-TR-4, EC-30) --------------------------------------------------------------


def test_transition_noop_for_unknown_run(kernel_for: KernelFor) -> None:
    """K-TR-1: a run that does not exist -> ``noop``, nothing written."""
    kernel = kernel_for(two_stage())
    result = kernel.dispatch(TransitionRun(uuid.uuid4()))
    assert result.action == "noop"
    assert result.next_group is None
    assert OutboxEvent.objects.count() == 0
    assert WorkflowStage.objects.count() == 0


def test_transition_noop_for_completed_run(kernel_for: KernelFor) -> None:
    """K-TR-1, SM-6: a terminal run -> ``noop``: no version bump, no record, no job, no event."""
    kernel = kernel_for(two_stage())
    res = kernel.dispatch(CreateRun(workflow_id="two-stage", input={"value": 1}))
    run_id = uuid.UUID(res.workflow_run_id)
    assert run_to_completion(kernel, run_id).status == Status.COMPLETED
    before = _snapshot(run_id)

    assert kernel.dispatch(TransitionRun(run_id)).action == "noop"
    assert _snapshot(run_id) == before


def test_transition_noop_for_pending_run(kernel_for: KernelFor) -> None:
    """Part I item 17, EC-30, EC-53: a PENDING (unclaimed) run -> ``noop``; no group-1 records,
    no jobs that would be ghosted, no ``workflow:started``; the run stays PENDING.
    """
    kernel = kernel_for(two_stage())
    res = kernel.dispatch(CreateRun(workflow_id="two-stage", input={"value": 1}))
    run_id = uuid.UUID(res.workflow_run_id)
    before = _snapshot(run_id)

    assert kernel.dispatch(TransitionRun(res.workflow_run_id)).action == "noop"

    assert _snapshot(run_id) == before
    assert WorkflowRun.objects.get(pk=run_id).status == Status.PENDING
    assert WorkflowStage.objects.count() == 0
    assert WorkflowJob.objects.count() == 0
    assert _outbox_types(run_id) == ["workflow:created"]


def test_transition_noop_when_workflow_missing(kernel_for: KernelFor) -> None:
    """K-TR-1: the run's workflow is not in this kernel's registry -> ``noop``."""
    run_id = _start(kernel_for(two_stage()))
    WorkflowStage.objects.filter(run_id=run_id).update(status=Status.COMPLETED)
    before = _snapshot(run_id)
    assert kernel_for().dispatch(TransitionRun(run_id)).action == "noop"
    assert _snapshot(run_id) == before


@pytest.mark.parametrize("status", [Status.PENDING, Status.RUNNING, Status.SUSPENDED])
def test_transition_noop_while_a_stage_is_active(kernel_for: KernelFor, status: str) -> None:
    """K-TR-4, SM-18: a PENDING/RUNNING/SUSPENDED record -> ``noop``, nothing written."""
    kernel = kernel_for(two_stage())
    run_id = _start(kernel)
    WorkflowStage.objects.filter(run_id=run_id).update(status=status)
    before = _snapshot(run_id)

    assert kernel.dispatch(TransitionRun(run_id)).action == "noop"
    assert _snapshot(run_id) == before


# --- advance (K-TR-3, K-TR-6, K-TR-9) ----------------------------------------------------------


def test_transition_creates_first_group_when_running_run_has_no_records(
    kernel_for: KernelFor, clock: FakeClock
) -> None:
    """K-TR-3: a RUNNING run without records -> group 1 created and enqueued,
    ``workflow:started``, ``advanced`` to 1; the run stays RUNNING.
    """
    kernel = kernel_for(two_stage())
    res = kernel.dispatch(CreateRun(workflow_id="two-stage", input={"value": 1}))
    run_id = uuid.UUID(res.workflow_run_id)
    update_run(run_id, clock.now(), status=Status.RUNNING, started_at=clock.now())

    result = kernel.dispatch(TransitionRun(run_id))

    assert (result.action, result.next_group) == ("advanced", 1)
    assert list(WorkflowStage.objects.values_list("stage_id", "status", "generation")) == [
        ("add-1", Status.PENDING, 0)
    ]
    assert list(WorkflowJob.objects.values_list("stage_id", "status")) == [
        ("add-1", Status.PENDING)
    ]
    assert WorkflowRun.objects.get(pk=run_id).status == Status.RUNNING
    assert _outbox_types(run_id) == ["workflow:created", "workflow:started"]


def test_transition_advances_to_next_group(kernel_for: KernelFor) -> None:
    """K-TR-6, WF-45: group 1 COMPLETED -> ``advanced`` to 2: a PENDING ``add-10`` record in
    group 2 and one PENDING job for it (run priority, whole config map), written by the
    outcome's own transition; a later ``run.transition`` finds nothing to do and writes no
    event.
    """
    kernel = kernel_for(two_stage())
    run_id = _start(kernel)
    assert _execute_next(kernel, "add-1").outcome == "completed"
    events_before = OutboxEvent.objects.count()

    result = kernel.dispatch(TransitionRun(run_id))

    assert result.action == "noop"
    record = WorkflowStage.objects.get(run_id=run_id, stage_id="add-10")
    assert (record.status, record.execution_group, record.generation) == (Status.PENDING, 2, 0)
    jobs = WorkflowJob.objects.filter(workflow_run_id=run_id, stage_id="add-10")
    assert [(j.status, j.attempt, j.priority) for j in jobs] == [(Status.PENDING, 0, 5)]
    assert jobs[0].payload == {"config": WorkflowRun.objects.get(pk=run_id).config}
    assert OutboxEvent.objects.count() == events_before
    assert WorkflowRun.objects.get(pk=run_id).status == Status.RUNNING


def test_transition_new_group_inherits_the_highest_generation(kernel_for: KernelFor) -> None:
    """K-TR-6, SM-30: the next group's records get the max ``generation`` of the existing ones."""
    kernel = kernel_for(two_stage())
    run_id = _start(kernel)
    _execute_next(kernel, "add-1")
    _undo_advance(run_id, 2)
    WorkflowStage.objects.filter(run_id=run_id, stage_id="add-1").update(generation=2)

    assert kernel.dispatch(TransitionRun(run_id)).action == "advanced"
    assert WorkflowStage.objects.get(run_id=run_id, stage_id="add-10").generation == 2


def test_transition_redispatch_after_advance_is_noop(kernel_for: KernelFor) -> None:
    """K-TR-9, EC-3, EC-8: a second dispatch sees the new PENDING records -> ``noop``; still one
    record and one job for the next group.
    """
    kernel = kernel_for(_fan_out())
    run_id = _start(kernel, "fan-out")
    _execute_next(kernel, "a")
    _execute_next(kernel, "b")
    assert kernel.dispatch(TransitionRun(run_id)).action == "noop"  # the outcome advanced
    _undo_advance(run_id, 2)

    results = [kernel.dispatch(TransitionRun(run_id)).action for _ in range(2)]

    assert results == ["advanced", "noop"]
    assert WorkflowStage.objects.filter(run_id=run_id, stage_id="join").count() == 1
    assert WorkflowJob.objects.filter(workflow_run_id=run_id, stage_id="join").count() == 1


@postgres_only
def test_transition_concurrent_siblings_have_one_winner(kernel_for: KernelFor) -> None:
    """K-TR-2, EC-8: two transitions of one run racing on PostgreSQL -> exactly one
    ``advanced``, the other ``noop``; one ``join`` record and one ``join`` job. The test holds
    the run row lock until both transitions are waiting for it, so they really overlap.
    """
    kernel = kernel_for(_fan_out())
    run_id = _start(kernel, "fan-out")
    _execute_next(kernel, "a")
    _execute_next(kernel, "b")
    _undo_advance(run_id, 2)  # the outcome of ``b`` advanced the run: take it back
    results: list[str] = []
    errors: list[BaseException] = []

    def transition() -> None:
        try:
            results.append(kernel.dispatch(TransitionRun(run_id)).action)
        except BaseException as exc:  # surfaced by the assertions below
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=transition) for _ in range(2)]
    with transaction.atomic():
        WorkflowRun.objects.select_for_update().get(pk=run_id)
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 10
        with connection.cursor() as cursor:
            while True:
                cursor.execute("SELECT count(*) FROM pg_locks WHERE NOT granted")
                waiting = cursor.fetchone()[0]
                if waiting >= 2 or time.monotonic() > deadline:
                    break
                time.sleep(0.01)  # real threads, not kernel time: the FakeClock cannot help
        assert waiting >= 2, "both transitions should be waiting for the run row lock"
    for thread in threads:
        thread.join(timeout=30)

    assert errors == []
    assert sorted(results) == ["advanced", "noop"]
    assert WorkflowStage.objects.filter(run_id=run_id, stage_id="join").count() == 1
    assert WorkflowJob.objects.filter(workflow_run_id=run_id, stage_id="join").count() == 1


# --- complete (K-TR-7) -------------------------------------------------------------------------


def test_transition_completes_the_run(
    kernel_for: KernelFor, clock: FakeClock, sink: CollectingSink
) -> None:
    """K-TR-7, WF-40, WF-61, Part I item 14: last group COMPLETED -> ``completed`` (by the last
    outcome's transition); run COMPLETED with the last group's output, totals,
    ``completed_at`` and a duration measured from ``started_at``; exactly one
    ``workflow:completed``; a later ``run.transition`` is a noop.
    """
    kernel = kernel_for(two_stage())
    res = kernel.dispatch(CreateRun(workflow_id="two-stage", input={"value": 1}))
    clock.advance(5)  # queue time: not part of the duration
    run_id = _start_claimed(kernel, res.workflow_run_id)
    _execute_next(kernel, "add-1")
    clock.advance(7)
    _execute_next(kernel, "add-10")

    result = kernel.dispatch(TransitionRun(run_id))

    assert result.action == "noop"
    run = WorkflowRun.objects.get(pk=run_id)
    assert run.status == Status.COMPLETED
    assert run.output == {"value": 12}
    assert run.completed_at == clock.now()
    assert run.duration_ms == 7000
    assert (run.total_cost, run.total_tokens) == (0, 0)

    kernel.dispatch(FlushOutbox())
    completed = [e for e in sink.events if e["type"] == "workflow:completed"]
    assert len(completed) == 1
    assert completed[0]["output"] == {"value": 12}
    assert completed[0]["duration_ms"] == 7000
    assert sink.types(run_id)[-1] == "workflow:completed"


def _start_claimed(kernel: Kernel, run_id: str) -> uuid.UUID:
    claimed = kernel.dispatch(ClaimPendingRuns(worker_id="w-1")).claimed
    assert [c.workflow_run_id for c in claimed] == [run_id]
    return uuid.UUID(run_id)


def test_transition_completes_with_parallel_output(kernel_for: KernelFor) -> None:
    """K-TR-7, WF-40: a parallel last group yields ``{stage_id: output}``."""
    wf = define_workflow(id="par-end", input=Num).parallel([add(1, "x"), add(2, "y")]).build()
    kernel = kernel_for(wf)
    run_id = _start(kernel, "par-end")
    _execute_next(kernel, "x")
    _execute_next(kernel, "y")

    assert WorkflowRun.objects.get(pk=run_id).status == Status.COMPLETED
    assert WorkflowRun.objects.get(pk=run_id).output == {"x": {"value": 2}, "y": {"value": 3}}


# --- fail (K-TR-5, EC-9) -----------------------------------------------------------------------


def test_transition_fails_run_when_a_stage_failed_without_jobs(
    kernel_for: KernelFor, clock: FakeClock, sink: CollectingSink
) -> None:
    """K-TR-5: a FAILED record with no job retrying it -> ``failed``; run FAILED with
    ``completed_at``, output untouched; ``workflow:failed`` carries the stage's error.
    """
    kernel = kernel_for(two_stage())
    run_id = _start(kernel)
    WorkflowJob.objects.all().delete()
    record = WorkflowStage.objects.get(run_id=run_id)
    update_stage(record.pk, clock.now(), status=Status.FAILED, error_message="disk on fire")
    clock.advance(4)

    result = kernel.dispatch(TransitionRun(run_id))

    assert result.action == "failed"
    run = WorkflowRun.objects.get(pk=run_id)
    assert run.status == Status.FAILED
    assert run.completed_at == clock.now()
    assert run.duration_ms == 4000
    assert run.output is None
    assert WorkflowStage.objects.filter(run_id=run_id).count() == 1  # no next group
    kernel.dispatch(FlushOutbox())
    assert sink.types(run_id)[-1] == "workflow:failed"
    assert sink.events[-1]["error"] == "disk on fire"


def test_transition_parallel_retry_race(kernel_for: KernelFor, clock: FakeClock) -> None:
    """K-TR-5, EC-9: sibling ``a`` FAILED with its job re-queued (PENDING, attempt 1): the
    transition after ``b`` completes is ``noop`` and the run stays RUNNING; once ``a``'s retry
    succeeds the next transition advances.
    """
    kernel = kernel_for(_fan_out(_flaky("a", failures=1)))
    run_id = _start(kernel, "fan-out")

    first = _execute_next(kernel, "a")
    assert first.outcome == "failed"
    job_a = WorkflowJob.objects.get(workflow_run_id=run_id, stage_id="a")
    assert (job_a.status, job_a.attempt) == (Status.PENDING, 1)
    assert WorkflowStage.objects.get(run_id=run_id, stage_id="a").status == Status.FAILED
    _execute_next(kernel, "b")

    assert kernel.dispatch(TransitionRun(run_id)).action == "noop"
    assert WorkflowRun.objects.get(pk=run_id).status == Status.RUNNING

    clock.advance(60)  # past the retry back-off
    assert _execute_next(kernel, "a").outcome == "completed"  # its outcome advances the run
    join = WorkflowStage.objects.get(run_id=run_id, stage_id="join")
    assert (join.status, join.execution_group) == (Status.PENDING, 2)
    _execute_next(kernel, "join")
    assert WorkflowRun.objects.get(pk=run_id).status == Status.COMPLETED
    assert WorkflowRun.objects.get(pk=run_id).output == {"value": 3}


def test_transition_noop_while_failed_stage_job_is_running(kernel_for: KernelFor) -> None:
    """K-TR-5, EC-9: a FAILED record whose job is RUNNING (re-delivered) has a retry in flight
    -> ``noop``.
    """
    kernel = kernel_for(two_stage())
    run_id = _start(kernel)
    job = kernel.queue.dequeue("w-1")
    assert job is not None
    WorkflowStage.objects.filter(run_id=run_id).update(status=Status.FAILED, error_message="x")
    before = _snapshot(run_id)
    assert kernel.dispatch(TransitionRun(run_id)).action == "noop"
    assert _snapshot(run_id) == before


def test_transition_fails_run_when_retries_are_exhausted(
    kernel_for: KernelFor, clock: FakeClock, sink: CollectingSink
) -> None:
    """K-TR-5, EC-9, EC-10: while ``a`` still has deliveries left every transition is ``noop``;
    when its job is FAILED for good the transition fails the run with the real stage error.
    """
    kernel = kernel_for(_fan_out(_flaky("a", failures=99)))
    run_id = _start(kernel, "fan-out")
    _execute_next(kernel, "a")
    _execute_next(kernel, "b")
    max_attempts = WorkflowJob.objects.get(stage_id="a").max_attempts
    assert max_attempts >= 2

    for _ in range(max_attempts - 1):
        assert kernel.dispatch(TransitionRun(run_id)).action == "noop"
        clock.advance(600)
        assert _execute_next(kernel, "a").outcome == "failed"

    job_a = WorkflowJob.objects.get(stage_id="a")
    assert (job_a.status, job_a.attempt) == (Status.FAILED, max_attempts)
    # the last failure's outcome transaction failed the run (K-TR-5)
    assert WorkflowRun.objects.get(pk=run_id).status == Status.FAILED
    assert not WorkflowStage.objects.filter(run_id=run_id, stage_id="join").exists()
    kernel.dispatch(FlushOutbox())
    assert sink.types(run_id)[-1] == "workflow:failed"
    assert f"boom {max_attempts}" in sink.events[-1]["error"]
