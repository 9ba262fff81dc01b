import pytest
from pydantic import BaseModel

from django_workflows import StageContext, define_workflow, stage


class Order(BaseModel):
    qty: int


@stage(id="total", input=Order)
def total(ctx: StageContext[Order, None]) -> dict:
    return {"total": ctx.input.qty * 3}


@pytest.mark.django_db
def test_order_total(run_workflow):
    result = run_workflow(define_workflow(id="order", input=Order).pipe(total).build(), {"qty": 2})
    assert result.status == "COMPLETED" and result.output == {"total": 6}
