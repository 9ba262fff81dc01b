"""The benchmark's workflows.

* ``bench-4``: ``a -> parallel(b, c) -> d`` with trivial stage bodies (4 stages per run).
* ``bench-suspend``: one async-batch stage that suspends with a 1 s poll interval and is ready
  at its first check; the check records the wall time it ran at (for the due->resumed latency).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from django_workflows import (
    CompletionCheck,
    StageContext,
    Suspend,
    define_async_batch_stage,
    define_workflow,
    register,
    stage,
)


class Seed(BaseModel):
    n: int = 0


class Joined(BaseModel):
    b: Seed
    c: Seed


@stage(id="a", input=Seed, output=Seed)
def stage_a(ctx: StageContext[Seed, Any]) -> Seed:
    return Seed(n=ctx.input.n + 1)


@stage(id="b", input=Seed, output=Seed)
def stage_b(ctx: StageContext[Seed, Any]) -> Seed:
    return Seed(n=ctx.input.n + 1)


@stage(id="c", input=Seed, output=Seed)
def stage_c(ctx: StageContext[Seed, Any]) -> Seed:
    return Seed(n=ctx.input.n + 2)


@stage(id="d", input=Joined, output=Seed)
def stage_d(ctx: StageContext[Joined, Any]) -> Seed:
    return Seed(n=ctx.input.b.n + ctx.input.c.n)


BENCH_4 = register(
    define_workflow(id="bench-4", name="Benchmark a -> [b | c] -> d", input=Seed)
    .pipe(stage_a)
    .parallel([stage_b, stage_c])
    .pipe(stage_d)
    .build()
)


def bench_dir() -> Path | None:
    """Where the benchmark subprocesses write their records (``BENCH_DIR``), if set."""
    value = os.environ.get("BENCH_DIR")
    return Path(value) if value else None


def append_record(name: str, record: dict[str, Any]) -> None:
    """Append one JSON line to ``{BENCH_DIR}/{name}`` (one O_APPEND write: no interleaving)."""
    directory = bench_dir()
    if directory is None:
        return
    fd = os.open(directory / name, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    try:
        os.write(fd, (json.dumps(record) + "\n").encode())
    finally:
        os.close(fd)


def _submit(ctx: StageContext[Seed, Any]) -> Suspend:
    return Suspend(
        state={"batch_id": f"bench-{ctx.workflow_run_id}", "n": ctx.input.n},
        poll_interval_seconds=1,
        max_wait_seconds=300,
    )


def _check(state: dict[str, Any], ctx: Any) -> CompletionCheck:
    append_record(
        "suspend-checks.jsonl", {"run": str(ctx.workflow_run_id), "checked_at": time.time()}
    )
    return CompletionCheck.done({"n": state["n"]})


suspend_stage = define_async_batch_stage(
    id="wait", input=Seed, output=Seed, execute=_submit, check_completion=_check
)

BENCH_SUSPEND = register(
    define_workflow(id="bench-suspend", name="Benchmark suspend/resume", input=Seed)
    .pipe(suspend_stage)
    .build()
)
from . import fanout  # noqa: E402, F401  (bench/fanout.py's workloads)
