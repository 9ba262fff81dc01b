"""Hosts in-process (SPEC §7.2-7.3, §7.6; catalogue E.1, E.3; Part I item 18) and the executor
port (§4.13, A.15): ``run_maintenance_tick``, ``process_available_jobs``, ``execute_job`` with
heartbeats, graceful stop, non-overlapping ticks and a custom ``Kernel(executor=...)``.

Real worker processes (django-q2 clusters, crashes) are tested in ``tests/acceptance``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import replace
from datetime import timedelta
from typing import Any

import pytest
from django.db import connection

from django_workflows import StageContext, define_stage, define_workflow
from django_workflows.annotations import annotate_inputs
from django_workflows.definition import Stage, Workflow
from django_workflows.kernel import CancelRun, CreateRun, Kernel
from django_workflows.kernel import events as ev
from django_workflows.kernel.executor import ExecutionInput, ExecutionOutcome, LocalExecutor
from django_workflows.kernel.hosting import (
    acquire_lease,
    execute_job,
    process_available_jobs,
    run_maintenance_tick,
    tick_lease_name,
)
from django_workflows.models import (
    MaintenanceLease,
    Status,
    WorkflowAnnotation,
    WorkflowBlob,
    WorkflowJob,
    WorkflowRun,
    WorkflowStage,
)
from django_workflows.testing import CollectingSink, FakeClock, make_kernel
from tests.workflows import Num, add, async_stage, two_stage

pytestmark = pytest.mark.django_db(transaction=True)

KernelFor = Callable[..., Kernel]


def _single(stage: Stage, workflow_id: str = "single") -> Workflow:
    return define_workflow(id=workflow_id, input=Num).pipe(stage).build()


def _create(kernel: Kernel, workflow_id: str = "two-stage") -> str:
    cmd = CreateRun(workflow_id=workflow_id, input={"value": 1})
    return str(kernel.dispatch(cmd).workflow_run_id)


def _run(run_id: str) -> WorkflowRun:
    return WorkflowRun.objects.get(pk=run_id)


# --------------------------------------------------------------------------------------------
# Serverless-style host: tick + process_available_jobs (E.3, H-10/11, H-41..43)
# --------------------------------------------------------------------------------------------


def test_tick_claims_and_one_job_completes_a_single_stage_run(kernel_for: KernelFor) -> None:
    """H-41..43, E.3 :208/:364: the tick claims the run (claimed 1); one job processed ->
    processed 1, succeeded 1, failed 0; the run is COMPLETED with the stage output."""
    kernel = kernel_for(_single(add(1)))
    run_id = _create(kernel, "single")

    assert run_maintenance_tick(kernel, "t").claimed == 1
    result = process_available_jobs(kernel, "w")

    assert (result.processed, result.succeeded, result.failed) == (1, 1, 0)
    assert (_run(run_id).status, _run(run_id).output) == (Status.COMPLETED, {"value": 2})


def test_two_stage_run_completes_over_two_invocations(kernel_for: KernelFor) -> None:
    """H-42, H-5, E.3 :243/:394: with ``max_jobs=1`` (the serverless default) the first call
    runs stage 1 and transitions (stage 2 queued), the second completes the run."""
    kernel = kernel_for(two_stage())
    run_id = _create(kernel)
    run_maintenance_tick(kernel, "t")

    assert process_available_jobs(kernel, "w").processed == 1
    assert _run(run_id).status == Status.RUNNING
    assert WorkflowJob.objects.get(workflow_run_id=run_id, stage_id="add-10").status == (
        Status.PENDING
    )
    assert process_available_jobs(kernel, "w").processed == 1
    assert _run(run_id).status == Status.COMPLETED


def test_tick_reports_its_counts(kernel_for: KernelFor, sink: CollectingSink) -> None:
    """H-10/H-11, E.3 :281: two pending runs -> claimed 2, nothing suspended, released or
    reaped; the same tick flushes the 4 events (created + started per run) it can see."""
    kernel = kernel_for(two_stage())
    _create(kernel)
    _create(kernel)

    tick = run_maintenance_tick(kernel, "t")

    assert (tick.claimed, tick.suspended_checked, tick.resumed) == (2, 0, 0)
    assert (tick.stale_released, tick.stuck_reaped, tick.errors, tick.skipped) == (0, 0, 0, False)
    assert tick.events_flushed == 4
    assert sorted(sink.types()) == sorted([ev.WORKFLOW_CREATED, ev.WORKFLOW_STARTED] * 2)
    assert tick.did_work


def test_empty_queue_gives_zeros(kernel_for: KernelFor) -> None:
    """H-42, E.3 :458."""
    kernel = kernel_for(two_stage())
    result = process_available_jobs(kernel, "w", max_jobs=5)
    assert (result.processed, result.succeeded, result.failed) == (0, 0, 0)
    assert not run_maintenance_tick(kernel, "t").did_work


def test_max_jobs_bounds_one_invocation(kernel_for: KernelFor) -> None:
    """H-42, E.3 :427: three ready jobs, ``max_jobs=2`` -> processed 2, one left PENDING."""
    wf = define_workflow(id="three", input=Num).parallel([add(1), add(2), add(3)]).build()
    kernel = kernel_for(wf)
    run_id = _create(kernel, "three")
    run_maintenance_tick(kernel, "t")

    assert process_available_jobs(kernel, "w", max_jobs=2).processed == 2

    statuses = sorted(
        WorkflowJob.objects.filter(workflow_run_id=run_id).values_list("status", flat=True)
    )
    assert statuses == [Status.COMPLETED, Status.COMPLETED, Status.PENDING]


def test_execute_job_of_a_lease_taken_over_runs_nothing(kernel_for: KernelFor) -> None:
    """``execute_job`` enters the stage path at the given job fenced by its token (job id and
    ``attempt``): a job another delivery has leased since (a higher ``attempt``) is not run
    and not changed; a job that is no longer RUNNING neither."""
    calls: list[int] = []

    def body(ctx: StageContext[Num, Any]) -> Num:
        calls.append(1)
        return ctx.input

    kernel = kernel_for(_single(define_stage(id="once", input=Num, output=Num, execute=body)))
    run_id = _create(kernel, "single")
    run_maintenance_tick(kernel, "t")
    job = kernel.queue.dequeue("w")
    assert job is not None
    WorkflowJob.objects.filter(pk=job.pk).update(attempt=job.attempt + 1, worker_id="other")

    outcome = execute_job(kernel, job)

    assert outcome.outcome == "failed" and "no longer this lease's" in (outcome.error or "")
    assert calls == []
    taken = WorkflowJob.objects.get(pk=job.pk)
    assert (taken.status, taken.attempt, taken.worker_id) == (
        Status.RUNNING,
        job.attempt + 1,
        "other",
    )
    assert WorkflowStage.objects.get(run_id=run_id).status == Status.PENDING

    job.refresh_from_db()
    assert execute_job(kernel, job).outcome == "completed"  # the current token delivers it
    assert calls == [1]
    assert WorkflowRun.objects.get(pk=run_id).status == Status.COMPLETED


def test_throwing_stage_outcome_is_failed_with_its_message(kernel_for: KernelFor) -> None:
    """H-7/H-8, E.3 :312: ``execute_job`` of a stage that raises returns outcome ``failed`` with
    the error text; the job is scheduled for a retry (deliveries left)."""

    def boom(ctx: StageContext[Num, Any]) -> Num:
        raise ValueError("bad row 7")

    kernel = kernel_for(_single(define_stage(id="boom", input=Num, output=Num, execute=boom)))
    _create(kernel, "single")
    run_maintenance_tick(kernel, "t")
    job = kernel.queue.dequeue("w")
    assert job is not None

    outcome = execute_job(kernel, job)

    assert (outcome.outcome, outcome.error) == ("failed", "ValueError: bad row 7")
    assert WorkflowJob.objects.get(pk=job.pk).status == Status.PENDING


def test_tick_resumes_a_suspended_stage_and_transitions(
    kernel_for: KernelFor, clock: FakeClock
) -> None:
    """H-10 step 2, E.3 :339, E.1 :254: the job suspends; once the poll is due the tick checks
    it (checked 1, resumed 1) and transitions the run, whose next stage is then queued."""
    wf = define_workflow(id="with-batch").pipe(async_stage()).pipe(add(1)).build()
    kernel = kernel_for(wf)
    run_id = _create(kernel, "with-batch")
    run_maintenance_tick(kernel, "t")
    assert process_available_jobs(kernel, "w").succeeded == 1  # suspended counts as success
    clock.advance(5)

    tick = run_maintenance_tick(kernel, "t")

    assert (tick.suspended_checked, tick.resumed) == (1, 1)
    assert WorkflowJob.objects.get(workflow_run_id=run_id, stage_id="add-1").status == (
        Status.PENDING
    )
    process_available_jobs(kernel, "w")
    assert (_run(run_id).status, _run(run_id).output) == (Status.COMPLETED, {"value": 100})


def test_a_later_tick_flushes_the_whole_lifecycle(
    kernel_for: KernelFor, sink: CollectingSink
) -> None:
    """H-10 step 4, E.1 :472, E.3 :473: the tick's flush delivers created, started and
    completed (with the stage events in between), in order."""
    kernel = kernel_for(_single(add(1)))
    run_id = _create(kernel, "single")
    run_maintenance_tick(kernel, "t")
    process_available_jobs(kernel, "w")
    assert ev.WORKFLOW_COMPLETED not in sink.types(run_id)

    run_maintenance_tick(kernel, "t")

    assert sink.types(run_id) == [
        ev.WORKFLOW_CREATED,
        ev.WORKFLOW_STARTED,
        ev.STAGE_STARTED,
        ev.STAGE_COMPLETED,
        ev.WORKFLOW_COMPLETED,
    ]


def test_terminal_failure_fails_the_run_at_once_with_the_stage_error(
    settings: Any, clock: FakeClock
) -> None:
    """H-7, EC-10, E.1 :342: with MAX_ATTEMPTS=1 a failing stage fails the run in the same
    ``execute_job`` (no tick, no stuck reaping): the output carries no STUCK_RUN_REAPED and
    ``workflow:failed`` carries the stage's error."""
    settings.DJANGO_WORKFLOWS = {**settings.DJANGO_WORKFLOWS, "MAX_ATTEMPTS": 1}

    def boom(ctx: StageContext[Num, Any]) -> Num:
        raise RuntimeError("upstream API said no")

    sink = CollectingSink()
    kernel = make_kernel(
        _single(define_stage(id="boom", input=Num, output=Num, execute=boom)),
        clock=clock,
        event_sink=sink,
    )
    run_id = _create(kernel, "single")
    run_maintenance_tick(kernel, "t")

    assert process_available_jobs(kernel, "w").failed == 1

    run = _run(run_id)
    assert (run.status, run.completed_at) == (Status.FAILED, clock.now())
    assert "STUCK_RUN_REAPED" not in str(run.output)
    run_maintenance_tick(kernel, "t")
    (failed,) = [e for e in sink.events if e["type"] == ev.WORKFLOW_FAILED]
    assert failed["error"] == "RuntimeError: upstream API said no"


def test_suspension_and_job_state_commit_together_so_a_later_cancel_cancels_the_job(
    kernel_for: KernelFor,
) -> None:
    """K-CA-2/3, SM-25, H-6: the stage's suspension and its job's SUSPENDED state commit in one
    transaction under the run lock (the race of a cancel between the two is gone), so a cancel
    that follows finds the SUSPENDED job and cancels it: no SUSPENDED job outlives its run."""
    wf = define_workflow(id="with-batch").pipe(async_stage()).build()
    kernel = kernel_for(wf)
    run_id = _create(kernel, "with-batch")
    run_maintenance_tick(kernel, "t")

    process_available_jobs(kernel, "w")
    assert WorkflowJob.objects.get(workflow_run_id=run_id).status == Status.SUSPENDED
    kernel.dispatch(CancelRun(run_id))

    assert _run(run_id).status == Status.CANCELLED
    job = WorkflowJob.objects.get(workflow_run_id=run_id)
    assert job.status == Status.CANCELLED


# --------------------------------------------------------------------------------------------
# Heartbeats, graceful stop, non-overlapping ticks (H-2, Part I item 18)
# --------------------------------------------------------------------------------------------


def _wait_for(predicate: Callable[[], bool], what: str, seconds: float = 10.0) -> None:
    """Poll ``predicate`` (another thread's database write) with a deadline."""
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_heartbeat_advances_the_lease_while_the_stage_is_blocked(
    settings: Any, clock: FakeClock
) -> None:
    """H-2, DM-46, E.1 :409, Part I item 4: while a stage blocks, the job's heartbeat keeps
    moving ``locked_at`` to the kernel's current time, so the lease never goes stale."""
    settings.DJANGO_WORKFLOWS = {**settings.DJANGO_WORKFLOWS, "HEARTBEAT_INTERVAL_SECONDS": 0.02}
    started, release = threading.Event(), threading.Event()

    def blocked(ctx: StageContext[Num, Any]) -> Num:
        started.set()
        release.wait(10)
        return Num(value=ctx.input.value)

    kernel = make_kernel(
        _single(define_stage(id="slow", input=Num, output=Num, execute=blocked)), clock=clock
    )
    run_id = _create(kernel, "single")
    run_maintenance_tick(kernel, "t")
    job = kernel.queue.dequeue("w")
    assert job is not None
    leased_at = job.locked_at

    def host() -> None:
        try:
            execute_job(kernel, job)
        finally:
            connection.close()

    thread = threading.Thread(target=host, daemon=True)
    thread.start()
    try:
        assert started.wait(10)
        for _ in range(3):
            clock.advance(120)
            target = clock.now()
            _wait_for(
                lambda t=target: WorkflowJob.objects.get(pk=job.pk).locked_at == t,
                "the heartbeat",
            )
    finally:
        release.set()
        thread.join(10)
    assert WorkflowJob.objects.get(pk=job.pk).locked_at is None  # completed: lease cleared
    assert clock.now() - leased_at == timedelta(seconds=360)
    assert _run(run_id).status == Status.COMPLETED


def test_stop_request_finishes_the_in_flight_job_then_stops(kernel_for: KernelFor) -> None:
    """Part I item 18, EC-50, H-42: a stop requested while a job executes lets that job finish
    (COMPLETED, run transitioned) and no further job is leased."""
    stop = threading.Event()

    def stopping(ctx: StageContext[Num, Any]) -> Num:
        stop.set()  # e.g. SIGTERM arrives while the stage runs
        return Num(value=ctx.input.value + 1)

    wf = (
        define_workflow(id="par", input=Num)
        .parallel(
            [
                define_stage(id="a", input=Num, output=Num, execute=stopping),
                define_stage(id="b", input=Num, output=Num, execute=stopping),
            ]
        )
        .build()
    )
    kernel = kernel_for(wf)
    run_id = _create(kernel, "par")
    run_maintenance_tick(kernel, "t")

    result = process_available_jobs(kernel, "w", max_jobs=10, stop=stop)

    assert (result.processed, result.succeeded) == (1, 1)
    statuses = sorted(
        WorkflowJob.objects.filter(workflow_run_id=run_id).values_list("status", flat=True)
    )
    assert statuses == [Status.COMPLETED, Status.PENDING]
    assert process_available_jobs(kernel, "w", stop=stop).processed == 0


def test_ticks_never_overlap(kernel_for: KernelFor, clock: FakeClock) -> None:
    """Part I item 18, H-25, EC-50: a tick started while another holds the maintenance lease
    returns ``skipped`` at once and does nothing; the lease is released after each tick; a
    lease left by a dead ticker stops blocking once it expired."""
    nested: list[Any] = []

    class NestingSink(CollectingSink):
        def emit(self, event: dict[str, Any]) -> None:
            if not nested:  # a second ticker fires while the first is flushing
                nested.append(run_maintenance_tick(kernel, "other-ticker"))
            super().emit(event)

    kernel = kernel_for(two_stage())
    kernel.event_sink = NestingSink()
    run_id = _create(kernel)

    first = run_maintenance_tick(kernel, "ticker")

    assert (first.skipped, first.claimed) == (False, 1)
    assert nested[0].skipped is True
    assert (nested[0].claimed, nested[0].events_flushed) == (0, 0)
    assert not MaintenanceLease.objects.filter(name=tick_lease_name(kernel)).exists()

    assert acquire_lease(kernel, tick_lease_name(kernel), "dead-ticker", ttl_seconds=60)
    other = _create(kernel)
    assert run_maintenance_tick(kernel, "ticker").skipped is True
    assert _run(other).status == Status.PENDING
    clock.advance(61)
    assert run_maintenance_tick(kernel, "ticker").claimed == 1
    assert _run(other).status == Status.RUNNING
    assert _run(run_id).status == Status.RUNNING


# --------------------------------------------------------------------------------------------
# The executor port (A.15, K-30..33)
# --------------------------------------------------------------------------------------------


class SpyExecutor:
    """Records calls, delegates to a LocalExecutor and adds an annotation of its own (as a
    remote executor returning annotations would)."""

    def __init__(self) -> None:
        self.calls: list[ExecutionInput] = []
        self.local = LocalExecutor()

    def run(self, execution: ExecutionInput) -> ExecutionOutcome:
        self.calls.append(execution)
        outcome = self.local.run(execution)
        extra = annotate_inputs("executor.host", "remote-1")
        return replace(outcome, annotations=[*outcome.annotations, *extra])


def test_custom_executor_result_and_annotations_are_persisted(kernel_for: KernelFor) -> None:
    """K-30, K-33, A.15 :73: ``Kernel(executor=...)`` runs every stage through the custom
    executor (called once per stage with the stage and workflow); its result is persisted
    (stage COMPLETED, output blob) and its returned annotation is stored."""
    spy = SpyExecutor()
    kernel = kernel_for(_single(add(1)), executor=spy)
    run_id = _create(kernel, "single")
    run_maintenance_tick(kernel, "t")

    process_available_jobs(kernel, "w")

    assert [(c.stage.id, c.workflow.id, c.workflow_run_id) for c in spy.calls] == [
        ("add-1", "single", run_id)
    ]
    record = WorkflowStage.objects.get(run_id=run_id)
    assert record.status == Status.COMPLETED
    assert _run(run_id).output == {"value": 2}
    note = WorkflowAnnotation.objects.get(run_id=run_id, key="executor.host")
    assert (note.value, note.scope, note.scope_id, note.stage_record_id) == (
        "remote-1",
        "stage",
        "add-1",
        record.pk,
    )


def test_default_executor_is_local_and_writes_output_blobs(kernel_for: KernelFor) -> None:
    """K-31, DM-51, A.15 :148: without an executor the kernel uses LocalExecutor and stores the
    output under ``workflow-v2/{type}/{run}/{stage}/output.json``."""
    kernel = kernel_for(_single(add(1)))
    assert isinstance(kernel.executor, LocalExecutor)
    run_id = _create(kernel, "single")
    run_maintenance_tick(kernel, "t")
    process_available_jobs(kernel, "w")
    blob = WorkflowBlob.objects.get(run_id=run_id)
    assert blob.key == f"workflow-v2/single/{run_id}/add-1/output.json"
    assert blob.data == {"value": 2}
