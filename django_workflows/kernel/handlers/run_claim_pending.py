"""``run.claimPending`` (SPEC §4.2, K-CP-1..6; Part I item 2).

Claims up to ``max_claims`` PENDING runs (``SKIP LOCKED`` on PostgreSQL), each moved to RUNNING.
Each claimed run is prepared inside its own savepoint: a failure rolls back only that run's
preparation, and the run is failed with ``CLAIM_FAILED`` (EC-26). Missing workflows fail the run
with ``WORKFLOW_NOT_FOUND`` (K-CP-2); group-1 records are upserted and jobs enqueued for those
that are PENDING (K-CP-4).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from django.db import transaction

from ...models import Status, WorkflowJob, WorkflowRun, WorkflowStage
from .. import events as ev
from ..commands import ClaimedRun, ClaimPendingRuns, ClaimPendingRunsResult
from ..limits import claim_next_allowed_run
from ..locking import claim_next_pending_run
from ..store import create_missing_stages, run_error, update_run, write_log
from .base import HandlerOutput, enqueue_stage_jobs

if TYPE_CHECKING:
    from ..dispatch import Kernel


@dataclass
class StartedRun:
    """A run :func:`start_claimed_run` moved to RUNNING: its public result, the jobs it
    enqueued (the first one leased when a worker was named) and its group-1 stage records.
    """

    claimed: ClaimedRun
    jobs: list[WorkflowJob]
    records: list[WorkflowStage]


#: ``run.error["error_type"]`` of a run failed when it was claimed, by ``output.error`` code.
_ERROR_TYPES = {"WORKFLOW_NOT_FOUND": "WorkflowNotFound", "CLAIM_FAILED": "ClaimFailed"}


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
        error=run_error(None, message, _ERROR_TYPES.get(code, code)),
    )
    write_log(now, "ERROR", message, run_id=run.pk, metadata={"worker_id": worker_id, "code": code})
    events.append(ev.event(ev.WORKFLOW_FAILED, run.pk, now, error=message))


def handle(kernel: Kernel, cmd: ClaimPendingRuns) -> HandlerOutput:
    claimed: list[ClaimedRun] = []
    events: list[dict[str, Any]] = []
    versions = kernel.registry.runnable_versions()  # issue 12 item 3
    for _ in range(max(0, cmd.max_claims)):
        run = claim_next_allowed_run(
            kernel.registry, versions, kernel.transport, claim=claim_next_pending_run
        )
        if run is None:
            break
        started = start_claimed_run(kernel, run, cmd.worker_id, events)
        if started is not None:
            claimed.append(started.claimed)
    return HandlerOutput(ClaimPendingRunsResult(claimed), events)


def start_claimed_run(
    kernel: Kernel,
    run: WorkflowRun,
    worker_id: str,
    events: list[dict[str, Any]],
    *,
    reserve_for: str | None = None,
    serves: frozenset[str] | None = None,
) -> StartedRun | None:
    """Move a claimed (locked, PENDING) run to RUNNING and enqueue its first group (K-CP-2..6);
    its events are appended to ``events``. ``reserve_for`` leases the first job to that worker
    if it serves the job's queue (``serves``: its queues, ``None`` any; see
    :func:`.base.enqueue_stage_jobs`): then ``jobs[0]`` is RUNNING, leased to it.

    Returns what was started, or ``None`` when the run was failed instead (workflow missing,
    or preparing its first group raised: Part I item 2).
    """
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
            worker_id,
            events,
        )
        return None
    try:
        with transaction.atomic():  # savepoint: Part I item 2
            records = create_missing_stages(run, workflow.stages_in_group(1), generation=0, now=now)
            jobs = enqueue_stage_jobs(
                kernel.queue,
                run,
                records,
                workflow=workflow,
                reserve_for=reserve_for,
                serves=serves,
            )
    except Exception as exc:
        _fail(kernel, run, "CLAIM_FAILED", f"{type(exc).__name__}: {exc}", worker_id, events)
        return None
    events.append(ev.event(ev.WORKFLOW_STARTED, run.pk, now))
    return StartedRun(ClaimedRun(str(run.pk), run.workflow_id, [j.pk for j in jobs]), jobs, records)
