"""The fan-out benchmark's workloads (``bench/fanout.py``), loaded by the subprocesses.

* ``bench-fanout``: one map stage over ``range(count)`` with a trivial body
  (``max_concurrency`` 50), then a fan-in that sums the outputs.
* the django-q2 peer: ``count`` trivial tasks of one group (``async_task(..., group=...)``),
  each inserting one marker row so the driver can count finished tasks (the map's items write
  their output row too).
"""

from __future__ import annotations

import json
import time
from typing import Any

from pydantic import BaseModel

from django_workflows import StageContext, define_workflow, map_results, register, stage

MARKER_PREFIX = "bench-fan/"


class FanCount(BaseModel):
    count: int = 100


class FanN(BaseModel):
    n: int


@stage(id="item")
def fan_item(ctx: StageContext[FanN]) -> FanN:
    return FanN(n=ctx.input.n)


FanItems = map_results(fan_item)


@stage(id="sum")
def fan_sum(ctx: StageContext[FanItems]) -> FanN:
    return FanN(n=sum(i.n for i in ctx.input.succeeded()))


def _items(ctx: Any) -> list[dict[str, int]]:
    return [{"n": n} for n in range(ctx.input.count)]


BENCH_FANOUT = register(
    define_workflow(id="bench-fanout", name="Benchmark fan-out", input=FanCount)
    .map(fan_item, over=_items, max_concurrency=50)
    .pipe(fan_sum)
    .build()
)


def fan_task(group: str, n: int) -> None:
    """One django-q2 peer task: insert its marker row."""
    from django.utils import timezone

    from django_workflows.models import WorkflowBlob

    WorkflowBlob.objects.create(
        key=f"{MARKER_PREFIX}{group}/{n}", created_at=timezone.now(), data=n
    )


def _wait(predicate: Any, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return False


def fanout_and_wait(count: int, timeout: float = 900) -> None:
    """One ``bench-fanout`` run of ``count`` items; prints wall times and the outcome."""
    from django_workflows import start_run
    from django_workflows.models import WorkflowRun

    t_start = time.time()
    run_id = start_run("bench-fanout", {"count": count})
    done = _wait(
        lambda: WorkflowRun.objects.filter(pk=run_id, status__in=("COMPLETED", "FAILED")).exists(),
        timeout,
    )
    run = WorkflowRun.objects.get(pk=run_id)
    print(
        json.dumps(
            {
                "t_start": t_start,
                "t_done": time.time(),
                "timed_out": not done,
                "status": run.status,
                "ok": run.output == {"n": count * (count - 1) // 2},
            }
        )
    )


def group_and_wait(count: int, timeout: float = 900) -> None:
    """``count`` django-q2 tasks of one group, enqueued from here; waits for their markers."""
    import uuid

    from django_q.tasks import async_task

    from django_workflows.models import WorkflowBlob

    group = uuid.uuid4().hex[:8]
    t_start = time.time()
    for n in range(count):
        async_task("bench.benchapp.fanout.fan_task", group, n, group=group)
    t_enqueued = time.time()
    prefix = f"{MARKER_PREFIX}{group}/"
    done = _wait(
        lambda: WorkflowBlob.objects.filter(key__startswith=prefix).count() >= count, timeout
    )
    print(
        json.dumps(
            {
                "t_start": t_start,
                "t_enqueued": t_enqueued,
                "t_done": time.time(),
                "timed_out": not done,
            }
        )
    )
