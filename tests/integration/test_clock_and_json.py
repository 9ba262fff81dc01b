"""One clock (Part I item 12, EC-41) and JSON that round-trips (Part I item 13, EC-43, EC-44).

The fake clock is set years away from real time: if any engine timestamp came from the
database or the wall clock, it would show here.
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

import pytest
from pydantic import BaseModel

from django_workflows import (
    CompletionCheck,
    StageContext,
    Suspend,
    define_async_batch_stage,
    define_stage,
    define_workflow,
)
from django_workflows.kernel import (
    ClaimPendingRuns,
    CreateRun,
    ExecuteJob,
    PollSuspendedStages,
    ReapStaleLeases,
    ReapStuckRuns,
    TransitionRun,
)
from django_workflows.kernel.commands import ExecuteJobResult
from django_workflows.kernel.hosting import (
    execute_job,
    process_available_jobs,
    run_maintenance_tick,
)
from django_workflows.models import (
    IdempotencyKey,
    OutboxEvent,
    Status,
    WorkflowAnnotation,
    WorkflowBlob,
    WorkflowJob,
    WorkflowLog,
    WorkflowRun,
    WorkflowStage,
)
from django_workflows.testing import CollectingSink, FakeClock, make_kernel
from tests.workflows import Num

pytestmark = pytest.mark.django_db(transaction=True)

FAR = datetime(2031, 7, 1, 12, 0, tzinfo=UTC)  # years away from the real "now"


def _noted(ctx: StageContext[Num, Any]) -> Num:
    ctx.log("INFO", "working")
    ctx.annotate("test.note", "seen")
    ctx.storage.save("scratch", {"n": ctx.input.value})
    return Num(value=ctx.input.value + 1)


def test_engine_timestamps_come_from_the_injected_clock() -> None:
    """Part I item 12, EC-41, DM-8, DM-21: with the kernel's clock set to 2031, every engine
    timestamp - run, stage, job, outbox, idempotency key, log, annotation, blob - is exactly
    the fake time of the step that wrote it, and durations are differences of fake times."""
    clock = FakeClock(FAR)
    wf = define_workflow(id="noted", input=Num).pipe(
        define_stage(id="s", input=Num, output=Num, execute=_noted)
    )
    kernel = make_kernel(wf.build(), clock=clock, event_sink=CollectingSink())
    t0 = clock.now()
    res = kernel.dispatch(CreateRun(workflow_id="noted", input={"value": 1}, idempotency_key="k"))
    run_id = res.workflow_run_id
    t1 = clock.advance(10)
    run_maintenance_tick(kernel, "t")  # claim
    t2 = clock.advance(10)
    job = kernel.queue.dequeue("w")
    assert job is not None
    t3 = clock.advance(10)
    execute_job(kernel, job)
    t4 = clock.advance(10)
    run_maintenance_tick(kernel, "t")  # flush

    run = WorkflowRun.objects.get(pk=run_id)
    assert (run.created_at, run.started_at, run.completed_at, run.updated_at) == (t0, t1, t3, t3)
    assert run.duration_ms == 20_000
    stage = WorkflowStage.objects.get(run_id=run_id)
    assert (stage.created_at, stage.started_at, stage.completed_at) == (t1, t3, t3)
    job = WorkflowJob.objects.get(pk=job.pk)
    assert (job.created_at, job.started_at, job.completed_at, job.updated_at) == (t1, t2, t3, t3)
    events = OutboxEvent.objects.filter(workflow_run_id=run_id).order_by("sequence")
    assert [(e.event_type, e.created_at, e.occurred_at) for e in events][:2] == [
        ("workflow:created", t0, t0),
        ("workflow:started", t1, t1),
    ]
    assert {e.published_at for e in events} <= {t1, t4}
    assert all(e.payload["timestamp"] == e.occurred_at.isoformat() for e in events)
    assert IdempotencyKey.objects.get(key="k").created_at == t0
    assert WorkflowLog.objects.get(run_id=run_id, message="working").created_at == t3
    assert WorkflowAnnotation.objects.get(run_id=run_id).created_at == t3
    assert {b.created_at for b in WorkflowBlob.objects.filter(run_id=run_id)} == {t3}


def test_leases_and_stuck_detection_use_the_injected_clock() -> None:
    """Part I item 12, EC-41: lease reaping and stuck reaping compare fake times only - with the
    clock years ahead of the database's time, nothing is stale until the fake clock moves."""
    clock = FakeClock(FAR)
    wf = define_workflow(id="one", input=Num).pipe(
        define_stage(id="s", input=Num, output=Num, execute=lambda ctx: ctx.input)
    )
    kernel = make_kernel(wf.build(), clock=clock)
    run_id = kernel.dispatch(CreateRun(workflow_id="one", input={"value": 1})).workflow_run_id
    kernel.dispatch(ClaimPendingRuns(worker_id="w"))
    job = kernel.queue.dequeue("w")
    assert job is not None

    assert kernel.dispatch(ReapStaleLeases(stale_threshold_seconds=60)).released == 0
    assert kernel.dispatch(ReapStuckRuns(stuck_threshold_seconds=60)).failed == 0
    clock.advance(61)
    assert kernel.dispatch(ReapStaleLeases(stale_threshold_seconds=60)).released == 1
    assert WorkflowJob.objects.get(pk=job.pk).status == Status.PENDING
    WorkflowJob.objects.filter(pk=job.pk).update(status=Status.FAILED)
    assert kernel.dispatch(ReapStuckRuns(stuck_threshold_seconds=60)).failed == 1
    assert WorkflowRun.objects.get(pk=run_id).completed_at == clock.now()


class Invoice(BaseModel):
    issued: datetime
    amount: Decimal
    ref: uuid.UUID


def test_datetimes_decimals_and_uuids_round_trip_through_runs_and_events() -> None:
    """Part I item 13, EC-43, EV-2: a run input and a stage output holding a datetime, a
    Decimal and a UUID are stored with Django's JSON encoder (ISO string, decimal string, UUID
    string); stages read them back as the same typed values; events carry the encoded form.
    (Django's encoder writes datetimes with millisecond precision, ECMA-262 style.)"""
    seen: list[Invoice] = []

    def first(ctx: StageContext[Invoice, Any]) -> Invoice:
        seen.append(ctx.input)
        return ctx.input

    def second(ctx: StageContext[Invoice, Any]) -> Invoice:
        seen.append(ctx.input)
        return Invoice(issued=ctx.input.issued, amount=ctx.input.amount * 2, ref=ctx.input.ref)

    wf = (
        define_workflow(id="invoice", input=Invoice)
        .pipe(define_stage(id="first", input=Invoice, output=Invoice, execute=first))
        .pipe(define_stage(id="second", input=Invoice, output=Invoice, execute=second))
        .build()
    )
    clock = FakeClock(FAR)
    sink = CollectingSink()
    kernel = make_kernel(wf, clock=clock, event_sink=sink)
    issued = datetime(2024, 2, 29, 23, 59, 59, 123000, tzinfo=UTC)
    ref = uuid.uuid4()
    invoice = {"issued": issued, "amount": Decimal("10.10"), "ref": ref}

    run_id = kernel.dispatch(CreateRun(workflow_id="invoice", input=invoice)).workflow_run_id
    for _ in range(3):
        run_maintenance_tick(kernel, "t")
        process_available_jobs(kernel, "w", max_jobs=5)

    expected = Invoice(issued=issued, amount=Decimal("10.10"), ref=ref)
    assert seen == [expected, expected]
    run = WorkflowRun.objects.get(pk=run_id)
    assert run.input == {"issued": "2024-02-29T23:59:59.123Z", "amount": "10.10", "ref": str(ref)}
    assert Invoice.model_validate(run.output) == Invoice(
        issued=issued, amount=Decimal("20.20"), ref=ref
    )
    (completed,) = [e for e in sink.events if e["type"] == "workflow:completed"]
    assert Invoice.model_validate(completed["output"]).amount == Decimal("20.20")


def test_cached_results_round_trip_their_datetimes(clock: FakeClock) -> None:
    """Part I item 13, K-14, EC-43: a replayed ``job.execute`` result equals the original -
    its ``next_poll_at`` is a datetime again, not a string."""
    batch = define_async_batch_stage(
        id="batch",
        execute=lambda ctx: Suspend(state={"batch_id": "b-1"}, poll_interval_seconds=90),
        check_completion=lambda state, ctx: CompletionCheck.not_ready(),
    )
    kernel = make_kernel(define_workflow(id="b").pipe(batch).build(), clock=clock)
    run_id = kernel.dispatch(CreateRun(workflow_id="b", input={})).workflow_run_id
    kernel.dispatch(ClaimPendingRuns(worker_id="w"))
    cmd = ExecuteJob(
        workflow_run_id=run_id, workflow_id="b", stage_id="batch", idempotency_key="job:1:1"
    )

    first = kernel.dispatch(cmd)
    replay = kernel.dispatch(cmd)

    assert isinstance(first, ExecuteJobResult) and first.outcome == "suspended"
    assert replay == first
    assert replay.next_poll_at == clock.now() + timedelta(seconds=90)
    assert isinstance(IdempotencyKey.objects.get(key="job:1:1").result["next_poll_at"], str)


def test_durations_above_two_to_the_31_milliseconds_are_stored(clock: FakeClock) -> None:
    """Part I item 13, EC-44, DM-1: a stage suspended for 30 days (poll interval 30 days) has
    ``poll_interval_ms`` and ``duration_ms`` above 2**31 - 1 ms; both, and the run's duration,
    are stored and read back exactly (64-bit columns)."""
    month = 30 * 24 * 3600
    batch = define_async_batch_stage(
        id="monthly",
        execute=lambda ctx: Suspend(
            state={"batch_id": "m-1"}, poll_interval_seconds=month, max_wait_seconds=2 * month
        ),
        check_completion=lambda state, ctx: CompletionCheck.done({"value": 1}),
        output=Num,
    )
    kernel = make_kernel(define_workflow(id="m").pipe(batch).build(), clock=clock)
    run_id = kernel.dispatch(CreateRun(workflow_id="m", input={})).workflow_run_id
    kernel.dispatch(ClaimPendingRuns(worker_id="w"))
    kernel.dispatch(ExecuteJob(workflow_run_id=run_id, workflow_id="m", stage_id="monthly"))
    clock.advance(month)

    assert kernel.dispatch(PollSuspendedStages()).resumed == 1
    assert kernel.dispatch(TransitionRun(run_id)).action == "completed"

    month_ms = month * 1000
    assert month_ms > 2**31 - 1
    stage = WorkflowStage.objects.get(run_id=run_id)
    assert (stage.poll_interval_ms, stage.duration_ms) == (month_ms, month_ms)
    assert WorkflowRun.objects.get(pk=run_id).duration_ms == month_ms
