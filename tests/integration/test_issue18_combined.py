"""Issue 18's features together, in-process on both databases: a map stage behind a
``when=``, a conditional stage after a fan-in, a branch that chooses a map, a child workflow
started from a branch, and a signal awaited after a skipped stage."""

from __future__ import annotations

import pytest
from pydantic import BaseModel

from django_workflows import (
    MapContext,
    StageContext,
    child_workflow,
    define_workflow,
    map_results,
    stage,
    wait_for_signal,
)

pytestmark = pytest.mark.django_db


class Batch(BaseModel):
    items: list[int]
    big: bool = False


class Num(BaseModel):
    n: int


class Total(BaseModel):
    total: int


@stage(id="double")
def double(ctx: StageContext[Num]) -> Num:
    return Num(n=ctx.input.n * 2)


@stage(id="sum-up")
def sum_up(ctx: StageContext[map_results(double)]) -> Total:
    return Total(total=sum(x.n for x in ctx.input.succeeded()))


@stage(id="start")
def start(ctx: StageContext[Batch]) -> Batch:
    return ctx.input


@stage(id="audit")
def audit(ctx: StageContext[Total]) -> Total:
    return Total(total=ctx.input.total + 1)


def _items(c: MapContext) -> list[dict[str, int]]:
    return [{"n": n} for n in c.input.items]


def test_a_conditional_stage_after_a_fan_in_runs_only_when_its_predicate_holds(
    run_workflow,
) -> None:
    wf = (
        define_workflow(id="combo-map-when", input=Batch)
        .map(double, over=_items, max_concurrency=2)
        .pipe(sum_up)
        .pipe(audit, when=lambda c: c.output("sum-up").total > 10)
        .build()
    )
    small = run_workflow(wf, {"items": [1, 2]})
    assert small.status == "COMPLETED", small.error
    assert small.output == {"total": 6} and list(small.skipped) == ["audit"]
    large = run_workflow(wf, {"items": [1, 2, 3, 4]})
    assert large.status == "COMPLETED", large.error
    assert large.output == {"total": 21} and large.skipped == {}


@stage(id="triple", when=lambda c: c.input.big)
def triple(ctx: StageContext[Num]) -> Num:
    return Num(n=ctx.input.n * 3)


def test_a_map_stage_behind_a_false_condition_is_skipped_with_no_item_job(run_workflow) -> None:
    from django_workflows.models import WorkflowJob

    wf = define_workflow(id="combo-when-map", input=Batch).pipe(start).map(triple, over=_items)
    wf = wf.build()
    skipped = run_workflow(wf, {"items": [1, 2, 3]})
    assert skipped.status == "COMPLETED", skipped.error
    assert list(skipped.skipped) == ["triple"]
    assert not WorkflowJob.objects.filter(workflow_run_id=skipped.run.pk, stage_id="triple")
    ran = run_workflow(wf, {"items": [1, 2, 3], "big": True})
    assert ran.status == "COMPLETED", ran.error
    assert WorkflowJob.objects.filter(workflow_run_id=ran.run.pk, stage_id="triple").count() == 3
    assert [x["n"] for x in ran.output["items"]] == [3, 6, 9], ran.output


class Kid(BaseModel):
    n: int


@stage(id="kid-work")
def kid_work(ctx: StageContext[Kid]) -> Total:
    return Total(total=ctx.input.n * 10)


KID = define_workflow(id="combo-kid", input=Kid).pipe(kid_work).build()


@stage(id="cheap")
def cheap(ctx: StageContext[Batch]) -> Total:
    return Total(total=len(ctx.input.items))


def test_a_branch_chooses_a_child_workflow_and_takes_its_output(run_workflow) -> None:
    delegate = child_workflow(
        id="delegate",
        workflow=KID,
        input=lambda c: {"n": len(c.input.items)},
        output=Total,
        stage_input=Batch,
    )
    wf = (
        define_workflow(id="combo-branch-child", input=Batch)
        .branch(lambda c: "big" if c.input.big else "small", {"big": [delegate], "small": [cheap]})
        .build()
    )
    big = run_workflow(wf, {"items": [1, 2, 3], "big": True})
    assert big.status == "COMPLETED", big.error
    assert big.output == {"total": 30} and list(big.skipped) == ["cheap"]
    small = run_workflow(wf, {"items": [1, 2, 3]})
    assert small.status == "COMPLETED", small.error
    assert small.output == {"total": 3} and list(small.skipped) == ["delegate"]


class Go(BaseModel):
    ok: bool


def test_a_signal_is_awaited_after_a_skipped_stage(run_workflow) -> None:
    wf = (
        define_workflow(id="combo-skip-signal", input=Batch)
        .pipe(start)
        .pipe(cheap, when=lambda c: c.input.big)
        .pipe(wait_for_signal(id="go", payload=Go, timeout_seconds=60))
        .build()
    )
    result = run_workflow(wf, {"items": [1]}, signals=[("go", {"ok": True})])
    assert result.status == "COMPLETED", result.error
    assert result.output == {"ok": True} and list(result.skipped) == ["cheap"]
