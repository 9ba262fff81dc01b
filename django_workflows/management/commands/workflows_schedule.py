"""``manage.py workflows_schedule <action>``: list and operate schedules (issue 12 item 1).

Actions (each first syncs the code definitions to their rows, as the tick does):

* ``list [--json]`` - every schedule: spec, zone, policies, paused/orphaned, next fire time,
  last run.
* ``next NAME [--count N]`` - the next N scheduled times (UTC and the schedule's zone).
* ``pause NAME [--reason TEXT]`` / ``resume NAME`` - stop / restart firing (a resumed schedule
  fires next at its next time after now; missed times are not caught up).
* ``trigger NAME`` - start one run now (also when paused).
* ``backfill NAME --start ISO --end ISO`` - one run per scheduled time in the range; times that
  already have a run (fired by the ticker, or an earlier backfill) are not started again.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any
from zoneinfo import ZoneInfo

from django.core.management.base import BaseCommand, CommandError, CommandParser

from django_workflows.kernel.commands import (
    BackfillSchedule,
    PauseSchedule,
    ResumeSchedule,
    TriggerSchedule,
)
from django_workflows.kernel.errors import ScheduleOrphanedError, WorkflowError
from django_workflows.kernel.runtime import get_kernel
from django_workflows.kernel.schedules import (
    MAX_UPCOMING,
    get_schedule,
    sync_schedules,
    upcoming_times,
)
from django_workflows.models import WorkflowSchedule

from ._common import format_datetime, require_positive


def _iso(value: datetime | None) -> str | None:
    return value.isoformat() if value is not None else None


def schedule_document(row: WorkflowSchedule) -> dict[str, Any]:
    """The JSON description of one schedule row (``workflows_schedule list --json``): date-times
    as ISO-8601 strings, ``null`` when unset."""
    return {
        "name": row.name,
        "workflow_id": row.workflow_id,
        "spec": row.spec_text,
        "cron": row.cron or None,
        "every_seconds": row.every_seconds,
        "tz": row.tz,
        "overlap": row.overlap,
        "catchup": row.catchup,
        "jitter_seconds": row.jitter_seconds,
        "paused": row.paused,
        "pause_reason": row.pause_reason,
        "orphaned": row.orphaned,
        "next_scheduled_at": _iso(row.next_scheduled_at),
        "next_fire_at": _iso(row.next_fire_at),
        "last_scheduled_at": _iso(row.last_scheduled_at),
        "last_fired_at": _iso(row.last_fired_at),
        "last_run_id": str(row.last_run_id) if row.last_run_id else None,
        "fired_count": row.fired_count,
        "skipped_count": row.skipped_count,
        "last_error": row.last_error,
    }


def _aware(value: str, option: str) -> datetime:
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError:
        raise CommandError(f"{option}: {value!r} is not an ISO-8601 date-time") from None
    if parsed.utcoffset() is None:
        raise CommandError(f"{option}: {value!r} has no UTC offset (add +00:00 or Z)")
    return parsed


class Command(BaseCommand):
    help = (
        "List and operate schedules: list, next, pause, resume, trigger, backfill. See "
        "`workflows_schedule <action> --help`."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
        listing = actions.add_parser("list", help="list the schedules")
        listing.add_argument("--json", action="store_true", help="print a JSON list")
        upcoming = actions.add_parser("next", help="show the next scheduled times")
        upcoming.add_argument("name")
        upcoming.add_argument(
            "--count", type=int, default=5, help=f"how many (default 5, at most {MAX_UPCOMING})"
        )
        pause = actions.add_parser("pause", help="stop firing until resumed")
        pause.add_argument("name")
        pause.add_argument("--reason", default="", help="why (shown in the list and the admin)")
        resume = actions.add_parser("resume", help="fire again from the next time after now")
        resume.add_argument("name")
        trigger = actions.add_parser("trigger", help="start one run now")
        trigger.add_argument("name")
        backfill = actions.add_parser("backfill", help="one run per scheduled time in a range")
        backfill.add_argument("name")
        backfill.add_argument("--start", required=True, help="ISO-8601 with offset, inclusive")
        backfill.add_argument("--end", required=True, help="ISO-8601 with offset, inclusive")

    def handle(self, *args: Any, **opts: Any) -> None:
        kernel = get_kernel()
        action = opts["action"]
        try:
            sync = sync_schedules(kernel)
            for name, error in sync.errors.items():
                self.stderr.write(f"schedule {name} is not fired: {error}")
            if action == "list":
                self._list(opts["json"])
            elif action == "next":
                require_positive(opts["count"], "--count")
                if opts["count"] > MAX_UPCOMING:
                    raise CommandError(
                        f"--count: at most {MAX_UPCOMING} (like backfill), got {opts['count']}"
                    )
                row = get_schedule(opts["name"])
                for when in upcoming_times(row, opts["count"]):
                    local = when.astimezone(ZoneInfo(row.tz))
                    self.stdout.write(f"{when.isoformat()}  ({local.isoformat()} {row.tz})")
                if row.paused:
                    self.stdout.write(f"(paused: {row.pause_reason or 'by an operator'})")
            elif action == "pause":
                changed = kernel.dispatch(PauseSchedule(opts["name"], opts["reason"])).changed
                self.stdout.write(f"paused {opts['name']}" if changed else "already paused")
            elif action == "resume":
                changed = kernel.dispatch(ResumeSchedule(opts["name"])).changed
                row = get_schedule(opts["name"])
                self.stdout.write(
                    f"resumed {row.name}; next fire at {format_datetime(row.next_fire_at)}"
                    if changed
                    else "not paused"
                )
            elif action == "trigger":
                run_id = kernel.dispatch(TriggerSchedule(opts["name"], actor="cli")).workflow_run_id
                self.stdout.write(self.style.SUCCESS(f"started run {run_id}"))
            else:
                result = kernel.dispatch(
                    BackfillSchedule(
                        opts["name"],
                        _aware(opts["start"], "--start"),
                        _aware(opts["end"], "--end"),
                    )
                )
                self.stdout.write(
                    f"{len(result.times)} scheduled times: started {len(result.run_ids)} "
                    f"run{'s' if len(result.run_ids) != 1 else ''}, {result.existing} existed"
                )
        except ScheduleOrphanedError as exc:
            raise CommandError(
                f"{exc} (pausing it is still possible: workflows_schedule pause {exc.name})"
            ) from None
        except WorkflowError as exc:
            raise CommandError(str(exc)) from None

    def _list(self, as_json: bool) -> None:
        rows = list(WorkflowSchedule.objects.order_by("name"))
        if as_json:
            self.stdout.write(json.dumps([schedule_document(r) for r in rows], indent=2))
            return
        if not rows:
            self.stdout.write("no schedules")
            return
        for row in rows:
            state = "orphaned" if row.orphaned else "paused" if row.paused else "active"
            self.stdout.write(
                f"{row.name}  {row.workflow_id}  {row.spec_text}  {state}  "
                f"next {format_datetime(row.next_fire_at)}  last run "
                f"{row.last_run_id or '-'}"
            )
            if row.last_error:
                self.stdout.write(f"    last error: {row.last_error}")
