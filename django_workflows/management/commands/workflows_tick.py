"""``manage.py workflows_tick [--jobs N] [--loop] [--interval SECONDS]``: run the maintenance
tick from the shell (SPEC §7.3, H-10/H-11).

One tick claims PENDING runs, polls due suspended stages, releases stale job leases, flushes the
outbox and reaps stuck runs, then prints its counts. ``--jobs N`` afterwards executes up to N
ready jobs in this process, so a cron job or a serverless host can drive the engine without a
django-q2 cluster. ``--loop`` repeats every ``--interval`` seconds until SIGINT/SIGTERM; a stop
request is honoured between ticks and between jobs, never inside one (Part I item 18).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from django.core.management.base import BaseCommand, CommandParser

from django_workflows.conf import workflow_settings
from django_workflows.kernel.dispatch import Kernel
from django_workflows.kernel.hosting import (
    ProcessResult,
    TickResult,
    default_worker_id,
    process_available_jobs,
    run_maintenance_tick,
)
from django_workflows.kernel.runtime import get_kernel

from ._common import require_positive, stop_on_signals

TICK_FIELDS = (
    "claimed",
    "suspended_checked",
    "resumed",
    "stale_released",
    "stale_given_up",
    "events_flushed",
    "stuck_reaped",
    "workers_woken",
    "errors",
)


def format_tick(tick: TickResult) -> str:
    """``tick: claimed=1 suspended_checked=0 ...`` (or a note that the tick was skipped)."""
    if tick.skipped:
        return "tick skipped: another maintenance tick holds the lease"
    return "tick: " + " ".join(f"{name}={getattr(tick, name)}" for name in TICK_FIELDS)


def format_jobs(result: ProcessResult) -> str:
    return f"jobs: processed={result.processed} succeeded={result.succeeded} failed={result.failed}"


def tick_loop(
    kernel: Kernel,
    worker_id: str,
    *,
    jobs: int = 0,
    loop: bool = False,
    interval_seconds: float = 1.0,
    stop: threading.Event,
    write: Callable[[str], Any],
) -> int:
    """Run one maintenance tick (and up to ``jobs`` ready jobs); with ``loop``, repeat every
    ``interval_seconds`` until ``stop`` is set. Returns the number of ticks run.

    ``stop`` is checked between ticks and between jobs; a job already executing finishes.
    """
    ticks = 0
    while not stop.is_set():
        write(format_tick(run_maintenance_tick(kernel, worker_id)))
        ticks += 1
        if jobs:
            write(format_jobs(process_available_jobs(kernel, worker_id, max_jobs=jobs, stop=stop)))
        if not loop or stop.wait(interval_seconds):
            break
    return ticks


class Command(BaseCommand):
    help = (
        "Run one maintenance tick (claim pending runs, poll suspended stages, release stale "
        "leases, flush the outbox, reap stuck runs) and print its counts. --jobs N also "
        "executes up to N ready jobs; --loop repeats every --interval seconds until "
        "SIGINT/SIGTERM."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--jobs",
            type=int,
            default=0,
            metavar="N",
            help="after the tick, execute up to N ready jobs in this process (default 0)",
        )
        parser.add_argument(
            "--loop", action="store_true", help="repeat until SIGINT/SIGTERM (stops between ticks)"
        )
        parser.add_argument(
            "--interval",
            type=float,
            default=None,
            metavar="SECONDS",
            help="with --loop: seconds between ticks (default TICK_INTERVAL_SECONDS)",
        )

    def handle(self, *args: Any, **opts: Any) -> None:
        jobs = int(opts["jobs"] or 0)
        require_positive(jobs, "--jobs", allow_zero=True)
        interval = opts["interval"]
        if interval is None:
            interval = float(workflow_settings.TICK_INTERVAL_SECONDS)
        require_positive(interval, "--interval")
        stop = threading.Event()
        with stop_on_signals(stop):
            tick_loop(
                get_kernel(),
                default_worker_id(),
                jobs=jobs,
                loop=bool(opts["loop"]),
                interval_seconds=float(interval),
                stop=stop,
                write=self.stdout.write,
            )
        if stop.is_set():
            self.stdout.write("stopped")
