"""The definition-versions test's workflow (issue 12 item 3), in two variants selected by the
``VERSIONED_VARIANT`` environment variable, as two deploys of the same code base would be.

* ``v1`` (default): ``a`` -> ``gate`` (async batch: ready once ``{CRASH_DIR}/release`` exists)
  -> ``b`` (output :class:`Path`) -> ``c``.
* ``v2``: ``a`` -> ``gate`` -> ``b`` re-typed (output :class:`Counted`, a new required field)
  -> ``d`` added; ``c`` removed.

Both use the fingerprint as their version (no ``version=``). Every stage body appends
``{"run", "stage", "variant", "pid"}`` to ``{CRASH_DIR}/executions.jsonl``.
"""

from __future__ import annotations

import os
from typing import Any

from pydantic import BaseModel, Field

from django_workflows import (
    CompletionCheck,
    StageContext,
    Suspend,
    define_async_batch_stage,
    define_workflow,
    register,
    stage,
)

from .faults import record_execution
from .workflows import crash_dir

VARIANT = os.environ.get("VERSIONED_VARIANT", "v1")


class VersionedInput(BaseModel):
    n: int = 0


class Path(BaseModel):
    n: int
    path: list[str] = Field(default_factory=list)


class Counted(BaseModel):
    n: int
    path: list[str]
    count: int


def _step(ctx: StageContext[Any, Any], name: str) -> Path:
    record_execution(ctx.workflow_run_id, name, variant=VARIANT)
    previous = ctx.input
    return Path(n=previous.n, path=[*getattr(previous, "path", []), f"{name}:{VARIANT}"])


@stage(id="a", input=VersionedInput, output=Path)
def a(ctx: StageContext[VersionedInput, Any]) -> Path:
    return _step(ctx, "a")


def gate_submit(ctx: StageContext[Path, Any]) -> Suspend:
    record_execution(ctx.workflow_run_id, "gate", variant=VARIANT)
    return Suspend(
        state={"batch_id": f"gate-{ctx.workflow_run_id}", "n": ctx.input.n, "path": ctx.input.path},
        poll_interval_seconds=0.2,
        max_wait_seconds=600,
    )


def gate_check(state: dict[str, Any], ctx: Any) -> CompletionCheck:
    if not (crash_dir() / "release").exists():
        return CompletionCheck.not_ready(0.2)
    record_execution(ctx.workflow_run_id, "gate-check", variant=VARIANT)
    return CompletionCheck.done({"n": state["n"], "path": [*state["path"], f"gate:{VARIANT}"]})


gate = define_async_batch_stage(
    id="gate", input=Path, output=Path, execute=gate_submit, check_completion=gate_check
)


@stage(id="c", input=Path, output=Path)
def c(ctx: StageContext[Path, Any]) -> Path:
    return _step(ctx, "c")


if VARIANT == "v2":

    @stage(id="b", input=Path, output=Counted)
    def b2(ctx: StageContext[Path, Any]) -> Counted:
        step = _step(ctx, "b")
        return Counted(n=step.n, path=step.path, count=len(step.path))

    @stage(id="d", input=Counted, output=Counted)
    def d(ctx: StageContext[Counted, Any]) -> Counted:
        step = _step(ctx, "d")
        return Counted(n=step.n, path=step.path, count=len(step.path))

    versioned = define_workflow(id="versioned-pipeline", input=VersionedInput).pipe(a).pipe(gate)
    versioned.pipe(b2).pipe(d)
else:

    @stage(id="b", input=Path, output=Path)
    def b1(ctx: StageContext[Path, Any]) -> Path:
        return _step(ctx, "b")

    versioned = define_workflow(id="versioned-pipeline", input=VersionedInput).pipe(a).pipe(gate)
    versioned.pipe(b1).pipe(c)

versioned_pipeline = register(versioned.build())
