"""The shared-limits acceptance test's workflows (issue 18 item 6).

Every stage body sleeps ``LIMITS_STAGE_SECONDS`` (default 0.4) and then appends one line to
``{CRASH_DIR}/executions.jsonl`` (:func:`.faults.record_execution`) with its ``start`` and its
end (``at``), the run's concurrency key and the workflow, so the test can check that the
recorded intervals never overlap beyond the limits.

* ``limits-per-key``: one stage ``bill``; ``concurrency_key`` = ``customer``,
  ``max_running_per_key=1``.
* ``limits-per-workflow``: ``[s1 | s2 | s3]`` in parallel, ``max_running_stages=2``.
* ``limits-free``: one stage ``free``, no limit (must not be starved by held work).
"""

from __future__ import annotations

import os
import time
from typing import Any

from pydantic import BaseModel

from django_workflows import StageContext, define_workflow, register, stage

from .faults import record_execution


class Customer(BaseModel):
    customer: str = ""
    n: int = 0


def _work(ctx: StageContext[Any, Any], stage_id: str, workflow: str) -> dict[str, Any]:
    start = time.time()
    time.sleep(float(os.environ.get("LIMITS_STAGE_SECONDS", "0.4")))
    record_execution(
        ctx.workflow_run_id,
        stage_id,
        start=start,
        workflow=workflow,
        key=getattr(ctx.input, "customer", None),
    )
    return {"done": stage_id}


@stage(id="bill", input=Customer)
def bill(ctx: StageContext[Customer, Any]) -> dict[str, Any]:
    return _work(ctx, "bill", "limits-per-key")


def _parallel(stage_id: str) -> Any:
    @stage(id=stage_id, input=Customer)
    def body(ctx: StageContext[Customer, Any]) -> dict[str, Any]:
        return _work(ctx, stage_id, "limits-per-workflow")

    return body


@stage(id="free", input=Customer)
def free(ctx: StageContext[Customer, Any]) -> dict[str, Any]:
    return _work(ctx, "free", "limits-free")


per_key = register(
    define_workflow(
        id="limits-per-key",
        input=Customer,
        concurrency_key=lambda i: i.customer,
        max_running_per_key=1,
    )
    .pipe(bill)
    .build()
)
per_workflow = register(
    define_workflow(id="limits-per-workflow", input=Customer, max_running_stages=2)
    .parallel([_parallel("s1"), _parallel("s2"), _parallel("s3")])
    .build()
)
unlimited = register(define_workflow(id="limits-free", input=Customer).pipe(free).build())
