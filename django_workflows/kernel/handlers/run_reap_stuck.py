"""``run.reapStuck`` (SPEC §4.9, K-RS-1..5; Part I item 4).

A RUNNING run is a candidate when neither it nor any of its stage records changed since
``now - threshold``. A run is **not** stuck while something will still advance it:

* a RUNNING job with a fresh lease (heartbeats keep it fresh, EC-22);
* a SUSPENDED stage whose next poll or deadline is still ahead (EC-23);
* a PENDING job waiting in the queue (EC-24), or a suspended map item whose next poll is
  still ahead (issue 18 item 3);
* a run of a definition version this process does not run (issue 12 item 3): its suspended
  stages are polled, and its stuck-ness judged, by a process of its own version.

For each candidate (row-locked without waiting - a run another transaction holds is left for
the next tick - and re-checked RUNNING): a run with no active stage record is
advanced by the transition rules instead of failed (its work is done: the next group is
created, or the run completes or fails with its stage's error); PENDING stage records that no
job serves
(no PENDING or RUNNING job, and no job of the record's generation that ended, e.g. one given up
after ``max_attempts`` deliveries, Part I item 3) get a fresh job (recovery sweep, K-RS-3) and
the run is left alone; otherwise the
run is FAILED with ``STUCK_RUN_REAPED`` and ``workflow:failed`` (K-RS-4). Stage and job rows are
not touched by the failing branch (K-RS-5).
"""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING, Any

from django.db.models import Exists, OuterRef, Q

from ...conf import workflow_settings
from ...models import ACTIVE_STAGE_STATUSES, Status, WorkflowJob, WorkflowRun, WorkflowStage
from .. import events as ev
from ..children import wake_parent
from ..commands import ReapStuckRuns, ReapStuckRunsResult
from ..locking import LOCKED, try_lock_run
from ..store import run_error, stages_of, update_run
from ..versions import versions_q
from .base import HandlerOutput, enqueue_stage_jobs
from .run_transition import advance

if TYPE_CHECKING:
    from ..dispatch import Kernel


def handle(kernel: Kernel, cmd: ReapStuckRuns) -> HandlerOutput:
    now = kernel.clock.now()
    # Staleness is judged in database time (issue 17): a reaper whose clock runs ahead must not
    # see every run as idle for longer than it is. (With a test clock that drives leases this
    # is that clock; rows the reaper writes keep the kernel clock's time.)
    judged_at = kernel.lease_clock.read()
    since = judged_at - timedelta(seconds=cmd.stuck_threshold_seconds)
    # ``locked_at`` is lease time (the database's clock, stamped by the heartbeats of another
    # host): judge it in lease time, never with this host's clock (issue 17: a reaper 90 s
    # ahead saw every heartbeated lease as stale and failed long stages as stuck).
    lease_fresh_after = kernel.lease_clock.offset(-float(workflow_settings.STALE_LEASE_SECONDS))
    run_ref = OuterRef("pk")
    candidates = list(
        WorkflowRun.objects.filter(status=Status.RUNNING, updated_at__lte=since)
        # Only runs of versions this process runs (issue 12 item 3): a run whose suspended
        # stage only a worker of its own version can poll is not stuck, it waits for one.
        .filter(versions_q(kernel.registry.runnable_versions()))
        .exclude(Exists(WorkflowStage.objects.filter(run=run_ref, updated_at__gt=since)))
        .exclude(
            Exists(
                WorkflowJob.objects.filter(workflow_run_id=run_ref).filter(
                    Q(status=Status.PENDING)
                    | Q(status=Status.RUNNING, locked_at__gte=lease_fresh_after)
                    # A suspended async-batch map item polled later (issue 18 item 3).
                    | Q(
                        status=Status.SUSPENDED,
                        item_index__isnull=False,
                        next_poll_at__gt=judged_at,
                    )
                )
            )
        )
        .exclude(
            Exists(
                WorkflowStage.objects.filter(run=run_ref, status=Status.SUSPENDED).filter(
                    Q(next_poll_at__gt=judged_at) | Q(max_wait_until__gt=judged_at)
                )
            )
        )
        .order_by("updated_at")
        .values_list("pk", flat=True)
    )
    events: list[dict[str, Any]] = []
    failed = recovered = advanced = 0
    threshold = cmd.stuck_threshold_seconds
    for run_id in candidates:
        # Skip a run another transaction holds (maybe a vanished host's, until its session
        # is ended): one locked row never blocks the maintenance tick (issue 17).
        run = try_lock_run(run_id)
        if run is None or run is LOCKED or run.status != Status.RUNNING:
            continue
        assert isinstance(run, WorkflowRun)
        records = stages_of(run_id)
        workflow = kernel.registry.get(run.workflow_id)
        if workflow is not None and not any(r.status in ACTIVE_STAGE_STATUSES for r in records):
            # Its work is done but it was never advanced (a transition lost by an engine
            # older than the one-transaction outcome, or an operator's repair): advance it.
            step = advance(kernel, workflow, run, records, now)
            if step.result.action != "noop":
                events += step.events
                advanced += 1
                continue
        pending = [r for r in records if r.status == Status.PENDING]
        if pending:
            orphans = _orphans(run_id, pending)
            if orphans:
                enqueue_stage_jobs(kernel.queue, run, orphans, workflow=workflow, kernel=kernel)
                update_run(run_id, now)
                recovered += 1
                continue
        message = (
            f"Run reaped as stuck: no progress for {threshold:g} seconds "
            f"(stuck threshold {threshold:g} s)"
        )
        update_run(
            run_id,
            now,
            status=Status.FAILED,
            completed_at=now,
            output={
                "error": {
                    "code": "STUCK_RUN_REAPED",
                    "message": message,
                    "stage_statuses": [
                        {"stage_id": r.stage_id, "status": r.status} for r in records
                    ],
                }
            },
            error=run_error(
                next((r.stage_id for r in records if r.status in ACTIVE_STAGE_STATUSES), None),
                message,
                "StuckRunReaped",
            ),
        )
        if run.parent_run_id is not None:  # a child run: its parent's stage reads it now
            wake_parent(kernel, run, now)
        events.append(ev.event(ev.WORKFLOW_FAILED, run_id, now, error=message))
        failed += 1
    return HandlerOutput(
        ReapStuckRunsResult(failed + advanced, failed, recovered + advanced), events
    )


def _orphans(run_id: Any, pending: list[WorkflowStage]) -> list[WorkflowStage]:
    """PENDING records that no job serves (K-RS-3): no PENDING or RUNNING job of the stage,
    and no job of any status created with or after the record. A job of the record's own
    generation that ended (e.g. given up after ``max_attempts`` deliveries, Part I item 3) is
    not replaced: the sweep must not restart a bounded re-delivery.
    """
    created = {r.stage_id: r.created_at for r in pending}
    served = {
        stage_id
        for stage_id, status, job_created in WorkflowJob.objects.filter(
            workflow_run_id=run_id, stage_id__in=created
        ).values_list("stage_id", "status", "created_at")
        if status in (Status.PENDING, Status.RUNNING) or job_created >= created[stage_id]
    }
    return [r for r in pending if r.stage_id not in served]
