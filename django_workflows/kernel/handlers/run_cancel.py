"""``run.cancel`` (SPEC §4.4, K-CA-1..3).

Locks the run row; a missing or terminal run answers ``cancelled=False`` and writes nothing.
Otherwise, in one transaction: run CANCELLED (its ``output`` records
``{"error": {"code": "CANCELLED", "message": reason}}`` so operators see why), every open stage
record CANCELLED (poll time cleared), PENDING/SUSPENDED jobs CANCELLED, ``workflow:cancelled``.
RUNNING jobs keep running; their results are discarded by the RUNNING guard of
``job.execute`` (K-JE-15, Part I item 1).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from django.db.models import F

from ...models import TERMINAL_RUN_STATUSES, Status, WorkflowStage
from .. import events as ev
from ..commands import CancelRun, CancelRunResult
from ..jsonvalue import storable_text
from ..locking import lock_run, parse_run_id
from ..store import duration_ms, update_run
from .base import HandlerOutput

if TYPE_CHECKING:
    from ..dispatch import Kernel


def handle(kernel: Kernel, cmd: CancelRun) -> HandlerOutput:
    run_id = parse_run_id(cmd.workflow_run_id)
    run = lock_run(run_id)
    if run is None or run.status in TERMINAL_RUN_STATUSES:
        return HandlerOutput(CancelRunResult(False))
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
    return HandlerOutput(
        CancelRunResult(True), [ev.event(ev.WORKFLOW_CANCELLED, run_id, now, reason=reason)]
    )
