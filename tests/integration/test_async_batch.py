"""Async-batch stages: suspend, poll, resume and fail through the kernel (TEST-SCENARIOS D.5-D.8).

Ports the ★ scenarios of `EX/suspend-resume.test.ts`, `AB/batch-failures.test.ts`,
`AB/check-completion.test.ts` and `AB/suspend-resume.test.ts` (K-JE-16, K-PS-6, K-PS-7,
K-TR-4, WF-8, WF-60). Time moves only through the fake clock.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any

import pytest
from pydantic import BaseModel

from django_workflows import (
    CompletionCheck,
    StageContext,
    Suspend,
    Workflow,
    define_async_batch_stage,
    define_stage,
    define_workflow,
)
from django_workflows.blobs import output_key
from django_workflows.kernel import (
    ClaimPendingRuns,
    CreateRun,
    ExecuteJob,
    Kernel,
    PollSuspendedStages,
    TransitionRun,
)
from django_workflows.kernel.commands import ExecuteJobResult, PollSuspendedStagesResult
from django_workflows.models import OutboxEvent, Status, WorkflowJob, WorkflowRun, WorkflowStage
from django_workflows.testing import CollectingSink, FakeClock, run_to_completion

pytestmark = pytest.mark.django_db(transaction=True)

KernelFor = Callable[..., Kernel]
POLL_SECONDS = 5


class Num(BaseModel):
    value: int


class Batch:
    """A scripted external batch: ``check_completion`` answers from ``answers`` in order (the
    last answer repeats) and records every state it was polled with.
    """

    def __init__(
        self,
        answers: list[CompletionCheck | Exception] | None = None,
        *,
        batch_id: str = "batch-1",
        metadata: dict[str, Any] | None = None,
    ) -> None:
        self.answers = answers or [CompletionCheck.done({"value": 99})]
        self.batch_id = batch_id
        self.metadata = metadata
        self.inputs: list[Any] = []
        self.polled_states: list[dict[str, Any]] = []
        self.polled_configs: list[Any] = []

    def execute(self, ctx: StageContext[Any, Any]) -> Suspend:
        self.inputs.append(ctx.input)
        state: dict[str, Any] = {"batch_id": self.batch_id}
        if self.metadata is not None:
            state["metadata"] = self.metadata
        return Suspend(state=state, poll_interval_seconds=POLL_SECONDS)

    def check(self, state: dict[str, Any], ctx: Any) -> CompletionCheck:
        self.polled_states.append(dict(state))
        self.polled_configs.append(ctx.config)
        answer = self.answers[min(len(self.polled_states), len(self.answers)) - 1]
        if isinstance(answer, Exception):
            raise answer
        return answer

    @property
    def calls(self) -> int:
        return len(self.polled_states)

    def stage(self, stage_id: str = "batch", input: type[BaseModel] | None = None) -> Any:
        return define_async_batch_stage(
            id=stage_id, input=input, output=Num, execute=self.execute, check_completion=self.check
        )


def add_stage(stage_id: str, n: int, calls: list[str] | None = None) -> Any:
    def run(ctx: StageContext[Num, Any]) -> Num:
        if calls is not None:
            calls.append(stage_id)
        return Num(value=ctx.input.value + n)

    return define_stage(id=stage_id, input=Num, output=Num, execute=run)


# --- helpers (same shape as in test_execution) --------------------------------------------------


def start_run(kernel: Kernel, workflow_id: str, input: Any = None) -> str:
    created = kernel.dispatch(CreateRun(workflow_id=workflow_id, input=input or {}))
    claimed = kernel.dispatch(ClaimPendingRuns(worker_id="test-worker"))
    assert [c.workflow_run_id for c in claimed.claimed] == [created.workflow_run_id]
    return str(created.workflow_run_id)


def execute(kernel: Kernel, run_id: str, stage_id: str) -> ExecuteJobResult:
    run = WorkflowRun.objects.get(pk=run_id)
    return kernel.dispatch(
        ExecuteJob(
            workflow_run_id=run_id,
            workflow_id=run.workflow_id,
            stage_id=stage_id,
            config=run.config,
        )
    )


def poll(
    kernel: Kernel, clock: FakeClock, seconds: float = POLL_SECONDS
) -> PollSuspendedStagesResult:
    """Advance the clock, then stage.pollSuspended."""
    clock.advance(seconds)
    return kernel.dispatch(PollSuspendedStages())


def outbox(run_id: str) -> list[dict[str, Any]]:
    rows = OutboxEvent.objects.filter(workflow_run_id=run_id).order_by("sequence")
    return [row.payload for row in rows]


def record(run_id: str, stage_id: str) -> WorkflowStage:
    return WorkflowStage.objects.get(run_id=run_id, stage_id=stage_id)


def run_status(run_id: str) -> str:
    return WorkflowRun.objects.get(pk=run_id).status


def single(batch: Batch, workflow_id: str = "one-batch") -> Workflow:
    return define_workflow(id=workflow_id).pipe(batch.stage()).build()


# --- D.5 suspend / resume -----------------------------------------------------------------------


def test_async_stage_execute_returns_suspended_outcome(
    kernel_for: KernelFor, clock: FakeClock
) -> None:
    """D.5 :21 - K-JE-16: outcome suspended with the first poll time; run stays RUNNING."""
    batch = Batch()
    kernel = kernel_for(single(batch))
    run_id = start_run(kernel, "one-batch")

    result = execute(kernel, run_id, "batch")
    assert result.outcome == "suspended"
    assert result.next_poll_at == clock.now() + timedelta(seconds=POLL_SECONDS)
    assert result.error is None
    assert run_status(run_id) == Status.RUNNING
    assert kernel.dispatch(TransitionRun(run_id)).action == "noop"  # K-TR-4


def test_suspension_emits_one_stage_suspended_event(
    kernel_for: KernelFor, clock: FakeClock
) -> None:
    """D.5 :91 - one stage:suspended with stage_id and next_poll_at, then workflow:suspended."""
    kernel = kernel_for(single(Batch()))
    run_id = start_run(kernel, "one-batch")
    execute(kernel, run_id, "batch")

    events = outbox(run_id)
    suspended = [e for e in events if e["type"] == "stage:suspended"]
    assert len(suspended) == 1
    assert suspended[0]["stage_id"] == "batch"
    expected = clock.now() + timedelta(seconds=POLL_SECONDS)
    assert datetime.fromisoformat(suspended[0]["next_poll_at"]) == expected
    assert [e["type"] for e in events][-3:] == [
        "stage:started",
        "stage:suspended",
        "workflow:suspended",
    ]


def test_suspended_record_keeps_state_and_poll_schedule(
    kernel_for: KernelFor, clock: FakeClock
) -> None:
    """D.5 :166, D.7 :96 - record SUSPENDED with state (batch_id, metadata, back-filled
    fields), next_poll_at stored as a timestamp, poll interval and deadline (WF-8).
    """
    kernel = kernel_for(single(Batch(metadata={"provider": "acme", "items": 3})))
    run_id = start_run(kernel, "one-batch")
    execute(kernel, run_id, "batch")

    rec = record(run_id, "batch")
    assert rec.status == Status.SUSPENDED
    assert rec.suspended_state == {
        "batch_id": "batch-1",
        "metadata": {"provider": "acme", "items": 3},
        "submitted_at": clock.now().isoformat(),
        "poll_interval_seconds": POLL_SECONDS,
        "max_wait_seconds": 86400.0,
    }
    assert isinstance(rec.next_poll_at, datetime)
    assert rec.next_poll_at == clock.now() + timedelta(seconds=POLL_SECONDS)
    assert rec.poll_interval_ms == POLL_SECONDS * 1000
    assert rec.max_wait_until == clock.now() + timedelta(hours=24)
    assert rec.completed_at is None


def test_poll_before_due_time_does_not_call_check_completion(
    kernel_for: KernelFor, clock: FakeClock
) -> None:
    """K-PS-1: only stages whose next_poll_at has come are checked."""
    batch = Batch()
    kernel = kernel_for(single(batch))
    run_id = start_run(kernel, "one-batch")
    execute(kernel, run_id, "batch")

    assert poll(kernel, clock, POLL_SECONDS - 1).checked == 0
    assert batch.calls == 0
    assert record(run_id, "batch").status == Status.SUSPENDED


def test_poll_resumes_stage_and_transition_completes_run(
    kernel_for: KernelFor, clock: FakeClock
) -> None:
    """D.5 :249 - K-PS-6.2: resumed 1, stage COMPLETED with its output, run COMPLETED after
    run.transition.
    """
    batch = Batch([CompletionCheck.done({"value": 7})])
    kernel = kernel_for(single(batch))
    run_id = start_run(kernel, "one-batch")
    execute(kernel, run_id, "batch")

    result = poll(kernel, clock)
    assert (result.checked, result.resumed, result.failed) == (1, 1, 0)
    assert result.resumed_workflow_run_ids == [run_id]
    rec = record(run_id, "batch")
    assert rec.status == Status.COMPLETED
    assert rec.next_poll_at is None
    assert rec.completed_at == clock.now()
    assert run_status(run_id) == Status.RUNNING  # the poll does not transition

    assert kernel.dispatch(TransitionRun(run_id)).action == "completed"
    run = WorkflowRun.objects.get(pk=run_id)
    assert (run.status, run.output) == (Status.COMPLETED, {"value": 7})
    assert run.completed_at is not None


def test_next_stage_runs_after_resume(kernel_for: KernelFor, clock: FakeClock) -> None:
    """D.5 :346, :471 - after the resume the next group runs with the batch output; the earlier
    COMPLETED record is preserved.
    """
    batch = Batch([CompletionCheck.done({"value": 10})])
    wf = (
        define_workflow(id="then-sync")
        .pipe(add_stage("prepare", 1))
        .pipe(batch.stage(input=Num))
        .pipe(add_stage("finish", 5))
        .build()
    )
    kernel = kernel_for(wf)
    run_id = start_run(kernel, "then-sync", {"value": 0})

    execute(kernel, run_id, "prepare")
    assert kernel.dispatch(TransitionRun(run_id)).action == "noop"  # the outcome advanced
    assert execute(kernel, run_id, "batch").outcome == "suspended"
    prepared = record(run_id, "prepare")
    assert prepared.status == Status.COMPLETED

    assert poll(kernel, clock).resumed == 1
    assert kernel.dispatch(TransitionRun(run_id)).action == "advanced"
    assert execute(kernel, run_id, "finish").output == {"value": 15}  # completes the run

    run = WorkflowRun.objects.get(pk=run_id)
    assert (run.status, run.output) == (Status.COMPLETED, {"value": 15})
    again = record(run_id, "prepare")
    assert (again.status, again.completed_at, again.output_data) == (
        Status.COMPLETED,
        prepared.completed_at,
        prepared.output_data,
    )


def test_parallel_group_waits_for_its_suspended_stage(
    kernel_for: KernelFor, clock: FakeClock
) -> None:
    """D.5 :573 - K-TR-4: one sibling suspended -> transition noop, run RUNNING; after the
    resume the run completes with both outputs keyed by stage id.
    """
    batch = Batch([CompletionCheck.done({"value": 2})])
    wf = (
        define_workflow(id="mixed-par")
        .parallel([define_stage(id="quick", execute=lambda c: {"value": 1}), batch.stage()])
        .build()
    )
    kernel = kernel_for(wf)
    run_id = start_run(kernel, "mixed-par")

    assert execute(kernel, run_id, "quick").outcome == "completed"
    assert execute(kernel, run_id, "batch").outcome == "suspended"
    assert kernel.dispatch(TransitionRun(run_id)).action == "noop"
    assert run_status(run_id) == Status.RUNNING

    assert poll(kernel, clock).resumed == 1
    assert kernel.dispatch(TransitionRun(run_id)).action == "completed"
    assert WorkflowRun.objects.get(pk=run_id).output == {
        "quick": {"value": 1},
        "batch": {"value": 2},
    }


# --- D.6 async-batch failures -------------------------------------------------------------------


def test_check_completion_error_fails_stage_and_run(
    kernel_for: KernelFor, clock: FakeClock
) -> None:
    """D.6 :25, :117 - K-PS-6.1: failed 1; stage FAILED with that error; run FAILED; both
    failure events carry it; the job is FAILED too (Part I item 9).
    """
    message = "Batch job failed: quota exceeded"
    kernel = kernel_for(single(Batch([CompletionCheck.failed(message)])))
    run_id = start_run(kernel, "one-batch")
    execute(kernel, run_id, "batch")

    result = poll(kernel, clock)
    assert (result.checked, result.resumed, result.failed) == (1, 0, 1)
    rec = record(run_id, "batch")
    assert (rec.status, rec.error_message, rec.next_poll_at) == (Status.FAILED, message, None)
    run = WorkflowRun.objects.get(pk=run_id)
    assert run.status == Status.FAILED
    assert run.completed_at == clock.now()
    tail = outbox(run_id)[-2:]
    assert [(e["type"], e["error"]) for e in tail] == [
        ("stage:failed", message),
        ("workflow:failed", message),
    ]
    assert tail[0]["stage_id"] == "batch"


def test_error_wins_over_ready(kernel_for: KernelFor, clock: FakeClock) -> None:
    """K-PS-6.1: an error with ready=True still fails the stage."""
    check = CompletionCheck(ready=True, output={"value": 1}, error="partial garbage")
    kernel = kernel_for(single(Batch([check])))
    run_id = start_run(kernel, "one-batch")
    execute(kernel, run_id, "batch")

    assert poll(kernel, clock).failed == 1
    assert record(run_id, "batch").error_message == "partial garbage"
    assert run_status(run_id) == Status.FAILED


def test_check_completion_exception_fails_stage_and_run(
    kernel_for: KernelFor, clock: FakeClock
) -> None:
    """D.6 :226 - K-PS-7: a raised exception is handled as an error with its message."""
    kernel = kernel_for(single(Batch([ConnectionError("provider unreachable")])))
    run_id = start_run(kernel, "one-batch")
    execute(kernel, run_id, "batch")

    assert poll(kernel, clock).failed == 1
    rec = record(run_id, "batch")
    assert rec.status == Status.FAILED
    assert rec.error_message == "ConnectionError: provider unreachable"
    assert run_status(run_id) == Status.FAILED


def test_error_in_initial_execute_fails_the_stage(kernel_for: KernelFor) -> None:
    """D.6 :314 - an exception while submitting: outcome failed with the message, stage
    FAILED, nothing suspended.
    """

    def submit(ctx: StageContext[Any, Any]) -> Suspend:
        raise RuntimeError("submission rejected")

    stage = define_async_batch_stage(
        id="batch", execute=submit, check_completion=lambda s, c: CompletionCheck.done()
    )
    kernel = kernel_for(define_workflow(id="bad-submit").pipe(stage).build())
    run_id = start_run(kernel, "bad-submit")
    WorkflowJob.objects.filter(workflow_run_id=run_id).update(max_attempts=1)  # final failure

    result = execute(kernel, run_id, "batch")
    assert (result.outcome, result.error) == ("failed", "RuntimeError: submission rejected")
    rec = record(run_id, "batch")
    assert (rec.status, rec.error_message, rec.suspended_state) == (
        Status.FAILED,
        "RuntimeError: submission rejected",
        None,
    )
    assert WorkflowRun.objects.get(pk=run_id).status == Status.FAILED  # by the outcome


def test_suspend_without_batch_id_is_a_non_retryable_failure(kernel_for: KernelFor) -> None:
    """WF-4: a suspension whose state lacks batch_id fails the stage, non-retryable."""
    stage = define_async_batch_stage(
        id="batch",
        execute=lambda ctx: Suspend(state={"job": "x"}),
        check_completion=lambda s, c: CompletionCheck.done(),
    )
    kernel = kernel_for(define_workflow(id="no-id").pipe(stage).build())
    run_id = start_run(kernel, "no-id")

    result = execute(kernel, run_id, "batch")
    assert result.outcome == "failed"
    assert result.retryable is False
    assert "batch_id" in (result.error or "")


def test_batch_failure_stops_the_pipeline(kernel_for: KernelFor, clock: FakeClock) -> None:
    """D.6 :615, :701, :786 - the run is FAILED by the poll; the later stage never runs and a
    transition changes nothing (Part I item 17).
    """
    calls: list[str] = []
    wf = (
        define_workflow(id="stops")
        .pipe(Batch([CompletionCheck.failed("batch lost")]).stage())
        .pipe(add_stage("after", 1, calls))
        .build()
    )
    kernel = kernel_for(wf)
    run_id = start_run(kernel, "stops")
    execute(kernel, run_id, "batch")
    poll(kernel, clock)

    assert kernel.dispatch(TransitionRun(run_id)).action == "noop"
    assert run_status(run_id) == Status.FAILED
    assert record(run_id, "batch").error_message == "batch lost"
    assert not WorkflowStage.objects.filter(run_id=run_id, stage_id="after").exists()
    assert calls == []


def test_batch_failure_through_the_host(kernel_for: KernelFor, sink: CollectingSink) -> None:
    """D.6 (host path) - run_to_completion ends FAILED with the batch error in workflow:failed;
    the suspended job is FAILED and the next stage never ran.
    """
    calls: list[str] = []
    wf = (
        define_workflow(id="stops")
        .pipe(Batch([CompletionCheck.not_ready(), CompletionCheck.failed("batch lost")]).stage())
        .pipe(add_stage("after", 1, calls))
        .build()
    )
    kernel = kernel_for(wf)
    run_id = kernel.dispatch(CreateRun(workflow_id="stops")).workflow_run_id
    run = run_to_completion(kernel, run_id, advance_seconds=POLL_SECONDS)

    assert run.status == Status.FAILED
    assert calls == []
    assert WorkflowJob.objects.get(workflow_run_id=run_id, stage_id="batch").status == Status.FAILED
    assert [e["error"] for e in sink.events if e["type"] == "workflow:failed"] == ["batch lost"]


# --- D.7 check_completion polling ---------------------------------------------------------------


def test_not_ready_twice_then_ready(kernel_for: KernelFor, clock: FakeClock) -> None:
    """D.7 :240, :350, :654, :742 - K-PS-6.4: resumed 0, 0, 1 over three polls; three calls
    with the same batch_id and submitted_at; final COMPLETED.
    """
    batch = Batch(
        [
            CompletionCheck.not_ready(),
            CompletionCheck.not_ready(),
            CompletionCheck.done({"value": 3}),
        ]
    )
    kernel = kernel_for(single(batch))
    run_id = start_run(kernel, "one-batch")
    execute(kernel, run_id, "batch")
    submitted_at = record(run_id, "batch").suspended_state["submitted_at"]

    resumed = []
    for _ in range(3):
        resumed.append(poll(kernel, clock).resumed)
        if resumed[-1] == 0:
            rec = record(run_id, "batch")
            assert rec.status == Status.SUSPENDED
            assert rec.next_poll_at == clock.now() + timedelta(seconds=POLL_SECONDS)
    assert resumed == [0, 0, 1]
    assert batch.calls == 3
    assert {s["batch_id"] for s in batch.polled_states} == {"batch-1"}
    assert {s["submitted_at"] for s in batch.polled_states} == {submitted_at}
    assert kernel.dispatch(TransitionRun(run_id)).action == "completed"
    assert WorkflowRun.objects.get(pk=run_id).output == {"value": 3}


def test_not_ready_next_check_in_overrides_interval(
    kernel_for: KernelFor, clock: FakeClock
) -> None:
    """K-PS-6.4: not_ready(next_check_in_seconds) reschedules after that delay."""
    batch = Batch([CompletionCheck.not_ready(120), CompletionCheck.done({"value": 1})])
    kernel = kernel_for(single(batch))
    run_id = start_run(kernel, "one-batch")
    execute(kernel, run_id, "batch")

    poll(kernel, clock)
    assert record(run_id, "batch").next_poll_at == clock.now() + timedelta(seconds=120)
    assert poll(kernel, clock, 119).checked == 0
    assert poll(kernel, clock, 1).resumed == 1


def test_ready_output_is_saved_to_the_blob_store(kernel_for: KernelFor, clock: FakeClock) -> None:
    """D.7 :460 - K-PS-6.2: the validated output is a blob referenced by output_data."""
    kernel = kernel_for(single(Batch([CompletionCheck.done({"value": "42"})])))
    run_id = start_run(kernel, "one-batch")
    execute(kernel, run_id, "batch")
    poll(kernel, clock)

    key = output_key("one-batch", run_id, "batch")
    assert record(run_id, "batch").output_data == {"_artifactKey": key}
    assert kernel.blobs.get(key) == {"value": 42}  # parsed with the output model (Part I item 6)


def test_check_completion_metrics_are_stored(kernel_for: KernelFor, clock: FakeClock) -> None:
    """D.7 :558 - WF-60: metrics of the ready check are stored on the record (merged with the
    suspension's) and tokens are summed on the run.
    """

    def submit(ctx: StageContext[Any, Any]) -> Suspend:
        return Suspend(
            state={"batch_id": "m-1"},
            poll_interval_seconds=POLL_SECONDS,
            metrics={"submitted": 100},
        )

    def check(state: dict[str, Any], ctx: Any) -> CompletionCheck:
        return CompletionCheck.done(
            {"value": 1}, metrics={"items_processed": 100, "total_tokens": 50000}
        )

    stage = define_async_batch_stage(id="batch", execute=submit, check_completion=check)
    kernel = kernel_for(define_workflow(id="metrics").pipe(stage).build())
    run_id = start_run(kernel, "metrics")
    execute(kernel, run_id, "batch")
    assert record(run_id, "batch").metrics == {"submitted": 100}
    poll(kernel, clock)

    assert record(run_id, "batch").metrics == {
        "submitted": 100,
        "items_processed": 100,
        "total_tokens": 50000,
    }
    kernel.dispatch(TransitionRun(run_id))
    assert WorkflowRun.objects.get(pk=run_id).total_tokens == 50000


def test_check_completion_gets_run_id_and_config_with_defaults(
    kernel_for: KernelFor, clock: FakeClock
) -> None:
    """WF-20/WF-21 (our choice): the check context has the run id and the parsed config."""

    class Cfg(BaseModel):
        model: str = "small"
        retries: int = 2

    seen: list[tuple[str, Any]] = []

    def check(state: dict[str, Any], ctx: Any) -> CompletionCheck:
        seen.append((ctx.workflow_run_id, ctx.config))
        return CompletionCheck.done({"value": 0})

    stage = define_async_batch_stage(
        id="batch",
        config=Cfg,
        output=Num,
        execute=lambda ctx: Suspend(state={"batch_id": "c"}, poll_interval_seconds=1),
        check_completion=check,
    )
    kernel = kernel_for(define_workflow(id="cfg-check").pipe(stage).build())
    created = kernel.dispatch(
        CreateRun(workflow_id="cfg-check", config={"batch": {"model": "large"}})
    )
    run_id = created.workflow_run_id
    kernel.dispatch(ClaimPendingRuns(worker_id="test-worker"))
    execute(kernel, run_id, "batch")
    poll(kernel, clock, 1)

    assert seen == [(run_id, Cfg(model="large", retries=2))]


# --- D.8 chained async-batch stages -------------------------------------------------------------


def test_two_chained_async_stages(kernel_for: KernelFor, clock: FakeClock) -> None:
    """D.8 :51, :208, :678 - suspend -> ready -> advanced -> second suspends -> ready ->
    completed; one stage:suspended per stage, distinct batch ids.
    """
    first = Batch([CompletionCheck.done({"value": 1})], batch_id="first-batch")
    second = Batch([CompletionCheck.done({"value": 2})], batch_id="second-batch")
    wf = (
        define_workflow(id="chained")
        .pipe(first.stage("first"))
        .pipe(second.stage("second", input=Num))
        .build()
    )
    kernel = kernel_for(wf)
    run_id = start_run(kernel, "chained")

    actions = []
    assert execute(kernel, run_id, "first").outcome == "suspended"
    assert poll(kernel, clock).resumed == 1
    actions.append(kernel.dispatch(TransitionRun(run_id)).action)
    assert execute(kernel, run_id, "second").outcome == "suspended"
    assert poll(kernel, clock).resumed == 1
    actions.append(kernel.dispatch(TransitionRun(run_id)).action)

    assert actions == ["advanced", "completed"]
    run = WorkflowRun.objects.get(pk=run_id)
    assert (run.status, run.output) == (Status.COMPLETED, {"value": 2})
    assert second.inputs == [Num(value=1)]
    suspended = [e["stage_id"] for e in outbox(run_id) if e["type"] == "stage:suspended"]
    assert suspended == ["first", "second"]
    assert record(run_id, "first").suspended_state["batch_id"] == "first-batch"
    assert record(run_id, "second").suspended_state["batch_id"] == "second-batch"


def test_sync_async_sync_pipeline(kernel_for: KernelFor, clock: FakeClock) -> None:
    """D.8 :310, :462 - advanced, advanced, completed; the sync output feeds the async stage
    and the final output comes from the last sync stage. The sync stages' outcomes transition
    the run themselves (a later ``run.transition`` is a noop); after the poller's resume the
    tick's ``run.transition`` advances it.
    """
    batch = Batch([CompletionCheck.done({"value": 50})])
    wf = (
        define_workflow(id="sandwich", input=Num)
        .pipe(add_stage("before", 1))
        .pipe(batch.stage(input=Num))
        .pipe(add_stage("after", 100))
        .build()
    )
    kernel = kernel_for(wf)
    run_id = start_run(kernel, "sandwich", {"value": 9})

    actions = []
    execute(kernel, run_id, "before")
    actions.append(kernel.dispatch(TransitionRun(run_id)).action)
    execute(kernel, run_id, "batch")
    poll(kernel, clock)
    actions.append(kernel.dispatch(TransitionRun(run_id)).action)
    execute(kernel, run_id, "after")
    actions.append(kernel.dispatch(TransitionRun(run_id)).action)

    assert actions == ["noop", "advanced", "noop"]
    assert batch.inputs == [Num(value=10)]
    assert WorkflowRun.objects.get(pk=run_id).output == {"value": 150}


def test_sync_async_sync_pipeline_through_the_host(
    kernel_for: KernelFor, sink: CollectingSink
) -> None:
    """D.8 :310 (host path) - run_to_completion with a batch that needs two polls; jobs end
    COMPLETED; events in order.
    """
    batch = Batch([CompletionCheck.not_ready(), CompletionCheck.done({"value": 50})])
    wf = (
        define_workflow(id="sandwich", input=Num)
        .pipe(add_stage("before", 1))
        .pipe(batch.stage(input=Num))
        .pipe(add_stage("after", 100))
        .build()
    )
    kernel = kernel_for(wf)
    run_id = kernel.dispatch(CreateRun(workflow_id="sandwich", input={"value": 9})).workflow_run_id
    run = run_to_completion(kernel, run_id, advance_seconds=POLL_SECONDS)

    assert (run.status, run.output) == (Status.COMPLETED, {"value": 150})
    assert batch.calls == 2
    jobs = WorkflowJob.objects.filter(workflow_run_id=run_id)
    assert {j.stage_id: j.status for j in jobs} == {
        "before": Status.COMPLETED,
        "batch": Status.COMPLETED,
        "after": Status.COMPLETED,
    }
    assert sink.types(run_id) == [
        "workflow:created",
        "workflow:started",
        "stage:started",
        "stage:completed",
        "stage:started",
        "stage:suspended",
        "workflow:suspended",
        "stage:completed",
        "stage:started",
        "stage:completed",
        "workflow:completed",
    ]
