"""``fanout-pipeline`` for the fan-out crash test (issue 18 item 3): split -> map(square) over
``range(count)`` (``max_concurrency`` 4) -> total. Every item body records its execution
(``executions.jsonl``, stage id ``square.<index>``) and sleeps ``CRASH_STAGE_SECONDS``.
"""

from __future__ import annotations

import os
import time
from typing import Any

from pydantic import BaseModel

from django_workflows import StageContext, define_workflow, map_results, register, stage

from .faults import record_execution


class FanInput(BaseModel):
    count: int = 20


class FanItem(BaseModel):
    n: int


class FanSquare(BaseModel):
    n: int
    sq: int


@stage(id="square")
def fan_square(ctx: StageContext[FanItem]) -> FanSquare:
    record_execution(ctx.workflow_run_id, f"square.{ctx.input.n}")
    time.sleep(float(os.environ.get("CRASH_STAGE_SECONDS", "0")))
    return FanSquare(n=ctx.input.n, sq=ctx.input.n * ctx.input.n)


FanSquares = map_results(fan_square)


class FanTotal(BaseModel):
    order: list[int]
    total: int


@stage(id="total")
def fan_total(ctx: StageContext[FanSquares]) -> FanTotal:
    items = ctx.input.succeeded()
    return FanTotal(order=[i.n for i in items], total=sum(i.sq for i in items))


def _items(ctx: Any) -> list[dict[str, int]]:
    return [{"n": n} for n in range(ctx.input.count)]


fanout_pipeline = register(
    define_workflow(id="fanout-pipeline", name="Fan-out crash test", input=FanInput)
    .map(fan_square, over=_items, max_concurrency=4)
    .pipe(fan_total)
    .build()
)
