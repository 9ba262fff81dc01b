"""``schedule.trigger`` (issue 12 item 1): an operator starts one run of a schedule now.

One transaction: lock the row (refused when orphaned), dispatch ``run.create`` with the
schedule's workflow, input, config and priority under the key
``schedule:<name>:manual:<now ISO>`` and the schedule's trigger annotations, and record the
firing on the row (``last_run_id``, ``last_fired_at``, ``fired_count``). Also when paused; the
overlap policy is not applied (an operator asked for it). A ``run.create`` error rolls it all
back.
"""

from __future__ import annotations

from datetime import UTC
from typing import TYPE_CHECKING

from django.db import transaction

from ..commands import TriggerSchedule, TriggerScheduleResult
from ..schedules import lock_operable, start_firing

if TYPE_CHECKING:
    from ..dispatch import Kernel


def handle(kernel: Kernel, cmd: TriggerSchedule) -> TriggerScheduleResult:
    """Start a run of ``cmd.name`` now; its id is ``workflow_run_id``.

    Raises:
        ScheduleNotFoundError: no such schedule.
        ScheduleOrphanedError: its definition is gone from code (nothing written).
        WorkflowNotFoundError, InvalidWorkflowInputError, InvalidWorkflowConfigError: the run
            cannot be created (nothing written).
    """
    now = kernel.clock.now()
    name = cmd.name
    with transaction.atomic():
        row = lock_operable(name, "triggered")
        key = f"schedule:{name}:manual:{now.astimezone(UTC).isoformat()}"
        reason = f"triggered now by {cmd.actor}" if cmd.actor else "triggered now"
        run_id, _ = start_firing(kernel, row, now, key=key, reason=reason)
        row.last_run_id = run_id  # type: ignore[assignment]
        row.last_fired_at = row.updated_at = now
        row.fired_count += 1
        row.save(update_fields=["last_run_id", "last_fired_at", "updated_at", "fired_count"])
    return TriggerScheduleResult(name=name, workflow_run_id=run_id)
