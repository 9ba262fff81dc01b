"""What transactional handlers return to the dispatcher."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ...models import Status, WorkflowRun, WorkflowStage
from ..commands import Result
from ..queue import JobQueue, JobSpec


@dataclass
class HandlerOutput:
    """A handler's public result and the events to append in its transaction (K-5, K-6)."""

    result: Result
    events: list[dict[str, Any]] = field(default_factory=list)


def enqueue_stage_jobs(
    queue: JobQueue, run: WorkflowRun, records: list[WorkflowStage]
) -> list[int]:
    """Enqueue one job per PENDING record (K-CP-4, K-TR-6): priority = run priority, payload =
    ``{"config": run.config}`` (WF-45).
    """
    return queue.enqueue(
        [
            JobSpec(
                workflow_run_id=run.pk,
                workflow_id=run.workflow_id,
                stage_id=rec.stage_id,
                priority=run.priority,
                payload={"config": run.config or {}},
            )
            for rec in records
            if rec.status == Status.PENDING
        ]
    )
