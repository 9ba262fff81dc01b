"""Conditional stages and branches end to end with the test kit (issue 18 items 1 and 2):
skipped records and events, branch choice, run completion and output, predicate failures,
rerun re-evaluation, and the zero-cost plain path."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import BaseModel

from django_workflows import (
    Condition,
    StageContext,
    define_stage,
    define_workflow,
    parallel_input,
    stage,
)
from django_workflows.approval import approval_stage, approve, waiting_approvals
from django_workflows.definition.context import MissingStageOutputError
from django_workflows.kernel import RerunFrom
from django_workflows.models import Status, WorkflowStage
from django_workflows.testing import collect_result, run_to_completion

pytestmark = pytest.mark.django_db


class Order(BaseModel):
    total: int
    kind: str = "small"


class Charge(BaseModel):
    total: int


@stage(id="charge")
def charge(ctx: StageContext[Order]) -> Charge:
    return Charge(total=ctx.input.total)


@stage(id="bump")
def bump(ctx: StageContext[Charge]) -> Charge:
    return Charge(total=ctx.input.total + 1)


@stage(id="ship")
def ship(ctx: StageContext[Charge]) -> dict:
    return {"shipped": ctx.input.total, "bumped": ctx.optional("bump") is not None}


def big(ctx: Any) -> bool:
    """total over 1000"""
    return ctx.output("charge").total > 1000


def _flow(**kw: Any) -> Any:
    return define_workflow(id="cond-flow", input=Order).pipe(charge).pipe(bump, when=big).pipe(ship)


def test_false_condition_skips_stage_with_reason_and_event(run_workflow) -> None:
    result = run_workflow(_flow().build(), {"total": 5})
    assert result.status == "COMPLETED"
    assert result.output == {"shipped": 5, "bumped": False}
    assert result.skipped == {"bump": "condition not met: total over 1000"}
    rec = next(r for r in result.stage_records if r.stage_id == "bump")
    assert rec.status == Status.SKIPPED and rec.completed_at is not None
    skipped = [e for e in result.events if e["type"] == "stage:skipped"]
    assert skipped == [
        {
            **skipped[0],
            "stage_id": "bump",
            "stage_name": "bump",
            "reason": "condition not met: total over 1000",
        }
    ]
    assert not result.kernel.queue.jobs_by_run(rec.run_id) or all(
        j.stage_id != "bump" for j in result.kernel.queue.jobs_by_run(rec.run_id)
    )


def test_true_condition_runs_stage(run_workflow) -> None:
    result = run_workflow(_flow().build(), {"total": 5000})
    assert result.output == {"shipped": 5001, "bumped": True}
    assert result.skipped == {}
    assert "stage:skipped" not in result.event_types


def test_last_group_skipped_run_output_is_previous_group(run_workflow) -> None:
    wf = define_workflow(id="tail-skip", input=Order).pipe(charge).pipe(bump, when=big).build()
    result = run_workflow(wf, {"total": 7})
    assert result.status == "COMPLETED" and result.output == {"total": 7}
    assert result.event_types[-2:] == ["stage:skipped", "workflow:completed"]


def test_every_stage_skipped_completes_with_none_output(run_workflow) -> None:
    never = Condition(lambda c: False, reason="never")
    wf = define_workflow(id="all-skip", input=Order).pipe(charge, when=never).build()
    result = run_workflow(wf, {"total": 7})
    assert result.status == "COMPLETED" and result.output is None
    assert result.skipped == {"charge": "condition not met: never"}
    assert result.event_types == [
        "workflow:created",
        "workflow:started",
        "stage:skipped",
        "workflow:completed",
    ]


def test_skipped_parallel_member_is_none_in_parallel_input(run_workflow) -> None:
    a = define_stage(id="a", execute=lambda ctx: Charge(total=1), output=Charge)
    b = define_stage(
        id="b",
        execute=lambda ctx: Charge(total=2),
        output=Charge,
        when=Condition(lambda c: c.input.total > 10, reason="total over 10"),
    )
    Both = parallel_input(a, b)

    def join(ctx: StageContext[Any]) -> dict:
        with pytest.raises(MissingStageOutputError, match="'b': the stage was SKIPPED"):
            ctx.require("b")
        return {"a": ctx.input.a.total, "b": ctx.input.b}

    after = define_stage(id="join", execute=join, input=Both)
    wf = define_workflow(id="par-skip", input=Order).parallel([a, b]).pipe(after).build()
    result = run_workflow(wf, {"total": 3})
    assert result.status == "COMPLETED", result.error
    assert result.output == {"a": 1, "b": None}


def test_whole_parallel_group_skipped_next_gets_earlier_output(run_workflow) -> None:
    a = define_stage(id="a", execute=lambda ctx: 1)
    b = define_stage(id="b", execute=lambda ctx: 2)
    wf = (
        define_workflow(id="group-skip", input=Order)
        .pipe(charge)
        .parallel([a, b], when=big)
        .pipe(ship)
        .build()
    )
    result = run_workflow(wf, {"total": 9})
    assert result.output == {"shipped": 9, "bumped": False}
    assert set(result.skipped) == {"a", "b"}


def _route(ctx: Any) -> str:
    return ctx.input.kind


small_a = define_stage(
    id="small-a", execute=lambda ctx: Charge(total=ctx.input.total * 2), input=Charge, output=Charge
)
small_b = define_stage(
    id="small-b", execute=lambda ctx: Charge(total=ctx.input.total + 1), input=Charge, output=Charge
)
large = define_stage(
    id="large", execute=lambda ctx: Charge(total=ctx.input.total * 100), input=Charge, output=Charge
)


def _branchy() -> Any:
    return (
        define_workflow(id="branchy", input=Order)
        .pipe(charge)
        .branch(_route, {"small": [small_a, small_b], "large": [large]}, id="size")
        .pipe(ship)
        .build()
    )


def test_branch_runs_chosen_chain_and_skips_others(run_workflow) -> None:
    result = run_workflow(_branchy(), {"total": 3, "kind": "small"})
    assert result.status == "COMPLETED", result.error
    assert result.output == {"shipped": 7, "bumped": False}
    assert list(result.skipped) == ["large"]
    reason = "branch 'small' of 'size' was chosen; this stage is on 'large'"
    assert result.skipped["large"] == reason
    chosen = [e for e in result.events if e["type"] == "branch:chosen"]
    assert len(chosen) == 1
    assert (chosen[0]["branch_id"], chosen[0]["branch"], chosen[0]["branches"]) == (
        "size",
        "small",
        ["small", "large"],
    )


def test_branch_large_skips_first_branch_in_one_transaction(run_workflow) -> None:
    result = run_workflow(_branchy(), {"total": 3, "kind": "large"})
    assert result.output == {"shipped": 300, "bumped": False}
    assert list(result.skipped) == ["small-a", "small-b"]
    assert result.event_types.count("branch:chosen") == 1


def test_unknown_branch_fails_run_naming_declared_branches(run_workflow) -> None:
    result = run_workflow(_branchy(), {"total": 3, "kind": "medium"})
    assert result.status == "FAILED"
    assert result.error["error_type"] == "BranchNotFound"
    assert result.error["stage_id"] == "small-a"
    assert "chose 'medium'" in result.error["message"]
    assert "small, large" in result.error["message"]


def test_raising_predicate_fails_run_naming_stage_and_predicate(run_workflow) -> None:
    def broken(ctx: Any) -> bool:
        raise ValueError("boom")

    wf = define_workflow(id="broken", input=Order).pipe(charge).pipe(bump, when=broken).build()
    result = run_workflow(wf, {"total": 3})
    assert result.status == "FAILED"
    assert result.error["error_type"] == "ConditionError"
    assert result.error["stage_id"] == "bump"
    assert "broken" in result.error["message"] and "ValueError: boom" in result.error["message"]
    assert result.stage_error("bump") == result.error["message"]


def test_unknown_stage_in_predicate_fails_clearly(run_workflow) -> None:
    wf = (
        define_workflow(id="typo", input=Order)
        .pipe(charge)
        .pipe(bump, when=lambda c: c.output("chrage"))
        .build()
    )
    result = run_workflow(wf, {"total": 3})
    assert result.error["error_type"] == "ConditionError"
    assert "'chrage' is not a stage of an earlier execution group" in result.error["message"]


def test_first_group_condition_decided_at_claim(run_workflow) -> None:
    wf = (
        define_workflow(id="first", input=Order)
        .pipe(charge, when=lambda c: c.input.total > 0)
        .pipe(bump, when=lambda c: c.skipped("charge"))
        .build()
    )
    skipped_first = run_workflow(wf, {"total": 0})
    # charge skipped at claim; bump (group 2) receives the run input
    assert skipped_first.skipped == {"charge": "condition not met: <lambda> is true"}
    assert skipped_first.output == {"total": 1}
    result = run_workflow(wf, {"total": 4})
    assert result.output == {"total": 4} and list(result.skipped) == ["bump"]


def test_rerun_re_evaluates_condition_for_new_generation(run_workflow) -> None:
    flips = {"n": 0}

    def flip(ctx: Any) -> bool:
        flips["n"] += 1
        return flips["n"] > 1

    wf = define_workflow(id="flip", input=Order).pipe(charge).pipe(bump, when=flip).build()
    first = run_workflow(wf, {"total": 1})
    assert first.output == {"total": 1} and list(first.skipped) == ["bump"]
    kernel = first.kernel
    kernel.dispatch(RerunFrom(first.run_id, "bump"))
    run = run_to_completion(kernel, first.run_id)
    again = collect_result(kernel, run)
    assert again.status == "COMPLETED" and again.output == {"total": 2}
    rec = WorkflowStage.objects.get(run_id=first.run_id, stage_id="bump")
    assert rec.status == Status.COMPLETED and rec.generation == 1 and rec.skip_reason == ""


def test_rerun_inside_branch_block_chooses_again(run_workflow) -> None:
    result = run_workflow(_branchy(), {"total": 3, "kind": "small"})
    kernel = result.kernel
    kernel.dispatch(RerunFrom(result.run_id, "small-b"))
    run = run_to_completion(kernel, result.run_id)
    again = collect_result(kernel, run)
    assert again.output == {"shipped": 7, "bumped": False}
    assert again.event_types.count("branch:chosen") == 2
    assert {r.stage_id: r.generation for r in again.stage_records}["small-a"] == 1


def test_approval_only_over_1000_is_one_argument(run_workflow, workflows_kernel) -> None:
    def done(ctx: StageContext[Any]) -> dict:
        decision = ctx.optional("review")
        return {"approved": None if decision is None else decision.approved}

    wf = (
        define_workflow(id="approve-big", input=Order)
        .pipe(charge)
        .pipe(approval_stage(id="review"), when=lambda c: c.output("charge").total > 1000)
        .pipe(define_stage(id="done", execute=done))
        .build()
    )
    small = run_workflow(wf, {"total": 10})
    assert small.status == "COMPLETED" and small.output == {"approved": None}
    assert list(small.skipped) == ["review"]

    kernel = workflows_kernel(wf)
    from django_workflows.kernel import CreateRun

    run_id = kernel.dispatch(CreateRun(wf.id, {"total": 5000})).workflow_run_id
    with pytest.raises(AssertionError):
        run_to_completion(kernel, run_id, max_rounds=3)
    assert [w.stage_id for w in waiting_approvals(run_id)] == ["review"]
    approve(run_id, by="alice", kernel=kernel)
    run = run_to_completion(kernel, run_id, advance_seconds=None)
    assert run.output == {"approved": True}


def test_condition_reads_run_config(run_workflow) -> None:
    class Flags(BaseModel):
        enabled: bool = False

    @stage(id="flagged", config=Flags)
    def flagged(ctx: StageContext[Charge, Flags]) -> Charge:
        return ctx.input

    wf = (
        define_workflow(id="by-config", input=Order)
        .pipe(charge)
        .pipe(flagged, when=lambda c: c.config["flagged"]["enabled"])
        .build()
    )
    assert list(run_workflow(wf, {"total": 1}).skipped) == ["flagged"]
    assert run_workflow(wf, {"total": 1}, {"flagged": {"enabled": True}}).skipped == {}


def test_when_inside_chosen_branch_then_after_block(run_workflow) -> None:
    never = Condition(lambda c: False, reason="never")
    wf = (
        define_workflow(id="nested-skip", input=Order)
        .pipe(charge)
        .branch(_route, {"small": [small_a], "large": [large]}, id="size")
        .pipe(bump, when=never)
        .build()
    )
    result = run_workflow(wf, {"total": 2, "kind": "small"})
    # bump skipped, large skipped: the run output is the chosen branch's last output
    assert result.output == {"total": 4}
    assert list(result.skipped) == ["large", "bump"]


def test_rerun_from_before_the_condition_decides_again(run_workflow) -> None:
    wf = _flow().build()
    first = run_workflow(wf, {"total": 5})
    kernel = first.kernel
    kernel.dispatch(RerunFrom(first.run_id, "charge"))
    again = collect_result(kernel, run_to_completion(kernel, first.run_id))
    assert again.skipped == {"bump": "condition not met: total over 1000"}
    assert {r.stage_id: r.generation for r in again.stage_records} == {
        "charge": 1,
        "bump": 1,
        "ship": 1,
    }
    assert again.event_types.count("stage:skipped") == 2  # one per generation
