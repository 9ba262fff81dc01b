"""``run.claimPending`` (SPEC §4.2, K-CP-1..6; Part I item 2).

Claims up to ``max_claims`` PENDING runs (``SKIP LOCKED`` on PostgreSQL), each moved to RUNNING.
Each claimed run is prepared inside its own savepoint (:func:`..savepoints.rollback_point`, ended
by the commit): a failure rolls back only that run's preparation, and the run is failed with
``CLAIM_FAILED`` (EC-26). Missing workflows fail the run with ``WORKFLOW_NOT_FOUND`` (K-CP-2);
group-1 records are upserted and jobs enqueued for those that are PENDING (K-CP-4).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

from ...models import Status, WorkflowJob, WorkflowRun, WorkflowStage
from .. import events as ev
from ..children import wake_parent
from ..commands import ClaimedRun, ClaimPendingRuns, ClaimPendingRunsResult
from ..limits import claim_next_allowed_run
from ..locking import claim_next_pending_run
from ..savepoints import rollback_point
from ..stage_path.conditions import open_groups
from ..stage_path.transition import advance_new_group
from ..store import create_missing_stages, run_error, update_run, write_log
from .base import HandlerOutput, open_stages

if TYPE_CHECKING:
    from datetime import datetime

    from ...definition.workflow import Workflow
    from ..dispatch import Kernel


@dataclass
class StartedRun:
    """A run :func:`start_claimed_run` moved to RUNNING: its public result, the jobs it
    enqueued (the first one leased when a worker was named) and its group-1 stage records.
    """

    claimed: ClaimedRun
    jobs: list[WorkflowJob]
    records: list[WorkflowStage]
    #: The leased job's record, inserted RUNNING (:func:`.base.open_stages`): pass it to
    #: :func:`..stage_path.lease.begin` as ``started``. ``None``: begin starts the record.
    started: WorkflowStage | None = None


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
    if run.parent_run_id is not None:  # a child run: its parent's stage reads it now
        wake_parent(kernel, run, now)
    events.append(ev.event(ev.WORKFLOW_FAILED, run.pk, now, error=message))


def handle(kernel: Kernel, cmd: ClaimPendingRuns) -> HandlerOutput:
    claimed: list[ClaimedRun] = []
    events: list[dict[str, Any]] = []
    versions = kernel.registry.runnable_versions()  # issue 12 item 3
    for _ in range(max(0, cmd.max_claims)):
        now = kernel.clock.now()
        run = claim_next_allowed_run(
            kernel.registry, versions, kernel.transport, claim=claim_next_pending_run, start_at=now
        )
        if run is None:
            break
        started = start_claimed_run(kernel, run, cmd.worker_id, events, now=now)
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
    now: datetime | None = None,
) -> StartedRun | None:
    """Move a claimed (locked, PENDING) run to RUNNING and enqueue its first group (K-CP-2..6);
    its events are appended to ``events``. A run the claim statement made RUNNING already
    (:func:`..locking.claim_next_pending_run` with ``start_at``, issue 19) is not written
    again; ``now`` is then that ``start_at`` (else the kernel's clock is read).
    ``reserve_for`` leases the first job to that worker if it serves the job's queue
    (``serves``: its queues, ``None`` any; see :func:`.base.enqueue_stage_jobs`): then
    ``jobs[0]`` is RUNNING, leased to it.

    Returns what was started, or ``None`` when the run was failed instead (workflow missing,
    or preparing its first group raised: Part I item 2), or - a workflow with conditions -
    completed or failed at once (every stage skipped, a condition raised; issue 18).
    """
    if now is None:
        now = kernel.clock.now()
    if run.status != Status.RUNNING:
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
    if workflow.has_conditions:
        return _start_conditional(
            kernel, workflow, run, worker_id, events, now, reserve_for, serves
        )
    started_record: WorkflowStage | None = None
    try:
        with rollback_point():  # Part I item 2; released by the commit (issue 19)
            if not workflow.has_maps:
                opened = open_stages(
                    kernel.queue, run, workflow.stages_in_group(1), workflow=workflow,
                    generation=0, now=now, reserve_for=reserve_for, serves=serves,
                )  # fmt: skip
                records, jobs, started_record = opened.records, opened.jobs, opened.started
            else:  # issue 18 item 3: fan out a map stage (or settle it)
                records = create_missing_stages(
                    run, workflow.stages_in_group(1), generation=0, now=now
                )
                started = [ev.event(ev.WORKFLOW_STARTED, run.pk, now)]
                step = advance_new_group(
                    kernel, workflow, run, [], records, now, 1, started, reserve_for, serves
                )
                events += step.events
                jobs = [step.reserved_job] if step.reserved_job is not None else []
                return StartedRun(
                    ClaimedRun(str(run.pk), run.workflow_id, [j.pk for j in jobs]), jobs, records
                )
    except Exception as exc:
        _fail(kernel, run, "CLAIM_FAILED", f"{type(exc).__name__}: {exc}", worker_id, events)
        return None
    events.append(ev.event(ev.WORKFLOW_STARTED, run.pk, now))
    return StartedRun(
        ClaimedRun(str(run.pk), run.workflow_id, [j.pk for j in jobs]),
        jobs,
        records,
        started_record,
    )


def _start_conditional(
    kernel: Kernel,
    workflow: Workflow,
    run: WorkflowRun,
    worker_id: str,
    events: list[dict[str, Any]],
    now: datetime,
    reserve_for: str | None,
    serves: frozenset[str] | None,
) -> StartedRun | None:
    """:func:`start_claimed_run`'s first group for a workflow with conditions (issue 18): the
    group's conditions are decided here (:func:`..stage_path.conditions.open_groups`)."""
    try:
        with rollback_point():  # Part I item 2; released by the commit (issue 19)
            opened = open_groups(
                kernel,
                workflow,
                run,
                [],
                1,
                generation=0,
                now=now,
                reserve_for=reserve_for,
                serves=serves,
                map_opener=advance_new_group,
            )
    except Exception as exc:
        _fail(kernel, run, "CLAIM_FAILED", f"{type(exc).__name__}: {exc}", worker_id, events)
        return None
    events.append(ev.event(ev.WORKFLOW_STARTED, run.pk, now))
    events.extend(opened.events)
    if opened.outcome != "advanced":
        return None
    return StartedRun(
        ClaimedRun(str(run.pk), run.workflow_id, [j.pk for j in opened.jobs]),
        opened.jobs,
        opened.new_records,
    )
