"""The run's transition rules (SPEC §4.3, K-TR-1..9; Part I items 14 and 17), applied by the
stage path's outcome transaction (:mod:`.outcome`) and by ``run.transition``.

Locks the run row first, so concurrent transitions of one run are serialised and exactly one
advances or completes it (EC-8); the second sees the new group's PENDING records and returns
``noop``. Acts on RUNNING runs only (EC-30).

* no stage records yet -> create group 1, enqueue, ``workflow:started`` (``advanced``, 1);
* any PENDING/RUNNING/SUSPENDED record -> ``noop`` (K-TR-4);
* a FAILED record whose job is not being retried -> run FAILED, ``workflow:failed`` (K-TR-5);
* a next group exists -> create it with the current rerun generation, enqueue (K-TR-6);
* otherwise -> run COMPLETED with the last group's output and cost totals (K-TR-7).

A child run (``parent_run_id`` set) that ends COMPLETED or FAILED here wakes its parent's
waiting stage in the same transaction (:func:`..children.wake_parent`; issue 18 item 5).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any

from ...definition.workflow import Workflow
from ...models import ACTIVE_STAGE_STATUSES, Status, WorkflowJob, WorkflowRun, WorkflowStage
from .. import events as ev
from ..children import wake_parent
from ..commands import TransitionRunResult
from ..handlers.base import enqueue_stage_jobs, job_leased_to, open_stages
from ..limits import wake_claimer_if_keyed
from ..store import (
    create_missing_stages,
    duration_ms,
    group_output,
    load_outputs,
    run_error,
    update_run,
    update_stage,
)
from . import conditions

if TYPE_CHECKING:
    from ..dispatch import Kernel

NOOP = TransitionRunResult("noop")


def _advance_conditional(
    kernel: Kernel,
    workflow: Workflow,
    run: WorkflowRun,
    records: list[WorkflowStage],
    now: datetime,
    outputs: dict[str, Any] | None,
    reserve_for: str | None,
    serves: frozenset[str] | None,
) -> Advance:
    """K-TR-3/6/7 for a workflow with conditions (:mod:`.conditions`): open the next group,
    skipping what does not apply, or complete the run past the last one."""
    group = max((r.execution_group for r in records), default=0) + 1
    generation = max((r.generation for r in records), default=0)
    opened = conditions.open_groups(
        kernel,
        workflow,
        run,
        records,
        group,
        generation=generation,
        now=now,
        outputs=outputs,
        reserve_for=reserve_for,
        serves=serves,
        map_opener=advance_new_group,
    )
    if not records:
        opened.events.insert(0, ev.event(ev.WORKFLOW_STARTED, run.pk, now))
    if opened.outcome == "advanced":
        if not records:
            update_run(run.pk, now)
        result = TransitionRunResult("advanced", opened.group)
    else:
        result = TransitionRunResult(opened.outcome)
    return Advance(result, opened.events, opened.new_records, opened.reserved_job)


@dataclass
class Advance:
    """What :func:`advance` did: the public result, the events to append, the records it
    created, the job it reserved for the calling worker (``None`` if it reserved none) and
    that job's record if it was inserted RUNNING.
    """

    result: TransitionRunResult
    events: list[dict[str, Any]] = field(default_factory=list)
    new_records: list[WorkflowStage] = field(default_factory=list)
    reserved_job: WorkflowJob | None = None
    #: The reserved job's stage record when it was inserted RUNNING (pass it to
    #: :func:`.lease.begin` as ``started``); ``None``: begin starts the record itself.
    started_record: WorkflowStage | None = None


def advance(
    kernel: Kernel,
    workflow: Workflow,
    run: WorkflowRun,
    records: list[WorkflowStage],
    now: datetime,
    *,
    outputs: dict[str, Any] | None = None,
    reserve_for: str | None = None,
    serves: frozenset[str] | None = None,
) -> Advance:
    """The transition rules (K-TR-1..9) for a run whose row the caller has locked and found
    RUNNING, given its current stage ``records``.

    ``outputs``: raw outputs the caller already holds (``{stage_id: output}``), so completing
    a run does not read them again. ``reserve_for``: a worker id; the first job of a new group
    is inserted leased to that worker if it serves the job's queue (``serves``: its queues,
    ``None`` any; see :func:`.base.enqueue_stage_jobs`).
    """
    run_id = run.pk
    if workflow.has_conditions and not any(r.status in ACTIVE_STAGE_STATUSES for r in records):
        if not records or not any(r.status == Status.FAILED for r in records):
            return _advance_conditional(
                kernel, workflow, run, records, now, outputs, reserve_for, serves
            )
    if not records:
        started = [ev.event(ev.WORKFLOW_STARTED, run_id, now)]
        if workflow.has_maps:
            new = create_missing_stages(run, workflow.stages_in_group(1), generation=0, now=now)
            update_run(run_id, now)
            return advance_new_group(
                kernel, workflow, run, [], new, now, 1, started, reserve_for, serves
            )
        opened = open_stages(
            kernel.queue, run, workflow.stages_in_group(1), workflow=workflow, generation=0,
            now=now, reserve_for=reserve_for, serves=serves,
        )  # fmt: skip
        update_run(run_id, now)
        return Advance(
            TransitionRunResult("advanced", 1),
            started,
            opened.records,
            job_leased_to(opened.jobs, reserve_for),
            opened.started,
        )

    if any(r.status in ACTIVE_STAGE_STATUSES for r in records):
        return Advance(NOOP)

    failed = [r for r in records if r.status == Status.FAILED]
    if failed:
        jobs = kernel.queue.jobs_by_run(run_id)
        retrying = {
            j.stage_id
            for j in jobs
            if j.status == Status.RUNNING or (j.status == Status.PENDING and j.attempt > 0)
        }
        unretried = [r for r in failed if r.stage_id not in retrying]
        if not unretried:
            return Advance(NOOP)
        first = unretried[0]
        error = first.error_message or "Stage failed"
        deliveries = [j for j in jobs if j.stage_id == first.stage_id]
        update_run(
            run_id,
            now,
            status=Status.FAILED,
            completed_at=now,
            duration_ms=duration_ms(run.started_at, now),
            # In the same UPDATE: the failed stage's error (its error_type rode in its metrics).
            error=run_error(
                first.stage_id,
                error,
                (first.metrics or {}).get("error_type"),
                generation=first.generation,
                delivery=max(deliveries, key=lambda j: j.pk).attempt if deliveries else None,
            ),
        )
        if run.parent_run_id is not None:  # a child run: its parent's stage reads it now
            wake_parent(kernel, run, now)
        wake_claimer_if_keyed(kernel.transport, workflow, run)  # a key slot freed (issue 18)
        return Advance(
            TransitionRunResult("failed"), [ev.event(ev.WORKFLOW_FAILED, run_id, now, error=error)]
        )

    max_group = max(r.execution_group for r in records)
    next_nodes = workflow.stages_in_group(max_group + 1)
    if next_nodes:
        generation = max(r.generation for r in records)
        if workflow.has_maps:
            new = create_missing_stages(
                run, next_nodes, generation=generation, now=now, records=records
            )
            return advance_new_group(
                kernel, workflow, run, records, new, now, max_group + 1, [], reserve_for, serves,
                outputs,
            )  # fmt: skip
        opened = open_stages(
            kernel.queue, run, next_nodes, workflow=workflow, generation=generation, now=now,
            records=records, reserve_for=reserve_for, serves=serves,
        )  # fmt: skip
        return Advance(
            TransitionRunResult("advanced", max_group + 1),
            [],
            opened.records,
            job_leased_to(opened.jobs, reserve_for),
            opened.started,
        )

    total_cost = sum(float((r.metrics or {}).get("total_cost") or 0) for r in records)
    total_tokens = sum(int((r.metrics or {}).get("total_tokens") or 0) for r in records)
    last_group = [r for r in records if r.execution_group == max_group]
    known = outputs or {}
    missing = [r for r in last_group if r.stage_id not in known]
    loaded = {**load_outputs(kernel.blobs, missing), **known} if missing else known
    _, output = group_output(workflow, max_group, loaded)
    duration = duration_ms(run.started_at, now)
    update_run(
        run_id,
        now,
        status=Status.COMPLETED,
        completed_at=now,
        duration_ms=duration,
        output=output,
        total_cost=total_cost,
        total_tokens=total_tokens,
    )
    if run.parent_run_id is not None:  # a child run: its parent's stage takes its output now
        wake_parent(kernel, run, now)
    wake_claimer_if_keyed(kernel.transport, workflow, run)  # a key slot freed (issue 18)
    return Advance(
        TransitionRunResult("completed"),
        [
            ev.event(
                ev.WORKFLOW_COMPLETED,
                run_id,
                now,
                duration_ms=duration,
                output=output,
                total_cost=total_cost,
                total_tokens=total_tokens,
            )
        ],
    )


def advance_new_group(
    kernel: Kernel,
    workflow: Workflow,
    run: WorkflowRun,
    records: list[WorkflowStage],
    new: list[WorkflowStage],
    now: datetime,
    group: int,
    events: list[dict[str, Any]],
    reserve_for: str | None,
    serves: frozenset[str] | None,
    outputs: dict[str, Any] | None = None,
) -> Advance:
    """The new group's jobs for a workflow with map stages (issue 18 item 3): a map stage is
    fanned out (:func:`..mapping.expand`); one whose ``over`` failed is FAILED and one whose
    list was empty is COMPLETED at once - then the run is transitioned again right here.
    """
    from ..mapping import MAP_OVER_FAILED, _MapOverError

    try:
        jobs = enqueue_stage_jobs(
            kernel.queue, run, new, workflow=workflow, reserve_for=reserve_for, serves=serves,
            kernel=kernel, events=events,
        )  # fmt: skip
    except _MapOverError as exc:
        jobs = []
        for record in new:
            if record.status == Status.PENDING and workflow.node(record.stage_id).map is not None:
                fields = dict(
                    status=Status.FAILED,
                    completed_at=now,
                    error_message=str(exc),
                    metrics={"error_type": MAP_OVER_FAILED},
                )
                update_stage(record.pk, now, **fields)
                for name, value in fields.items():
                    setattr(record, name, value)
                events.append(
                    ev.event(
                        ev.STAGE_FAILED, run.pk, now, stage_id=record.stage_id,
                        stage_name=record.stage_name, error=str(exc),
                    )
                )  # fmt: skip
                break
    if any(r.status in (Status.COMPLETED, Status.FAILED) for r in new):
        ids = {r.stage_id for r in new}
        step = advance(
            kernel, workflow, run, [r for r in records if r.stage_id not in ids] + new, now,
            outputs=outputs, reserve_for=reserve_for, serves=serves,
        )  # fmt: skip
        return Advance(step.result, events + step.events, new + step.new_records, step.reserved_job)
    return Advance(
        TransitionRunResult("advanced", group), events, new, job_leased_to(jobs, reserve_for)
    )
