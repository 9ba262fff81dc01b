"""Schedule operator operations on the default kernel (or a given one): pause, resume,
trigger now, backfill (issue 12 item 1). Each dispatches one kernel command.

They live here, beside :mod:`django_workflows.runs`, and not in
:mod:`django_workflows.kernel.schedules`, because resolving the default kernel imports
:mod:`django_workflows.kernel.runtime`, which imports the dispatcher, whose schedule handlers
import :mod:`~django_workflows.kernel.schedules`: an import circle (``bin/import_cycles.py``).
"""

from __future__ import annotations

from datetime import datetime

from .kernel.commands import (
    BackfillSchedule,
    BackfillScheduleResult,
    PauseSchedule,
    ResumeSchedule,
    TriggerSchedule,
)
from .kernel.dispatch import Kernel
from .kernel.runtime import get_kernel
from .kernel.schedules import BackfillResult, check_backfill_range, get_schedule


def _kernel(kernel: Kernel | None) -> Kernel:
    return kernel if kernel is not None else get_kernel()


def pause_schedule(name: str, reason: str = "", *, kernel: Kernel | None = None) -> bool:
    """Pause schedule ``name`` (no firing until resumed): dispatches
    :class:`~.kernel.commands.PauseSchedule`. ``False`` if it was paused already.

    Raises:
        ScheduleNotFoundError: no such schedule.
    """
    return bool(_kernel(kernel).dispatch(PauseSchedule(name, str(reason))).changed)


def resume_schedule(name: str, *, kernel: Kernel | None = None) -> bool:
    """Resume a paused schedule: dispatches :class:`~.kernel.commands.ResumeSchedule`. Its
    next firing is the next scheduled time after now (times that passed while paused are not caught
    up); ``False`` if it was not paused.

    Raises:
        ScheduleNotFoundError: no such schedule.
        ScheduleOrphanedError: the schedule is orphaned: its definition is gone.
    """
    return bool(_kernel(kernel).dispatch(ResumeSchedule(name)).changed)


def trigger_schedule(name: str, *, kernel: Kernel | None = None, actor: str = "") -> str:
    """Start one run of schedule ``name`` now: dispatches
    :class:`~.kernel.commands.TriggerSchedule` (also when paused; the overlap policy is not
    applied: an operator asked for it). Its scheduled time is now; its
    idempotency key is ``schedule:<name>:manual:<now>``. Returns the run id.

    Raises:
        ScheduleNotFoundError: no such schedule.
        ScheduleOrphanedError: the schedule is orphaned: its definition is gone (nothing
            written).
        WorkflowNotFoundError, InvalidWorkflowInputError, InvalidWorkflowConfigError: the run
            cannot be created (nothing written).
    """
    result = _kernel(kernel).dispatch(TriggerSchedule(name, actor=str(actor)))
    return str(result.workflow_run_id)


def backfill_schedule(
    name: str, start: datetime, end: datetime, *, kernel: Kernel | None = None
) -> BackfillScheduleResult:
    """Start one run for every scheduled time of ``name`` in ``[start, end]``: dispatches
    :class:`~.kernel.commands.BackfillSchedule` (oldest first; also when paused; overlap
    not applied). Each uses the firing's own idempotency key, so a time the ticker fired already
    (or an earlier backfill) is not started again.

    Raises:
        ScheduleNotFoundError: no such schedule.
        InvalidCommandError: field ``start``/``end`` naive or outside the years
            ``MIN_YEAR``-``MAX_YEAR`` (UTC), ``end`` before ``start``, or more than
            :data:`~.kernel.schedules.MAX_BACKFILL` times in the range (nothing written).
        ScheduleOrphanedError: the schedule is orphaned: its definition is gone (nothing
            written).
    """
    return _kernel(kernel).dispatch(BackfillSchedule(name, start, end))  # type: ignore[no-any-return]


__all__ = [
    "BackfillResult",
    "backfill_schedule",
    "check_backfill_range",
    "get_schedule",
    "pause_schedule",
    "resume_schedule",
    "trigger_schedule",
]
