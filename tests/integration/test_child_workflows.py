"""Child workflows (issue 18 item 5, ``django_workflows.children``): a stage starts a child run,
waits for it without holding a worker, and takes its output; failures, cancellation and reruns
carry across parent and child. Driven in-process with the test kit's fake clock.
"""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import BaseModel

from django_workflows import StageContext, define_stage, define_workflow
from django_workflows.children import CHILD_CANCELLED, CHILD_FAILED, child_runs, child_workflow
from django_workflows.definition.results import CompletionCheck, StageFailed, Suspend
from django_workflows.definition.stage import WorkflowDefinitionError, define_async_batch_stage
from django_workflows.kernel import CancelRun, CreateRun, ReapStaleLeases, RerunFrom, faults
from django_workflows.kernel.children import child_key
from django_workflows.models import (
    IdempotencyKey,
    Status,
    WorkflowJob,
    WorkflowRun,
    WorkflowStage,
)
from django_workflows.testing import drive, make_kernel, run_to_completion, run_workflow

pytestmark = pytest.mark.django_db


class Order(BaseModel):
    order_id: str
    items: int = 1


class Shipment(BaseModel):
    tracking: str
    parcels: int


def _pack(ctx: StageContext[Order]) -> Shipment:
    if ctx.input.order_id == "boom":
        raise StageFailed("no courier for boom", error_type="NoCourier")
    return Shipment(tracking=f"T-{ctx.input.order_id}", parcels=ctx.input.items)


pack = define_stage(id="pack", execute=_pack, input=Order, output=Shipment)
shipping = define_workflow(id="shipping", input=Order).pipe(pack).build()


def _validate(ctx: StageContext[Order]) -> Order:
    return ctx.input


validate = define_stage(id="validate", execute=_validate, input=Order, output=Order)
ship = child_workflow(
    id="ship",
    workflow=shipping,
    input=lambda ctx: {"order_id": ctx.input.order_id, "items": ctx.input.items},
    stage_input=Order,
)
orders = define_workflow(id="orders", input=Order).pipe(validate).pipe(ship).build()


def test_parent_completes_with_the_child_output_in_one_call() -> None:
    result = run_workflow(orders, {"order_id": "A1", "items": 3})
    assert result.status == Status.COMPLETED
    assert result.output == {"tracking": "T-A1", "parcels": 3}
    children = child_runs(result.run.pk)
    assert [(c["workflow_id"], c["status"], c["parent_stage_id"]) for c in children] == [
        ("shipping", Status.COMPLETED, "ship")
    ]
    child = WorkflowRun.objects.get(pk=children[0]["id"])
    assert child.parent_run_id == result.run.pk and child.parent_generation == 0
    assert child.input == {"order_id": "A1", "items": 3}
    stage = WorkflowStage.objects.get(run=result.run, stage_id="ship")
    assert stage.suspended_state["child_run_id"] == str(child.pk)


def test_child_failure_fails_the_parent_stage_naming_the_child() -> None:
    result = run_workflow(orders, {"order_id": "boom"})
    assert result.status == Status.FAILED
    child = WorkflowRun.objects.get(parent_run_id=result.run.pk)
    assert child.status == Status.FAILED
    assert result.error["stage_id"] == "ship"
    assert result.error["error_type"] == CHILD_FAILED
    assert str(child.pk) in result.error["message"]
    assert "at stage 'pack': no courier for boom" in result.error["message"]


def test_redelivered_outcome_creates_the_child_once() -> None:
    """The key is derived from parent run, stage and generation: a second CreateRun with it
    (a redelivery's) replays the first child instead of making another."""
    kernel = make_kernel(orders)
    result = run_workflow(orders, {"order_id": "A2"}, kernel=kernel)
    child = WorkflowRun.objects.get(parent_run_id=result.run.pk)
    key = child_key(result.run.pk, "ship", 0)
    assert IdempotencyKey.objects.filter(key=key).count() == 1
    again = kernel.dispatch(
        CreateRun(
            workflow_id="shipping",
            input={"order_id": "A2", "items": 1},
            idempotency_key=key,
            parent_run_id=str(result.run.pk),
            parent_stage_id="ship",
            parent_generation=0,
        )
    )
    assert again.replayed and again.workflow_run_id == str(child.pk)
    assert WorkflowRun.objects.filter(parent_run_id=result.run.pk).count() == 1


def _hold(ctx: StageContext[Order]) -> Any:
    if ctx.input.order_id.startswith("hold"):
        return Suspend(state={"batch_id": "hold"}, poll_interval_seconds=3600)
    return {"tracking": "late", "parcels": 0}


def _never(state: dict[str, Any], ctx: Any) -> Any:
    return CompletionCheck.not_ready()


slow = define_async_batch_stage(
    id="slow", execute=_hold, check_completion=_never, input=Order, output=Shipment
)
slow_shipping = define_workflow(id="slow-shipping", input=Order).pipe(slow).build()
wait_ship = child_workflow(
    id="ship", workflow=slow_shipping, input=lambda ctx: ctx.input, stage_input=Order
)
slow_orders = define_workflow(id="slow-orders", input=Order).pipe(wait_ship).build()


def _start(kernel: Any, order_id: str) -> tuple[str, WorkflowRun]:
    run_id = kernel.dispatch(
        CreateRun(workflow_id="slow-orders", input={"order_id": order_id})
    ).workflow_run_id
    drive(kernel, run_id, rounds=3)
    child = WorkflowRun.objects.get(parent_run_id=run_id)
    assert child.status == Status.RUNNING
    return run_id, child


def test_cancelling_the_parent_cancels_its_children() -> None:
    kernel = make_kernel(slow_orders)
    run_id, child = _start(kernel, "hold-1")
    assert kernel.dispatch(CancelRun(run_id, reason="customer left")).cancelled
    child.refresh_from_db()
    assert child.status == Status.CANCELLED
    assert child.output["error"]["message"] == f"parent run {run_id} was cancelled"
    assert WorkflowRun.objects.get(pk=run_id).status == Status.CANCELLED
    assert not WorkflowStage.objects.filter(
        run_id__in=[run_id, child.pk], status__in=[Status.RUNNING, Status.SUSPENDED]
    ).exists()


def test_cancelling_the_child_fails_the_parent_stage_at_once() -> None:
    kernel = make_kernel(slow_orders)
    run_id, child = _start(kernel, "hold-2")
    kernel.dispatch(CancelRun(child.pk, reason="courier strike"))
    stage = WorkflowStage.objects.get(run_id=run_id, stage_id="ship")
    assert stage.next_poll_at <= kernel.clock.now()  # woken, not left for its poll interval
    run = run_to_completion(kernel, run_id, advance_seconds=0, max_rounds=3)
    assert run.status == Status.FAILED
    assert run.error["error_type"] == CHILD_CANCELLED
    assert run.error["message"] == (
        f"child run {child.pk} (workflow 'slow-shipping') was cancelled: courier strike"
    )


def test_rerun_starts_a_new_child_for_the_new_generation() -> None:
    kernel = make_kernel(orders)
    first = run_workflow(orders, {"order_id": "A3"}, kernel=kernel)
    kernel.dispatch(RerunFrom(first.run.pk, "ship"))
    run = run_to_completion(kernel, first.run.pk, advance_seconds=None)
    assert run.status == Status.COMPLETED
    kids = child_runs(run.pk)
    assert [(k["parent_generation"], k["status"]) for k in kids] == [
        (0, Status.COMPLETED),
        (1, Status.COMPLETED),
    ]
    stage = WorkflowStage.objects.get(run=run, stage_id="ship")
    assert stage.generation == 1 and stage.suspended_state["child_run_id"] == kids[1]["id"]


def test_invalid_child_input_fails_the_stage_without_a_child() -> None:
    bad = child_workflow(id="ship", workflow=shipping, input=lambda ctx: {"items": 2})
    flow = define_workflow(id="bad-orders").pipe(bad).build()
    result = run_workflow(flow, {})
    assert result.status == Status.FAILED
    assert result.error["error_type"] == "ChildInputInvalid"
    assert "invalid input for workflow 'shipping'" in result.error["message"]
    assert "order_id" in result.error["message"]
    assert not WorkflowRun.objects.filter(parent_run_id=result.run.pk).exists()


def test_unknown_child_workflow_id_fails_the_stage_naming_it() -> None:
    lost = child_workflow(id="ship", workflow="no-such-flow", input=lambda ctx: {})
    flow = define_workflow(id="lost-orders").pipe(lost).build()
    result = run_workflow(flow, {})
    assert result.status == Status.FAILED
    assert result.error["error_type"] == "ChildRunNotStarted"
    assert "could not start its child run of workflow 'no-such-flow'" in result.error["message"]


def test_build_time_checks() -> None:
    with pytest.raises(WorkflowDefinitionError, match="input must be a function"):
        child_workflow(id="x", workflow=shipping, input=None)  # type: ignore[arg-type]
    with pytest.raises(WorkflowDefinitionError, match="workflow must be a built Workflow"):
        child_workflow(id="x", workflow=3, input=lambda ctx: {})  # type: ignore[arg-type]
    with pytest.raises(WorkflowDefinitionError, match="config names stages nope"):
        child_workflow(id="x", workflow=shipping, input=lambda ctx: {}, config={"nope": {}})
    with pytest.raises(WorkflowDefinitionError, match="poll_interval_seconds"):
        child_workflow(id="x", workflow=shipping, input=lambda ctx: {}, poll_interval_seconds=0)
    selfish = child_workflow(id="again", workflow="loop", input=lambda ctx: {})
    with pytest.raises(WorkflowDefinitionError, match="cycle: loop: again -> loop"):
        define_workflow(id="loop").pipe(selfish).build()
    inner = (
        define_workflow(id="inner")
        .pipe(child_workflow(id="back", workflow="outer", input=lambda ctx: {}))
        .build()
    )
    with pytest.raises(WorkflowDefinitionError, match="outer: go -> inner / back -> outer"):
        define_workflow(id="outer").pipe(
            child_workflow(id="go", workflow=inner, input=lambda ctx: {})
        ).build()


def test_fingerprint_and_structure_change_only_for_child_stages() -> None:
    plain = define_workflow(id="shipping", input=Order).pipe(pack).build()
    assert "child" not in str(plain.fingerprint_material())
    assert plain.version == shipping.version
    assert orders.structure()["groups"][1][0]["child"] == {"workflow_id": "shipping"}
    assert "child" not in orders.structure()["groups"][0][0]
    assert orders.fingerprint_material()["groups"][1][0]["child"] == "shipping"


def test_a_redelivery_after_a_lost_outcome_creates_one_child() -> None:
    """The outcome transaction of the first delivery dies before its commit (the child it
    created rolls back with it); the lease is reaped and the second delivery starts the child:
    one child in all, the parent completes with its output."""
    kernel = make_kernel(orders)
    run_id = kernel.dispatch(CreateRun(workflow_id="orders", input={"order_id": "R1"}))
    run_id = run_id.workflow_run_id
    calls: list[int] = []

    def die_on_the_ship_outcome() -> None:
        calls.append(1)
        if len(calls) == 2:  # validate's outcome first, then ship's
            assert WorkflowRun.objects.filter(parent_run_id=run_id).count() == 1
            raise RuntimeError("worker died before COMMIT")

    faults.inject("outcome.before_commit", die_on_the_ship_outcome)
    try:
        with pytest.raises(RuntimeError, match="worker died"):
            drive(kernel, run_id, rounds=2, advance_seconds=0)
    finally:
        faults.inject("outcome.before_commit", None)
    assert not WorkflowRun.objects.filter(parent_run_id=run_id).exists()  # rolled back
    kernel.clock.advance(3600)
    assert kernel.dispatch(ReapStaleLeases(stale_threshold_seconds=60)).released == 1
    run = run_to_completion(kernel, run_id, advance_seconds=None)
    assert run.status == Status.COMPLETED and run.output == {"tracking": "T-R1", "parcels": 1}
    assert WorkflowRun.objects.filter(parent_run_id=run_id).count() == 1
    ship_job = WorkflowJob.objects.get(workflow_run_id=run_id, stage_id="ship")
    assert ship_job.attempt == 2


def test_a_finishing_child_wakes_its_parent_at_once() -> None:
    """No clock jump to the parent's 30 s poll interval: the child's COMPLETED transition makes
    the parent stage due now, so the next tick completes the parent."""
    kernel = make_kernel(orders)
    run_id = kernel.dispatch(
        CreateRun(workflow_id="orders", input={"order_id": "W1"})
    ).workflow_run_id
    start = kernel.clock.now()
    run = run_to_completion(kernel, run_id, advance_seconds=0, max_rounds=6)
    assert run.status == Status.COMPLETED
    assert kernel.clock.now() == start  # never moved: woken, not polled


def test_a_parent_ended_another_way_has_its_child_cancelled_by_the_next_poll() -> None:
    """A parent that left RUNNING without run.cancel (here: failed behind the engine's back,
    as the stuck-run reaper would) gets its waiting child stage cancelled by the poll, and its
    child run with it."""
    kernel = make_kernel(slow_orders)
    run_id, child = _start(kernel, "hold-3")
    WorkflowRun.objects.filter(pk=run_id).update(status=Status.FAILED)
    kernel.clock.advance(3600)  # past the parent stage's poll interval
    drive(kernel, run_id, rounds=1)
    child.refresh_from_db()
    assert child.status == Status.CANCELLED
    assert child.output["error"]["message"] == f"parent run {run_id} is no longer running"
    stage = WorkflowStage.objects.get(run_id=run_id, stage_id="ship")
    assert stage.status == Status.CANCELLED
