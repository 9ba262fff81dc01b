"""``schedule.backfill`` (issue 12 item 1): an operator starts the runs of past (or future)
scheduled times of a schedule.

The range is checked (:func:`..schedules.check_backfill_range`) and the row read (refused when
orphaned) before anything is written; then one transaction dispatches ``run.create`` per
scheduled time in ``[start, end]``, oldest first, each with the firing's own key
``schedule:<name>:<ISO time>``: a time the ticker or an earlier backfill fired is not started
again (a replay, or a key reused with another input since the schedule changed). Also when
paused; the overlap policy is not applied.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from django.db import transaction

from ...definition.schedule import definition_from_row
from ..commands import BackfillSchedule, BackfillScheduleResult, CreateRun
from ..errors import IdempotencyKeyReusedError, InvalidCommandError, ScheduleOrphanedError
from ..schedules import (
    MAX_BACKFILL,
    check_backfill_range,
    firing_annotations,
    get_schedule,
    idempotency_key,
)

if TYPE_CHECKING:
    from ..dispatch import Kernel


def handle(kernel: Kernel, cmd: BackfillSchedule) -> BackfillScheduleResult:
    """Backfill ``cmd.name`` over ``[cmd.start, cmd.end]``.

    Raises:
        InvalidCommandError: field ``start``/``end`` naive or outside the supported years,
            ``end`` before ``start``, or more than ``MAX_BACKFILL`` times in the range.
        ScheduleNotFoundError: no such schedule.
        ScheduleOrphanedError: its definition is gone from code.
        (Nothing is written when any of these is raised.)
    """
    name = cmd.name
    check_backfill_range(cmd.start, cmd.end)
    row = get_schedule(name)
    if row.orphaned:
        raise ScheduleOrphanedError(name, "backfilled")
    definition = definition_from_row(row)
    times = definition.times_between(cmd.start, cmd.end, limit=MAX_BACKFILL + 1)
    if len(times) > MAX_BACKFILL:
        raise InvalidCommandError(
            f"end: the range holds more than {MAX_BACKFILL} scheduled times; backfill a shorter "
            "range",
            field="end",
        )
    out = BackfillScheduleResult(name=name, times=times)
    with transaction.atomic():
        for scheduled_at in times:
            try:
                result = kernel.dispatch(
                    CreateRun(
                        workflow_id=row.workflow_id,
                        input=row.input or {},
                        config=row.config or None,
                        priority=row.priority,
                        idempotency_key=idempotency_key(name, scheduled_at),
                        annotations=firing_annotations(name, scheduled_at, None),
                    )
                )
            except IdempotencyKeyReusedError:
                out.existing += 1  # fired before with another input (the schedule changed)
                continue
            if result.replayed:
                out.existing += 1
            else:
                out.run_ids.append(str(result.workflow_run_id))
    return out
