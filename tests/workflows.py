"""Small workflows used across the tests (built per test module, never registered globally)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from django_workflows import (
    CompletionCheck,
    StageContext,
    Suspend,
    define_async_batch_stage,
    define_stage,
    define_workflow,
)


class Num(BaseModel):
    value: int


def add(n: int, stage_id: str | None = None) -> Any:
    def execute(ctx: StageContext[Num, Any]) -> Num:
        return Num(value=ctx.input.value + n)

    return define_stage(id=stage_id or f"add-{n}", input=Num, output=Num, execute=execute)


def two_stage(workflow_id: str = "two-stage") -> Any:
    return define_workflow(id=workflow_id, input=Num).pipe(add(1)).pipe(add(10)).build()


def async_stage(stage_id: str = "batch", *, ready_after: int = 1, result: int = 99) -> Any:
    calls = {"n": 0}

    def execute(ctx: StageContext[Any, Any]) -> Suspend:
        return Suspend(state={"batch_id": "b-1"}, poll_interval_seconds=5)

    def check(state: dict[str, Any], ctx: Any) -> CompletionCheck:
        calls["n"] += 1
        if calls["n"] >= ready_after:
            return CompletionCheck.done({"value": result})
        return CompletionCheck.not_ready()

    st = define_async_batch_stage(id=stage_id, execute=execute, check_completion=check, output=Num)
    st.calls = calls  # type: ignore[attr-defined]
    return st
