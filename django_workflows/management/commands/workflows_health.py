"""``manage.py workflows_health``: the engine's health checks (issue 20 item 4).

::

    $ python manage.py workflows_health
    ok    database        reachable
    ok    ticker          not needed: no live run
    ok    workers:default 2 workers (versions 3f1c2a9b0d4e)
    FAIL  workers:gpu     no live worker serves queue 'gpu'
    ok    outbox          no undelivered event, 0 undelivered
    ok    dead_letters    0 dead letters
    unhealthy: workers:gpu

Exit codes: 0 healthy; 1 unhealthy (the failing checks are named, on stderr in the human
form and in ``failing`` of ``--json``; a database that does not answer within
``HEALTH_TIMEOUT_SECONDS`` fails ``database`` as ``timed out``, ``"reason": "timeout"`` in
``--json``); 2 bad usage (an unknown option, a negative
threshold). ``--liveness`` reads nothing and exits 0: the process starts and its settings
load (a liveness probe must not fail because the database does).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from django_workflows.conf import workflow_settings
from django_workflows.health.checks import evaluate
from django_workflows.health.views import bounded_snapshot

EXIT_HEALTHY = 0
EXIT_UNHEALTHY = 1
EXIT_USAGE = 2


def _non_negative(kind: type) -> Any:
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a {kind.__name__}, got {text!r}") from None
        if value < 0 or value != value:
            raise argparse.ArgumentTypeError(f"must be 0 or more, got {text}")
        return value

    parse.__name__ = kind.__name__
    return parse


class Command(BaseCommand):
    help = (
        "Check the engine's health: database reachable, ticker lease held by a live worker "
        "while runs are live, a live worker per queue, outbox lag and dead letters within "
        "their thresholds. Exit 0 healthy, 1 unhealthy, 2 bad usage."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--json", action="store_true", help="print one JSON document")
        parser.add_argument(
            "--max-outbox-lag-seconds",
            type=_non_negative(float),
            default=None,
            help="outbox check bound (default: HEALTH_MAX_OUTBOX_LAG_SECONDS)",
        )
        parser.add_argument(
            "--max-dead-letters",
            type=_non_negative(int),
            default=None,
            help="dead-letter check bound (default: HEALTH_MAX_DEAD_LETTERS)",
        )
        parser.add_argument(
            "--queue",
            action="append",
            default=None,
            metavar="Q",
            help="a queue that needs a live worker (repeatable; default: QUEUES + default)",
        )
        parser.add_argument(
            "--liveness",
            action="store_true",
            help="read nothing, exit 0: the process starts (for a liveness probe)",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        as_json = options["json"]
        if options["liveness"]:
            if as_json:
                self.stdout.write(json.dumps({"status": "live"}))
            else:
                self.stdout.write("live")
            return
        queues = options["queue"]
        if queues is not None:
            bad = [q for q in queues if not q.strip()]
            if bad:
                raise CommandError("--queue needs a queue name", returncode=EXIT_USAGE)
        lag = options["max_outbox_lag_seconds"]
        dead = options["max_dead_letters"]
        report = evaluate(
            bounded_snapshot(),
            queues=queues,
            max_outbox_lag_seconds=(
                lag if lag is not None else workflow_settings.HEALTH_MAX_OUTBOX_LAG_SECONDS
            ),
            max_dead_letters=dead
            if dead is not None
            else workflow_settings.HEALTH_MAX_DEAD_LETTERS,
        )
        if as_json:
            self.stdout.write(json.dumps(report.to_dict(), indent=2))
        else:
            width = max(len(c.name) for c in report.checks)
            for check in report.checks:
                mark = "ok  " if check.ok else "FAIL"
                self.stdout.write(f"{mark}  {check.name.ljust(width)} {check.detail}")
            self.stdout.write("healthy" if report.healthy else "unhealthy")
        if not report.healthy:
            raise CommandError(f"unhealthy: {', '.join(report.failing)}", returncode=EXIT_UNHEALTHY)
