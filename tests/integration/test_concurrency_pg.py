"""Concurrency and row-locking tests that only mean something on PostgreSQL.

Every test uses real threads, each with its own database connection (closed when the thread
ends), and real transactions. Where an interleaving must be forced, the test hooks a kernel
function and lines the threads up with events; "thread X is blocked on a lock held by Y" is
observed with ``pg_blocking_pids`` (a short bounded poll, the only way to see a lock wait).
On SQLite every test is skipped.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

import pytest
from django.db import connection, transaction

from django_workflows import StageContext, define_stage, define_workflow
from django_workflows.kernel import (
    CancelRun,
    ClaimPendingRuns,
    CreateRun,
    ExecuteJob,
    IdempotencyInProgressError,
    Kernel,
    TransitionRun,
)
from django_workflows.kernel import events as ev
from django_workflows.kernel import queue as queue_module
from django_workflows.kernel.handlers import (
    run_cancel,
    run_claim_pending,
    run_create,
    run_transition,
)
from django_workflows.kernel.hosting import execute_job
from django_workflows.kernel.outbox import append_events
from django_workflows.kernel.queue import JobSpec
from django_workflows.kernel.stage_path import lease as stage_lease
from django_workflows.kernel.stage_path import outcome as stage_outcome
from django_workflows.models import (
    OutboxEvent,
    Status,
    WorkflowBlob,
    WorkflowJob,
    WorkflowRun,
    WorkflowStage,
)
from django_workflows.testing import CollectingSink, FakeClock, make_kernel
from tests.markers import postgres_only
from tests.workflows import Num, add, two_stage

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.postgres, postgres_only]

#: Upper bound of every wait: a lost wake-up fails the test instead of hanging it.
WAIT_SECONDS = 10.0


# --------------------------------------------------------------------------------------------
# Thread and lock helpers
# --------------------------------------------------------------------------------------------


class _Thread:
    """Runs ``fn`` in a thread on its own connection; keeps its return value or exception."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self._fn = fn
        self._value: Any = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, daemon=True)
        self._thread.start()

    def _main(self) -> None:
        try:
            self._value = self._fn()
        except BaseException as exc:  # handed to the test thread
            self._error = exc
        finally:
            connection.close()

    def outcome(self) -> Any:
        """The return value, or the exception the function raised."""
        self._thread.join(WAIT_SECONDS * 2)
        assert not self._thread.is_alive(), "a worker thread hung"
        return self._error if self._error is not None else self._value

    def result(self) -> Any:
        """The return value; re-raises the thread's exception."""
        out = self.outcome()
        if isinstance(out, BaseException):
            raise out
        return out


def _outcomes(*fns: Callable[[], Any]) -> list[Any]:
    threads = [_Thread(fn) for fn in fns]
    return [t.outcome() for t in threads]


def _results(*fns: Callable[[], Any]) -> list[Any]:
    threads = [_Thread(fn) for fn in fns]
    return [t.result() for t in threads]


def _wait(event: threading.Event, what: str) -> None:
    assert event.wait(WAIT_SECONDS), f"timed out waiting for {what}"


def _backend_pid() -> int:
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        return int(cursor.fetchone()[0])


def _wait_until_blocked_by_me(waiters: list[int]) -> None:
    """Poll until every backend in ``waiters`` waits for a lock held by this connection."""
    me = _backend_pid()
    deadline = time.monotonic() + WAIT_SECONDS
    with connection.cursor() as cursor:
        while True:
            cursor.execute(
                "SELECT count(*) FROM unnest(%s::int[]) AS w(pid) "
                "WHERE %s = ANY(pg_blocking_pids(w.pid))",
                [waiters, me],
            )
            if cursor.fetchone()[0] == len(waiters):
                return
            assert time.monotonic() < deadline, f"backends {waiters} never blocked on pid {me}"
            time.sleep(0.002)


class _TickingClock(FakeClock):
    """A thread-safe fake clock that moves 1 ms per reading.

    The kernel reads the clock for every state write under the run row lock, so timestamps of
    the racing writes (stage ``completed_at``, blob ``created_at``, run ``completed_at``) follow
    their commit order and can be compared.
    """

    def __init__(self, start: datetime) -> None:
        super().__init__(start)
        self._lock = threading.Lock()

    def now(self) -> datetime:
        with self._lock:
            self._now += timedelta(milliseconds=1)
            return self._now


# --------------------------------------------------------------------------------------------
# 1. cancel vs. stage completion (Part I item 1)
# --------------------------------------------------------------------------------------------

#: Where the cancel is lined up against ``job.execute`` of stage 1.
RACE_MODES = (
    "before_start",  # cancel commits before the job starts (pre-flight ghost)
    "phase1_cancel_first",  # cancel commits between pre-flight and Phase 1's lock
    "phase1_cancel_holds_lock",  # Phase 1 waits on the row lock held by the cancel
    "phase1_worker_holds_lock",  # the cancel waits on Phase 1's lock, commits during the body
    "in_body",  # cancel commits while the stage body runs (Phase 2)
    "phase3_cancel_first",  # cancel commits after the body, before Phase 3's lock
    "phase3_cancel_holds_lock",  # Phase 3 waits on the row lock held by the cancel
    "phase3_worker_holds_lock",  # the cancel waits on Phase 3's lock: completion commits first
    "free",  # both start off a barrier, no further coordination
)
#: Modes in which the completion commits before the cancel.
COMPLETION_FIRST = {"phase3_worker_holds_lock"}
#: Modes in which either side may win.
EITHER = {"free"}


@dataclass
class _Race:
    mode: str
    start: threading.Barrier = field(default_factory=lambda: threading.Barrier(2))
    worker_pid: int = 0
    cancel_pid: int = 0
    guard_calls: int = 0
    reached: threading.Event = field(default_factory=threading.Event)
    in_body: threading.Event = field(default_factory=threading.Event)
    worker_locked: threading.Event = field(default_factory=threading.Event)
    cancel_locked: threading.Event = field(default_factory=threading.Event)
    cancel_done: threading.Event = field(default_factory=threading.Event)


class _RaceHooks:
    """Hooks on ``job.execute``'s RUNNING guard, ``run.cancel``'s lock and the stage body."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.race: _Race | None = None
        self._require_running = run_cancel.lock_run
        self._lock_run = run_cancel.lock_run
        # The stage path's two RUNNING guards: the run lock before the stage starts (phase 1,
        # stage_path.lease.lease_job) and the outcome transaction's (phase 3, .outcome).
        monkeypatch.setattr(stage_lease, "lock_run", self.require_running)
        monkeypatch.setattr(stage_outcome, "lock_run", self.require_running)
        monkeypatch.setattr(run_cancel, "lock_run", self.cancel_lock_run)

    def require_running(self, run_id: uuid.UUID) -> WorkflowRun:
        race = self.race
        assert race is not None
        race.guard_calls += 1
        phase = {1: "phase1", 2: "phase3"}[race.guard_calls]
        if race.mode == f"{phase}_cancel_first":
            race.reached.set()
            _wait(race.cancel_done, "the cancel to commit")
        elif race.mode == f"{phase}_cancel_holds_lock":
            race.reached.set()
            _wait(race.cancel_locked, "the cancel to lock the run")
        run = self._require_running(run_id)  # CANCELLED once the cancel has committed
        if race.mode == f"{phase}_worker_holds_lock":
            race.worker_locked.set()
            _wait_until_blocked_by_me([race.cancel_pid])
        return run

    def cancel_lock_run(self, run_id: uuid.UUID) -> WorkflowRun | None:
        race = self.race
        run = self._lock_run(run_id)
        if race is not None and race.mode.endswith("_cancel_holds_lock"):
            race.cancel_locked.set()
            _wait_until_blocked_by_me([race.worker_pid])
        return run

    def stage_body(self) -> None:
        race = self.race
        assert race is not None
        if race.mode == "in_body":
            race.in_body.set()
            _wait(race.cancel_done, "the cancel to commit")
        elif race.mode == "phase1_worker_holds_lock":
            _wait(race.cancel_done, "the cancel to commit")

    def worker(self, kernel: Kernel, job: WorkflowJob) -> str:
        race = self.race
        assert race is not None
        race.worker_pid = _backend_pid()
        race.start.wait(WAIT_SECONDS)
        if race.mode == "before_start":
            _wait(race.cancel_done, "the cancel to commit")
        return execute_job(kernel, job).outcome

    def canceller(self, kernel: Kernel, run_id: str) -> bool:
        race = self.race
        assert race is not None
        race.cancel_pid = _backend_pid()
        race.start.wait(WAIT_SECONDS)
        mode = race.mode
        if mode == "in_body":
            _wait(race.in_body, "the stage body")
        elif mode.endswith(("_cancel_first", "_cancel_holds_lock")):
            _wait(race.reached, "the worker to reach the guard")
        elif mode.endswith("_worker_holds_lock"):
            _wait(race.worker_locked, "the worker to lock the run")
        try:
            return bool(kernel.dispatch(CancelRun(run_id, reason="race")).cancelled)
        finally:
            race.cancel_done.set()


def _assert_cancel_wins_or_follows(run_id: str, mode: str, job_outcome: str) -> bool:
    """The invariants of Part I item 1 for one raced run; returns whether stage 1 completed."""
    run = WorkflowRun.objects.get(pk=run_id)
    assert run.status == Status.CANCELLED, mode
    cancelled_at = run.completed_at
    assert cancelled_at is not None

    events = list(OutboxEvent.objects.filter(workflow_run_id=run_id).order_by("sequence"))
    types = [e.event_type for e in events]
    assert [e.sequence for e in events] == list(range(1, len(events) + 1)), (mode, types)
    assert types.count(ev.WORKFLOW_CANCELLED) == 1, (mode, types)
    # nothing of the run is written after the cancel, in particular no stage:completed
    assert types[-1] == ev.WORKFLOW_CANCELLED, (mode, types)

    stages = {s.stage_id: s for s in WorkflowStage.objects.filter(run_id=run_id)}
    completed = {sid for sid, s in stages.items() if s.status == Status.COMPLETED}
    assert {s.status for s in stages.values()} <= {Status.COMPLETED, Status.CANCELLED}, mode
    completed_events = {e.payload["stage_id"] for e in events if e.event_type == ev.STAGE_COMPLETED}
    assert completed_events == completed, mode
    assert completed <= {"add-1"}, mode  # stage 2 never runs
    for sid in completed:
        assert stages[sid].completed_at is not None
        assert stages[sid].completed_at < cancelled_at, mode

    blobs = list(WorkflowBlob.objects.filter(run_id=run_id))
    assert {b.stage_id for b in blobs} == completed, mode  # no output of a discarded result
    for blob in blobs:
        assert blob.created_at < cancelled_at, mode

    open_jobs = WorkflowJob.objects.filter(
        workflow_run_id=run_id, status__in=[Status.PENDING, Status.RUNNING, Status.SUSPENDED]
    )
    assert not open_jobs.exists(), mode
    stage1_completed = "add-1" in completed
    assert job_outcome == "completed" if stage1_completed else job_outcome in ("failed", "ghost")
    return stage1_completed


def test_cancel_races_stage_completion_cancel_always_wins_or_follows(
    monkeypatch: pytest.MonkeyPatch, clock: FakeClock, sink: CollectingSink
) -> None:
    """Part I item 1, EC-25, EC-6, K-JE-15, K-CA-1..3: a cancel racing ``job.execute`` of the
    same run (pre-flight, Phase 1, the stage body, Phase 3; lock held by either side; free)
    always leaves the run CANCELLED; a stage is COMPLETED only if its completion committed
    before the cancel (earlier ``completed_at``, ``stage:completed`` before
    ``workflow:cancelled``, output blob older than the cancel); otherwise the result is a
    ghost and nothing of it is written.
    """
    hooks = _RaceHooks(monkeypatch)

    def body(ctx: StageContext[Num, Any]) -> Num:
        hooks.stage_body()
        return Num(value=ctx.input.value + 1)

    first = define_stage(id="add-1", input=Num, output=Num, execute=body)
    wf = define_workflow(id="race", input=Num).pipe(first).pipe(add(10)).build()
    kernel = make_kernel(wf, clock=_TickingClock(clock.now()), event_sink=sink)

    for round_no in range(4):
        for mode in RACE_MODES:
            created = kernel.dispatch(CreateRun(workflow_id="race", input={"value": round_no}))
            run_id = created.workflow_run_id
            kernel.dispatch(ClaimPendingRuns(worker_id="claimer", max_claims=1))
            job = kernel.queue.dequeue("worker")
            assert job is not None and str(job.workflow_run_id) == run_id
            hooks.race = _Race(mode)

            outcome, cancelled = _results(
                lambda job=job: hooks.worker(kernel, job),
                lambda run_id=run_id: hooks.canceller(kernel, run_id),
            )

            assert cancelled is True, mode
            done = _assert_cancel_wins_or_follows(run_id, mode, outcome)
            if mode not in EITHER:
                assert done == (mode in COMPLETION_FIRST), mode


# --------------------------------------------------------------------------------------------
# 2. claiming pending runs (B.1, DM-33)
# --------------------------------------------------------------------------------------------


def _claim(kernel: Kernel, worker: str) -> list[str]:
    result = kernel.dispatch(ClaimPendingRuns(worker_id=worker, max_claims=1))
    return [c.workflow_run_id for c in result.claimed]


def _assert_claimed_once(run_ids: list[str]) -> None:
    for run_id in run_ids:
        assert WorkflowRun.objects.get(pk=run_id).status == Status.RUNNING
        started = OutboxEvent.objects.filter(workflow_run_id=run_id, event_type=ev.WORKFLOW_STARTED)
        assert started.count() == 1
        assert WorkflowJob.objects.filter(workflow_run_id=run_id).count() == 1
        assert WorkflowStage.objects.filter(run_id=run_id).count() == 1


def test_claim_pending_two_concurrent_claims_of_one_run_one_wins(
    kernel_for: Callable[..., Kernel], monkeypatch: pytest.MonkeyPatch
) -> None:
    """B.1 :144, DM-33, K-CP-1: two concurrent claims of one PENDING run -> exactly one claims
    it (one ``workflow:started``, one job); a claim that meets the locked row skips it instead
    of waiting (SKIP LOCKED).
    """
    kernel = kernel_for(two_stage())
    real_claim = run_claim_pending.claim_next_pending_run
    hold = {"on": False}
    held, released = threading.Event(), threading.Event()

    def holding_claim(*args: Any, **kwargs: Any) -> WorkflowRun | None:
        run = real_claim(*args, **kwargs)
        if run is not None and hold["on"]:
            held.set()
            _wait(released, "the second claim")
        return run

    monkeypatch.setattr(run_claim_pending, "claim_next_pending_run", holding_claim)

    # forced overlap: the second claim runs while the first holds the row lock
    hold["on"] = True
    run_id = kernel.dispatch(CreateRun(workflow_id="two-stage", input={"value": 1}))
    holder = _Thread(lambda: _claim(kernel, "holder"))
    _wait(held, "the first claim to lock the run")
    hold["on"] = False
    assert _Thread(lambda: _claim(kernel, "second")).result() == []  # did not block
    released.set()
    assert holder.result() == [run_id.workflow_run_id]
    _assert_claimed_once([run_id.workflow_run_id])

    # free races
    for i in range(10):
        run_id = kernel.dispatch(CreateRun(workflow_id="two-stage", input={"value": i}))
        barrier = threading.Barrier(2)

        def claim(worker: str, barrier: threading.Barrier = barrier) -> list[str]:
            barrier.wait(WAIT_SECONDS)
            return _claim(kernel, worker)

        a, b = _results(lambda: claim("w-a"), lambda: claim("w-b"))
        assert sorted([a, b], key=len) == [[], [run_id.workflow_run_id]]
        _assert_claimed_once([run_id.workflow_run_id])
    assert not WorkflowRun.objects.filter(status=Status.PENDING).exists()


def test_claim_pending_ten_claimers_over_three_runs_claim_each_once(
    kernel_for: Callable[..., Kernel],
) -> None:
    """B.1 :208, DM-33: 10 concurrent claimers over 3 PENDING runs -> 3 claims, 7 empty
    results, no run claimed twice, none left PENDING.
    """
    kernel = kernel_for(two_stage())
    for _ in range(3):
        run_ids = [
            kernel.dispatch(CreateRun(workflow_id="two-stage", input={"value": i})).workflow_run_id
            for i in range(3)
        ]
        barrier = threading.Barrier(10)

        def claim(worker: str, barrier: threading.Barrier = barrier) -> list[str]:
            barrier.wait(WAIT_SECONDS)
            return _claim(kernel, worker)

        results = _results(*[lambda i=i: claim(f"w-{i}") for i in range(10)])
        claimed = [rid for r in results for rid in r]
        assert sorted(claimed) == sorted(run_ids)  # each exactly once
        assert sum(1 for r in results if not r) == 7
        assert not WorkflowRun.objects.filter(status=Status.PENDING).exists()
        _assert_claimed_once(run_ids)


# --------------------------------------------------------------------------------------------
# 3. job dequeue with SKIP LOCKED (C.9 :222, B.2, DM-41)
# --------------------------------------------------------------------------------------------


def _enqueue(kernel: Kernel, count: int) -> list[int]:
    return kernel.queue.enqueue(
        [
            JobSpec(workflow_run_id=uuid.uuid4(), workflow_id="wf", stage_id="s")
            for _ in range(count)
        ]
    )


def test_job_dequeue_concurrent_workers_lease_each_job_once(
    kernel_for: Callable[..., Kernel],
) -> None:
    """C.9 :222, B.2 :111/:142/:158, DM-41, SM-31: 8 workers dequeuing concurrently from 20 jobs
    -> every job leased exactly once, RUNNING, by the worker that got it, attempt == 1.
    """
    kernel = kernel_for()
    job_ids = _enqueue(kernel, 20)
    barrier = threading.Barrier(8)

    def drain(worker: str) -> list[int]:
        barrier.wait(WAIT_SECONDS)
        got = []
        while (job := kernel.queue.dequeue(worker)) is not None:
            assert job.attempt == 1
            got.append(job.pk)
        return got

    results = _results(*[lambda i=i: drain(f"w-{i}") for i in range(8)])
    leased = [pk for got in results for pk in got]
    assert sorted(leased) == sorted(job_ids)  # each exactly once
    for i, got in enumerate(results):
        for job in WorkflowJob.objects.filter(pk__in=got):
            assert (job.status, job.attempt, job.worker_id) == (Status.RUNNING, 1, f"w-{i}")
            assert job.locked_at is not None


def test_job_dequeue_skips_a_job_locked_by_another_worker(
    kernel_for: Callable[..., Kernel], monkeypatch: pytest.MonkeyPatch
) -> None:
    """DM-41, C.9 :222: while one worker holds the lock on the first job, a second dequeue
    takes the next job without waiting; both end leased once with attempt 1.
    """
    kernel = kernel_for()
    first, second = _enqueue(kernel, 2)
    real_claim = queue_module.claim_next_job
    held, released = threading.Event(), threading.Event()
    hold = {"on": True}

    def holding_claim(now: datetime, exclude: Any = (), **kwargs: Any) -> WorkflowJob | None:
        job = real_claim(now, exclude, **kwargs)
        if hold["on"]:
            hold["on"] = False
            held.set()
            _wait(released, "the second dequeue")
        return job

    monkeypatch.setattr(queue_module, "claim_next_job", holding_claim)
    holder = _Thread(lambda: kernel.queue.dequeue("holder"))
    _wait(held, "the first dequeue to lock its job")
    other = _Thread(lambda: kernel.queue.dequeue("other")).result()
    released.set()
    mine = holder.result()
    assert (mine.pk, mine.attempt) == (first, 1)
    assert (other.pk, other.attempt) == (second, 1)
    assert kernel.queue.dequeue("late") is None
    assert set(WorkflowJob.objects.values_list("worker_id", "attempt")) == {
        ("holder", 1),
        ("other", 1),
    }


# --------------------------------------------------------------------------------------------
# 4. outbox sequences (C.9 :188, EV-3)
# --------------------------------------------------------------------------------------------


def _append_one(run_id: str, n: int, now: datetime) -> int:
    with transaction.atomic():
        append_events([ev.event(ev.STAGE_PROGRESS, run_id, now, n=n)], f"cause-{n}", now)
        return OutboxEvent.objects.get(workflow_run_id=run_id, payload__n=n).sequence


def _assert_gap_free(run_id: str, count: int) -> None:
    rows = list(OutboxEvent.objects.filter(workflow_run_id=run_id).order_by("sequence"))
    assert [r.sequence for r in rows] == list(range(1, count + 1))
    assert sorted(r.payload["n"] for r in rows) == list(range(count))


def test_outbox_concurrent_appends_for_one_run_get_sequences_1_to_10(clock: FakeClock) -> None:
    """C.9 :188, EV-3, EC-18, DM-20: 10 concurrent transactions each appending one event for the
    same run -> sequences 1..10, no duplicates, no gaps (three runs, one after another).
    """
    for _ in range(3):
        run_id = str(uuid.uuid4())
        barrier = threading.Barrier(10)

        def append(n: int, run_id: str = run_id, barrier: threading.Barrier = barrier) -> int:
            barrier.wait(WAIT_SECONDS)
            return _append_one(run_id, n, clock.now())

        sequences = _results(*[lambda n=n: append(n) for n in range(10)])
        assert sorted(sequences) == list(range(1, 11))
        _assert_gap_free(run_id, 10)


def test_outbox_appends_wait_for_an_open_transaction_of_the_same_run(clock: FakeClock) -> None:
    """EV-3 (advisory lock path): while one transaction that appended for a run is still open,
    9 other appenders for that run wait for it instead of reusing its sequence; after it
    commits they continue the sequence: 1..10, the holder has 1.
    """
    run_id = str(uuid.uuid4())
    appended = threading.Event()
    pids: list[int] = []
    pids_lock = threading.Lock()

    def holder() -> int:
        with transaction.atomic():
            append_events([ev.event(ev.STAGE_PROGRESS, run_id, clock.now(), n=0)], "c", clock.now())
            appended.set()
            _wait_until_blocked_by_me(_wait_for_pids(pids, pids_lock, 9))
        return OutboxEvent.objects.get(workflow_run_id=run_id, payload__n=0).sequence

    def follower(n: int) -> int:
        with pids_lock:
            pids.append(_backend_pid())
        _wait(appended, "the holder's append")
        return _append_one(run_id, n, clock.now())

    first = _Thread(holder)
    others = [_Thread(lambda n=n: follower(n)) for n in range(1, 10)]
    assert first.result() == 1
    assert sorted(t.result() for t in others) == list(range(2, 11))
    _assert_gap_free(run_id, 10)


def _wait_for_pids(pids: list[int], lock: threading.Lock, count: int) -> list[int]:
    deadline = time.monotonic() + WAIT_SECONDS
    while True:
        with lock:
            if len(pids) == count:
                return list(pids)
        assert time.monotonic() < deadline, "followers never connected"
        time.sleep(0.002)


# --------------------------------------------------------------------------------------------
# 5. concurrent run.transition after a group completed (EC-8, K-TR-2)
# --------------------------------------------------------------------------------------------


def _siblings_done(
    kernel: Kernel, workflow_id: str, value: int, monkeypatch: pytest.MonkeyPatch
) -> str:
    """A RUNNING run whose parallel group 1 (``a``, ``b``) has completed, not transitioned:
    both delivered through the stage path, the outcomes' own transition left out - the state
    a group resumed by the poller leaves for the tick's ``run.transition`` (the poller does
    not transition).
    """
    run_id = kernel.dispatch(CreateRun(workflow_id=workflow_id, input={"value": value}))
    run_id = run_id.workflow_run_id
    kernel.dispatch(ClaimPendingRuns(worker_id="claimer", max_claims=1))
    for _ in range(2):
        job = kernel.queue.dequeue("worker")
        assert job is not None and str(job.workflow_run_id) == run_id
        with monkeypatch.context() as patched:
            patched.setattr(stage_outcome, "_transition", lambda *args, **kwargs: (None, None))
            result = kernel.dispatch(
                ExecuteJob(workflow_run_id=run_id, workflow_id=workflow_id, stage_id=job.stage_id)
            )
        assert result.outcome == "completed"
        assert WorkflowJob.objects.get(pk=job.pk).status == Status.COMPLETED  # by the outcome
    return run_id


class _TransitionRacer:
    """Dispatches two concurrent ``run.transition``; optionally the first holds the run lock
    until the second waits on it.
    """

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self._lock_run = run_transition.lock_run
        self.forced = False
        self.held = threading.Event()
        self.waiter_pid = 0
        monkeypatch.setattr(run_transition, "lock_run", self.lock_run)

    def lock_run(self, run_id: uuid.UUID) -> WorkflowRun | None:
        run = self._lock_run(run_id)
        if self.forced and not self.held.is_set():
            self.held.set()
            _wait_until_blocked_by_me([self.waiter_pid])
        return run

    def race(self, kernel: Kernel, run_id: str, forced: bool) -> list[Any]:
        self.forced, self.held = forced, threading.Event()
        barrier = threading.Barrier(2)

        def first() -> Any:
            barrier.wait(WAIT_SECONDS)
            return kernel.dispatch(TransitionRun(run_id))

        def second() -> Any:
            self.waiter_pid = _backend_pid()  # known to the first once the barrier breaks
            barrier.wait(WAIT_SECONDS)
            if forced:
                _wait(self.held, "the first transition to lock the run")
            return kernel.dispatch(TransitionRun(run_id))

        return _results(first, second)


def _parallel_workflow(workflow_id: str, *, then: bool) -> Any:
    builder = define_workflow(id=workflow_id, input=Num).parallel(
        [add(1, stage_id="a"), add(2, stage_id="b")]
    )
    if then:
        builder = builder.pipe(define_stage(id="c", execute=lambda ctx: Num(value=0), output=Num))
    return builder.build()


def test_transition_concurrent_after_group_done_advances_once(
    kernel_for: Callable[..., Kernel], monkeypatch: pytest.MonkeyPatch
) -> None:
    """EC-8, K-TR-2, K-TR-6: two siblings' concurrent ``run.transition`` after group 1
    completed -> one ``advanced`` to group 2, the other ``noop``; group 2's record and job
    exist once.
    """
    kernel = kernel_for(_parallel_workflow("fan-in", then=True))
    racer = _TransitionRacer(monkeypatch)
    for round_no in range(8):
        run_id = _siblings_done(kernel, "fan-in", round_no, monkeypatch)
        results = racer.race(kernel, run_id, forced=round_no < 2)
        actions = sorted((r.action, r.next_group) for r in results)
        assert actions == [("advanced", 2), ("noop", None)]
        assert WorkflowStage.objects.filter(run_id=run_id, stage_id="c").count() == 1
        jobs = WorkflowJob.objects.filter(workflow_run_id=run_id, stage_id="c")
        assert [j.status for j in jobs] == [Status.PENDING]
        assert WorkflowRun.objects.get(pk=run_id).status == Status.RUNNING
        kernel.dispatch(CancelRun(run_id))  # its group-2 job must not reach the next round


def test_transition_concurrent_after_last_group_completes_once(
    kernel_for: Callable[..., Kernel], monkeypatch: pytest.MonkeyPatch
) -> None:
    """EC-8, K-TR-2, K-TR-7: two concurrent ``run.transition`` after the last group completed
    -> one ``completed``, the other ``noop``; one ``workflow:completed``, no job enqueued.
    """
    kernel = kernel_for(_parallel_workflow("fan-out", then=False))
    racer = _TransitionRacer(monkeypatch)
    for round_no in range(8):
        run_id = _siblings_done(kernel, "fan-out", round_no, monkeypatch)
        results = racer.race(kernel, run_id, forced=round_no < 2)
        assert sorted(r.action for r in results) == ["completed", "noop"]
        run = WorkflowRun.objects.get(pk=run_id)
        assert run.status == Status.COMPLETED
        assert run.output == {"a": {"value": round_no + 1}, "b": {"value": round_no + 2}}
        completed = OutboxEvent.objects.filter(
            workflow_run_id=run_id, event_type=ev.WORKFLOW_COMPLETED
        )
        assert completed.count() == 1
        assert WorkflowJob.objects.filter(workflow_run_id=run_id).count() == 2


# --------------------------------------------------------------------------------------------
# 6. idempotent run.create under concurrency (K-10..12)
# --------------------------------------------------------------------------------------------


def _create_with_key(kernel: Kernel, key: str) -> str:
    cmd = CreateRun(workflow_id="two-stage", input={"value": 1}, idempotency_key=key)
    return kernel.dispatch(cmd).workflow_run_id


def _assert_one_run(outcomes: list[Any]) -> str:
    """Every outcome names the single stored run or is IdempotencyInProgressError."""
    assert WorkflowRun.objects.count() == 1
    run_id = str(WorkflowRun.objects.get().pk)
    for out in outcomes:
        if isinstance(out, BaseException):
            assert isinstance(out, IdempotencyInProgressError), repr(out)
        else:
            assert out == run_id
    created = OutboxEvent.objects.filter(event_type=ev.WORKFLOW_CREATED)
    assert list(created.values_list("workflow_run_id", flat=True)) == [uuid.UUID(run_id)]
    return run_id


def test_create_run_concurrent_same_idempotency_key_creates_one_run(
    kernel_for: Callable[..., Kernel],
) -> None:
    """K-10, K-12, B/C.9 :285, issue 3 item 2: fifty concurrent ``run.create`` with the same
    idempotency key -> exactly one run; every successful call returns its id (the others may
    be told the key is in progress); afterwards the key replays the same id.
    """
    kernel = kernel_for(two_stage())
    barrier = threading.Barrier(50)

    def create() -> str:
        barrier.wait(WAIT_SECONDS)
        return _create_with_key(kernel, "same-key")

    outcomes = _outcomes(*[create for _ in range(50)])
    run_id = _assert_one_run(outcomes)
    assert any(out == run_id for out in outcomes)
    assert _create_with_key(kernel, "same-key") == run_id
    assert WorkflowRun.objects.count() == 1


def test_create_run_same_key_while_first_is_inside_its_transaction(
    kernel_for: Callable[..., Kernel], monkeypatch: pytest.MonkeyPatch
) -> None:
    """K-10, K-12, K-20, issue 7: the key is recorded in the run's own transaction. While the
    first ``run.create`` with a key is held inside its transaction, 20 concurrent calls with
    that key race for it: one commits its run, the others wait for that commit and replay it,
    and the held first call, once released, finds the key taken, rolls its own run back and
    replays it too. 20 later calls replay it. One run in the end, every caller has its id.
    """
    kernel = kernel_for(two_stage())
    real_write = run_create.write_annotations
    inside, others_done = threading.Event(), threading.Event()

    def holding_write(*args: Any, **kwargs: Any) -> Any:
        if not inside.is_set():
            inside.set()
            _wait(others_done, "the concurrent creates")
        return real_write(*args, **kwargs)

    monkeypatch.setattr(run_create, "write_annotations", holding_write)
    first = _Thread(lambda: _create_with_key(kernel, "held-key"))
    _wait(inside, "the first create's transaction")
    barrier = threading.Barrier(20)

    def create() -> str:
        barrier.wait(WAIT_SECONDS)
        return _create_with_key(kernel, "held-key")

    during = _results(*[create for _ in range(20)])
    others_done.set()
    run_id = first.result()
    assert during == [run_id] * 20

    barrier = threading.Barrier(20)
    after = _outcomes(*[create for _ in range(20)])
    assert after == [run_id] * 20
    assert _assert_one_run([run_id, *during, *after]) == run_id
