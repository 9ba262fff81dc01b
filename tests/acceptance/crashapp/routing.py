"""A workflow with a stage routed to the ``gpu`` worker pool, for the multi-host routing
scenario (tests/hosts, issue 8 item 5): ``prep -> render (queue="gpu") -> publish``.

Defined only where ``@stage`` accepts ``queue=`` (:data:`ROUTING_SUPPORTED`); every stage
records its executions like the fault workflows (``executions.jsonl``, with the process group
that tells which host ran it).
"""

from __future__ import annotations

import inspect
from typing import Any

from pydantic import BaseModel, Field

from django_workflows import StageContext, define_workflow, register, stage

from .faults import record_execution

#: Whether this version of the engine routes stages to named pools (``@stage(queue=...)``).
ROUTING_SUPPORTED = "queue" in inspect.signature(stage).parameters


class RouteInput(BaseModel):
    n: int = 0


class Hops(BaseModel):
    n: int
    hops: list[str] = Field(default_factory=list)


if ROUTING_SUPPORTED:

    @stage(id="prep", input=RouteInput, output=Hops)
    def route_prep(ctx: StageContext[RouteInput, Any]) -> Hops:
        record_execution(ctx.workflow_run_id, "prep")
        return Hops(n=ctx.input.n, hops=["prep"])

    @stage(id="render", input=Hops, output=Hops, queue="gpu")  # type: ignore[call-arg]
    def route_render(ctx: StageContext[Hops, Any]) -> Hops:
        record_execution(ctx.workflow_run_id, "render")
        return Hops(n=ctx.input.n, hops=[*ctx.input.hops, "render"])

    @stage(id="publish", input=Hops, output=Hops)
    def route_publish(ctx: StageContext[Hops, Any]) -> Hops:
        record_execution(ctx.workflow_run_id, "publish")
        return Hops(n=ctx.input.n, hops=[*ctx.input.hops, "publish"])

    routed_pipeline = register(
        define_workflow(id="routed-pipeline", name="Routing: gpu stage", input=RouteInput)
        .pipe(route_prep)
        .pipe(route_render)
        .pipe(route_publish)
        .build()
    )
