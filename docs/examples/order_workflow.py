"""The order workflow of issue 11, in the new style (docs/authoring.md): validate the order,
then reserve stock and price shipping in parallel, then confirm with a decision annotation.
A duplicate SKU is a final business error (StageFailed): the run fails at once, no retry."""

from pydantic import BaseModel

from django_workflows import StageContext, StageFailed, define_workflow, parallel_input, stage
from django_workflows.conventions import Decision


class Order(BaseModel):
    order_id: str
    skus: list[str]
    country: str = "DE"


class Reservation(BaseModel):
    reserved: list[str]


class Shipping(BaseModel):
    cents: int


class Confirmation(BaseModel):
    order_id: str
    total_cents: int


@stage(id="validate")
def validate(ctx: StageContext[Order]) -> Order:
    dupes = sorted({sku for sku in ctx.input.skus if ctx.input.skus.count(sku) > 1})
    if dupes:
        raise StageFailed(f"Duplicate SKU {', '.join(dupes)}", error_type="DuplicateSku")
    return ctx.input


@stage(id="reserve-stock", retry=5)
def reserve_stock(ctx: StageContext[Order]) -> Reservation:
    return Reservation(reserved=ctx.input.skus)


@stage(id="price-shipping")
def price_shipping(ctx: StageContext[Order]) -> Shipping:
    return Shipping(cents=499 if ctx.input.country == "DE" else 1499)


Checked = parallel_input(reserve_stock, price_shipping)


@stage(id="confirm")
def confirm(ctx: StageContext[Checked]) -> Confirmation:
    order: Order = ctx.require("validate")
    ctx.annotate(Decision.outcome, "confirmed")
    items = 1000 * len(ctx.input.reserve_stock.reserved)
    return Confirmation(order_id=order.order_id, total_cents=items + ctx.input.price_shipping.cents)


order_workflow = (
    define_workflow(id="order", input=Order)
    .pipe(validate)
    .parallel([reserve_stock, price_shipping])
    .pipe(confirm)
    .build()
)
