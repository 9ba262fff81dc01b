"""The order workflow of issue 18: reserve every line's stock (one job per line), charge with
retries, ask a human only for orders over 1000, then ship and poll the carrier."""

from pydantic import BaseModel

from django_workflows import (
    CompletionCheck,
    StageContext,
    Suspend,
    approval_stage,
    define_async_batch_stage,
    define_workflow,
    map_results,
    stage,
)


class Line(BaseModel):
    sku: str
    price: int


class Order(BaseModel):
    order_id: str
    lines: list[Line]


class Charged(BaseModel):
    total: int


class Shipped(BaseModel):
    tracking: str


@stage(id="reserve")
def reserve(ctx: StageContext[Line]) -> Line:
    return ctx.input  # a call to the warehouse per line, each with its own retries


@stage(id="charge", retry=5)
def charge(ctx: StageContext[map_results(reserve)]) -> Charged:
    return Charged(total=sum(line.price for line in ctx.input.succeeded()))


def hand_over(ctx: StageContext) -> Suspend:
    return Suspend({"batch_id": f"parcel-{ctx.require('charge').total}"}, poll_interval_seconds=600)


def delivered(state: dict, ctx: object) -> CompletionCheck[Shipped]:
    return CompletionCheck.done(Shipped(tracking=state["batch_id"]))


order_workflow = (
    define_workflow(id="order", input=Order)
    .map(reserve, over=lambda c: [line.model_dump() for line in c.input.lines])
    .pipe(charge)
    .pipe(approval_stage(id="approval"), when=lambda c: c.output("charge").total > 1000)
    .pipe(define_async_batch_stage(id="ship", execute=hand_over, check_completion=delivered))
    .build()
)
