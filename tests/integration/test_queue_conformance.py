"""The job queue and the persistence helpers against the database: the upstream conformance
suite (catalogue C.1, C.2, C.8; A.13) and the multi-worker scenarios (B.1-B.7), translated to
our models, :class:`JobQueue` and store helpers.

Not translated: the in-memory adapters and their inspection helpers (we test the database
directly), the deprecated artifact table (C.3) and the AI call logger (C.7). Optimistic
``expectedVersion`` errors (A.13 :52-:90, C.1 :257, C.2 :451) do not apply: our writers take
row locks (Part I item 1) instead; what remains is that every update bumps ``version`` (DM-5).
Real concurrency (SKIP LOCKED claims and dequeues) is in ``test_concurrency_pg.py``.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest

from django_workflows import StageContext, define_stage, define_workflow
from django_workflows.kernel import ClaimPendingRuns, CreateRun, Kernel
from django_workflows.kernel.hosting import process_available_jobs
from django_workflows.kernel.queue import JobQueue, JobSpec
from django_workflows.kernel.store import create_missing_stages, stages_of, update_run, update_stage
from django_workflows.models import Status, WorkflowJob, WorkflowRun, WorkflowStage
from django_workflows.testing import FakeClock, run_to_completion
from django_workflows.transport.inline import NullTransport, RecordingTransport
from tests.workflows import Num, add, two_stage

pytestmark = pytest.mark.django_db(transaction=True)

KernelFor = Callable[..., Kernel]


@pytest.fixture
def queue(clock: FakeClock) -> JobQueue:
    return JobQueue(clock, NullTransport())


def _spec(stage_id: str = "s", priority: int = 5, **kwargs: Any) -> JobSpec:
    return JobSpec(uuid.uuid4(), "wf", stage_id, priority=priority, **kwargs)


def _enqueue(queue: JobQueue, clock: FakeClock, *priorities: int) -> list[int]:
    """One job per priority, each created one second after the previous (FIFO is visible)."""
    ids = []
    for i, priority in enumerate(priorities):
        ids += queue.enqueue([_spec(f"s{i}", priority)])
        clock.advance(1)
    return ids


def _drain(queue: JobQueue) -> list[int]:
    out = []
    while (job := queue.dequeue("w")) is not None:
        out.append(job.pk)
    return out


# --------------------------------------------------------------------------------------------
# Enqueue and dequeue (C.8, B.2, B.4, DM-40/41)
# --------------------------------------------------------------------------------------------


def test_enqueue_stores_pending_jobs_with_defaults_and_wakes_workers(clock: FakeClock) -> None:
    """DM-40, C.8 :1914/:1926, B.2 :18/:40/:68/:81/:95: ``enqueue`` returns one id per spec in
    order; each job is PENDING, attempt 0, max_attempts from settings (3), default priority
    5 (or the given one), payload stored; the transport is woken after commit."""
    transport = RecordingTransport()
    queue = JobQueue(clock, transport)
    run_id = uuid.uuid4()
    ids = queue.enqueue(
        [
            JobSpec(run_id, "wf", "a"),
            JobSpec(run_id, "wf", "b", priority=9, payload={"config": {"b": {"x": 1}}}),
            JobSpec(run_id, "wf", "c"),
        ]
    )
    assert len(set(ids)) == 3
    jobs = [WorkflowJob.objects.get(pk=i) for i in ids]
    assert [j.stage_id for j in jobs] == ["a", "b", "c"]
    assert {(j.status, j.attempt, j.max_attempts) for j in jobs} == {(Status.PENDING, 0, 3)}
    assert [j.priority for j in jobs] == [5, 9, 5]
    assert jobs[1].payload == {"config": {"b": {"x": 1}}}
    assert jobs[0].payload == {}
    assert {(j.workflow_run_id, j.workflow_id, j.created_at) for j in jobs} == {
        (run_id, "wf", clock.now())
    }
    assert transport.worker_wakeups == 3
    assert queue.enqueue([]) == []


def test_dequeue_leases_the_job_and_reports_its_fields(queue: JobQueue, clock: FakeClock) -> None:
    """DM-41, SM-20/31, C.8 :1974, B.2 :111/:158/:212: the dequeued job is RUNNING with the
    worker id, ``locked_at = started_at = now`` and attempt 1, and carries run, workflow,
    stage, priority, payload and max_attempts."""
    (job_id,) = queue.enqueue([_spec("s", 7, payload={"k": "v"})])
    job = queue.dequeue("worker-1")
    assert job is not None and job.pk == job_id
    assert (job.status, job.worker_id, job.attempt, job.max_attempts) == (
        Status.RUNNING,
        "worker-1",
        1,
        3,
    )
    assert (job.locked_at, job.started_at) == (clock.now(), clock.now())
    assert (job.workflow_id, job.stage_id, job.priority, job.payload) == ("wf", "s", 7, {"k": "v"})
    stored = WorkflowJob.objects.get(pk=job_id)
    assert (stored.status, stored.worker_id, stored.attempt) == (Status.RUNNING, "worker-1", 1)


def test_dequeue_of_an_empty_queue_and_of_a_leased_job(queue: JobQueue) -> None:
    """DM-41, C.8 :1965, B.2 :134/:142/:175: an empty queue gives ``None``; a RUNNING job is not
    dequeued again; successive dequeues get different jobs."""
    assert queue.dequeue("w") is None
    ids = queue.enqueue([_spec("a"), _spec("b")])
    first, second = queue.dequeue("w-1"), queue.dequeue("w-2")
    assert first is not None and second is not None
    assert {first.pk, second.pk} == set(ids)
    assert queue.dequeue("w-3") is None


def test_dequeue_order_is_priority_then_fifo(queue: JobQueue, clock: FakeClock) -> None:
    """DM-41, C.8 :1944, B.4 :18/:50/:88/:139: highest priority first (100 before 10 before 5
    before 0); equal priorities in enqueue order."""
    ids = _enqueue(queue, clock, 5, 10, 0, 5, 100, 10)
    assert _drain(queue) == [ids[4], ids[1], ids[5], ids[0], ids[3], ids[2]]


def test_parallel_enqueue_keeps_per_job_priorities(queue: JobQueue) -> None:
    """DM-40/41, B.4 :244: one enqueue call with priorities 3, 8, 5 dequeues 8, 5, 3."""
    ids = queue.enqueue([_spec("a", 3), _spec("b", 8), _spec("c", 5)])
    assert _drain(queue) == [ids[1], ids[2], ids[0]]


def test_scheduled_jobs_wait_for_their_time(queue: JobQueue, clock: FakeClock) -> None:
    """DM-41, B.2 :298/:315/:332, B.4 :165/:191: a job scheduled in the future is not dequeued
    and does not block an available lower-priority one; once its time has come it is."""
    (later,) = queue.enqueue([_spec("later", 10, next_poll_at=clock.now() + timedelta(minutes=1))])
    (now,) = queue.enqueue([_spec("now", 1)])
    assert _drain(queue) == [now]
    clock.advance(60)
    assert _drain(queue) == [later]


# --------------------------------------------------------------------------------------------
# complete / suspend / fail / retries (C.8, B.6, DM-42..44)
# --------------------------------------------------------------------------------------------


def test_complete_and_suspend_clear_the_lease(queue: JobQueue, clock: FakeClock) -> None:
    """DM-42/43, SM-21/22, C.8 :2001/:2013/:2020: ``complete`` -> COMPLETED with completed_at;
    ``suspend`` -> SUSPENDED at the given poll time; both clear worker and lease. An unknown or
    non-RUNNING job is not changed (``False``; upstream raises for unknown ids, EC-36)."""
    a, b = queue.enqueue([_spec("a"), _spec("b")])
    queue.dequeue("w")
    queue.dequeue("w")
    clock.advance(5)
    poll = clock.now() + timedelta(minutes=5)

    assert queue.complete(a) is True
    assert queue.suspend(b, poll) is True

    done, waiting = WorkflowJob.objects.get(pk=a), WorkflowJob.objects.get(pk=b)
    assert (done.status, done.completed_at, done.worker_id, done.locked_at) == (
        Status.COMPLETED,
        clock.now(),
        None,
        None,
    )
    assert (waiting.status, waiting.next_poll_at, waiting.worker_id) == (
        Status.SUSPENDED,
        poll,
        None,
    )
    assert queue.complete(999_999) is False
    assert queue.complete(a) is False  # not RUNNING any more


def test_suspend_without_a_time_uses_the_fallback(queue: JobQueue, clock: FakeClock) -> None:
    """DM-43, SM-22, H-6: no poll time -> now + SUSPEND_FALLBACK_SECONDS (60 s)."""
    (job_id,) = queue.enqueue([_spec()])
    queue.dequeue("w")
    queue.suspend(job_id, None)
    assert WorkflowJob.objects.get(pk=job_id).next_poll_at == clock.now() + timedelta(seconds=60)


def test_fail_defaults_to_no_retry(queue: JobQueue, clock: FakeClock) -> None:
    """DM-44, C.8 :2036/:2050, B.6 :58/:265: ``fail`` without ``should_retry`` -> FAILED at
    attempt 1 with ``last_error`` and completed_at; it is not dequeued again."""
    (job_id,) = queue.enqueue([_spec()])
    queue.dequeue("w")
    assert queue.fail(job_id, "boom") == Status.FAILED
    job = WorkflowJob.objects.get(pk=job_id)
    assert (job.status, job.attempt, job.last_error, job.completed_at) == (
        Status.FAILED,
        1,
        "boom",
        clock.now(),
    )
    assert queue.dequeue("w") is None


def test_retries_back_off_until_max_attempts(queue: JobQueue, clock: FakeClock) -> None:
    """DM-44, SM-23/24/31, C.8 :2065, B.6 :18/:100/:176/:242: a retried job goes back to
    PENDING with ``last_error``, its lease cleared, the attempt unchanged and ``next_poll_at =
    now + 2 s, then 4 s``; the third delivery's failure is final (FAILED, attempt 3)."""
    (job_id,) = queue.enqueue([_spec()])
    for attempt, delay in ((1, 2), (2, 4)):
        job = queue.dequeue("w")
        assert job is not None and job.attempt == attempt
        assert queue.fail(job_id, f"error {attempt}", should_retry=True) == Status.PENDING
        row = WorkflowJob.objects.get(pk=job_id)
        assert (row.status, row.attempt, row.last_error) == (
            Status.PENDING,
            attempt,
            f"error {attempt}",
        )
        assert (row.worker_id, row.locked_at) == (None, None)
        assert row.next_poll_at == clock.now() + timedelta(seconds=delay)
        assert queue.dequeue("w") is None  # backing off
        clock.advance(delay)
    job = queue.dequeue("w")
    assert job is not None and job.attempt == 3
    assert queue.fail(job_id, "error 3", should_retry=True) == Status.FAILED
    row = WorkflowJob.objects.get(pk=job_id)
    assert (row.status, row.attempt, row.last_error, row.completed_at) == (
        Status.FAILED,
        3,
        "error 3",
        clock.now(),
    )


def test_max_attempts_and_back_off_come_from_settings(settings: Any, clock: FakeClock) -> None:
    """DM-40/44, B.6 :285/:307: MAX_ATTEMPTS=2 fails a retried job at attempt 2; the back-off
    is RETRY_BACKOFF_BASE_SECONDS * 2**(attempt-1), capped by RETRY_BACKOFF_MAX_SECONDS."""
    settings.DJANGO_WORKFLOWS = {
        **settings.DJANGO_WORKFLOWS,
        "MAX_ATTEMPTS": 2,
        "RETRY_BACKOFF_BASE_SECONDS": 10,
        "RETRY_BACKOFF_MAX_SECONDS": 15,
    }
    queue = JobQueue(clock, NullTransport())
    (job_id,) = queue.enqueue([_spec()])
    assert WorkflowJob.objects.get(pk=job_id).max_attempts == 2
    queue.dequeue("w")
    queue.fail(job_id, "e", should_retry=True)
    assert WorkflowJob.objects.get(pk=job_id).next_poll_at == clock.now() + timedelta(seconds=10)
    clock.advance(10)
    queue.dequeue("w")
    assert queue.fail(job_id, "e", should_retry=True) == Status.FAILED

    settings.DJANGO_WORKFLOWS = {**settings.DJANGO_WORKFLOWS, "MAX_ATTEMPTS": 5}
    (job_id,) = queue.enqueue([_spec()])
    WorkflowJob.objects.filter(pk=job_id).update(attempt=2)
    queue.dequeue("w")
    queue.fail(job_id, "e", should_retry=True)  # attempt 3: 10 * 4 = 40 s, capped at 15 s
    assert WorkflowJob.objects.get(pk=job_id).next_poll_at == clock.now() + timedelta(seconds=15)


def test_host_retries_a_failing_stage_up_to_max_attempts(
    kernel_for: KernelFor, clock: FakeClock
) -> None:
    """H-7, DM-44, EC-10, B.6, T/13: through the host, a stage that always raises is delivered
    three times with back-off, then the run fails with the stage's error."""
    calls = {"n": 0}

    def always(ctx: StageContext[Num, Any]) -> Num:
        calls["n"] += 1
        raise RuntimeError(f"attempt {calls['n']} failed")

    wf = define_workflow(id="always", input=Num).pipe(
        define_stage(id="s", input=Num, output=Num, execute=always)
    )
    kernel = kernel_for(wf.build())
    run_id = kernel.dispatch(CreateRun(workflow_id="always", input={"value": 1})).workflow_run_id

    run = run_to_completion(kernel, run_id, advance_seconds=5)

    assert run.status == Status.FAILED
    job = WorkflowJob.objects.get(workflow_run_id=run_id)
    assert (job.status, job.attempt, job.last_error) == (
        Status.FAILED,
        3,
        "RuntimeError: attempt 3 failed",
    )
    assert calls["n"] == 3


# --------------------------------------------------------------------------------------------
# touch, release, cancel, jobs by run (C.8, DM-45..48)
# --------------------------------------------------------------------------------------------


def test_touch_refreshes_only_running_jobs(queue: JobQueue, clock: FakeClock) -> None:
    """DM-46, H-2, C.8 :2104/:2128: ``touch`` advances a RUNNING job's ``locked_at`` (status
    stays RUNNING); on a PENDING or unknown job it is a silent no-op."""
    running, pending = queue.enqueue([_spec("a"), _spec("b")])
    leased = queue.dequeue("w")
    assert leased is not None and leased.pk == running
    clock.advance(30)
    assert queue.touch(running) is True
    assert queue.touch(pending) is False
    assert queue.touch(999_999) is False
    row = WorkflowJob.objects.get(pk=running)
    assert (row.status, row.locked_at) == (Status.RUNNING, clock.now())
    assert WorkflowJob.objects.get(pk=pending).locked_at is None


def test_release_stale_returns_a_count(queue: JobQueue, clock: FakeClock) -> None:
    """DM-45, C.8 :2092, B.5 :90/:131/:292/:311: ``release_stale`` returns how many stale jobs
    it released; fresh ones are kept; custom and very short thresholds work."""
    queue.enqueue([_spec("a"), _spec("b"), _spec("c")])
    queue.dequeue("w")
    queue.dequeue("w")
    clock.advance(10)
    queue.dequeue("w")
    clock.advance(0.5)
    assert queue.release_stale(60) == 0
    assert queue.release_stale(5) == 2
    assert queue.release_stale(0.1) == 1
    assert WorkflowJob.objects.filter(status=Status.PENDING).count() == 3


def test_cancel_by_run_cancels_queued_and_suspended_jobs_only(
    queue: JobQueue, clock: FakeClock
) -> None:
    """DM-47/48, SM-25, K-CA-2/3: ``cancel_by_run`` cancels the run's PENDING and SUSPENDED jobs
    (count returned), leaves RUNNING ones and other runs alone; ``jobs_by_run`` lists every job
    of the run in id order."""
    run_id, other = uuid.uuid4(), uuid.uuid4()
    running, suspended, pending = queue.enqueue(
        [JobSpec(run_id, "wf", "r"), JobSpec(run_id, "wf", "s"), JobSpec(run_id, "wf", "p")]
    )
    (foreign,) = queue.enqueue([JobSpec(other, "wf", "x", priority=0)])
    queue.dequeue("w")
    queue.dequeue("w")
    queue.suspend(suspended, None)

    assert queue.cancel_by_run(run_id) == 2

    status = dict(WorkflowJob.objects.values_list("pk", "status"))
    assert status == {
        running: Status.RUNNING,
        suspended: Status.CANCELLED,
        pending: Status.CANCELLED,
        foreign: Status.PENDING,
    }
    assert WorkflowJob.objects.get(pk=pending).completed_at == clock.now()
    assert [j.pk for j in queue.jobs_by_run(run_id)] == [running, suspended, pending]


# --------------------------------------------------------------------------------------------
# Claiming runs (B.1, B.7, DM-33)
# --------------------------------------------------------------------------------------------


def _create(kernel: Kernel, workflow_id: str = "two-stage", priority: int = 5) -> str:
    cmd = CreateRun(workflow_id=workflow_id, input={"value": 1}, priority=priority)
    return str(kernel.dispatch(cmd).workflow_run_id)


def test_claim_order_is_priority_then_fifo_and_only_pending_runs(
    kernel_for: KernelFor, clock: FakeClock
) -> None:
    """DM-33, K-CP-1, B.1 :21/:41/:51/:69/:107/:270, B.7 :77: claims come in priority order
    (10, 5, 1), FIFO within a priority; claimed runs are RUNNING with ``started_at``; RUNNING
    and finished runs are never claimed; an empty claim returns nothing."""
    kernel = kernel_for(two_stage())
    ids = {}
    for name, priority in (("low", 1), ("mid-a", 5), ("high", 10), ("mid-b", 5)):
        ids[name] = _create(kernel, priority=priority)
        clock.advance(1)
    claimed = []
    while batch := kernel.dispatch(ClaimPendingRuns(worker_id="w", max_claims=1)).claimed:
        claimed.append(batch[0].workflow_run_id)
    assert claimed == [ids["high"], ids["mid-a"], ids["mid-b"], ids["low"]]
    for run in WorkflowRun.objects.all():
        assert (run.status, run.started_at is not None) == (Status.RUNNING, True)
    assert kernel.dispatch(ClaimPendingRuns(worker_id="w")).claimed == []


def test_jobs_of_several_runs_are_served_fifo_and_runs_stay_isolated(
    kernel_for: KernelFor, clock: FakeClock
) -> None:
    """B.7 :32/:122/:151/:198/:316/:426, K-CP-1: one claim over three workflows enqueues one
    job per run; equal-priority jobs are dequeued in creation order (interleaving runs); each
    run keeps its own records and output; a failing run does not affect the others."""

    def broken(ctx: StageContext[Num, Any]) -> Num:
        raise ValueError("bad data")

    failing = (
        define_workflow(id="failing", input=Num)
        .pipe(define_stage(id="s", input=Num, output=Num, execute=broken))
        .build()
    )
    other = define_workflow(id="other", input=Num).pipe(add(5, "plus-5")).build()
    kernel = kernel_for(two_stage(), other, failing)
    runs = []
    for workflow_id in ("two-stage", "other", "failing"):
        runs.append(_create(kernel, workflow_id))
        clock.advance(1)

    claimed = kernel.dispatch(ClaimPendingRuns(worker_id="w")).claimed

    assert [len(c.job_ids) for c in claimed] == [1, 1, 1]
    assert len({c.workflow_run_id for c in claimed}) == 3
    order = [kernel.queue.dequeue("w") for _ in range(3)]
    assert [j.workflow_id for j in order if j is not None] == ["two-stage", "other", "failing"]
    WorkflowJob.objects.update(status=Status.PENDING, attempt=0, worker_id=None, locked_at=None)
    for _ in range(4):  # the failing stage is retried with back-off
        process_available_jobs(kernel, "w", max_jobs=20)
        clock.advance(10)
    outcome = {r.workflow_id: (r.status, r.output) for r in WorkflowRun.objects.filter(pk__in=runs)}
    assert outcome == {
        "two-stage": (Status.COMPLETED, {"value": 12}),
        "other": (Status.COMPLETED, {"value": 6}),
        "failing": (Status.FAILED, None),
    }
    for run_id in runs:
        assert {s.run_id for s in stages_of(uuid.UUID(run_id))} == {uuid.UUID(run_id)}


# --------------------------------------------------------------------------------------------
# Runs and stage records through the store helpers (C.1, C.2, A.13)
# --------------------------------------------------------------------------------------------


def test_every_update_bumps_the_version_and_keeps_other_fields(
    kernel_for: KernelFor, clock: FakeClock
) -> None:
    """DM-5, DM-7, DM-8, A.13 :12/:30, C.1 :196/:215/:231/:319/:335, C.2 :409: run versions go
    1 -> 2 (claim) -> 3 -> 4 over two updates, stage versions 1 -> 2; ``updated_at`` is the
    kernel's clock; fields not named keep their values; an unknown id updates nothing."""
    kernel = kernel_for(two_stage())
    run_id = uuid.UUID(_create(kernel))
    assert WorkflowRun.objects.get(pk=run_id).version == 1
    kernel.dispatch(ClaimPendingRuns(worker_id="w"))
    assert WorkflowRun.objects.get(pk=run_id).version == 2

    clock.advance(5)
    assert update_run(run_id, clock.now(), total_cost=1.5) == 1
    assert update_run(run_id, clock.now()) == 1
    run = WorkflowRun.objects.get(pk=run_id)
    assert (run.version, run.updated_at, run.total_cost, run.status) == (
        4,
        clock.now(),
        1.5,
        Status.RUNNING,
    )
    stage = WorkflowStage.objects.get(run_id=run_id)
    assert stage.version == 1
    assert update_stage(stage.pk, clock.now(), progress=50.0) == 1
    stage.refresh_from_db()
    assert (stage.version, stage.progress, stage.status) == (2, 50.0, Status.PENDING)
    assert update_run(uuid.uuid4(), clock.now(), status=Status.FAILED) == 0


def test_stage_upsert_keeps_existing_records_and_lists_in_group_order(
    kernel_for: KernelFor, clock: FakeClock
) -> None:
    """DM-32, EC-3, C.2 :351/:467/:491/:527/:597: ``create_missing_stages`` inserts PENDING
    records with number, group, generation and config slice, keeps an existing record as it is,
    and ``stages_of`` orders by group then stage number, one run only."""
    wf = define_workflow(id="groups", input=Num).parallel([add(1, "a"), add(2, "b")]).pipe(add(3))
    workflow = wf.build()
    kernel = kernel_for(workflow)
    run_id = uuid.UUID(_create(kernel, "groups"))
    other = uuid.UUID(_create(kernel, "groups"))
    run = WorkflowRun.objects.get(pk=run_id)
    run.config = {"b": {"x": 1}}

    first = create_missing_stages(run, workflow.stages_in_group(1), generation=2, now=clock.now())
    update_stage(first[0].pk, clock.now(), status=Status.COMPLETED)
    again = create_missing_stages(run, workflow.stages_in_group(1), generation=5, now=clock.now())
    create_missing_stages(run, workflow.stages_in_group(2), generation=2, now=clock.now())
    create_missing_stages(
        WorkflowRun.objects.get(pk=other),
        workflow.stages_in_group(1),
        generation=0,
        now=clock.now(),
    )

    assert [r.pk for r in again] == [r.pk for r in first]
    records = stages_of(run_id)
    assert [(r.stage_id, r.execution_group, r.stage_number) for r in records] == [
        ("a", 1, 1),
        ("b", 1, 2),
        ("add-3", 2, 3),
    ]
    assert [(r.status, r.generation) for r in records] == [
        (Status.COMPLETED, 2),
        (Status.PENDING, 2),
        (Status.PENDING, 2),
    ]
    assert records[1].config == {"x": 1}
