"""A test kit for projects that use django-workflows (and for our own tests).

* :class:`FakeClock` - an exact, advanceable clock for the kernel.
* :func:`make_kernel` - a kernel with a fake clock, a private registry and no transport.
* :func:`run_to_completion` - drive a run through claims, jobs and polls in-process.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from ..definition.registry import WorkflowRegistry
from ..definition.workflow import Workflow
from ..kernel.dispatch import Kernel
from ..kernel.hosting import process_available_jobs, run_maintenance_tick
from ..models import TERMINAL_RUN_STATUSES, WorkflowRun
from ..plugins import PluginRunner
from ..ports import EventSink, JobTransport
from ..transport.inline import RecordingTransport


def _utc(when: datetime) -> datetime:
    """``when`` in UTC, so ``advance`` is elapsed-time arithmetic (a local zone's wall-clock
    arithmetic would run backwards across a DST change).

    Raises:
        ValueError: ``when`` is naive (its zone would be a guess).
    """
    if when.tzinfo is None or when.utcoffset() is None:
        raise ValueError(f"FakeClock needs a zone-aware datetime, got naive {when.isoformat()}")
    return when.astimezone(UTC)


class FakeClock:
    """A clock that only moves when told (Appendix C). Default start 2025-01-01T00:00:00Z.

    It also drives lease time (``drives_leases``): leases are stamped and judged with this
    clock instead of the database's, so a test can expire a lease by advancing it.
    """

    drives_leases = True

    def __init__(self, start: datetime | None = None) -> None:
        self._now = _utc(start or datetime(2025, 1, 1, tzinfo=UTC))

    def now(self) -> datetime:
        """The current fake time, in UTC (the Clock port's promise)."""
        return self._now

    def advance(self, seconds: float = 0, **kwargs: float) -> datetime:
        """Move forward by ``seconds`` (plus ``timedelta`` keyword arguments)."""
        self._now += timedelta(seconds=seconds, **kwargs)
        return self._now

    def set(self, when: datetime) -> None:
        """Jump to ``when`` (zone-aware; converted to UTC).

        Raises:
            ValueError: ``when`` is naive.
        """
        self._now = _utc(when)


class CollectingSink(PluginRunner):
    """An event sink that records every event it is given (and can be told to fail)."""

    def __init__(self, max_retries: int = 3) -> None:
        super().__init__([], max_retries=max_retries)
        self.events: list[dict[str, Any]] = []
        self.fail_with: Exception | None = None

    def emit(self, event: dict[str, Any]) -> None:
        if self.fail_with is not None:
            raise self.fail_with
        super().emit(event)
        self.events.append(event)

    def types(self, run_id: Any = None) -> list[str]:
        return [
            e["type"] for e in self.events if run_id is None or e["workflow_run_id"] == str(run_id)
        ]


def make_kernel(
    *workflows: Workflow,
    clock: FakeClock | None = None,
    transport: JobTransport | None = None,
    event_sink: EventSink | None = None,
    **kwargs: Any,
) -> Kernel:
    """A kernel for tests: its own registry holding ``workflows``, a :class:`FakeClock` set to
    the real time (so database-stamped and kernel times agree), a recording transport and a
    collecting sink.
    """
    registry = WorkflowRegistry()
    for wf in workflows:
        registry.register(wf)
    return Kernel(
        registry=registry,
        clock=clock or FakeClock(datetime.now(UTC)),
        transport=transport or RecordingTransport(),
        event_sink=event_sink or CollectingSink(),
        **kwargs,
    )


def run_to_completion(
    kernel: Kernel, run_id: Any, *, max_rounds: int = 100, advance_seconds: float = 0
) -> WorkflowRun:
    """Drive a run in-process until it is terminal: tick (claim, poll, flush), execute ready
    jobs, and advance a :class:`FakeClock` by ``advance_seconds`` per round so suspended stages
    and retries come due.

    Raises:
        AssertionError: the run is not terminal after ``max_rounds`` rounds.
    """
    for _ in range(max_rounds):
        run_maintenance_tick(kernel, "test-worker")
        process_available_jobs(kernel, "test-worker", max_jobs=100)
        run = WorkflowRun.objects.get(pk=run_id)
        if run.status in TERMINAL_RUN_STATUSES:
            run_maintenance_tick(kernel, "test-worker")  # flush the last events
            return run
        if advance_seconds and isinstance(kernel.clock, FakeClock):
            kernel.clock.advance(advance_seconds)
    raise AssertionError(f"Run {run_id} not terminal after {max_rounds} rounds: {run.status}")
