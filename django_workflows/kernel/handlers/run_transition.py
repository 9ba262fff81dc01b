"""``run.transition`` (SPEC §4.3, K-TR-1..9; Part I items 14 and 17).

Locks the run row first, so concurrent transitions of one run are serialised and exactly one
advances or completes it (EC-8); the second sees the new group's PENDING records and returns
``noop``. Acts on RUNNING runs only (EC-30).

* no stage records yet -> create group 1, enqueue, ``workflow:started`` (``advanced``, 1);
* any PENDING/RUNNING/SUSPENDED record -> ``noop`` (K-TR-4);
* a FAILED record whose job is not being retried -> run FAILED, ``workflow:failed`` (K-TR-5);
* a next group exists -> create it with the current rerun attempt, enqueue (K-TR-6);
* otherwise -> run COMPLETED with the last group's output and cost totals (K-TR-7).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ...models import ACTIVE_STAGE_STATUSES, Status
from .. import events as ev
from ..commands import TransitionRun, TransitionRunResult
from ..locking import lock_run, parse_run_id
from ..store import (
    create_missing_stages,
    duration_ms,
    group_output,
    load_outputs,
    stages_of,
    update_run,
)
from .base import HandlerOutput, enqueue_stage_jobs

if TYPE_CHECKING:
    from ..dispatch import Kernel

NOOP = TransitionRunResult("noop")


def handle(kernel: Kernel, cmd: TransitionRun) -> HandlerOutput:
    run_id = parse_run_id(cmd.workflow_run_id)
    run = lock_run(run_id)
    if run is None or run.status != Status.RUNNING:
        return HandlerOutput(NOOP)
    workflow = kernel.registry.get(run.workflow_id)
    if workflow is None:
        return HandlerOutput(NOOP)
    now = kernel.clock.now()
    records = stages_of(run_id)

    if not records:
        new = create_missing_stages(run, workflow.stages_in_group(1), attempt=0, now=now)
        update_run(run_id, now)
        enqueue_stage_jobs(kernel.queue, run, new)
        return HandlerOutput(
            TransitionRunResult("advanced", 1), [ev.event(ev.WORKFLOW_STARTED, run_id, now)]
        )

    if any(r.status in ACTIVE_STAGE_STATUSES for r in records):
        return HandlerOutput(NOOP)

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
            return HandlerOutput(NOOP)
        error = unretried[0].error_message or "Stage failed"
        update_run(
            run_id,
            now,
            status=Status.FAILED,
            completed_at=now,
            duration_ms=duration_ms(run.started_at, now),
        )
        return HandlerOutput(
            TransitionRunResult("failed"), [ev.event(ev.WORKFLOW_FAILED, run_id, now, error=error)]
        )

    max_group = max(r.execution_group for r in records)
    next_nodes = workflow.stages_in_group(max_group + 1)
    if next_nodes:
        attempt = max(r.attempt for r in records)
        new = create_missing_stages(run, next_nodes, attempt=attempt, now=now, records=records)
        update_run(run_id, now)
        enqueue_stage_jobs(kernel.queue, run, new)
        return HandlerOutput(TransitionRunResult("advanced", max_group + 1))

    total_cost = sum(float((r.metrics or {}).get("total_cost") or 0) for r in records)
    total_tokens = sum(int((r.metrics or {}).get("total_tokens") or 0) for r in records)
    last_group = [r for r in records if r.execution_group == max_group]
    _, output = group_output(workflow, max_group, load_outputs(kernel.blobs, last_group))
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
    return HandlerOutput(
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
