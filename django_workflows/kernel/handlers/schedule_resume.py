"""``schedule.resume`` (issue 12 item 1): an operator lets a paused schedule fire again.

One transaction: lock the row (refused when orphaned), clear ``paused``, and set its next
firing to its next scheduled time after now - times that passed while paused are not caught
up. Writes no events.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from django.db import transaction

from ...definition.schedule import definition_from_row
from ..commands import ResumeSchedule, ResumeScheduleResult
from ..schedules import lock_operable, set_next

if TYPE_CHECKING:
    from ..dispatch import Kernel


def handle(kernel: Kernel, cmd: ResumeSchedule) -> ResumeScheduleResult:
    """Resume ``cmd.name``; ``changed`` is ``False`` when it was not paused.

    Raises:
        ScheduleNotFoundError: no such schedule.
        ScheduleOrphanedError: its definition is gone from code (nothing written).
    """
    now = kernel.clock.now()
    with transaction.atomic():
        row = lock_operable(cmd.name, "resumed")
        if not row.paused:
            return ResumeScheduleResult(name=cmd.name, changed=False)
        row.paused, row.pause_reason, row.updated_at = False, "", now
        if not row.last_error or row.next_scheduled_at is not None:
            definition = definition_from_row(row)
            set_next(row, definition, definition.next_after(now))
        row.save()
    return ResumeScheduleResult(name=cmd.name, changed=True)
