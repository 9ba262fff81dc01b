"""``run.claimPending`` (SPEC §4.2, K-CP-1..6; Part I item 2).

Claims up to ``max_claims`` PENDING runs (``SKIP LOCKED`` on PostgreSQL), each moved to RUNNING.
Each claimed run is prepared inside its own savepoint: a failure rolls back only that run's
preparation, and the run is failed with ``CLAIM_FAILED`` (EC-26). Missing workflows fail the run
with ``WORKFLOW_NOT_FOUND`` (K-CP-2); group-1 records are upserted and jobs enqueued for those
that are PENDING (K-CP-4).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from django.db import transaction

from ...models import Status, WorkflowRun
from .. import events as ev
from ..commands import ClaimedRun, ClaimPendingRuns, ClaimPendingRunsResult
from ..locking import claim_next_pending_run
from ..store import create_missing_stages, update_run, write_log
from .base import HandlerOutput, enqueue_stage_jobs

if TYPE_CHECKING:
    from ..dispatch import Kernel


def _fail(
    kernel: Kernel,
    run: WorkflowRun,
    code: str,
    message: str,
    worker_id: str,
    events: list[dict[str, Any]],
) -> None:
    now = kernel.clock.now()
    update_run(
        run.pk,
        now,
        status=Status.FAILED,
        completed_at=now,
        output={"error": {"code": code, "message": message, "worker_id": worker_id}},
    )
    write_log(now, "ERROR", message, run_id=run.pk, metadata={"worker_id": worker_id, "code": code})
    events.append(ev.event(ev.WORKFLOW_FAILED, run.pk, now, error=message))


def handle(kernel: Kernel, cmd: ClaimPendingRuns) -> HandlerOutput:
    claimed: list[ClaimedRun] = []
    events: list[dict[str, Any]] = []
    for _ in range(max(0, cmd.max_claims)):
        run = claim_next_pending_run()
        if run is None:
            break
        now = kernel.clock.now()
        update_run(run.pk, now, status=Status.RUNNING, started_at=now)
        run.status, run.started_at = Status.RUNNING, now
        workflow = kernel.registry.get(run.workflow_id)
        if workflow is None:
            _fail(
                kernel,
                run,
                "WORKFLOW_NOT_FOUND",
                f"Workflow {run.workflow_id!r} not found in registry",
                cmd.worker_id,
                events,
            )
            continue
        try:
            with transaction.atomic():  # savepoint: Part I item 2
                records = create_missing_stages(
                    run, workflow.stages_in_group(1), attempt=0, now=now
                )
                job_ids = enqueue_stage_jobs(kernel.queue, run, records)
        except Exception as exc:
            _fail(
                kernel, run, "CLAIM_FAILED", f"{type(exc).__name__}: {exc}", cmd.worker_id, events
            )
            continue
        events.append(ev.event(ev.WORKFLOW_STARTED, run.pk, now))
        claimed.append(ClaimedRun(str(run.pk), run.workflow_id, job_ids))
    return HandlerOutput(ClaimPendingRunsResult(claimed), events)
