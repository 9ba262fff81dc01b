"""``run.cancel`` (SPEC §4.4, K-CA-1..3).

Locks the run row; a missing or terminal run answers ``cancelled=False`` and writes nothing.
Otherwise, in one transaction: run CANCELLED (its ``output`` records
``{"error": {"code": "CANCELLED", "message": reason}}`` so operators see why), every open stage
record CANCELLED (poll time cleared), PENDING/SUSPENDED jobs CANCELLED, ``workflow:cancelled``.
RUNNING jobs keep running; their results are discarded by the RUNNING guard of
``job.execute`` (K-JE-15, Part I item 1).

Child runs (issue 18 item 5, :mod:`..children`): the run's non-terminal children are
cancelled first, in the same transaction and recursively (reason ``"parent run <id> was
cancelled"``); a cancelled child wakes its parent's waiting stage, which then fails naming it.
"""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING, Any

from django.db.models import F

from ... import telemetry
from ...models import TERMINAL_RUN_STATUSES, Status, WorkflowRun, WorkflowStage
from .. import events as ev
from ..children import wake_parent
from ..commands import CancelRun, CancelRunResult
from ..jsonvalue import storable_text
from ..locking import lock_run, parse_run_id
from ..store import duration_ms, update_run
from .base import HandlerOutput

if TYPE_CHECKING:
    from ..dispatch import Kernel


def handle(kernel: Kernel, cmd: CancelRun) -> HandlerOutput:
    return cancel(kernel, cmd)


def cancel(kernel: Kernel, cmd: CancelRun, *, wake: bool = True) -> HandlerOutput:
    """``run.cancel`` in the caller's transaction. ``wake=False``: a cascade from the parent's
    own cancel (its waiting stage is being cancelled too, so it is not woken)."""
    run_id = parse_run_id(cmd.workflow_run_id)
    run = lock_run(run_id)
    if run is None or run.status in TERMINAL_RUN_STATUSES:
        return HandlerOutput(CancelRunResult(False))
    # Children first: their rows are locked before this run's stage rows are written, the
    # order a finishing child's wake takes too (child row, then the parent's stage row).
    child_events = cancel_children(kernel, run_id, f"parent run {run_id} was cancelled")
    now = kernel.clock.now()
    duration = duration_ms(run.started_at, now)
    reason = storable_text(cmd.reason) if cmd.reason else None
    update_run(
        run_id,
        now,
        status=Status.CANCELLED,
        completed_at=now,
        duration_ms=duration,
        output={"error": {"code": "CANCELLED", "message": reason or "cancelled (no reason given)"}},
    )
    WorkflowStage.objects.filter(run_id=run_id).exclude(
        status__in=[Status.COMPLETED, Status.FAILED, Status.CANCELLED]
    ).update(
        status=Status.CANCELLED,
        completed_at=now,
        next_poll_at=None,
        updated_at=now,
        version=F("version") + 1,
    )
    kernel.queue.cancel_by_run(run_id)
    if wake and run.parent_run_id is not None:
        wake_parent(kernel, run, now)
    events = [*child_events, ev.event(ev.WORKFLOW_CANCELLED, run_id, now, reason=reason)]
    telemetry.runs_ended_at_commit(run.workflow_id, events[-1:], run.started_at, now)
    return HandlerOutput(CancelRunResult(True), events)


def cancel_children(
    kernel: Kernel,
    run_id: uuid.UUID,
    reason: str,
    *,
    stage_ids: list[str] | None = None,
) -> list[dict[str, Any]]:
    """Cancel the non-terminal child runs of ``run_id`` (only those started by ``stage_ids``,
    if given) and, through ``run.cancel``, their children; in the caller's transaction.
    Returns the events to append (``workflow:cancelled`` per cancelled run). One SELECT when
    there are none.
    """
    children = WorkflowRun.objects.filter(parent_run_id=run_id).exclude(
        status__in=TERMINAL_RUN_STATUSES
    )
    if stage_ids is not None:
        children = children.filter(parent_stage_id__in=stage_ids)
    events: list[dict[str, Any]] = []
    for child_id in children.order_by("created_at").values_list("pk", flat=True):
        out = cancel(kernel, CancelRun(child_id, reason=reason), wake=False)
        events += out.events
    return events
