"""``manage.py workflows_outbox <action>``: operate the event outbox (SPEC §5, Part I item 16).

Actions:

* ``flush [--max-events N] [--all]`` - publish unpublished events now, in per-run order
  (``outbox.flush``; the maintenance tick does this too). ``--all`` repeats until a pass
  publishes nothing.
* ``dead-letters [--json] [--limit N]`` - list dead-lettered events, how many later events of
  their run each one blocks, and the error of the latest failed delivery (``last_error``).
* ``replay [--max-events N] [--flush]`` - re-arm dead letters (``plugin.replayDLQ``) so the next
  flush retries them; ``--flush`` flushes right away.
* ``skip EVENT_ID [--note TEXT]`` - skip one dead letter for good (``outbox.skipDeadLetter``):
  it is never delivered, stays in the table for audit, and its run's later events flow again.
"""

from __future__ import annotations

import json
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db.models import Count, OuterRef, Subquery
from django.db.models.functions import Coalesce

from django_workflows.conf import workflow_settings
from django_workflows.kernel.commands import FlushOutbox, ReplayDeadLetters, SkipDeadLetter
from django_workflows.kernel.errors import WorkflowError
from django_workflows.kernel.runtime import get_kernel
from django_workflows.models import OutboxEvent

from ._common import format_datetime, require_positive


def dead_letters(limit: int | None = None) -> list[dict[str, Any]]:
    """Dead-lettered events in per-run order, each with ``blocks``: the number of unpublished
    later events of its run waiting behind it, and ``last_error``: the error of the latest
    failed delivery (``None`` when none was recorded).
    """
    behind = (
        OutboxEvent.objects.filter(
            workflow_run_id=OuterRef("workflow_run_id"),
            sequence__gt=OuterRef("sequence"),
            published_at__isnull=True,
        )
        .order_by()
        .values("workflow_run_id")
        .annotate(n=Count("pk"))
        .values("n")
    )
    rows = (
        OutboxEvent.objects.filter(dlq_at__isnull=False, published_at__isnull=True)
        .annotate(blocks=Coalesce(Subquery(behind), 0))
        .order_by("workflow_run_id", "sequence")
    )
    if limit is not None:
        rows = rows[:limit]
    return [
        {
            "id": row.pk,
            "workflow_run_id": str(row.workflow_run_id),
            "sequence": row.sequence,
            "event_type": row.event_type,
            "retry_count": row.retry_count,
            "dlq_at": format_datetime(row.dlq_at),
            "blocks": row.blocks,
            "last_error": row.last_error,
        }
        for row in rows
    ]


class Command(BaseCommand):
    help = (
        "Operate the event outbox: flush now, list dead letters, replay them, or skip one "
        "dead-lettered event. See `workflows_outbox <action> --help`."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
        flush = actions.add_parser("flush", help="publish unpublished events now")
        flush.add_argument(
            "--max-events", type=int, default=None, help="events per pass (default: the tick's)"
        )
        flush.add_argument(
            "--all", action="store_true", help="repeat until a pass publishes nothing"
        )
        listing = actions.add_parser("dead-letters", help="list dead-lettered events")
        listing.add_argument("--json", action="store_true", help="print a JSON list")
        listing.add_argument("--limit", type=int, default=None, help="at most N rows")
        replay = actions.add_parser("replay", help="re-arm dead letters for the next flush")
        replay.add_argument("--max-events", type=int, default=None, help="at most N (default: all)")
        replay.add_argument("--flush", action="store_true", help="flush right after replaying")
        skip = actions.add_parser("skip", help="skip one dead letter (never delivered)")
        skip.add_argument("event_id", help="the dead letter's outbox id (see dead-letters)")
        skip.add_argument("--note", default="", help="why (stored on the row for audit)")

    def handle(self, *args: Any, **opts: Any) -> None:
        action = opts["action"]
        try:
            if action == "flush":
                self._flush(opts["max_events"], opts["all"])
            elif action == "dead-letters":
                self._list(opts["json"], opts["limit"])
            elif action == "replay":
                self._replay(opts["max_events"], opts["flush"])
            else:
                self._skip(opts["event_id"], opts["note"])
        except WorkflowError as exc:
            raise CommandError(str(exc)) from None

    def _flush(self, max_events: int | None, repeat: bool) -> None:
        require_positive(max_events, "--max-events")
        size = max_events or int(workflow_settings.MAX_OUTBOX_FLUSH_PER_TICK)
        kernel = get_kernel()
        total = 0
        while True:
            published = kernel.dispatch(FlushOutbox(max_events=size)).published
            total += published
            if not repeat or published == 0:
                break
        self.stdout.write(f"published {total} event{'s' if total != 1 else ''}")
        self._summary(hint=True)

    def _list(self, as_json: bool, limit: int | None) -> None:
        require_positive(limit, "--limit")
        rows = dead_letters(limit)
        if as_json:
            self.stdout.write(json.dumps(rows, indent=2))
            return
        if not rows:
            self.stdout.write("no dead letters")
            return
        for row in rows:
            self.stdout.write(
                f"#{row['id']} run {row['workflow_run_id']} seq {row['sequence']} "
                f"{row['event_type']} retries={row['retry_count']} dead since {row['dlq_at']} "
                f"blocks {row['blocks']}"
            )
            if row["last_error"]:
                error = row["last_error"].replace("\n", "\n      ")
                self.stdout.write(f"    last error: {error}")
        self._summary(hint=False)

    def _replay(self, max_events: int | None, flush: bool) -> None:
        require_positive(max_events, "--max-events")
        if max_events is None:
            max_events = OutboxEvent.objects.filter(
                dlq_at__isnull=False, published_at__isnull=True
            ).count()
        replayed = get_kernel().dispatch(ReplayDeadLetters(max_events=max_events)).replayed
        self.stdout.write(f"replayed {replayed} dead letter{'s' if replayed != 1 else ''}")
        if flush:
            self._flush(None, True)

    def _skip(self, event_id: str, note: str) -> None:
        try:
            number = int(event_id)
        except ValueError:
            raise CommandError(
                f"event_id: {event_id!r} is not an outbox event id (expected an integer)"
            ) from None
        result = get_kernel().dispatch(SkipDeadLetter(event_id=number, note=note))
        self.stdout.write(
            self.style.SUCCESS(
                f"skipped #{result.event_id} ({result.event_type} #{result.sequence} of run "
                f"{result.workflow_run_id}); {result.unblocked} later event"
                f"{'s' if result.unblocked != 1 else ''} of the run will be delivered"
            )
        )

    def _summary(self, hint: bool) -> None:
        """How many dead letters block how many runs, and how many events wait; ``hint`` adds
        a pointer to ``dead-letters`` (not printed by that very action).
        """
        dead = OutboxEvent.objects.filter(dlq_at__isnull=False, published_at__isnull=True)
        count = dead.count()
        if count:
            runs = dead.values("workflow_run_id").distinct().count()
            see = " (see `workflows_outbox dead-letters`)" if hint else ""
            self.stdout.write(
                f"{count} dead letter{'s block' if count != 1 else ' blocks'} {runs} "
                f"run{'s' if runs != 1 else ''}{see}"
            )
        waiting = OutboxEvent.objects.filter(published_at__isnull=True, dlq_at__isnull=True).count()
        self.stdout.write(f"{waiting} event{'s' if waiting != 1 else ''} waiting")
