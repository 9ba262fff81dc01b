"""``schedule.pause`` (issue 12 item 1): an operator stops a schedule's firings.

One transaction: lock the row, set ``paused`` and ``pause_reason``. An orphaned schedule may be
paused (it is paused already, so nothing changes). Writes no events.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from django.db import transaction

from ..commands import PauseSchedule, PauseScheduleResult
from ..errors import ScheduleNotFoundError
from ..locking import lock_schedule
from ..schedules import known_schedule_names

if TYPE_CHECKING:
    from ..dispatch import Kernel


def handle(kernel: Kernel, cmd: PauseSchedule) -> PauseScheduleResult:
    """Pause ``cmd.name``; ``changed`` is ``False`` when it was paused already.

    Raises:
        ScheduleNotFoundError: no such schedule.
    """
    now = kernel.clock.now()
    with transaction.atomic():
        row = lock_schedule(cmd.name)
        if row is None:
            raise ScheduleNotFoundError(cmd.name, known_schedule_names())
        if row.paused:
            return PauseScheduleResult(name=cmd.name, changed=False)
        row.paused, row.pause_reason, row.updated_at = True, str(cmd.reason)[:500], now
        row.save(update_fields=["paused", "pause_reason", "updated_at"])
    return PauseScheduleResult(name=cmd.name, changed=True)
