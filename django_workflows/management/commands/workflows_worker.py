"""``manage.py workflows_worker [--jobs-per-batch N] [--tick-interval SECONDS] [--queue Q ...]``:
a standalone, long-running worker for hosts without a django-q2 cluster (SPEC §11 item 7).

``--queue`` (repeatable) limits the worker to the jobs of those queues (stage routing); without
it the worker serves every queue. The worker announces its queues' presence at each tick.

The loop executes ready jobs in batches of up to N and runs a maintenance tick at most every
``--tick-interval`` seconds (claims of new runs, polls of suspended stages, lease and stuck-run
reaping, outbox flush). When there is nothing to execute it waits until the next tick is due.
SIGINT/SIGTERM finish the job in flight and then exit; a second SIGINT exits at once (the job
is then re-delivered once its lease expires). Several workers may run side by side: job claims
skip locked rows and maintenance ticks never overlap (Part I item 18).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import close_old_connections

from django_workflows.definition.stage import QUEUE_PATTERN
from django_workflows.kernel import routing
from django_workflows.kernel.dispatch import Kernel
from django_workflows.kernel.hosting import (
    ProcessResult,
    default_worker_id,
    process_available_jobs,
    run_maintenance_tick,
)
from django_workflows.kernel.runtime import get_kernel

from ._common import require_positive, stop_on_signals
from .workflows_tick import format_jobs, format_tick

logger = logging.getLogger("django_workflows.worker")


@dataclass
class WorkerStats:
    """What a :func:`worker_loop` did before it stopped."""

    iterations: int = 0
    ticks: int = 0
    processed: int = 0
    succeeded: int = 0
    failed: int = 0
    errors: int = 0


def worker_loop(
    kernel: Kernel,
    worker_id: str,
    *,
    stop: threading.Event,
    jobs_per_batch: int = 10,
    tick_interval_seconds: float = 1.0,
    monotonic: Callable[[], float] = time.monotonic,
    write: Callable[[str], Any] | None = None,
    queues: frozenset[str] | None = None,
) -> WorkerStats:
    """Run ticks and jobs until ``stop`` is set; see the module docstring.

    Each iteration runs a maintenance tick if ``tick_interval_seconds`` have passed since the
    last one (the first iteration always ticks), then up to ``jobs_per_batch`` ready jobs
    (``stop`` is passed on, so a stop request ends the batch after the job in flight). After a
    batch that found no work the loop waits on ``stop`` until the next tick is due.
    ``queues``: lease only these queues' jobs (``None``: all); announced with each tick
    (``None``: every queue of ``QUEUES`` and of the registered stages).
    """
    stats = WorkerStats()
    last_tick: float | None = None
    batch: ProcessResult
    while not stop.is_set():
        stats.iterations += 1
        close_old_connections()
        now = monotonic()
        try:
            if last_tick is None or now - last_tick >= tick_interval_seconds:
                last_tick = now
                tick = run_maintenance_tick(kernel, worker_id)
                stats.ticks += 1
                announced = queues
                if announced is None:
                    announced = frozenset(routing.queue_clusters()) | set(routing.stage_queues())
                routing.announce(
                    worker_id, announced, lease_clock=kernel.lease_clock, registry=kernel.registry
                )
                if write is not None and (tick.did_work or tick.errors):
                    write(format_tick(tick))
            batch = process_available_jobs(
                kernel, worker_id, max_jobs=jobs_per_batch, stop=stop, queues=queues
            )
        except Exception:
            # A job whose execution raised stays RUNNING and is re-delivered after its lease
            # expires (H-4); a database outage is retried after one tick interval.
            logger.exception("Worker %s iteration failed", worker_id)
            stats.errors += 1
            if stop.wait(tick_interval_seconds):
                break
            continue
        stats.processed += batch.processed
        stats.succeeded += batch.succeeded
        stats.failed += batch.failed
        if write is not None and batch.processed:
            write(format_jobs(batch))
        wait = 0.0
        if batch.processed == 0:
            wait = max(0.0, tick_interval_seconds - (monotonic() - (last_tick or 0.0)))
        if stop.wait(wait):
            break
    return stats


class Command(BaseCommand):
    help = (
        "Run a standalone worker (for hosts without a django-q2 cluster): execute ready jobs "
        "in batches of --jobs-per-batch and run a maintenance tick at most every "
        "--tick-interval seconds. SIGINT/SIGTERM finish the job in flight, then exit."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--jobs-per-batch",
            type=int,
            default=10,
            metavar="N",
            help="ready jobs executed between two checks for a due tick (default 10)",
        )
        parser.add_argument(
            "--tick-interval",
            type=float,
            default=1.0,
            metavar="SECONDS",
            help="at most one maintenance tick per this many seconds; also the longest idle "
            "wait before new work is noticed (default 1.0)",
        )
        parser.add_argument(
            "--queue",
            action="append",
            default=None,
            metavar="QUEUE",
            help="serve only this queue's stages (repeatable; default: every queue)",
        )

    def handle(self, *args: Any, **opts: Any) -> None:
        jobs_per_batch = int(opts["jobs_per_batch"])
        interval = float(opts["tick_interval"])
        require_positive(jobs_per_batch, "--jobs-per-batch")
        require_positive(interval, "--tick-interval")
        queues = frozenset(opts["queue"]) if opts.get("queue") else None
        for name in queues or ():
            if not QUEUE_PATTERN.match(name):
                raise CommandError(
                    f"--queue: invalid queue {name!r}: use 1-40 lower-case letters, digits, "
                    "'-' or '_', starting with a letter or digit"
                )
        worker_id = default_worker_id()
        self.stdout.write(
            f"worker {worker_id} started (jobs per batch {jobs_per_batch}, tick interval "
            f"{interval:g} s); SIGINT/SIGTERM to stop"
        )
        self.stdout.flush()
        stop = threading.Event()
        with stop_on_signals(stop):
            stats = worker_loop(
                get_kernel(),
                worker_id,
                stop=stop,
                jobs_per_batch=jobs_per_batch,
                tick_interval_seconds=interval,
                write=self.stdout.write,
                queues=queues,
            )
        self.stdout.write(
            f"worker {worker_id} stopped: {stats.processed} jobs ({stats.succeeded} succeeded, "
            f"{stats.failed} failed), {stats.ticks} ticks, {stats.errors} errors"
        )
