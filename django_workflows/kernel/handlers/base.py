"""What transactional handlers return to the dispatcher."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ...models import Status, WorkflowJob, WorkflowRun, WorkflowStage
from ..commands import Result
from ..queue import JobQueue, JobSpec


@dataclass
class HandlerOutput:
    """A handler's public result and the events to append in its transaction (K-5, K-6)."""

    result: Result
    events: list[dict[str, Any]] = field(default_factory=list)


def enqueue_stage_jobs(
    queue: JobQueue,
    run: WorkflowRun,
    records: list[WorkflowStage],
    *,
    reserve_for: str | None = None,
) -> list[WorkflowJob]:
    """Enqueue one job per PENDING record (K-CP-4, K-TR-6): priority = run priority, payload =
    ``{"config": run.config}`` (WF-45). ``reserve_for``: lease the first job to that worker
    (:meth:`JobQueue.enqueue_jobs`). Returns the inserted jobs.
    """
    return queue.enqueue_jobs(
        reserve_for=reserve_for,
        specs=[
            JobSpec(
                workflow_run_id=run.pk,
                workflow_id=run.workflow_id,
                stage_id=rec.stage_id,
                priority=run.priority,
                payload={"config": run.config or {}},
                run_created_at=run.created_at,
            )
            for rec in records
            if rec.status == Status.PENDING
        ],
    )
