"""Recovery: ``lease.reapStale`` (A.8, B.5), bounded re-delivery (Part I item 3, EC-21) and
``run.reapStuck`` with the liveness rules of Part I item 4 (A.9, EC-22..24), in-process.

A "worker crash" is simulated the way it looks in the database: a leased job that is never
finished (its lease stops being refreshed), optionally after Phase 1 of ``job.execute`` (an
executor that raises leaves the stage RUNNING, EC-21). Crash tests with real processes live in
``tests/acceptance/test_crash_recovery.py``.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
from django.db import connection, transaction

from django_workflows import Suspend, define_workflow
from django_workflows.definition import Workflow
from django_workflows.kernel import (
    CancelRun,
    ClaimPendingRuns,
    CreateRun,
    ExecuteJob,
    Kernel,
    PollSuspendedStages,
    ReapStaleLeases,
    ReapStuckRuns,
    TransitionRun,
    redelivery,
)
from django_workflows.kernel import events as ev
from django_workflows.kernel.executor import ExecutionInput, ExecutionOutcome
from django_workflows.kernel.handlers import run_reap_stuck
from django_workflows.kernel.hosting import (
    process_available_jobs,
    run_maintenance_tick,
    stuck_reap_interval,
)
from django_workflows.kernel.locking import lock_run
from django_workflows.kernel.queue import JobQueue
from django_workflows.models import (
    OutboxEvent,
    Status,
    WorkflowJob,
    WorkflowLog,
    WorkflowRun,
    WorkflowStage,
)
from django_workflows.testing import FakeClock, run_to_completion
from django_workflows.transport.inline import NullTransport
from tests.markers import postgres_only
from tests.workflows import add, async_stage, two_stage

pytestmark = pytest.mark.django_db(transaction=True)

KernelFor = Callable[..., Kernel]
STALE = 300.0  # STALE_LEASE_SECONDS default (H-10)


class BrokenExecutor:
    """An executor whose machinery raises: ``job.execute`` raises after Phase 1, so the job
    stays RUNNING and the stage RUNNING (EC-21, H-4)."""

    def __init__(self) -> None:
        self.calls = 0

    def run(self, execution: ExecutionInput) -> ExecutionOutcome:
        self.calls += 1
        raise ConnectionError("executor lost its connection")


def _start(kernel: Kernel, workflow_id: str = "two-stage", priority: int = 5) -> uuid.UUID:
    """Create and claim a run: RUNNING, group-1 records and jobs PENDING."""
    res = kernel.dispatch(CreateRun(workflow_id=workflow_id, input={"value": 1}, priority=priority))
    kernel.dispatch(ClaimPendingRuns(worker_id="w"))
    return uuid.UUID(res.workflow_run_id)


def _job(run_id: uuid.UUID, stage_id: str | None = None) -> WorkflowJob:
    qs = WorkflowJob.objects.filter(workflow_run_id=run_id)
    if stage_id is not None:
        qs = qs.filter(stage_id=stage_id)
    return qs.get()


def _stage(run_id: uuid.UUID, stage_id: str) -> WorkflowStage:
    return WorkflowStage.objects.get(run_id=run_id, stage_id=stage_id)


def _types(run_id: uuid.UUID) -> list[str]:
    return list(
        OutboxEvent.objects.filter(workflow_run_id=run_id)
        .order_by("sequence")
        .values_list("event_type", flat=True)
    )


def _last_event(run_id: uuid.UUID, event_type: str) -> dict[str, Any]:
    row = (
        OutboxEvent.objects.filter(workflow_run_id=run_id, event_type=event_type)
        .order_by("-sequence")
        .first()
    )
    assert row is not None, f"no {event_type} event"
    return dict(row.payload)


def _execute(kernel: Kernel, job: WorkflowJob) -> Any:
    """``job.execute`` for a leased job, without touching the queue (a crash afterwards)."""
    return kernel.dispatch(
        ExecuteJob(
            workflow_run_id=job.workflow_run_id,
            workflow_id=job.workflow_id,
            stage_id=job.stage_id,
            config=(job.payload or {}).get("config") or {},
        )
    )


def _fan_out() -> Workflow:
    return define_workflow(id="fan-out").parallel([add(1, "a"), add(2, "b")]).build()


# --------------------------------------------------------------------------------------------
# lease.reapStale (A.8, B.5, C.8)
# --------------------------------------------------------------------------------------------


def test_reap_stale_releases_job_locked_longer_than_threshold(
    kernel_for: KernelFor, clock: FakeClock
) -> None:
    """K-LR-1, DM-45, A.8 :46, B.5 :18: a job locked 120 s ago with a 60 s threshold is
    released: PENDING, lease cleared, ``attempt`` and ``next_poll_at`` untouched, no events, the
    stage record untouched."""
    kernel = kernel_for(two_stage())
    run_id = _start(kernel)
    job = kernel.queue.dequeue("w")
    assert job is not None
    events_before = OutboxEvent.objects.count()
    stage_before = _stage(run_id, "add-1").updated_at
    clock.advance(120)

    result = kernel.dispatch(ReapStaleLeases(stale_threshold_seconds=60))

    assert (result.released, result.failed) == (1, 0)
    row = WorkflowJob.objects.get(pk=job.pk)
    assert (row.status, row.worker_id, row.locked_at) == (Status.PENDING, None, None)
    assert (row.attempt, row.next_poll_at) == (1, None)
    assert OutboxEvent.objects.count() == events_before
    assert _stage(run_id, "add-1").updated_at == stage_before


def test_reap_stale_with_nothing_stale_releases_nothing(
    kernel_for: KernelFor, clock: FakeClock
) -> None:
    """K-LR-1, A.8 :73, B.5 :48: a lease younger than the threshold is kept (still RUNNING)."""
    kernel = kernel_for(two_stage())
    _start(kernel)
    job = kernel.queue.dequeue("w")
    assert job is not None
    clock.advance(30)
    assert kernel.dispatch(ReapStaleLeases(stale_threshold_seconds=60)).released == 0
    assert WorkflowJob.objects.get(pk=job.pk).status == Status.RUNNING


def test_reap_stale_default_threshold_is_300_seconds(
    kernel_for: KernelFor, clock: FakeClock
) -> None:
    """DM-45, H-10, B.5 :68: the tick reaps with STALE_LEASE_SECONDS (300 s): a 30 s old lease
    survives, a 301 s old one is released."""
    kernel = kernel_for(two_stage())
    _start(kernel)
    job = kernel.queue.dequeue("w")
    assert job is not None
    clock.advance(30)
    assert run_maintenance_tick(kernel, "t").stale_released == 0
    assert WorkflowJob.objects.get(pk=job.pk).status == Status.RUNNING
    clock.advance(271)
    assert run_maintenance_tick(kernel, "t").stale_released == 1
    assert WorkflowJob.objects.get(pk=job.pk).status == Status.PENDING


def test_reap_stale_released_job_is_delivered_again_with_its_data(
    kernel_for: KernelFor, clock: FakeClock
) -> None:
    """DM-45, SM-31, B.5 :163/:185, B.6 :127/:176: a released job is dequeued again with the
    next delivery count; priority and payload are preserved."""
    kernel = kernel_for(two_stage())
    _start(kernel, priority=8)
    first = kernel.queue.dequeue("w-1")
    assert first is not None and first.attempt == 1
    clock.advance(STALE + 1)
    kernel.dispatch(ReapStaleLeases(stale_threshold_seconds=STALE))

    again = kernel.queue.dequeue("w-2")

    assert again is not None and again.pk == first.pk
    assert (again.attempt, again.worker_id, again.priority) == (2, "w-2", 8)
    assert again.payload == first.payload
    assert again.locked_at == clock.now()


@pytest.mark.parametrize(
    "status", [Status.PENDING, Status.COMPLETED, Status.FAILED, Status.SUSPENDED]
)
def test_reap_stale_never_touches_jobs_that_are_not_running(
    kernel_for: KernelFor, clock: FakeClock, status: str
) -> None:
    """DM-45, SM-27, B.5 :211/:226/:247/:269: only RUNNING jobs are released, however old
    their ``locked_at``."""
    kernel = kernel_for(two_stage())
    run_id = _start(kernel)
    WorkflowJob.objects.filter(workflow_run_id=run_id).update(
        status=status, locked_at=clock.now(), attempt=1
    )
    clock.advance(3600)
    assert kernel.dispatch(ReapStaleLeases(stale_threshold_seconds=60)).released == 0
    assert _job(run_id).status == status


def test_reap_stale_spares_a_heartbeated_job(kernel_for: KernelFor, clock: FakeClock) -> None:
    """DM-45/46, H-2, C.8 :2141: of two leased jobs, the one whose heartbeat touched it
    survives the reaper; the untouched one is released (PENDING, lease cleared)."""
    kernel = kernel_for(_fan_out())
    _start(kernel, "fan-out")
    beating, silent = kernel.queue.dequeue("w-1"), kernel.queue.dequeue("w-2")
    assert beating is not None and silent is not None
    clock.advance(STALE - 10)
    assert kernel.queue.touch(beating.pk)
    clock.advance(20)

    assert kernel.dispatch(ReapStaleLeases(stale_threshold_seconds=STALE)).released == 1

    kept, released = WorkflowJob.objects.get(pk=beating.pk), WorkflowJob.objects.get(pk=silent.pk)
    assert (kept.status, kept.worker_id) == (Status.RUNNING, "w-1")
    assert (released.status, released.worker_id, released.locked_at) == (
        Status.PENDING,
        None,
        None,
    )


# --------------------------------------------------------------------------------------------
# Bounded re-delivery (Part I item 3, EC-21)
# --------------------------------------------------------------------------------------------


def test_crashing_job_is_given_up_after_max_attempts_and_fails_the_run(
    kernel_for: KernelFor, clock: FakeClock
) -> None:
    """Part I item 3, EC-21, H-4, K-LR-1: ``job.execute`` raises on every delivery (the job
    stays RUNNING); the reaper releases it twice, and on the third stale lease (deliveries =
    ``max_attempts`` = 3) gives it up instead: job FAILED, stage FAILED with a clear message,
    ``stage:failed`` then ``workflow:failed`` carrying it, run FAILED. Nothing is delivered
    again."""
    executor = BrokenExecutor()
    kernel = kernel_for(two_stage(), executor=executor)
    run_id = _start(kernel)

    for delivery in (1, 2, 3):
        with pytest.raises(ConnectionError):
            process_available_jobs(kernel, "w")
        job = _job(run_id)
        assert (job.status, job.attempt) == (Status.RUNNING, delivery)
        assert _stage(run_id, "add-1").status == Status.RUNNING
        clock.advance(STALE + 1)
        result = kernel.dispatch(ReapStaleLeases(stale_threshold_seconds=STALE))
        assert (result.released, result.failed) == ((1, 0) if delivery < 3 else (0, 1))

    message = (
        f"Job {job.pk} of stage 'add-1' was delivered 3 times without finishing (worker crash "
        "or infrastructure error); giving up after max_attempts=3"
    )
    job = _job(run_id)
    assert (job.status, job.attempt, job.last_error) == (Status.FAILED, 3, message)
    assert (job.completed_at, job.worker_id, job.locked_at) == (clock.now(), None, None)
    stage = _stage(run_id, "add-1")
    assert (stage.status, stage.error_message, stage.completed_at) == (
        Status.FAILED,
        message,
        clock.now(),
    )
    run = WorkflowRun.objects.get(pk=run_id)
    assert (run.status, run.completed_at) == (Status.FAILED, clock.now())
    assert _types(run_id)[-2:] == [ev.STAGE_FAILED, ev.WORKFLOW_FAILED]
    assert _last_event(run_id, ev.STAGE_FAILED)["error"] == message
    assert _last_event(run_id, ev.WORKFLOW_FAILED)["error"] == message
    assert WorkflowLog.objects.filter(run_id=run_id, level="ERROR", message__contains=message)

    assert process_available_jobs(kernel, "w").processed == 0
    assert executor.calls == 3


def test_dequeue_gives_up_a_job_whose_deliveries_are_used_up(
    kernel_for: KernelFor, clock: FakeClock
) -> None:
    """Part I item 3, EC-21, DM-41: a PENDING job that was already delivered ``max_attempts``
    times (e.g. released before the limit was lowered) is not leased: ``dequeue`` fails it,
    its stage and its run, and leases the next ready job instead."""
    kernel = kernel_for(two_stage())
    exhausted_run = _start(kernel)
    WorkflowJob.objects.filter(workflow_run_id=exhausted_run).update(attempt=3, max_attempts=3)
    clock.advance(1)
    other_run = _start(kernel)

    leased = kernel.queue.dequeue("w")

    assert leased is not None and leased.workflow_run_id == other_run
    job = _job(exhausted_run)
    assert (job.status, job.attempt, job.worker_id) == (Status.FAILED, 3, None)
    assert "was delivered 3 times without finishing" in (job.last_error or "")
    assert "giving up after max_attempts=3" in (job.last_error or "")
    stage = _stage(exhausted_run, "add-1")
    assert (stage.status, stage.error_message) == (Status.FAILED, job.last_error)
    assert WorkflowRun.objects.get(pk=exhausted_run).status == Status.FAILED
    assert _types(exhausted_run)[-2:] == [ev.STAGE_FAILED, ev.WORKFLOW_FAILED]
    assert WorkflowRun.objects.get(pk=other_run).status == Status.RUNNING
    assert kernel.queue.dequeue("w") is None


def test_queue_without_kernel_hook_fails_only_the_exhausted_job(clock: FakeClock) -> None:
    """Part I item 3, DM-41: a bare :class:`JobQueue` (no kernel) never re-delivers an
    exhausted job either; it fails the job row and leaves stage and run to the kernel."""
    queue = JobQueue(clock, NullTransport())
    run_id = uuid.uuid4()
    from django_workflows.kernel.queue import JobSpec

    (job_id,) = queue.enqueue([JobSpec(run_id, "wf", "s")])
    WorkflowJob.objects.filter(pk=job_id).update(attempt=3)

    assert queue.dequeue("w") is None

    job = WorkflowJob.objects.get(pk=job_id)
    assert (job.status, job.attempt, job.completed_at) == (Status.FAILED, 3, clock.now())
    assert "giving up after max_attempts=3" in (job.last_error or "")


def test_given_up_stage_fails_the_run_once_its_parallel_sibling_finishes(
    kernel_for: KernelFor, clock: FakeClock
) -> None:
    """Part I item 3, K-TR-4/5, EC-9: when a job of a parallel group is given up while its
    sibling is still queued, the stage fails at once but the run waits (transition is a
    ``noop``); the sibling's completion then fails the run with the give-up message."""
    kernel = kernel_for(_fan_out())
    run_id = _start(kernel, "fan-out")
    crashed = kernel.queue.dequeue("w")
    assert crashed is not None and crashed.stage_id == "a"
    WorkflowJob.objects.filter(pk=crashed.pk).update(max_attempts=1)
    clock.advance(STALE + 1)

    assert kernel.dispatch(ReapStaleLeases(stale_threshold_seconds=STALE)).failed == 1

    assert _stage(run_id, "a").status == Status.FAILED
    assert WorkflowRun.objects.get(pk=run_id).status == Status.RUNNING
    assert process_available_jobs(kernel, "w").succeeded == 1  # sibling b
    run = WorkflowRun.objects.get(pk=run_id)
    assert run.status == Status.FAILED
    assert "giving up after max_attempts=1" in _last_event(run_id, ev.WORKFLOW_FAILED)["error"]


def test_given_up_job_of_a_completed_stage_completes_and_advances_the_run(
    kernel_for: KernelFor, clock: FakeClock
) -> None:
    """Part I item 3, K-JE-5, EC-11: a job left RUNNING, exhausted, whose stage record is
    COMPLETED (the outcome transaction settles the job with the record, so only a job left
    by an engine that settled them apart looks like this): the reaper settles it COMPLETED
    (not failed), the run advanced and then completes normally."""
    kernel = kernel_for(two_stage())
    run_id = _start(kernel)
    job = kernel.queue.dequeue("w")
    assert job is not None
    assert _execute(kernel, job).outcome == "completed"
    WorkflowJob.objects.filter(pk=job.pk).update(
        status=Status.RUNNING, worker_id="w", locked_at=job.locked_at, max_attempts=1
    )  # ... left RUNNING, its worker dead
    clock.advance(STALE + 1)

    assert kernel.dispatch(ReapStaleLeases(stale_threshold_seconds=STALE)).failed == 1

    assert WorkflowJob.objects.get(pk=job.pk).status == Status.COMPLETED
    assert _stage(run_id, "add-1").status == Status.COMPLETED
    assert _job(run_id, "add-10").status == Status.PENDING
    assert ev.STAGE_FAILED not in _types(run_id)
    assert run_to_completion(kernel, run_id).output == {"value": 12}


def test_given_up_job_of_a_suspended_stage_is_left_to_the_poller(
    kernel_for: KernelFor, clock: FakeClock
) -> None:
    """Part I item 3, SM-22/26: a job left RUNNING, exhausted, whose stage record is SUSPENDED
    (as above: only a job left by an engine that settled them apart): it becomes SUSPENDED at
    the stage's next poll (no events, run still RUNNING); the poller resumes the stage,
    completes the job and the run finishes."""
    wf = define_workflow(id="with-batch").pipe(async_stage()).pipe(add(1)).build()
    kernel = kernel_for(wf)
    run_id = _start(kernel, "with-batch")
    job = kernel.queue.dequeue("w")
    assert job is not None
    assert _execute(kernel, job).outcome == "suspended"
    WorkflowJob.objects.filter(pk=job.pk).update(
        status=Status.RUNNING, worker_id="w", locked_at=job.locked_at, max_attempts=1
    )  # ... left RUNNING, its worker dead
    events_before = OutboxEvent.objects.filter(workflow_run_id=run_id).count()
    clock.advance(STALE + 1)

    assert kernel.dispatch(ReapStaleLeases(stale_threshold_seconds=STALE)).failed == 1

    settled = WorkflowJob.objects.get(pk=job.pk)
    assert settled.status == Status.SUSPENDED
    assert settled.next_poll_at == _stage(run_id, "batch").next_poll_at
    assert OutboxEvent.objects.filter(workflow_run_id=run_id).count() == events_before
    clock.advance(5)
    assert kernel.dispatch(PollSuspendedStages()).resumed == 1
    assert WorkflowJob.objects.get(pk=job.pk).status == Status.COMPLETED
    assert kernel.dispatch(TransitionRun(run_id)).action == "advanced"  # as the tick does
    assert run_to_completion(kernel, run_id).output == {"value": 100}


def test_given_up_job_of_a_cancelled_run_only_fails_the_job(
    kernel_for: KernelFor, clock: FakeClock
) -> None:
    """Part I item 3, K-CA-3, SM-6: a RUNNING job of a cancelled run that is exhausted is
    FAILED; the run stays CANCELLED and no event is written."""
    kernel = kernel_for(two_stage())
    run_id = _start(kernel)
    job = kernel.queue.dequeue("w")
    assert job is not None
    kernel.dispatch(CancelRun(run_id))
    WorkflowJob.objects.filter(pk=job.pk).update(max_attempts=1)
    events_before = OutboxEvent.objects.count()
    clock.advance(STALE + 1)

    assert kernel.dispatch(ReapStaleLeases(stale_threshold_seconds=STALE)).failed == 1

    assert WorkflowJob.objects.get(pk=job.pk).status == Status.FAILED
    assert WorkflowRun.objects.get(pk=run_id).status == Status.CANCELLED
    assert OutboxEvent.objects.count() == events_before


def test_give_up_that_raises_still_fails_the_job_and_stuck_reaping_ends_the_run(
    kernel_for: KernelFor, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Part I items 3 and 4, EC-21, K-RS-3: if settling the stage raises, the kernel's writes
    roll back but the job is still FAILED (never delivered again); with no live work left,
    ``run.reapStuck`` fails the run - its recovery sweep does not replace a job that was given
    up, so the bounded re-delivery cannot restart."""
    kernel = kernel_for(two_stage())
    run_id = _start(kernel)
    job = kernel.queue.dequeue("w")
    assert job is not None
    WorkflowJob.objects.filter(pk=job.pk).update(max_attempts=1)

    def broken(*args: Any, **kwargs: Any) -> int:
        raise RuntimeError("stage table unavailable")

    monkeypatch.setattr(redelivery, "update_stage", broken)
    clock.advance(STALE + 1)

    assert kernel.dispatch(ReapStaleLeases(stale_threshold_seconds=STALE)).failed == 1

    assert WorkflowJob.objects.get(pk=job.pk).status == Status.FAILED
    assert _stage(run_id, "add-1").status == Status.PENDING
    assert WorkflowRun.objects.get(pk=run_id).status == Status.RUNNING
    assert kernel.queue.dequeue("w") is None
    clock.advance(STALE)
    result = kernel.dispatch(ReapStuckRuns(stuck_threshold_seconds=STALE))
    assert (result.failed, result.recovered) == (1, 0)
    assert WorkflowRun.objects.get(pk=run_id).status == Status.FAILED
    assert WorkflowJob.objects.filter(workflow_run_id=run_id).count() == 1


def _hold_run_lock(run_id: uuid.UUID) -> tuple[threading.Event, threading.Event, threading.Thread]:
    """Another connection holds the run's row lock until ``release`` is set."""
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        try:
            with transaction.atomic():
                lock_run(run_id)
                held.set()
                release.wait(10)
        finally:
            connection.close()

    thread = threading.Thread(target=hold, daemon=True)
    thread.start()
    assert held.wait(10)
    return held, release, thread


@postgres_only
def test_give_up_waits_for_a_locked_run_instead_of_blocking(
    kernel_for: KernelFor, clock: FakeClock
) -> None:
    """Part I items 1 and 3: the kernel never waits for a run row while holding job locks (that
    could deadlock with ``run.cancel``, which locks run then jobs). While another transaction
    holds the run, ``dequeue`` and the reaper leave the exhausted job alone; afterwards they
    give it up."""
    kernel = kernel_for(two_stage())
    run_id = _start(kernel)
    WorkflowJob.objects.filter(workflow_run_id=run_id).update(attempt=3)
    _, release, thread = _hold_run_lock(run_id)
    try:
        assert kernel.queue.dequeue("w") is None
        assert _job(run_id).status == Status.PENDING
    finally:
        release.set()
        thread.join(10)
    assert kernel.queue.dequeue("w") is None
    assert _job(run_id).status == Status.FAILED
    assert WorkflowRun.objects.get(pk=run_id).status == Status.FAILED

    run_id = _start(kernel)
    job = kernel.queue.dequeue("w")
    assert job is not None
    WorkflowJob.objects.filter(pk=job.pk).update(max_attempts=1)
    clock.advance(STALE + 1)
    _, release, thread = _hold_run_lock(run_id)
    try:
        result = kernel.dispatch(ReapStaleLeases(stale_threshold_seconds=STALE))
        assert (result.released, result.failed) == (0, 0)
    finally:
        release.set()
        thread.join(10)
    assert kernel.dispatch(ReapStaleLeases(stale_threshold_seconds=STALE)).failed == 1
    assert WorkflowRun.objects.get(pk=run_id).status == Status.FAILED


# --------------------------------------------------------------------------------------------
# run.reapStuck (A.9, Part I item 4)
# --------------------------------------------------------------------------------------------


def _crashed_run(kernel: Kernel, clock: FakeClock, idle_seconds: float = 600) -> uuid.UUID:
    """A RUNNING run whose only job was leased by a worker that died ``idle_seconds`` ago:
    stage RUNNING (Phase 1 done), job RUNNING with a lease nobody refreshes."""
    run_id = _start(kernel)
    job = kernel.queue.dequeue("w")
    assert job is not None
    with pytest.raises(ConnectionError):
        _execute(kernel, job)
    clock.advance(idle_seconds)
    return run_id


def test_reap_stuck_fails_an_idle_run_that_nothing_will_advance(
    kernel_for: KernelFor, clock: FakeClock
) -> None:
    """K-RS-1/4/5, A.9 :32/:154, Part I item 4: a run idle for 10 min (threshold 5 min) whose
    job's lease is stale is FAILED with ``STUCK_RUN_REAPED`` (message and event mention the
    threshold, stage statuses listed); ``transitioned == failed == 1``; stage and job rows keep
    their status."""
    kernel = kernel_for(two_stage(), executor=BrokenExecutor())
    run_id = _crashed_run(kernel, clock)

    result = kernel.dispatch(ReapStuckRuns(stuck_threshold_seconds=300))

    assert (result.transitioned, result.failed, result.recovered) == (1, 1, 0)
    run = WorkflowRun.objects.get(pk=run_id)
    assert (run.status, run.completed_at) == (Status.FAILED, clock.now())
    error = run.output["error"]
    assert error["code"] == "STUCK_RUN_REAPED"
    assert "300" in error["message"]
    assert error["stage_statuses"] == [{"stage_id": "add-1", "status": Status.RUNNING}]
    assert _last_event(run_id, ev.WORKFLOW_FAILED)["error"] == error["message"]
    assert _stage(run_id, "add-1").status == Status.RUNNING
    assert _job(run_id).status == Status.RUNNING


def test_reap_stuck_leaves_runs_with_recent_activity(
    kernel_for: KernelFor, clock: FakeClock
) -> None:
    """K-RS-1, A.9 :61: activity within the threshold -> failed 0, transitioned 0."""
    kernel = kernel_for(two_stage(), executor=BrokenExecutor())
    run_id = _crashed_run(kernel, clock, idle_seconds=120)
    result = kernel.dispatch(ReapStuckRuns(stuck_threshold_seconds=300))
    assert (result.transitioned, result.failed) == (0, 0)
    assert WorkflowRun.objects.get(pk=run_id).status == Status.RUNNING


def test_reap_stuck_never_reaps_pending_or_finished_runs(
    kernel_for: KernelFor, clock: FakeClock
) -> None:
    """DM-31, K-RS-2, A.9 :87/:112, EC-14: PENDING and COMPLETED runs are never reaped."""
    kernel = kernel_for(two_stage())
    done = _start(kernel)
    run_to_completion(kernel, done)
    pending = kernel.dispatch(CreateRun(workflow_id="two-stage", input={"value": 1}))
    clock.advance(3600)

    result = kernel.dispatch(ReapStuckRuns(stuck_threshold_seconds=300))

    assert result.failed == 0
    assert WorkflowRun.objects.get(pk=pending.workflow_run_id).status == Status.PENDING
    assert WorkflowRun.objects.get(pk=done).status == Status.COMPLETED


def test_reap_stuck_skips_a_run_another_writer_failed_first(
    kernel_for: KernelFor, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """K-RS-2/4, EC-14, A.9 :179: the run is a candidate, but before the reaper locks it a
    concurrent reaper fails it: the reaper re-checks under the lock and skips it (failed 0,
    transitioned 0, no second ``workflow:failed``, no error)."""
    kernel = kernel_for(two_stage(), executor=BrokenExecutor())
    run_id = _crashed_run(kernel, clock)
    real_lock = run_reap_stuck.try_lock_run

    def lock_after_concurrent_reaper(rid: uuid.UUID) -> WorkflowRun | object | None:
        WorkflowRun.objects.filter(pk=rid).update(status=Status.FAILED)
        return real_lock(rid)

    monkeypatch.setattr(run_reap_stuck, "try_lock_run", lock_after_concurrent_reaper)

    result = kernel.dispatch(ReapStuckRuns(stuck_threshold_seconds=300))

    assert (result.transitioned, result.failed) == (0, 0)
    assert ev.WORKFLOW_FAILED not in _types(run_id)


def test_reap_stuck_re_enqueues_a_pending_stage_without_a_job(
    kernel_for: KernelFor, clock: FakeClock
) -> None:
    """K-RS-3, EC-2, A.9 :215: a PENDING stage whose job is gone is re-enqueued instead of
    failed: failed 0, recovered 1, run RUNNING, exactly one new PENDING job (run priority,
    config payload); the run then completes."""
    kernel = kernel_for(two_stage())
    run_id = _start(kernel, priority=7)
    WorkflowJob.objects.filter(workflow_run_id=run_id).delete()
    clock.advance(600)

    result = kernel.dispatch(ReapStuckRuns(stuck_threshold_seconds=300))

    assert (result.failed, result.recovered) == (0, 1)
    assert WorkflowRun.objects.get(pk=run_id).status == Status.RUNNING
    job = _job(run_id)
    assert (job.status, job.stage_id, job.priority, job.attempt) == (
        Status.PENDING,
        "add-1",
        7,
        0,
    )
    assert job.payload == {"config": WorkflowRun.objects.get(pk=run_id).config}
    assert run_to_completion(kernel, run_id).status == Status.COMPLETED


def test_reap_stuck_spares_a_run_whose_job_heartbeats(
    kernel_for: KernelFor, clock: FakeClock
) -> None:
    """Part I item 4, EC-22: a stage running longer than the stuck threshold is not reaped
    while its job's lease is fresh (heartbeats touch it), although run and stage rows are
    idle; once the heartbeats stop and the lease goes stale, it is."""
    kernel = kernel_for(two_stage(), executor=BrokenExecutor())
    run_id = _crashed_run(kernel, clock, idle_seconds=1000)
    kernel.queue.touch(_job(run_id).pk)  # the heartbeat of a live worker

    assert kernel.dispatch(ReapStuckRuns(stuck_threshold_seconds=300)).failed == 0
    assert WorkflowRun.objects.get(pk=run_id).status == Status.RUNNING

    clock.advance(STALE + 1)  # no heartbeat since
    assert kernel.dispatch(ReapStuckRuns(stuck_threshold_seconds=300)).failed == 1


def test_reap_stuck_spares_a_suspended_stage_with_a_future_poll(
    kernel_for: KernelFor, clock: FakeClock
) -> None:
    """Part I item 4, EC-23: a stage suspended with a one-hour poll interval is not reaped
    after 10 idle minutes, nor after its poll time while its ``max_wait_until`` is ahead."""
    from django_workflows import CompletionCheck, define_async_batch_stage

    hourly = define_async_batch_stage(
        id="hourly",
        execute=lambda ctx: Suspend(
            state={"batch_id": "b"}, poll_interval_seconds=3600, max_wait_seconds=86400
        ),
        check_completion=lambda state, ctx: CompletionCheck.not_ready(),
    )
    kernel = kernel_for(define_workflow(id="hourly-wf").pipe(hourly).build())
    run_id = _start(kernel, "hourly-wf")
    job = kernel.queue.dequeue("w")
    assert job is not None
    result = _execute(kernel, job)
    kernel.queue.suspend(job.pk, result.next_poll_at)

    clock.advance(600)
    assert kernel.dispatch(ReapStuckRuns(stuck_threshold_seconds=300)).failed == 0
    clock.advance(3600)  # the poll is due, nobody polled; the deadline is still ahead
    assert kernel.dispatch(ReapStuckRuns(stuck_threshold_seconds=300)).failed == 0
    assert WorkflowRun.objects.get(pk=run_id).status == Status.RUNNING


def test_reap_stuck_spares_a_run_with_a_queued_job(kernel_for: KernelFor, clock: FakeClock) -> None:
    """Part I item 4, EC-24 (overrides A.9 :32): a claimed run whose job waits in the queue
    (a backlog, or a retry back-off) is not stuck, however long it waits."""
    kernel = kernel_for(two_stage())
    run_id = _start(kernel)
    clock.advance(3600)
    assert kernel.dispatch(ReapStuckRuns(stuck_threshold_seconds=300)).failed == 0

    WorkflowJob.objects.filter(workflow_run_id=run_id).update(
        attempt=1, next_poll_at=clock.now() + timedelta(hours=1)
    )
    clock.advance(600)
    assert kernel.dispatch(ReapStuckRuns(stuck_threshold_seconds=300)).failed == 0
    assert WorkflowRun.objects.get(pk=run_id).status == Status.RUNNING


def test_reap_stuck_through_the_tick_counts_reaped_runs(
    kernel_for: KernelFor, clock: FakeClock
) -> None:
    """H-10/H-11, Part I items 3 and 4: the tick counts stale jobs given up
    (``stale_given_up``) and reaped runs (``stuck_reaped``); stuck reaping uses
    STUCK_THRESHOLD_SECONDS (default max(3 x stale lease, 300) = 900 s) and runs at most every
    ``stuck_reap_interval`` (issue 19: 30 s here)."""
    kernel = kernel_for(two_stage(), executor=BrokenExecutor())
    run_id = _crashed_run(kernel, clock, idle_seconds=600)
    WorkflowJob.objects.filter(workflow_run_id=run_id).update(max_attempts=1)
    tick = run_maintenance_tick(kernel, "t")
    # the stale job is given up first (bounded re-delivery): the run fails with that message
    assert (tick.stale_released, tick.stale_given_up, tick.stuck_reaped) == (0, 1, 0)
    assert WorkflowRun.objects.get(pk=run_id).status == Status.FAILED
    assert "giving up" in _last_event(run_id, ev.WORKFLOW_FAILED)["error"]

    other = _crashed_run(kernel, clock, idle_seconds=0)
    WorkflowJob.objects.filter(workflow_run_id=other).update(status=Status.FAILED)
    clock.advance(899)
    assert run_maintenance_tick(kernel, "t").stuck_reaped == 0
    clock.advance(2)  # stuck now, but the reaper ran 2 s ago: it runs every 30 s at most
    assert run_maintenance_tick(kernel, "t").stuck_reaped == 0
    clock.advance(stuck_reap_interval(900))
    assert run_maintenance_tick(kernel, "t").stuck_reaped == 1
    assert WorkflowRun.objects.get(pk=other).output["error"]["code"] == "STUCK_RUN_REAPED"


def test_transition_after_give_up_is_idempotent(kernel_for: KernelFor, clock: FakeClock) -> None:
    """Part I item 3, K-TR-1: a later ``run.transition`` of the failed run is a noop (the
    give-up already transitioned it; one ``workflow:failed``)."""
    kernel = kernel_for(two_stage())
    run_id = _start(kernel)
    WorkflowJob.objects.filter(workflow_run_id=run_id).update(attempt=3)
    assert kernel.queue.dequeue("w") is None
    assert kernel.dispatch(TransitionRun(run_id)).action == "noop"
    assert _types(run_id).count(ev.WORKFLOW_FAILED) == 1
