"""Maintenance when clocks disagree and rows are locked (issue 17 section 2).

* A kernel whose clock is *not* the lease clock (``FakeClock(drives_leases=False)``: leases
  are stamped and judged by the database's clock, as in production): a reaper host 90 s ahead
  must not fail a heartbeated run as stuck, nor release its job; a lease that really went
  stale (in database time) is still reaped.
* Rows another transaction holds (a host that vanished inside a transaction: its session
  stays "idle in transaction" with the row locks) never block a maintenance step: the lease
  reaper, the stuck-run reaper and the suspended-stage poll skip them (``SKIP LOCKED`` / no
  wait) and handle them once the lock is gone. The test connection gets ``lock_timeout`` so
  a step that waits fails instead of hanging.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import pytest
from django.db import connection, transaction

from django_workflows.kernel import (
    ClaimPendingRuns,
    CreateRun,
    Kernel,
    PollSuspendedStages,
    ReapStaleLeases,
    ReapStuckRuns,
)
from django_workflows.kernel.hosting import process_available_jobs
from django_workflows.kernel.leases import LeaseClock
from django_workflows.models import Status, WorkflowJob, WorkflowRun, WorkflowStage
from django_workflows.testing import FakeClock, make_kernel
from tests.markers import postgres_only
from tests.workflows import async_stage, two_stage

pytestmark = pytest.mark.django_db(transaction=True)

STALE = 30.0
SKEW = timedelta(seconds=90)


@pytest.fixture(autouse=True)
def _short_lease(settings: Any) -> None:
    settings.DJANGO_WORKFLOWS = {**settings.DJANGO_WORKFLOWS, "STALE_LEASE_SECONDS": STALE}


def _database_now() -> Any:
    return LeaseClock(FakeClock(drives_leases=False)).read()


def _kernels(*workflows: Any) -> tuple[Kernel, Kernel]:
    """A worker kernel on the database's time and a reaper kernel 90 s ahead; neither clock
    drives leases."""
    now = _database_now()
    worker = make_kernel(*workflows, clock=FakeClock(now, drives_leases=False))
    reaper = make_kernel(*workflows, clock=FakeClock(now + SKEW, drives_leases=False))
    return worker, reaper


def _leased_run(kernel: Kernel, workflow_id: str = "two-stage") -> tuple[uuid.UUID, int]:
    """A RUNNING run whose first job a live worker leased and heartbeats."""
    res = kernel.dispatch(CreateRun(workflow_id=workflow_id, input={"value": 1}))
    kernel.dispatch(ClaimPendingRuns(worker_id="w"))
    job = kernel.queue.dequeue("w")
    assert job is not None
    assert kernel.queue.touch(job.pk, attempt=job.attempt)
    return uuid.UUID(res.workflow_run_id), job.pk


def test_a_reaper_ahead_of_the_database_spares_a_heartbeated_run() -> None:
    """Issue 17: the stuck-run reaper judges ``locked_at`` (database time) in database time. A
    reaper 90 s ahead, with a 60 s stuck threshold and a 30 s lease, finds the run idle for
    61 s, but its job's lease was refreshed just now: not stuck, not released. Once the
    lease is really stale (31 s old in database time) the same reaper fails the run."""
    worker, reaper = _kernels(two_stage())
    run_id, job_id = _leased_run(worker)
    # The stage started 61 s ago (database time): run and stage rows idle past the threshold.
    idle_since = _database_now() - timedelta(seconds=61)
    WorkflowRun.objects.filter(pk=run_id).update(updated_at=idle_since)
    WorkflowStage.objects.filter(run_id=run_id).update(updated_at=idle_since)

    assert reaper.dispatch(ReapStuckRuns(stuck_threshold_seconds=60)).failed == 0
    assert reaper.dispatch(ReapStaleLeases(stale_threshold_seconds=STALE)).released == 0
    assert WorkflowRun.objects.get(pk=run_id).status == Status.RUNNING
    assert WorkflowJob.objects.get(pk=job_id).status == Status.RUNNING

    # The worker died 31 s ago (database time): its last heartbeat is older than the lease.
    WorkflowJob.objects.filter(pk=job_id).update(
        locked_at=_database_now() - timedelta(seconds=STALE + 1)
    )
    WorkflowJob.objects.filter(pk=job_id).update(max_attempts=1)  # no re-delivery left
    assert reaper.dispatch(ReapStuckRuns(stuck_threshold_seconds=60)).failed == 1
    assert WorkflowRun.objects.get(pk=run_id).output["error"]["code"] == "STUCK_RUN_REAPED"


def test_a_reaper_ahead_of_the_database_does_not_add_its_skew_to_idle_time() -> None:
    """Issue 17: a run whose worker died 31 s ago (database time; lease stale) and that has
    been idle for 30 s is not stuck under a 60 s threshold, though the reaper's own clock runs
    90 s ahead (to it the run looks idle for 120 s); idle for 61 s, it is."""
    worker, reaper = _kernels(two_stage())
    run_id, job_id = _leased_run(worker)
    now = _database_now()
    WorkflowJob.objects.filter(pk=job_id).update(
        locked_at=now - timedelta(seconds=STALE + 1), max_attempts=1
    )
    for idle, reaped in ((30, 0), (61, 1)):
        WorkflowRun.objects.filter(pk=run_id).update(updated_at=now - timedelta(seconds=idle))
        WorkflowStage.objects.filter(run_id=run_id).update(updated_at=now - timedelta(seconds=idle))
        assert reaper.dispatch(ReapStuckRuns(stuck_threshold_seconds=60)).failed == reaped, idle


@contextmanager
def _held(*querysets: Any) -> Iterator[None]:
    """Another connection locks the rows of ``querysets`` (``FOR UPDATE``) and sits idle in
    its transaction until the block ends, as a host that vanished mid-transaction would."""
    held, release = threading.Event(), threading.Event()
    failure: list[BaseException] = []

    def hold() -> None:
        try:
            with transaction.atomic():
                for qs in querysets:
                    list(qs.select_for_update())
                held.set()
                release.wait(30)
        except BaseException as exc:  # pragma: no cover - shown by the assertion below
            failure.append(exc)
            held.set()
        finally:
            connection.close()

    thread = threading.Thread(target=hold, daemon=True)
    thread.start()
    assert held.wait(10) and not failure, failure
    try:
        yield
    finally:
        release.set()
        thread.join(10)


@pytest.fixture
def lock_timeout() -> Iterator[None]:
    """A maintenance step that waits for a lock fails after 2 s instead of hanging."""
    with connection.cursor() as cursor:
        cursor.execute("SET lock_timeout = '2s'")
    yield
    with connection.cursor() as cursor:
        cursor.execute("RESET lock_timeout")


@postgres_only
def test_lease_reaper_skips_job_rows_another_transaction_holds(lock_timeout: None) -> None:
    """Issue 17: ``release_stale`` skips locked rows instead of waiting for them, releases the
    stale jobs nobody holds, and releases the held one after its lock is gone."""
    clock = FakeClock(_database_now())
    kernel = make_kernel(two_stage("one"), two_stage("two"), clock=clock)
    _, held_job = _leased_run(kernel, "one")
    _, free_job = _leased_run(kernel, "two")
    clock.advance(STALE + 1)

    with _held(WorkflowJob.objects.filter(pk=held_job)):
        res = kernel.dispatch(ReapStaleLeases(stale_threshold_seconds=STALE))
        assert res.released == 1
        assert WorkflowJob.objects.get(pk=free_job).status == Status.PENDING
        assert WorkflowJob.objects.get(pk=held_job).status == Status.RUNNING
    assert kernel.dispatch(ReapStaleLeases(stale_threshold_seconds=STALE)).released == 1
    assert WorkflowJob.objects.get(pk=held_job).status == Status.PENDING


@postgres_only
def test_stuck_reaper_and_poll_skip_a_run_another_transaction_holds(lock_timeout: None) -> None:
    """Issue 17: the stuck-run reaper and the suspended-stage poll do not wait for a locked
    run row (it is left for a later tick); once the lock is gone they handle it."""
    clock = FakeClock(_database_now())
    kernel = make_kernel(two_stage(), clock=clock)
    run_id, job_id = _leased_run(kernel)
    WorkflowJob.objects.filter(pk=job_id).update(max_attempts=1)
    clock.advance(600)

    with _held(WorkflowRun.objects.filter(pk=run_id)):
        assert kernel.dispatch(ReapStuckRuns(stuck_threshold_seconds=300)).failed == 0
    assert WorkflowRun.objects.get(pk=run_id).status == Status.RUNNING
    assert kernel.dispatch(ReapStuckRuns(stuck_threshold_seconds=300)).failed == 1

    batch = make_kernel(_batch_workflow(), clock=clock)
    res = batch.dispatch(CreateRun(workflow_id="batchy", input={"value": 1}))
    run_id = uuid.UUID(res.workflow_run_id)
    process_available_jobs(batch, "w")  # claims the run, runs the stage: it suspends
    assert WorkflowStage.objects.get(run_id=run_id).status == Status.SUSPENDED
    clock.advance(10)  # the poll is due
    with _held(WorkflowRun.objects.filter(pk=run_id)):
        polled = batch.dispatch(PollSuspendedStages(max_checks=10))
        assert polled.resumed == 0
    assert WorkflowStage.objects.get(run_id=run_id).status == Status.SUSPENDED
    assert batch.dispatch(PollSuspendedStages(max_checks=10)).resumed == 1


def _batch_workflow() -> Any:
    from django_workflows import define_workflow
    from tests.workflows import Num

    return define_workflow(id="batchy", input=Num).pipe(async_stage()).build()


def test_w012_warns_about_an_unbounded_postgresql_session() -> None:
    """Issue 17: system check W012 names the session bounds a PostgreSQL database lacks, and
    is quiet when ``OPTIONS`` set them (SQLite is never checked)."""
    from django_workflows.checks import check_session_bounds

    bare = {"ENGINE": "django.db.backends.postgresql", "OPTIONS": {}}
    (warning,) = check_session_bounds("default", bare)
    assert warning.id == "django_workflows.W012"
    assert "idle_in_transaction_session_timeout, tcp_user_timeout, keepalives" in warning.msg
    partial = {"OPTIONS": {"options": "-c idle_in_transaction_session_timeout=30s"}}
    (warning,) = check_session_bounds("other", partial)
    assert "DATABASES['other']" in warning.msg and "idle_in" not in warning.msg.split(":")[1]
    bounded = {
        "OPTIONS": {
            "options": "-c idle_in_transaction_session_timeout=30s",
            "keepalives": 1,
            "tcp_user_timeout": 30000,
        }
    }
    assert check_session_bounds("default", bounded) == []
