"""Executing synchronous workflows through the kernel (TEST-SCENARIOS D.1, D.2, D.3).

Ports the ★ scenarios of `EX/basic-execution.test.ts`, `EX/error-handling.test.ts` and
`EX/execution-with-config.test.ts`: data flow between groups (WF-40), parallel outputs keyed by
stage id, per-stage config slices with defaults (WF-12, WF-44, WF-45), config rejected at
``run.create`` (K-CR-3), and failing stages (K-JE-9/11, K-TR-5). Tests either drive a run like a
host does (:func:`run_to_completion`) or dispatch the commands one by one, as upstream does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from pydantic import BaseModel, Field

from django_workflows import StageContext, Workflow, define_stage, define_workflow
from django_workflows.kernel import (
    ClaimPendingRuns,
    CreateRun,
    ExecuteJob,
    InvalidWorkflowConfigError,
    Kernel,
    TransitionRun,
)
from django_workflows.kernel.commands import ExecuteJobResult
from django_workflows.models import OutboxEvent, Status, WorkflowJob, WorkflowRun, WorkflowStage
from django_workflows.testing import CollectingSink, run_to_completion

pytestmark = pytest.mark.django_db(transaction=True)

KernelFor = Callable[..., Kernel]


class Num(BaseModel):
    value: int


class Multiplier(BaseModel):
    multiplier: int = 2
    addend: int = 0


class Offset(BaseModel):
    offset: int


class Strict(BaseModel):
    count: int = Field(ge=1, le=10)
    label: str = "x"


# --- helpers ------------------------------------------------------------------------------------


def start_run(
    kernel: Kernel, workflow_id: str, input: Any = None, config: dict[str, Any] | None = None
) -> str:
    """run.create + run.claimPending: the run is RUNNING with group 1 enqueued."""
    created = kernel.dispatch(CreateRun(workflow_id=workflow_id, input=input or {}, config=config))
    claimed = kernel.dispatch(ClaimPendingRuns(worker_id="test-worker"))
    assert [c.workflow_run_id for c in claimed.claimed] == [created.workflow_run_id]
    return str(created.workflow_run_id)


def execute(kernel: Kernel, run_id: str, stage_id: str) -> ExecuteJobResult:
    """job.execute with the run's config map, as hosts pass it (WF-45)."""
    run = WorkflowRun.objects.get(pk=run_id)
    return kernel.dispatch(
        ExecuteJob(
            workflow_run_id=run_id,
            workflow_id=run.workflow_id,
            stage_id=stage_id,
            config=run.config,
        )
    )


def final_delivery(run_id: str) -> None:
    """Give the run's queued jobs one delivery each: a failure is final (not retried), so the
    outcome transaction fails the run (K-TR-5)."""
    WorkflowJob.objects.filter(workflow_run_id=run_id, status=Status.PENDING).update(max_attempts=1)


def outbox(run_id: str) -> list[dict[str, Any]]:
    """The run's outbox events in order."""
    rows = OutboxEvent.objects.filter(workflow_run_id=run_id).order_by("sequence")
    return [row.payload for row in rows]


def outbox_types(run_id: str) -> list[str]:
    return [e["type"] for e in outbox(run_id)]


def record(run_id: str, stage_id: str) -> WorkflowStage:
    return WorkflowStage.objects.get(run_id=run_id, stage_id=stage_id)


def stored_output(kernel: Kernel, run_id: str, stage_id: str) -> Any:
    """The stage output as stored in the blob store (DM-51)."""
    return kernel.blobs.get(record(run_id, stage_id).output_data["_artifactKey"])


def calc_stage(
    stage_id: str,
    fn: Callable[[int], int],
    seen: list[tuple[str, Any]] | None = None,
    config: type[BaseModel] | None = None,
) -> Any:
    """A Num -> Num stage applying ``fn``; records (stage id, input value) in ``seen``."""

    def run(ctx: StageContext[Num, Any]) -> Num:
        if seen is not None:
            seen.append((stage_id, ctx.input.value))
        return Num(value=fn(ctx.input.value))

    return define_stage(id=stage_id, input=Num, output=Num, config=config, execute=run)


def boom_stage(stage_id: str = "explode", message: str = "Stage exploded") -> Any:
    def run(ctx: StageContext[Any, Any]) -> Any:
        raise RuntimeError(message)

    return define_stage(id=stage_id, execute=run)


# --- D.1 basic execution ------------------------------------------------------------------------


def test_single_stage_run_completes_with_output(kernel_for: KernelFor) -> None:
    """D.1 :15, :137 - job output {result: 42}; run COMPLETED with completed_at (K-JE-17)."""
    wf = (
        define_workflow(id="single")
        .pipe(define_stage(id="answer", execute=lambda c: {"result": 42}))
        .build()
    )
    kernel = kernel_for(wf)
    run_id = start_run(kernel, "single")

    result = execute(kernel, run_id, "answer")
    assert (result.outcome, result.output, result.error) == ("completed", {"result": 42}, None)
    assert WorkflowRun.objects.get(pk=run_id).status == Status.COMPLETED  # by the outcome

    run = WorkflowRun.objects.get(pk=run_id)
    assert run.status == Status.COMPLETED
    assert run.output == {"result": 42}
    assert run.completed_at is not None
    assert run.duration_ms is not None and run.duration_ms >= 0
    rec = record(run_id, "answer")
    assert rec.status == Status.COMPLETED
    assert rec.completed_at is not None
    assert stored_output(kernel, run_id, "answer") == {"result": 42}


def test_single_stage_run_emits_lifecycle_events_once(
    kernel_for: KernelFor, sink: CollectingSink
) -> None:
    """D.1 :68 - one workflow:started, stage:started, stage:completed, workflow:completed."""
    wf = (
        define_workflow(id="single")
        .pipe(define_stage(id="answer", execute=lambda c: {"result": 42}))
        .build()
    )
    kernel = kernel_for(wf)
    run_id = kernel.dispatch(CreateRun(workflow_id="single")).workflow_run_id
    run = run_to_completion(kernel, run_id)

    assert run.status == Status.COMPLETED
    assert sink.types(run_id) == [
        "workflow:created",
        "workflow:started",
        "stage:started",
        "stage:completed",
        "workflow:completed",
    ]
    started, completed = (e for e in sink.events if e["type"].startswith("stage:"))
    assert started["stage_id"] == completed["stage_id"] == "answer"
    assert started["stage_number"] == 1
    finished = sink.events[-1]
    assert finished["output"] == {"result": 42}
    assert finished["workflow_run_id"] == str(run_id)


def test_sequential_stages_pass_output_to_the_next_stage(kernel_for: KernelFor) -> None:
    """D.1 :192 - 3 -> double 6 -> double 12 -> square 144; each stage gets its predecessor's
    output (WF-40) and the run output is the last output.
    """
    seen: list[tuple[str, Any]] = []
    wf = (
        define_workflow(id="chain", input=Num)
        .pipe(calc_stage("double", lambda v: v * 2, seen))
        .pipe(calc_stage("double-again", lambda v: v * 2, seen))
        .pipe(calc_stage("square", lambda v: v * v, seen))
        .build()
    )
    kernel = kernel_for(wf)
    run_id = kernel.dispatch(CreateRun(workflow_id="chain", input={"value": 3})).workflow_run_id
    run = run_to_completion(kernel, run_id)

    assert run.status == Status.COMPLETED
    assert seen == [("double", 3), ("double-again", 6), ("square", 12)]
    assert [stored_output(kernel, run_id, s) for s in ("double", "double-again", "square")] == [
        {"value": 6},
        {"value": 12},
        {"value": 144},
    ]
    assert run.output == {"value": 144}


def test_sequential_stages_each_get_one_completed_record(kernel_for: KernelFor) -> None:
    """D.1 :305 - one COMPLETED record per stage, numbered and grouped (WF-31/32)."""
    wf = (
        define_workflow(id="chain", input=Num)
        .pipe(calc_stage("a", lambda v: v + 1))
        .pipe(calc_stage("b", lambda v: v + 1))
        .pipe(calc_stage("c", lambda v: v + 1))
        .build()
    )
    kernel = kernel_for(wf)
    run_id = kernel.dispatch(CreateRun(workflow_id="chain", input={"value": 0})).workflow_run_id
    run_to_completion(kernel, run_id)

    rows = WorkflowStage.objects.filter(run_id=run_id).order_by("stage_number")
    assert [(r.stage_id, r.stage_number, r.execution_group, r.status) for r in rows] == [
        ("a", 1, 1, Status.COMPLETED),
        ("b", 2, 2, Status.COMPLETED),
        ("c", 3, 3, Status.COMPLETED),
    ]


def test_parallel_stages_get_one_job_each_and_complete(kernel_for: KernelFor) -> None:
    """D.1 :388 - a parallel first group enqueues 2 jobs; both complete; run COMPLETED."""
    wf = (
        define_workflow(id="par", input=Num)
        .parallel([calc_stage("plus", lambda v: v + 1), calc_stage("times", lambda v: v * 10)])
        .build()
    )
    kernel = kernel_for(wf)
    run_id = kernel.dispatch(CreateRun(workflow_id="par", input={"value": 4})).workflow_run_id
    claimed = kernel.dispatch(ClaimPendingRuns(worker_id="test-worker")).claimed
    assert len(claimed) == 1 and len(claimed[0].job_ids) == 2
    jobs = WorkflowJob.objects.filter(workflow_run_id=run_id).order_by("id")
    assert sorted(j.stage_id for j in jobs) == ["plus", "times"]

    assert execute(kernel, run_id, "plus").outcome == "completed"
    assert kernel.dispatch(TransitionRun(run_id)).action == "noop"  # sibling still PENDING
    assert execute(kernel, run_id, "times").outcome == "completed"
    assert WorkflowRun.objects.get(pk=run_id).status == Status.COMPLETED  # by the outcome

    run = WorkflowRun.objects.get(pk=run_id)
    assert run.status == Status.COMPLETED
    # a parallel last group yields {stage_id: output} (WF-40)
    assert run.output == {"plus": {"value": 5}, "times": {"value": 40}}


def test_parallel_outputs_are_keyed_by_stage_id_as_next_input(kernel_for: KernelFor) -> None:
    """D.1 :477 - the group after a parallel group receives {stage_id: output} (WF-40)."""

    class Merged(BaseModel):
        plus: Num
        times: Num

    received: list[Merged] = []

    def merge(ctx: StageContext[Merged, Any]) -> dict[str, int]:
        received.append(ctx.input)
        return {"sum": ctx.input.plus.value + ctx.input.times.value}

    wf = (
        define_workflow(id="fan", input=Num)
        .parallel([calc_stage("plus", lambda v: v + 1), calc_stage("times", lambda v: v * 10)])
        .pipe(define_stage(id="merge", input=Merged, execute=merge))
        .build()
    )
    kernel = kernel_for(wf)
    run_id = kernel.dispatch(CreateRun(workflow_id="fan", input={"value": 2})).workflow_run_id
    run = run_to_completion(kernel, run_id)

    assert run.status == Status.COMPLETED
    assert received == [Merged(plus=Num(value=3), times=Num(value=20))]
    assert run.output == {"sum": 23}


def test_downstream_stage_sees_earlier_outputs_in_context(kernel_for: KernelFor) -> None:
    """D.1 :663 - WF-14: a later stage reads non-adjacent earlier outputs with require()."""
    captured: dict[str, Any] = {}

    def last(ctx: StageContext[Num, Any]) -> Num:
        captured["first"] = ctx.require("first")
        captured["context_ids"] = sorted(ctx.workflow_context)
        return Num(value=ctx.input.value + ctx.require("first").value)

    wf = (
        define_workflow(id="ctx", input=Num)
        .pipe(calc_stage("first", lambda v: v * 100))
        .pipe(calc_stage("second", lambda v: v + 1))
        .pipe(define_stage(id="last", input=Num, output=Num, execute=last))
        .build()
    )
    kernel = kernel_for(wf)
    run_id = kernel.dispatch(CreateRun(workflow_id="ctx", input={"value": 1})).workflow_run_id
    run = run_to_completion(kernel, run_id)

    assert captured["first"] == Num(value=100)  # as the producer's output model
    assert captured["context_ids"] == ["first", "second"]
    assert run.output == {"value": 201}


def test_stage_receives_its_own_config_slice(kernel_for: KernelFor) -> None:
    """D.1 :558 - the stage sees config[stage_id] {multiplier: 5} (WF-12, WF-45)."""
    seen: list[dict[str, Any]] = []

    def run(ctx: StageContext[Num, Multiplier]) -> Num:
        seen.append(ctx.config.model_dump())
        return Num(value=ctx.input.value * ctx.config.multiplier)

    wf = (
        define_workflow(id="cfg", input=Num)
        .pipe(define_stage(id="scale", input=Num, output=Num, config=Multiplier, execute=run))
        .build()
    )
    kernel = kernel_for(wf)
    run_id = start_run(kernel, "cfg", {"value": 7}, {"scale": {"multiplier": 5}})
    job = WorkflowJob.objects.get(workflow_run_id=run_id)
    assert job.payload == {"config": {"scale": {"multiplier": 5}}}  # WF-45: the whole map

    result = execute(kernel, run_id, "scale")
    assert result.output == {"value": 35}
    assert seen == [{"multiplier": 5, "addend": 0}]
    assert record(run_id, "scale").config == {"multiplier": 5}


def test_invalid_config_is_rejected_at_run_create(kernel_for: KernelFor) -> None:
    """D.1 :619, D.2 :521 - K-CR-3: /Invalid workflow config/, nothing written."""
    wf = (
        define_workflow(id="cfg", input=Num)
        .pipe(calc_stage("scale", abs, config=Multiplier))
        .build()
    )
    kernel = kernel_for(wf)
    with pytest.raises(InvalidWorkflowConfigError, match="Invalid workflow config") as info:
        kernel.dispatch(
            CreateRun(workflow_id="cfg", input={"value": 1}, config={"scale": {"multiplier": "x"}})
        )
    assert "scale" in str(info.value)
    assert "multiplier" in str(info.value)
    assert info.value.field == "config"
    assert not WorkflowRun.objects.exists()
    assert not OutboxEvent.objects.exists()


# --- D.2 error handling -------------------------------------------------------------------------


def failing_pipeline(calls: list[str]) -> Workflow:
    """ok -> explode -> never (records which stages ran)."""

    def tracked(stage_id: str) -> Any:
        def run(ctx: StageContext[Any, Any]) -> dict[str, str]:
            calls.append(stage_id)
            return {"done": stage_id}

        return define_stage(id=stage_id, execute=run)

    return (
        define_workflow(id="failing")
        .pipe(tracked("ok"))
        .pipe(boom_stage())
        .pipe(tracked("never"))
        .build()
    )


def test_throwing_stage_outcome_is_failed_with_message(kernel_for: KernelFor) -> None:
    """D.2 :17, :237 - the outcome and the stage record carry the error (K-JE-11)."""
    wf = define_workflow(id="boom").pipe(boom_stage(message="Something broke")).build()
    kernel = kernel_for(wf)
    run_id = start_run(kernel, "boom")

    result = execute(kernel, run_id, "explode")
    assert result.outcome == "failed"
    assert result.error == "RuntimeError: Something broke"
    assert result.ghost is False
    rec = record(run_id, "explode")
    assert rec.status == Status.FAILED
    assert rec.error_message == "RuntimeError: Something broke"
    assert rec.completed_at is not None


def test_plain_exception_message_is_kept_verbatim(kernel_for: KernelFor) -> None:
    """K-JE-11: a generic Exception's message is stored without a class prefix."""

    def run(ctx: StageContext[Any, Any]) -> Any:
        raise Exception("plain failure")

    wf = define_workflow(id="plain").pipe(define_stage(id="s", execute=run)).build()
    kernel = kernel_for(wf)
    run_id = start_run(kernel, "plain")
    assert execute(kernel, run_id, "s").error == "plain failure"


def test_failed_stage_emits_one_stage_failed_event(kernel_for: KernelFor) -> None:
    """D.2 :125 - exactly one stage:failed with stage_id and error (after stage:started)."""
    wf = define_workflow(id="boom").pipe(boom_stage()).build()
    kernel = kernel_for(wf)
    run_id = start_run(kernel, "boom")
    execute(kernel, run_id, "explode")

    failed = [e for e in outbox(run_id) if e["type"] == "stage:failed"]
    assert len(failed) == 1
    assert failed[0]["stage_id"] == "explode"
    assert failed[0]["error"] == "RuntimeError: Stage exploded"
    assert outbox_types(run_id)[-2:] == ["stage:started", "stage:failed"]


def test_transition_after_failure_fails_run_with_stage_error(kernel_for: KernelFor) -> None:
    """D.2 :67, :183 - transition -> failed; run FAILED with completed_at; workflow:failed
    carries the stage error (K-TR-5).
    """
    wf = define_workflow(id="boom").pipe(boom_stage()).build()
    kernel = kernel_for(wf)
    run_id = start_run(kernel, "boom")
    final_delivery(run_id)
    execute(kernel, run_id, "explode")

    assert WorkflowRun.objects.get(pk=run_id).status == Status.FAILED  # by the outcome
    run = WorkflowRun.objects.get(pk=run_id)
    assert run.status == Status.FAILED
    assert run.completed_at is not None
    workflow_failed = [e for e in outbox(run_id) if e["type"] == "workflow:failed"]
    assert len(workflow_failed) == 1
    assert workflow_failed[0]["error"] == "RuntimeError: Stage exploded"
    assert kernel.dispatch(TransitionRun(run_id)).action == "noop"  # Part I item 17


def test_only_failing_stage_is_failed_and_later_stages_never_run(kernel_for: KernelFor) -> None:
    """D.2 :295, :376 - earlier stage stays COMPLETED; after the failure the run fails and the
    later stage gets no record and never executes.
    """
    calls: list[str] = []
    kernel = kernel_for(failing_pipeline(calls))
    run_id = start_run(kernel, "failing")

    assert execute(kernel, run_id, "ok").outcome == "completed"
    assert kernel.dispatch(TransitionRun(run_id)).action == "noop"  # the outcome advanced
    final_delivery(run_id)
    assert execute(kernel, run_id, "explode").outcome == "failed"
    assert WorkflowRun.objects.get(pk=run_id).status == Status.FAILED  # by the outcome

    statuses = dict(WorkflowStage.objects.filter(run_id=run_id).values_list("stage_id", "status"))
    assert statuses == {"ok": Status.COMPLETED, "explode": Status.FAILED}
    assert calls == ["ok"]
    assert not WorkflowJob.objects.filter(workflow_run_id=run_id, stage_id="never").exists()


def test_failing_stage_fails_the_run_through_the_host(
    kernel_for: KernelFor, sink: CollectingSink
) -> None:
    """D.2 (host path, H-7) - retries exhausted, run FAILED with the stage error in
    workflow:failed; the stage after it never runs.
    """
    calls: list[str] = []
    kernel = kernel_for(failing_pipeline(calls))
    run_id = kernel.dispatch(CreateRun(workflow_id="failing")).workflow_run_id
    run = run_to_completion(kernel, run_id, advance_seconds=10)

    assert run.status == Status.FAILED
    assert calls == ["ok"]
    job = WorkflowJob.objects.get(workflow_run_id=run_id, stage_id="explode")
    assert (job.status, job.attempt) == (Status.FAILED, job.max_attempts)
    assert job.last_error == "RuntimeError: Stage exploded"
    failed = [e for e in sink.events if e["type"] == "workflow:failed"]
    assert [e["error"] for e in failed] == ["RuntimeError: Stage exploded"]
    assert "never" not in {e.get("stage_id") for e in sink.events}
    assert sink.types(run_id)[-1] == "workflow:failed"


def test_invalid_stage_input_fails_before_user_code(kernel_for: KernelFor) -> None:
    """D.2 :470 - K-JE-9: the previous output does not match the stage input; non-retryable,
    and the stage body never runs.
    """

    class Words(BaseModel):
        words: list[str]

    ran: list[bool] = []

    def count(ctx: StageContext[Words, Any]) -> int:
        ran.append(True)
        return len(ctx.input.words)

    wf = (
        define_workflow(id="mismatch", input=Num)
        .pipe(calc_stage("number", lambda v: v))
        .pipe(define_stage(id="count", input=Words, execute=count))
        .build()
    )
    kernel = kernel_for(wf)
    run_id = start_run(kernel, "mismatch", {"value": 1})
    execute(kernel, run_id, "number")
    kernel.dispatch(TransitionRun(run_id))

    result = execute(kernel, run_id, "count")
    assert result.outcome == "failed"
    assert result.retryable is False
    assert result.error is not None
    assert result.error.startswith("ValidationError: invalid input of stage 'count'")
    assert "words: Field required" in result.error
    assert ran == []


# --- D.3 execution with config ------------------------------------------------------------------


def test_each_stage_gets_its_own_config(kernel_for: KernelFor) -> None:
    """D.3 :16 - {multiplier: 3} and {offset: 5} go to their own stages: (2*3)+5 = 11."""
    seen: dict[str, Any] = {}

    def scale(ctx: StageContext[Num, Multiplier]) -> Num:
        seen["scale"] = ctx.config.model_dump()
        return Num(value=ctx.input.value * ctx.config.multiplier)

    def shift(ctx: StageContext[Num, Offset]) -> Num:
        seen["shift"] = ctx.config.model_dump()
        return Num(value=ctx.input.value + ctx.config.offset)

    wf = (
        define_workflow(id="two-cfg", input=Num)
        .pipe(define_stage(id="scale", input=Num, output=Num, config=Multiplier, execute=scale))
        .pipe(define_stage(id="shift", input=Num, output=Num, config=Offset, execute=shift))
        .build()
    )
    kernel = kernel_for(wf)
    config = {"scale": {"multiplier": 3}, "shift": {"offset": 5}}
    run_id = kernel.dispatch(
        CreateRun(workflow_id="two-cfg", input={"value": 2}, config=config)
    ).workflow_run_id
    run = run_to_completion(kernel, run_id)

    assert run.output == {"value": 11}
    assert seen == {"scale": {"multiplier": 3, "addend": 0}, "shift": {"offset": 5}}
    assert record(run_id, "scale").config == {"multiplier": 3}
    assert record(run_id, "shift").config == {"offset": 5}


def test_defaults_are_merged_at_execution(kernel_for: KernelFor) -> None:
    """D.3 :114 - WF-44: the run stores the caller's slice unparsed; the stage sees
    {multiplier: 2, addend: 10} because parsing re-applies the defaults (WF-12).
    """
    seen: list[dict[str, Any]] = []

    def run(ctx: StageContext[Num, Multiplier]) -> Num:
        seen.append(ctx.config.model_dump())
        return Num(value=ctx.input.value * ctx.config.multiplier + ctx.config.addend)

    wf = (
        define_workflow(id="defaults", input=Num)
        .pipe(define_stage(id="calc", input=Num, output=Num, config=Multiplier, execute=run))
        .build()
    )
    kernel = kernel_for(wf)
    run_id = kernel.dispatch(
        CreateRun(workflow_id="defaults", input={"value": 4}, config={"calc": {"addend": 10}})
    ).workflow_run_id
    assert WorkflowRun.objects.get(pk=run_id).config == {"calc": {"addend": 10}}
    run = run_to_completion(kernel, run_id)

    assert seen == [{"multiplier": 2, "addend": 10}]
    assert run.output == {"value": 18}


def test_all_defaults_apply_without_config(kernel_for: KernelFor) -> None:
    """D.3 :182 - no config: the run stores the defaults and the stage sees them (WF-43/44)."""
    seen: list[dict[str, Any]] = []

    def run(ctx: StageContext[Num, Multiplier]) -> Num:
        seen.append(ctx.config.model_dump())
        return Num(value=ctx.input.value * ctx.config.multiplier)

    wf = (
        define_workflow(id="defaults", input=Num)
        .pipe(define_stage(id="calc", input=Num, output=Num, config=Multiplier, execute=run))
        .pipe(calc_stage("plain", lambda v: v))
        .build()
    )
    kernel = kernel_for(wf)
    run_id = kernel.dispatch(CreateRun(workflow_id="defaults", input={"value": 4})).workflow_run_id
    assert WorkflowRun.objects.get(pk=run_id).config == {
        "calc": {"multiplier": 2, "addend": 0},
        "plain": {},
    }
    run = run_to_completion(kernel, run_id)
    assert seen == [{"multiplier": 2, "addend": 0}]
    assert run.output == {"value": 8}


def test_provided_values_override_defaults(kernel_for: KernelFor) -> None:
    """D.3 :252 - a provided value wins over the default."""
    seen: list[dict[str, Any]] = []

    def run(ctx: StageContext[Num, Multiplier]) -> Num:
        seen.append(ctx.config.model_dump())
        return Num(value=ctx.input.value * ctx.config.multiplier + ctx.config.addend)

    wf = (
        define_workflow(id="override", input=Num)
        .pipe(define_stage(id="calc", input=Num, output=Num, config=Multiplier, execute=run))
        .build()
    )
    kernel = kernel_for(wf)
    run_id = kernel.dispatch(
        CreateRun(
            workflow_id="override",
            input={"value": 4},
            config={"calc": {"multiplier": 10, "addend": 1}},
        )
    ).workflow_run_id
    assert run_to_completion(kernel, run_id).output == {"value": 41}
    assert seen == [{"multiplier": 10, "addend": 1}]


@pytest.mark.parametrize(
    ("stage_input", "expected"),
    [({"value": "abc"}, "value: Input should be a valid integer"), ({}, "value: Field required")],
    ids=["invalid", "incomplete"],
)
def test_invalid_stage_input_fails_at_execution(
    kernel_for: KernelFor, stage_input: dict[str, Any], expected: str
) -> None:
    """D.3 :322, :378 - the workflow accepts any input; the stage's input model rejects it when
    the job executes (K-JE-9): failed, non-retryable, stage FAILED with the field path.
    """
    wf = define_workflow(id="loose").pipe(calc_stage("strict", lambda v: v)).build()
    kernel = kernel_for(wf)
    run_id = start_run(kernel, "loose", stage_input)

    result = execute(kernel, run_id, "strict")
    assert result.outcome == "failed"
    assert result.retryable is False
    assert expected in (result.error or "")
    assert record(run_id, "strict").status == Status.FAILED


@pytest.mark.parametrize(
    ("config", "fragment"),
    [
        ({"limited": {"count": "five"}}, "count: Input should be a valid integer"),
        ({"limited": {"count": 11}}, "count: Input should be less than or equal to 10"),
        ({"limited": {"label": "no-count"}}, "count: Field required"),
        (None, "count: Field required"),
    ],
    ids=["wrong-type", "out-of-range", "missing-required", "no-config"],
)
def test_bad_config_is_rejected_at_run_create(
    kernel_for: KernelFor, config: dict[str, Any] | None, fragment: str
) -> None:
    """D.3 :440, :482, :524 - K-CR-3: rejected before anything runs, with the stage id and
    field path in the message.
    """
    wf = (
        define_workflow(id="strict-cfg", input=Num)
        .pipe(calc_stage("limited", lambda v: v, config=Strict))
        .build()
    )
    kernel = kernel_for(wf)
    with pytest.raises(InvalidWorkflowConfigError) as info:
        kernel.dispatch(CreateRun(workflow_id="strict-cfg", input={"value": 1}, config=config))
    message = str(info.value)
    assert message.startswith("Invalid workflow config: limited: Config validation failed: ")
    assert fragment in message
    assert not WorkflowRun.objects.exists()


def test_config_for_unknown_stage_is_rejected(kernel_for: KernelFor) -> None:
    """K-CR-3: a config key that is no stage id is rejected, naming the valid ids."""
    wf = define_workflow(id="known", input=Num).pipe(calc_stage("only", lambda v: v)).build()
    kernel = kernel_for(wf)
    with pytest.raises(
        InvalidWorkflowConfigError, match="unknown stage ids typo; valid stage ids: only"
    ):
        kernel.dispatch(CreateRun(workflow_id="known", input={"value": 1}, config={"typo": {}}))
    assert not WorkflowRun.objects.exists()
