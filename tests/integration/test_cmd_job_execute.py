"""``job.execute`` against the database (SPEC §4.6; catalogue A.6, A.12; Part I items 1, 5, 6,
7, 9, 14, 15).

Runs are put into RUNNING the way a host does it: ``run.create`` then ``run.claimPending``.
Stage bodies that need the kernel (to cancel their own run, to read their own record) reach it
through the enclosing test's ``kernel`` variable.
"""

from __future__ import annotations

import threading
import types
import uuid
from collections.abc import Callable, Iterable
from datetime import timedelta
from typing import Any

import pytest
from django.db import connection
from pydantic import BaseModel

from django_workflows import (
    MissingStageOutputError,
    StageContext,
    StageResult,
    Suspend,
    define_async_batch_stage,
    define_stage,
    define_workflow,
)
from django_workflows.blobs import DatabaseBlobStore, artifact_key, output_key
from django_workflows.definition import CompletionCheck, Stage, Workflow
from django_workflows.kernel import (
    CancelRun,
    ClaimPendingRuns,
    CreateRun,
    ExecuteJob,
    FlushOutbox,
    InvalidCommandError,
    Kernel,
    RunNotFoundError,
    StageNotFoundError,
    TransitionRun,
    WorkflowNotFoundError,
)
from django_workflows.kernel import services as kernel_services
from django_workflows.kernel.commands import ExecuteJobResult
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
from django_workflows.testing import CollectingSink, FakeClock
from tests.markers import postgres_only
from tests.workflows import Num, add, two_stage

pytestmark = pytest.mark.django_db(transaction=True)

KernelFor = Callable[..., Kernel]


# --- helpers ----------------------------------------------------------------------------------


def _single(
    stage: Stage, workflow_id: str = "single", input: type[BaseModel] | None = Num
) -> Workflow:
    return define_workflow(id=workflow_id, input=input).pipe(stage).build()


def _start(kernel: Kernel, workflow_id: str, input: Any = None, **kwargs: Any) -> str:
    """A RUNNING run: ``run.create`` then ``run.claimPending``."""
    run_id = kernel.dispatch(
        CreateRun(workflow_id=workflow_id, input={"value": 1} if input is None else input, **kwargs)
    ).workflow_run_id
    claimed = kernel.dispatch(ClaimPendingRuns(worker_id="w")).claimed
    assert [c.workflow_run_id for c in claimed] == [run_id]
    return str(run_id)


def _execute(
    kernel: Kernel, run_id: str, workflow_id: str, stage_id: str, **kwargs: Any
) -> ExecuteJobResult:
    kwargs.setdefault("config", {})
    return kernel.dispatch(
        ExecuteJob(workflow_run_id=run_id, workflow_id=workflow_id, stage_id=stage_id, **kwargs)
    )


def _record(run_id: str, stage_id: str) -> WorkflowStage:
    return WorkflowStage.objects.get(run_id=run_id, stage_id=stage_id)


def _outbox_types(run_id: str) -> list[str]:
    return list(
        OutboxEvent.objects.filter(workflow_run_id=run_id)
        .order_by("sequence")
        .values_list("event_type", flat=True)
    )


def _published(kernel: Kernel, sink: CollectingSink, run_id: str) -> list[dict[str, Any]]:
    kernel.dispatch(FlushOutbox())
    return [e for e in sink.events if e["workflow_run_id"] == run_id]


def _types(events: Iterable[dict[str, Any]]) -> list[str]:
    return [e["type"] for e in events]


def _run_blob_keys(run_id: str) -> list[str]:
    return sorted(WorkflowBlob.objects.filter(run_id=run_id).values_list("key", flat=True))


# --- catalogue A.6 ----------------------------------------------------------------------------


def test_execute_sync_stage_completes_with_output_blob_and_events(
    kernel_for: KernelFor, sink: CollectingSink, clock: FakeClock
) -> None:
    """K-JE-6, K-JE-17: one COMPLETED record, its output in one blob, started + completed."""

    def double(ctx: StageContext[Num, Any]) -> Num:
        clock.advance(2)
        return Num(value=ctx.input.value * 2)

    kernel = kernel_for(_single(define_stage(id="double", input=Num, output=Num, execute=double)))
    run_id = _start(kernel, "single", {"value": 21})

    result = _execute(kernel, run_id, "single", "double")

    assert result == ExecuteJobResult("completed", output={"value": 42})
    (record,) = WorkflowStage.objects.filter(run_id=run_id)
    assert record.status == Status.COMPLETED
    assert record.duration_ms == 2000
    key = output_key(record.run.workflow_type, run_id, "double")
    assert record.output_data == {"_artifactKey": key}
    assert _run_blob_keys(run_id) == [key]
    assert WorkflowBlob.objects.get(key=key).data == {"value": 42}
    events = _published(kernel, sink, run_id)
    assert _types(events) == [
        "workflow:created",
        "workflow:started",
        "stage:started",
        "stage:completed",
        "workflow:completed",
    ]
    assert events[-2]["stage_id"] == "double"
    assert events[-2]["duration_ms"] == 2000
    # the outcome transaction settled the job and completed the run (not K-JE-19: the
    # production stage path, a documented difference)
    assert WorkflowJob.objects.get(workflow_run_id=run_id).status == Status.COMPLETED
    assert WorkflowRun.objects.get(pk=run_id).status == Status.COMPLETED


def test_execute_artifacts_are_stored_as_blobs(kernel_for: KernelFor) -> None:
    """DM-52: artifacts become blobs beside the output, referenced from ``output_data``."""

    def body(ctx: StageContext[Num, Any]) -> StageResult:
        return StageResult(
            output={"value": 1},
            artifacts={"raw": {"rows": [1, 2, 3]}, "summary": {"n": 3}},
        )

    stage = define_stage(id="artifact-stage", input=Num, output=Num, execute=body)
    kernel = kernel_for(_single(stage))
    run_id = _start(kernel, "single")

    result = _execute(kernel, run_id, "single", "artifact-stage")

    assert result.outcome == "completed"
    wf_type = WorkflowRun.objects.get(pk=run_id).workflow_type
    raw_key = artifact_key(wf_type, run_id, "artifact-stage", "raw")
    assert raw_key.endswith("/artifact-stage/artifacts/raw.json")
    assert len(_run_blob_keys(run_id)) == 3
    assert WorkflowBlob.objects.get(key=raw_key).data == {"rows": [1, 2, 3]}
    assert _record(run_id, "artifact-stage").output_data["_artifactKeys"] == {
        "raw": raw_key,
        "summary": artifact_key(wf_type, run_id, "artifact-stage", "summary"),
    }


@pytest.mark.parametrize(
    ("error", "expected"),
    [(Exception("boom"), "boom"), (ValueError("boom"), "ValueError: boom")],
    ids=["plain", "named"],
)
def test_execute_failing_stage_records_failure(
    kernel_for: KernelFor, sink: CollectingSink, error: Exception, expected: str
) -> None:
    """K-JE-11..13: outcome failed with the error text, record FAILED, one ``stage:failed``, an
    ERROR log; the run is not failed by ``job.execute``.
    """

    def body(ctx: Any) -> Num:
        raise error

    kernel = kernel_for(_single(define_stage(id="broken", input=Num, output=Num, execute=body)))
    run_id = _start(kernel, "single")

    result = _execute(kernel, run_id, "single", "broken")

    assert result.outcome == "failed"
    assert result.error == expected
    assert result.retryable is None
    assert result.ghost is False
    record = _record(run_id, "broken")
    assert record.status == Status.FAILED
    assert record.error_message == expected
    assert record.completed_at is not None
    events = _published(kernel, sink, run_id)
    assert _types(events).count("stage:failed") == 1
    assert events[-1]["error"] == expected
    assert WorkflowLog.objects.filter(run_id=run_id, level="ERROR", stage=record).exists()
    assert WorkflowRun.objects.get(pk=run_id).status == Status.RUNNING


def test_execute_suspending_stage_records_suspension(
    kernel_for: KernelFor, sink: CollectingSink, clock: FakeClock
) -> None:
    """K-JE-16: outcome suspended with ``next_poll_at``; record SUSPENDED with its state."""

    def submit(ctx: Any) -> Suspend:
        return Suspend(state={"batch_id": "b-7"}, poll_interval_seconds=5, max_wait_seconds=60)

    stage = define_async_batch_stage(
        id="batch", execute=submit, check_completion=lambda s, c: CompletionCheck.not_ready()
    )
    kernel = kernel_for(_single(stage))
    run_id = _start(kernel, "single")
    now = clock.now()

    result = _execute(kernel, run_id, "single", "batch")

    assert result.outcome == "suspended"
    assert result.next_poll_at == now + timedelta(seconds=5)
    record = _record(run_id, "batch")
    assert record.status == Status.SUSPENDED
    assert record.suspended_state["batch_id"] == "b-7"
    assert record.next_poll_at == now + timedelta(seconds=5)
    assert record.poll_interval_ms == 5000
    assert record.max_wait_until == now + timedelta(seconds=60)
    assert _types(_published(kernel, sink, run_id))[-3:] == [
        "stage:started",
        "stage:suspended",
        "workflow:suspended",
    ]


def test_execute_unknown_workflow_stage_or_run_raises(kernel_for: KernelFor) -> None:
    """K-JE-1: pre-flight lookups raise and write nothing."""
    kernel = kernel_for(two_stage())
    run_id = _start(kernel, "two-stage")

    with pytest.raises(WorkflowNotFoundError, match="not found in registry"):
        _execute(kernel, run_id, "missing-workflow", "add-1")
    with pytest.raises(StageNotFoundError, match="no-such-stage"):
        _execute(kernel, run_id, "two-stage", "no-such-stage")
    with pytest.raises(RunNotFoundError):
        _execute(kernel, str(uuid.uuid4()), "two-stage", "add-1")

    assert _record(run_id, "add-1").status == Status.PENDING
    assert not WorkflowStage.objects.filter(run_id=run_id, stage_id="add-10").exists()


def test_execute_stage_record_is_running_during_execution(kernel_for: KernelFor) -> None:
    """K-JE-6, EC-4: Phase 1 committed before the body runs: the record is RUNNING, one
    unpublished ``stage:started`` exists, and no transaction is held open.
    """
    seen: dict[str, Any] = {}

    def body(ctx: StageContext[Num, Any]) -> Num:
        record = WorkflowStage.objects.get(pk=ctx.stage_record_id)
        seen["status"] = record.status
        seen["started_at"] = record.started_at
        seen["started_events"] = OutboxEvent.objects.filter(
            workflow_run_id=ctx.workflow_run_id,
            event_type="stage:started",
            published_at__isnull=True,
        ).count()
        seen["in_transaction"] = connection.in_atomic_block
        return Num(value=0)

    kernel = kernel_for(_single(define_stage(id="probe", input=Num, output=Num, execute=body)))
    run_id = _start(kernel, "single")

    assert _execute(kernel, run_id, "single", "probe").outcome == "completed"
    assert seen == {
        "status": Status.RUNNING,
        "started_at": kernel.clock.now(),
        "started_events": 1,
        "in_transaction": False,
    }


def test_execute_progress_events_written_with_outcome(
    kernel_for: KernelFor, sink: CollectingSink
) -> None:
    """WF-16, K-JE-17: ``stage:progress`` events go out with the outcome, before it."""

    def body(ctx: StageContext[Num, Any]) -> Num:
        ctx.progress(25, "quarter")
        ctx.progress(75, "most", rows=3)
        assert "stage:progress" not in _outbox_types(ctx.workflow_run_id)
        return Num(value=1)

    kernel = kernel_for(_single(define_stage(id="steps", input=Num, output=Num, execute=body)))
    run_id = _start(kernel, "single")

    assert _execute(kernel, run_id, "single", "steps").outcome == "completed"

    events = _published(kernel, sink, run_id)
    assert _types(events)[-4:-1] == ["stage:progress", "stage:progress", "stage:completed"]
    progress = [e for e in events if e["type"] == "stage:progress"]
    assert [(e["progress"], e["message"]) for e in progress] == [(25, "quarter"), (75, "most")]
    assert progress[1]["details"] == {"rows": 3}


def test_execute_refuses_a_config_other_than_the_jobs(kernel_for: KernelFor) -> None:
    """The stage runs with its job's config (the run's map): a different ``config`` is refused
    with an error naming the field, and nothing runs or changes.
    """
    calls: list[int] = []

    def body(ctx: Any) -> Num:
        calls.append(1)
        return Num(value=0)

    kernel = kernel_for(_single(define_stage(id="cfg", input=Num, output=Num, execute=body)))
    run_id = _start(kernel, "single")
    before = (OutboxEvent.objects.count(), list(WorkflowJob.objects.values_list("status")))

    with pytest.raises(InvalidCommandError) as raised:
        _execute(kernel, run_id, "single", "cfg", config={"cfg": {"a": 2}})

    assert raised.value.field == "config"
    assert calls == []
    assert (OutboxEvent.objects.count(), list(WorkflowJob.objects.values_list("status"))) == before
    assert _execute(kernel, run_id, "single", "cfg").outcome == "completed"


def test_execute_ghost_when_run_not_running(kernel_for: KernelFor) -> None:
    """K-JE-3, EC-5: a job of a PENDING run is a ghost; nothing runs, nothing is written."""
    calls: list[int] = []

    def body(ctx: Any) -> Num:
        calls.append(1)
        return Num(value=0)

    kernel = kernel_for(_single(define_stage(id="never", input=Num, output=Num, execute=body)))
    run_id = kernel.dispatch(CreateRun(workflow_id="single", input={"value": 1})).workflow_run_id
    before = OutboxEvent.objects.count()

    result = _execute(kernel, run_id, "single", "never")

    assert result.outcome == "failed"
    assert result.ghost is True
    assert "not RUNNING" in (result.error or "")
    assert "PENDING" in (result.error or "")
    assert calls == []
    assert not WorkflowStage.objects.filter(run_id=run_id).exists()
    assert OutboxEvent.objects.count() == before


def test_execute_input_validation_failure_is_not_retryable(kernel_for: KernelFor) -> None:
    """K-JE-9, K-JE-11: an input that fails the stage's input model is a non-retryable
    ``ValidationError`` naming the field; the body never runs.
    """
    calls: list[int] = []

    def body(ctx: Any) -> Num:
        calls.append(1)
        return Num(value=0)

    stage = define_stage(id="typed", input=Num, output=Num, execute=body)
    kernel = kernel_for(_single(stage, input=None))
    run_id = _start(kernel, "single", {"value": "not-a-number"})

    result = _execute(kernel, run_id, "single", "typed")

    assert result.outcome == "failed"
    assert result.retryable is False
    assert (result.error or "").startswith("ValidationError")
    assert "value" in (result.error or "")
    assert calls == []
    assert _record(run_id, "typed").status == Status.FAILED


def test_execute_completed_stage_is_not_executed_again(
    kernel_for: KernelFor, sink: CollectingSink
) -> None:
    """K-JE-5, EC-11: a re-delivery of a COMPLETED stage (its job back in the queue, as after
    a lost settlement) returns the stored output without a key, runs nothing and writes
    nothing but the job's settlement.
    """
    calls: list[int] = []

    def body(ctx: StageContext[Num, Any]) -> Num:
        calls.append(1)
        return Num(value=ctx.input.value + len(calls))

    once = define_stage(id="once", input=Num, output=Num, execute=body)
    kernel = kernel_for(define_workflow(id="twice", input=Num).pipe(once).pipe(add(1)).build())
    run_id = _start(kernel, "twice", {"value": 10})

    first = _execute(kernel, run_id, "twice", "once")
    WorkflowJob.objects.filter(workflow_run_id=run_id, stage_id="once").update(
        status=Status.PENDING
    )
    outbox = OutboxEvent.objects.count()
    version = _record(run_id, "once").version
    second = _execute(kernel, run_id, "twice", "once")

    assert first == second == ExecuteJobResult("completed", output={"value": 11})
    assert calls == [1]
    assert OutboxEvent.objects.count() == outbox
    assert _record(run_id, "once").version == version
    job = WorkflowJob.objects.get(workflow_run_id=run_id, stage_id="once")
    assert (job.status, job.attempt) == (Status.COMPLETED, 2)
    assert _types(_published(kernel, sink, run_id)).count("stage:started") == 1


def test_execute_missing_previous_group_output_fails_loudly(kernel_for: KernelFor) -> None:
    """WF-41, EC-13: a stage whose previous group has no output fails instead of running on
    the workflow input.
    """
    kernel = kernel_for(two_stage())
    run_id = _start(kernel, "two-stage")
    assert _execute(kernel, run_id, "two-stage", "add-1").outcome == "completed"
    WorkflowStage.objects.filter(run_id=run_id, execution_group=1).delete()  # output lost

    result = _execute(kernel, run_id, "two-stage", "add-10")

    assert result.outcome == "failed"
    assert "missing the output of execution group 1" in (result.error or "")
    assert _record(run_id, "add-10").status == Status.FAILED


def test_execute_phase1_stores_the_stage_config_slice(kernel_for: KernelFor) -> None:
    """K-JE-6: a stage record keeps its own config slice, not the whole map."""

    class Own(BaseModel):
        own: str = "default"

    seen: list[str] = []

    def second(ctx: StageContext[Num, Own]) -> Num:
        seen.append(ctx.config.own)
        return ctx.input

    wf = (
        define_workflow(id="sliced", input=Num)
        .pipe(add(1, "first"))
        .pipe(define_stage(id="second", input=Num, output=Num, config=Own, execute=second))
        .build()
    )
    kernel = kernel_for(wf)
    config = {"first": {}, "second": {"own": "value"}}
    run_id = _start(kernel, "sliced", config=config)
    assert _execute(kernel, run_id, "sliced", "first", config=config).outcome == "completed"

    assert _execute(kernel, run_id, "sliced", "second").outcome == "completed"

    assert _record(run_id, "second").config == {"own": "value"}
    assert seen == ["value"]


def test_execute_invalid_config_logs_warning_and_uses_raw(kernel_for: KernelFor) -> None:
    """WF-12: a config slice that fails the config model is used raw with a WARN log naming the
    stage and the config; the stage still completes.
    """

    class Limits(BaseModel):
        limit: int = 3

    seen: list[Any] = []

    def body(ctx: StageContext[Num, Limits]) -> Num:
        seen.append(ctx.config.limit)
        return ctx.input

    stage = define_stage(id="cfg-stage", input=Num, output=Num, config=Limits, execute=body)
    kernel = kernel_for(_single(stage))
    run_id = _start(kernel, "single")
    # run.create validates the config: a slice the model refuses reaches a job only when the
    # definition changed after the run was created; the job's payload says so here
    WorkflowJob.objects.filter(workflow_run_id=run_id).update(
        payload={"config": {"cfg-stage": {"limit": "x"}}}
    )

    result = _execute(kernel, run_id, "single", "cfg-stage")

    assert result.outcome == "completed"
    assert seen == ["x"]
    warnings = list(WorkflowLog.objects.filter(run_id=run_id, level="WARN"))
    assert len(warnings) == 1
    assert "config" in warnings[0].message
    assert "cfg-stage" in warnings[0].message
    assert "limit" in warnings[0].message


# --- Part I -----------------------------------------------------------------------------------


def test_execute_cancel_before_phase3_discards_result_as_ghost(
    kernel_for: KernelFor, sink: CollectingSink
) -> None:
    """Part I item 1, K-JE-14/15, EC-6: a cancel committed while the stage runs wins. The
    result is a ghost; no output blob, no annotation, no progress or completed event.
    """

    def body(ctx: StageContext[Num, Any]) -> Num:
        ctx.annotate("review.score", 5, emit_event=True)
        ctx.progress(50, "half")
        assert kernel.dispatch(CancelRun(ctx.workflow_run_id, reason="user")).cancelled
        return Num(value=99)

    kernel = kernel_for(_single(define_stage(id="late", input=Num, output=Num, execute=body)))
    run_id = _start(kernel, "single")

    result = _execute(kernel, run_id, "single", "late")

    assert result.outcome == "failed"
    assert result.ghost is True
    assert result.retryable is False
    assert "CANCELLED" in (result.error or "")
    assert "discarded" in (result.error or "")
    record = _record(run_id, "late")
    assert record.status == Status.CANCELLED
    assert record.output_data is None
    assert _run_blob_keys(run_id) == []
    assert not WorkflowAnnotation.objects.filter(run_id=run_id).exists()
    assert not WorkflowLog.objects.filter(run_id=run_id, level="ERROR").exists()
    types_ = _types(_published(kernel, sink, run_id))
    assert types_[-2:] == ["stage:started", "workflow:cancelled"]
    for absent in ("stage:completed", "stage:progress", "annotation:created", "stage:failed"):
        assert absent not in types_
    assert WorkflowRun.objects.get(pk=run_id).status == Status.CANCELLED


class _HookedBlobs(DatabaseBlobStore):
    """A blob store that calls ``hook`` once, inside the Phase-3 transaction, before writing."""

    hook: Callable[[], None] | None = None

    def put_many(self, items: Iterable[tuple[str, Any]], **kwargs: Any) -> None:
        hook, self.hook = self.hook, None
        if hook is not None:
            hook()
        super().put_many(items, **kwargs)


@postgres_only
def test_execute_phase3_holds_the_run_lock_against_a_concurrent_cancel(
    kernel_for: KernelFor, clock: FakeClock
) -> None:
    """Part I item 1, EC-25: a cancel that starts while Phase 3 is writing waits for the run
    row lock, so there is no residual window: the stage commits first (its outcome advances
    the run to ``add-10``), then the cancel.
    """
    blobs = _HookedBlobs(clock)
    kernel = kernel_for(two_stage(), blob_store=blobs)
    run_id = _start(kernel, "two-stage")
    outcome: dict[str, Any] = {}

    def cancel() -> None:
        try:
            outcome["cancelled"] = kernel.dispatch(CancelRun(run_id)).cancelled
        finally:
            connection.close()

    thread = threading.Thread(target=cancel)

    def during_phase3() -> None:
        thread.start()
        thread.join(timeout=1.0)
        outcome["blocked"] = thread.is_alive()

    blobs.hook = during_phase3
    result = _execute(kernel, run_id, "two-stage", "add-1")
    thread.join(timeout=10)

    assert outcome == {"blocked": True, "cancelled": True}
    assert result.outcome == "completed"
    assert _record(run_id, "add-1").status == Status.COMPLETED
    assert WorkflowRun.objects.get(pk=run_id).status == Status.CANCELLED
    assert _outbox_types(run_id)[-2:] == ["stage:completed", "workflow:cancelled"]


def test_execute_sync_stage_returning_suspend_fails_non_retryable(kernel_for: KernelFor) -> None:
    """Part I item 5 (EC-31a): a sync stage that returns ``Suspend`` is a definition error:
    FAILED, not retryable, never SUSPENDED.
    """

    def body(ctx: Any) -> Suspend:
        return Suspend(state={"batch_id": "b-1"})

    kernel = kernel_for(_single(define_stage(id="not-async", input=Num, execute=body)))
    run_id = _start(kernel, "single")

    result = _execute(kernel, run_id, "single", "not-async")

    assert result.outcome == "failed"
    assert result.retryable is False
    assert "sync stage" in (result.error or "")
    assert "not-async" in (result.error or "")
    record = _record(run_id, "not-async")
    assert record.status == Status.FAILED
    assert record.suspended_state is None
    assert record.next_poll_at is None
    assert "stage:suspended" not in _outbox_types(run_id)


def test_execute_output_not_matching_model_fails_with_field_path(kernel_for: KernelFor) -> None:
    """Part I item 6 (EC-34): a sync output that fails the output model fails the stage, not
    retryable, with the field path; nothing is stored as output.
    """

    class Inner(BaseModel):
        count: int

    class Report(BaseModel):
        inner: Inner

    def body(ctx: Any) -> dict[str, Any]:
        return {"inner": {"count": "many"}}

    stage = define_stage(id="reporter", input=Num, output=Report, execute=body)
    kernel = kernel_for(_single(stage))
    run_id = _start(kernel, "single")

    result = _execute(kernel, run_id, "single", "reporter")

    assert result.outcome == "failed"
    assert result.retryable is False
    assert "ValidationError" in (result.error or "")
    assert "inner.count" in (result.error or "")
    record = _record(run_id, "reporter")
    assert record.status == Status.FAILED
    assert "inner.count" in (record.error_message or "")
    assert _run_blob_keys(run_id) == []


def test_execute_parallel_stage_context_excludes_finished_sibling(kernel_for: KernelFor) -> None:
    """Part I item 7 (EC-35): a parallel stage's context holds earlier groups only, even when
    its sibling completed first.
    """
    seen: dict[str, Any] = {}

    def sibling(stage_id: str) -> Stage:
        def body(ctx: StageContext[Num, Any]) -> Num:
            seen[stage_id] = {
                "keys": sorted(ctx.workflow_context),
                "sibling": ctx.optional("left" if stage_id == "right" else "right"),
                "input": ctx.input.value,
            }
            with pytest.raises(MissingStageOutputError):
                ctx.require("left" if stage_id == "right" else "right")
            return Num(value=ctx.input.value + 1)

        return define_stage(id=stage_id, input=Num, output=Num, execute=body)

    wf = (
        define_workflow(id="fan-out", input=Num)
        .pipe(add(1, "first"))
        .parallel([sibling("left"), sibling("right")])
        .build()
    )
    kernel = kernel_for(wf)
    run_id = _start(kernel, "fan-out")
    assert _execute(kernel, run_id, "fan-out", "first").outcome == "completed"
    assert kernel.dispatch(TransitionRun(run_id)).action == "noop"  # the outcome advanced

    assert _execute(kernel, run_id, "fan-out", "left").outcome == "completed"
    assert _record(run_id, "left").status == Status.COMPLETED
    assert _execute(kernel, run_id, "fan-out", "right").outcome == "completed"

    assert seen["right"] == {"keys": ["first"], "sibling": None, "input": 2}
    assert seen["left"] == {"keys": ["first"], "sibling": None, "input": 2}


def test_execute_rerun_of_failed_stage_clears_previous_attempt(kernel_for: KernelFor) -> None:
    """Part I item 9 (EC-37): Phase 1 clears the previous attempt's error and progress, so a
    re-executed stage never carries a stale ``error_message``.
    """
    seen: list[dict[str, Any]] = []

    def flaky(ctx: StageContext[Num, Any]) -> Num:
        record = WorkflowStage.objects.get(pk=ctx.stage_record_id)
        seen.append(
            {
                "error": record.error_message,
                "progress": record.progress,
                "completed_at": record.completed_at,
            }
        )
        if len(seen) == 1:
            ctx.progress(30, "partway")
            raise RuntimeError("first attempt failed")
        return Num(value=1)

    kernel = kernel_for(_single(define_stage(id="flaky", input=Num, output=Num, execute=flaky)))
    run_id = _start(kernel, "single")
    assert _execute(kernel, run_id, "single", "flaky").outcome == "failed"
    failed = _record(run_id, "flaky")
    assert failed.error_message == "RuntimeError: first attempt failed"

    assert _execute(kernel, run_id, "single", "flaky").outcome == "completed"

    assert seen[1] == {"error": None, "progress": None, "completed_at": None}
    record = _record(run_id, "flaky")
    assert record.status == Status.COMPLETED
    assert record.error_message is None


def test_queue_keeps_a_cancelled_job_cancelled(kernel_for: KernelFor) -> None:
    """Part I item 9 (EC-36): complete/fail/suspend/touch check the job's status, so a job
    cancelled with its run stays CANCELLED whatever a late host reports.
    """
    kernel = kernel_for(_single(add(1)))
    run_id = _start(kernel, "single")
    (job,) = kernel.queue.jobs_by_run(uuid.UUID(run_id))
    assert kernel.dispatch(CancelRun(run_id)).cancelled
    job.refresh_from_db()
    assert job.status == Status.CANCELLED

    assert kernel.queue.complete(job.pk) is False
    assert kernel.queue.complete(job.pk, from_status=Status.SUSPENDED) is False
    assert kernel.queue.fail(job.pk, "late failure") is None
    assert kernel.queue.fail(job.pk, "late failure", should_retry=True) is None
    assert kernel.queue.suspend(job.pk, None) is False
    assert kernel.queue.touch(job.pk) is False

    job.refresh_from_db()
    assert job.status == Status.CANCELLED
    assert job.last_error is None
    assert kernel.queue.dequeue("w") is None


def test_execute_progress_is_visible_while_the_stage_runs(kernel_for: KernelFor) -> None:
    """Part I item 14 (EC-49, WF-16): ``ctx.progress`` is written to the stage record at once."""
    seen: list[tuple[float | None, str]] = []

    def body(ctx: StageContext[Num, Any]) -> Num:
        ctx.progress(40, "fetching pages")
        record = WorkflowStage.objects.get(pk=ctx.stage_record_id)
        seen.append((record.progress, record.progress_message))
        return Num(value=1)

    kernel = kernel_for(_single(define_stage(id="slow", input=Num, output=Num, execute=body)))
    run_id = _start(kernel, "single")

    assert _execute(kernel, run_id, "single", "slow").outcome == "completed"

    assert seen == [(40.0, "fetching pages")]
    assert _record(run_id, "slow").progress == 100.0


def test_execute_last_throttled_progress_is_written_with_a_failure(kernel_for: KernelFor) -> None:
    """Part I item 14: the last progress of a burst (throttled while running) reaches the record
    with the outcome, so a failed stage shows how far it got.
    """

    def body(ctx: StageContext[Num, Any]) -> Num:
        ctx.progress(10, "started")
        ctx.progress(60, "most rows")
        raise RuntimeError("lost connection")

    kernel = kernel_for(_single(define_stage(id="bursty", input=Num, output=Num, execute=body)))
    run_id = _start(kernel, "single")

    assert _execute(kernel, run_id, "single", "bursty").outcome == "failed"

    record = _record(run_id, "bursty")
    assert record.status == Status.FAILED
    assert (record.progress, record.progress_message) == (60.0, "most rows")


def test_execute_is_cancelled_becomes_true_after_cancel(
    kernel_for: KernelFor, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Part I item 15 (EC-51): ``ctx.is_cancelled()`` answers from the database; after a cancel
    commits (and the check interval passes) it is True and the stage can stop early.
    """
    ticks = [0.0]
    monkeypatch.setattr(kernel_services, "time", types.SimpleNamespace(monotonic=lambda: ticks[0]))
    seen: list[bool] = []
    processed: list[int] = []

    def body(ctx: StageContext[Num, Any]) -> Num:
        for item in range(5):
            ticks[0] += 1.0
            if ctx.is_cancelled():
                seen.append(True)
                break
            seen.append(False)
            processed.append(item)
            if item == 1:
                kernel.dispatch(CancelRun(ctx.workflow_run_id))
        return Num(value=len(processed))

    kernel = kernel_for(_single(define_stage(id="loop", input=Num, output=Num, execute=body)))
    run_id = _start(kernel, "single")

    result = _execute(kernel, run_id, "single", "loop")

    assert seen == [False, False, True]
    assert processed == [0, 1]
    assert result.ghost is True
    assert _record(run_id, "loop").status == Status.CANCELLED


def test_execute_same_idempotency_key_replays_completed_result(kernel_for: KernelFor) -> None:
    """K-10, EC-16: the same key returns the cached result; the body ran once and the replay
    writes no outbox rows.
    """
    calls: list[int] = []

    def body(ctx: StageContext[Num, Any]) -> Num:
        calls.append(1)
        return Num(value=ctx.input.value * 3)

    kernel = kernel_for(_single(define_stage(id="triple", input=Num, output=Num, execute=body)))
    run_id = _start(kernel, "single", {"value": 5})

    first = _execute(kernel, run_id, "single", "triple", idempotency_key="job-1")
    outbox = OutboxEvent.objects.count()
    second = _execute(kernel, run_id, "single", "triple", idempotency_key="job-1")

    assert first == second == ExecuteJobResult("completed", output={"value": 15})
    assert calls == [1]
    assert OutboxEvent.objects.count() == outbox
    assert IdempotencyKey.objects.get(key="job-1", command_type="job.execute").state == (
        IdempotencyKey.State.COMPLETED
    )


def test_execute_same_idempotency_key_replays_failed_result(kernel_for: KernelFor) -> None:
    """K-10, K-13: a failed outcome is cached too; the same key does not execute the FAILED
    stage again (a fresh key does).
    """
    calls: list[int] = []

    def body(ctx: Any) -> Num:
        calls.append(1)
        raise RuntimeError(f"failure #{len(calls)}")

    kernel = kernel_for(_single(define_stage(id="fails", input=Num, output=Num, execute=body)))
    run_id = _start(kernel, "single")

    first = _execute(kernel, run_id, "single", "fails", idempotency_key="job-9:1")
    replay = _execute(kernel, run_id, "single", "fails", idempotency_key="job-9:1")
    fresh = _execute(kernel, run_id, "single", "fails", idempotency_key="job-9:2")

    assert first == replay
    assert first.error == "RuntimeError: failure #1"
    assert fresh.error == "RuntimeError: failure #2"
    assert calls == [1, 1]
    assert WorkflowJob.objects.filter(workflow_run_id=run_id).count() == 1
