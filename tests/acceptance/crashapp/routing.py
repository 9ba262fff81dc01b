"""The routing test's workflow (issue 8 item 5, scenario (h)).

* ``routed-pipeline``: ``prep`` (default queue) -> ``embed`` (queue ``gpu``) -> ``report``
  (default queue). Every execution appends ``{"pid", "pgid", "at", "run", "stage", "cluster"}`` to
  ``{CRASH_DIR}/executions.jsonl`` (``cluster``: the executing process's django-q2 cluster), so
  the test can tell which cluster ran each stage and how often.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field

from django_workflows import StageContext, define_workflow, register, stage

from .faults import record_execution


def record(run_id: str, stage_id: str) -> str:
    """Record this execution with the process's django-q2 cluster name; returns the name."""
    from django_q.conf import Conf

    cluster = str(Conf.CLUSTER_NAME)
    record_execution(run_id, stage_id, cluster=cluster)
    return cluster


class RoutedInput(BaseModel):
    n: int = 0


class Hops(BaseModel):
    n: int
    clusters: list[str] = Field(default_factory=list)


@stage(id="prep", input=RoutedInput, output=Hops)
def prep(ctx: StageContext[RoutedInput, Any]) -> Hops:
    return Hops(n=ctx.input.n, clusters=[record(ctx.workflow_run_id, "prep")])


@stage(id="embed", input=Hops, output=Hops, queue="gpu")
def embed(ctx: StageContext[Hops, Any]) -> Hops:
    return Hops(n=ctx.input.n, clusters=[*ctx.input.clusters, record(ctx.workflow_run_id, "embed")])


@stage(id="report", input=Hops, output=Hops)
def report(ctx: StageContext[Hops, Any]) -> Hops:
    return Hops(
        n=ctx.input.n, clusters=[*ctx.input.clusters, record(ctx.workflow_run_id, "report")]
    )


routed_pipeline = register(
    define_workflow(
        id="routed-pipeline", name="Routing: prep -> embed (gpu) -> report", input=RoutedInput
    )
    .pipe(prep)
    .pipe(embed)
    .pipe(report)
    .build()
)
