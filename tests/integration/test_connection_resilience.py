"""Connection resilience of the stage path (issue 8 item 1): a worker's database connection
terminated at each point of a delivery costs one retried write, never a delivery.

The faults are real: ``pg_terminate_backend`` from a second connection, on backends of this
test database only. Those tests need PostgreSQL (SQLite has no connection to lose); the
timeout message (item 6) and the classifier's SQLite answer run on both.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from django.conf import settings
from django.db import OperationalError, connection, transaction
from django_q.exceptions import TimeoutException

from django_workflows import StageContext, define_stage, define_workflow
from django_workflows.kernel import ClaimPendingRuns, CreateRun, faults
from django_workflows.kernel.connections import is_connection_error, retry_on_disconnect
from django_workflows.kernel.hosting import process_available_jobs
from django_workflows.kernel.stage_path import lease as stage_lease
from django_workflows.models import OutboxEvent, Status, WorkflowJob, WorkflowLog, WorkflowRun
from tests.markers import ON_POSTGRES
from tests.workflows import Num, add

pytestmark = pytest.mark.django_db(transaction=True)

needs_pg = pytest.mark.skipif(
    not ON_POSTGRES, reason="needs PostgreSQL: SQLite has no server connection to terminate"
)


# --- helpers ------------------------------------------------------------------------------------


def _backend_pid() -> int:
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        return int(cursor.fetchone()[0])


def _terminate(pid: int | None = None, *, keep: int | None = None) -> int:
    """Terminate backend ``pid`` (or every backend but ``keep``) of this test database, from a
    separate connection; returns how many were terminated."""
    db = settings.DATABASES["default"]
    name = connection.settings_dict["NAME"]
    admin = f"postgresql://{db['USER']}@{db['HOST']}:{db['PORT']}/postgres"
    sql = (
        "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
        "WHERE datname = %s AND pid <> pg_backend_pid()"
    )
    args: list[Any] = [name]
    if pid is not None:
        sql += " AND pid = %s"
        args.append(pid)
    if keep is not None:
        sql += " AND pid <> %s"
        args.append(keep)
    with psycopg.connect(admin, autocommit=True) as conn:
        return int(conn.execute(sql, args).fetchone()[0])


def _kill_own_connection() -> None:
    """Terminate this thread's backend; its next statement fails on the dead connection."""
    assert _terminate(_backend_pid()) == 1


def _retried(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "django_workflows.connections" and "retry" in r.getMessage()
    ]


def _events(run_id: Any) -> list[OutboxEvent]:
    return list(OutboxEvent.objects.filter(workflow_run_id=run_id).order_by("sequence"))


def _assert_completed_once(run_id: Any, stages: list[str]) -> None:
    run = WorkflowRun.objects.get(pk=run_id)
    assert run.status == Status.COMPLETED, run.status
    events = _events(run_id)
    sequences = [e.sequence for e in events]
    assert sequences == list(range(1, len(sequences) + 1)), sequences
    completed = Counter(
        e.payload.get("stage_id") for e in events if e.event_type == "stage:completed"
    )
    assert completed == Counter(stages), completed
    started = Counter(e.payload.get("stage_id") for e in events if e.event_type == "stage:started")
    assert started == Counter(stages), f"a stage was delivered twice: {started}"
    jobs = list(
        WorkflowJob.objects.filter(workflow_run_id=run_id).values_list("stage_id", "attempt")
    )
    assert sorted(jobs) == sorted((s, 1) for s in stages), jobs
    assert not WorkflowLog.objects.filter(run_id=run_id, message__icontains="discarded").exists()


def _hook_stage(stage_id: str, hook: Any) -> Any:
    def execute(ctx: StageContext[Num, Any]) -> Num:
        hook(ctx)
        return Num(value=ctx.input.value + 1)

    return define_stage(id=stage_id, input=Num, output=Num, execute=execute)


def _start(kernel: Any, workflow_id: str) -> str:
    run_id = kernel.dispatch(CreateRun(workflow_id, {"value": 0})).workflow_run_id
    kernel.dispatch(ClaimPendingRuns("claimer"))
    return str(run_id)


@pytest.fixture(autouse=True)
def _no_faults_left() -> Iterator[None]:
    yield
    for point in faults.POINTS:
        faults.inject(point, None)


# --- the worker's own connection ------------------------------------------------------------------


@needs_pg
def test_connection_killed_while_the_stage_executes_costs_one_retried_write(
    kernel_for: Any, caplog: pytest.LogCaptureFixture
) -> None:
    workflow = (
        define_workflow(id="kill-in-stage", input=Num)
        .pipe(_hook_stage("s1", lambda ctx: _kill_own_connection()))
        .pipe(add(1, stage_id="s2"))
        .build()
    )
    kernel = kernel_for(workflow)
    caplog.set_level(logging.WARNING, logger="django_workflows.connections")
    run_id = _start(kernel, "kill-in-stage")
    result = process_available_jobs(kernel, "w", max_jobs=5)
    assert (result.succeeded, result.failed) == (2, 0)
    _assert_completed_once(run_id, ["s1", "s2"])
    assert WorkflowRun.objects.get(pk=run_id).output == {"value": 2}
    retried = _retried(caplog)
    assert len(retried) == 1 and "outcome of stage s1" in retried[0], retried


@needs_pg
def test_connection_killed_at_a_fault_point_costs_one_retried_write(
    kernel_for: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """``stage.executing``: the body returned, nothing written yet; ``lease.after_commit``:
    the job is leased, the stage not started."""
    for point, workflow_id in (
        ("stage.executing", "kill-exec"),
        ("lease.after_commit", "kill-lease"),
    ):
        caplog.clear()
        kills = {"n": 0}

        def kill(kills: dict[str, int] = kills) -> None:
            if kills["n"] == 0:
                kills["n"] += 1
                _kill_own_connection()

        kernel = kernel_for(define_workflow(id=workflow_id, input=Num).pipe(add(1, "s1")).build())
        run_id = _start(kernel, workflow_id)
        faults.inject(point, kill)
        result = process_available_jobs(kernel, "w", max_jobs=5)
        faults.inject(point, None)
        assert (result.succeeded, result.failed) == (1, 0), point
        _assert_completed_once(run_id, ["s1"])
        assert kills["n"] == 1
        assert len(_retried(caplog)) == 1, (point, _retried(caplog))


@needs_pg
def test_connection_killed_while_the_worker_sat_idle_between_tasks(
    kernel_for: Any, caplog: pytest.LogCaptureFixture
) -> None:
    kernel = kernel_for(define_workflow(id="kill-idle", input=Num).pipe(add(1, "s1")).build())
    run_id = _start(kernel, "kill-idle")
    caplog.set_level(logging.WARNING, logger="django_workflows.connections")
    _kill_own_connection()  # the connection sits idle in the worker process, then dies
    result = process_available_jobs(kernel, "w", max_jobs=5)
    assert (result.succeeded, result.failed) == (1, 0)
    _assert_completed_once(run_id, ["s1"])
    retried = _retried(caplog)
    assert len(retried) == 1 and retried[0].startswith("lease"), retried


def _lose_ack_once(kills: dict[str, int]) -> None:
    """Kill this thread's connection and fail on it: what a lost COMMIT acknowledgement
    looks like to the worker, after the database committed."""
    if kills["n"] == 0:
        kills["n"] += 1
        _kill_own_connection()
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")


@needs_pg
def test_a_lost_outcome_acknowledgement_is_reported_as_committed_not_discarded(
    kernel_for: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """s1's outcome committed (and leased s2 to this worker), then the connection died before
    the worker heard so: the retry finds the job settled at its own attempt by this outcome,
    reports it committed and goes on with s2 at its first attempt."""
    workflow = define_workflow(id="lost-ack", input=Num).pipe(add(1, "s1")).pipe(add(1, "s2"))
    kernel = kernel_for(workflow.build())
    run_id = _start(kernel, "lost-ack")
    caplog.set_level(logging.WARNING)
    kills = {"n": 0}
    faults.inject("outcome.after_commit", lambda: _lose_ack_once(kills))
    result = process_available_jobs(kernel, "w", max_jobs=5)
    assert (result.succeeded, result.failed) == (2, 0)
    _assert_completed_once(run_id, ["s1", "s2"])
    assert kills["n"] == 1 and len(_retried(caplog)) == 1
    messages = [r.getMessage() for r in caplog.records]
    assert any("had committed before the connection was lost" in m for m in messages)
    assert any("acknowledgement was lost; delivering it" in m for m in messages), messages
    assert not any("discarded" in m for m in messages)


@needs_pg
def test_a_lost_lease_acknowledgement_delivers_the_leased_job_at_its_attempt(
    kernel_for: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """The lease committed, the acknowledgement was lost: the retry takes the job back
    instead of leaving it to lease expiry (which would cost a second delivery)."""
    kernel = kernel_for(define_workflow(id="lost-lease", input=Num).pipe(add(1, "s1")).build())
    run_id = _start(kernel, "lost-lease")
    caplog.set_level(logging.WARNING)
    kills = {"n": 0}
    faults.inject(
        "lease.before_commit", lambda: transaction.on_commit(lambda: _lose_ack_once(kills))
    )
    result = process_available_jobs(kernel, "w", max_jobs=5)
    assert (result.succeeded, result.failed) == (1, 0)
    _assert_completed_once(run_id, ["s1"])
    assert kills["n"] == 1 and len(_retried(caplog)) == 1
    messages = [r.getMessage() for r in caplog.records]
    assert any("acknowledgement was lost; delivering it" in m for m in messages), messages


@needs_pg
def test_a_database_error_that_is_not_a_connection_error_is_not_retried() -> None:
    calls = {"n": 0}

    def statement_timeout() -> None:
        calls["n"] += 1
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute("SET LOCAL statement_timeout = 1")
            cursor.execute("SELECT pg_sleep(1)")

    with pytest.raises(OperationalError) as caught:
        retry_on_disconnect(statement_timeout, what="test", sleep=lambda s: None)
    assert calls["n"] == 1
    assert not is_connection_error(caught.value)
    with connection.cursor() as cursor:  # the connection is alive and was kept
        cursor.execute("SELECT 1")


@needs_pg
def test_no_retry_inside_an_open_atomic_block() -> None:
    calls = {"n": 0}

    def write() -> None:
        calls["n"] += 1
        _kill_own_connection()
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")

    with pytest.raises(OperationalError) as caught:
        with transaction.atomic():
            retry_on_disconnect(write, what="test", sleep=lambda s: None)
    assert calls["n"] == 1
    assert is_connection_error(caught.value) or connection.connection is None
    with connection.cursor() as cursor:  # Django dropped the dead connection at the block's end
        cursor.execute("SELECT 1")


@needs_pg
@pytest.mark.parametrize("server_side_binding", [False, True])
def test_a_terminated_connection_is_recognised_with_the_debug_cursor(
    server_side_binding: bool,
) -> None:
    """With ``DEBUG`` (the debug cursor) and server-side binding, Django renders the failed
    statement by opening another cursor on the dead connection, which raises "the connection
    is closed" without SQLSTATE over the original 57P01: still a connection error, retried."""
    options = connection.settings_dict["OPTIONS"]
    saved = dict(options)
    connection.close()
    options["server_side_binding"] = server_side_binding
    connection.features.__dict__.pop("uses_server_side_binding", None)
    connection.force_debug_cursor = True
    calls = {"n": 0}

    def count_runs() -> int:
        calls["n"] += 1
        if calls["n"] == 1:
            _kill_own_connection()
        with transaction.atomic():
            return WorkflowRun.objects.count()

    try:
        assert retry_on_disconnect(count_runs, what="test", sleep=lambda s: None) == 0
        assert calls["n"] == 2
    finally:
        connection.force_debug_cursor = False
        connection.close()
        options.clear()
        options.update(saved)
        connection.features.__dict__.pop("uses_server_side_binding", None)


@needs_pg
def test_retry_gives_up_after_the_reconnect_window() -> None:
    calls = {"n": 0}
    waits: list[float] = []

    def always_dead() -> None:
        calls["n"] += 1
        _kill_own_connection()
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")

    with pytest.raises(OperationalError):
        retry_on_disconnect(always_dead, what="test", window_seconds=0, sleep=waits.append)
    assert calls["n"] == 2 and waits == []  # window 0: one immediate retry


@needs_pg
def test_a_refused_connection_is_retried_with_back_off_until_the_database_is_back() -> None:
    """A database restart as the worker sees it: connections refused for a while (here: a
    port nothing listens on), then accepted again; the transaction runs once it is back."""
    port = connection.settings_dict["PORT"]
    waits: list[float] = []
    calls = {"n": 0}

    def restart_over_after_three_waits(seconds: float) -> None:
        waits.append(seconds)
        if len(waits) == 3:
            connection.settings_dict["PORT"] = port

    def write() -> int:
        calls["n"] += 1
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute("SELECT 1")
            return int(cursor.fetchone()[0])

    connection.close()
    connection.settings_dict["PORT"] = "1"  # refused
    try:
        assert retry_on_disconnect(write, what="test", sleep=restart_over_after_three_waits) == 1
    finally:
        connection.settings_dict["PORT"] = port
    # 1 try + an immediate retry, then back-off 0.05, 0.1, 0.2 s; the 5th try succeeds.
    assert calls["n"] == 5
    assert waits == [0.05, 0.1, 0.2]


def test_sqlite_operational_errors_are_never_connection_errors() -> None:
    if ON_POSTGRES:
        pytest.skip("the SQLite answer of the classifier")
    assert not is_connection_error(OperationalError("database is locked"))


# --- the heartbeat thread ---------------------------------------------------------------


@needs_pg
def test_heartbeat_thread_reconnects_after_its_connection_is_terminated(
    kernel_for: Any, settings: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """The beater's connection is killed between two beats: the next beat discards it, sends
    the beat again on a new connection, and the lease is kept (no second delivery)."""
    settings.DJANGO_WORKFLOWS = {**settings.DJANGO_WORKFLOWS, "HEARTBEAT_INTERVAL_SECONDS": 0.05}
    caplog.set_level(logging.WARNING, logger="django_workflows.connections")
    beats: list[tuple[bool, int]] = []
    beat_seen = threading.Condition()

    def stage_body(ctx: StageContext[Num, Any]) -> None:
        main_pid = _backend_pid()

        def wait_for(pred: Any) -> None:
            with beat_seen:
                assert beat_seen.wait_for(pred, timeout=20), beats

        wait_for(lambda: len(beats) >= 1)
        beater_pid = beats[-1][1]
        assert _terminate(beater_pid, keep=main_pid) == 1
        wait_for(lambda: any(ok and pid != beater_pid for ok, pid in beats))
        assert not ctx.is_cancelled()  # the lease was never lost

    kernel = kernel_for(
        define_workflow(id="kill-beat", input=Num).pipe(_hook_stage("s1", stage_body)).build()
    )
    touch = kernel.queue.touch

    def counting_touch(job_id: int, *, attempt: int | None = None) -> bool:
        ok = touch(job_id, attempt=attempt)
        pid = _backend_pid()
        with beat_seen:
            beats.append((ok, pid))
            beat_seen.notify_all()
        return ok

    kernel.queue.touch = counting_touch  # type: ignore[method-assign]
    run_id = _start(kernel, "kill-beat")
    result = process_available_jobs(kernel, "w", max_jobs=5)
    assert (result.succeeded, result.failed) == (1, 0)
    _assert_completed_once(run_id, ["s1"])
    assert all(ok for ok, _ in beats), beats
    assert any("heartbeat of job" in line for line in _retried(caplog)), _retried(caplog)


# --- django-q2's timeout (item 6) ----------------------------------------------------------------


def test_a_stage_stopped_by_django_q2s_timeout_fails_with_a_message_naming_it(
    kernel_for: Any,
) -> None:
    """The TimeoutException (a SystemExit) raised in the stage body: the failure commits at
    once through the fenced outcome transaction, then the exception ends the task."""
    assert issubclass(TimeoutException, BaseException) and not issubclass(
        TimeoutException, Exception
    )

    def stopped(ctx: StageContext[Num, Any]) -> None:
        raise TimeoutException("Task exceeded maximum timeout value (5 seconds)")

    kernel = kernel_for(
        define_workflow(id="q-timeout", input=Num)
        .pipe(_hook_stage("s1", stopped))
        .pipe(add(1, "s2"))
        .build()
    )
    run_id = _start(kernel, "q-timeout")
    with pytest.raises(TimeoutException):
        process_available_jobs(kernel, "w", max_jobs=5)
    job = WorkflowJob.objects.get(workflow_run_id=run_id, stage_id="s1")
    # Retried like any failure (attempts left): the timeout counts from the task's start.
    assert (job.status, job.attempt) == (Status.PENDING, 1)
    assert "stopped by django-q2's timeout (Q_CLUSTER['timeout'] = " in job.last_error
    failed = [e for e in _events(run_id) if e.event_type == "stage:failed"]
    assert len(failed) == 1 and "django-q2's timeout" in failed[0].payload["error"]
    assert not WorkflowJob.objects.filter(workflow_run_id=run_id, stage_id="s2").exists()
    assert WorkflowRun.objects.get(pk=run_id).status == Status.RUNNING


def test_a_job_this_process_already_executed_is_never_taken_back(
    kernel_for: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The take-back after a lost acknowledgement (``_adopt_orphan``) must never run a stage
    body a second time under the same attempt: a job whose body this process started - and
    that something left RUNNING - waits for lease expiry and a new, counted delivery."""

    bodies = {"n": 0}
    stage = _hook_stage("s1", lambda ctx: bodies.__setitem__("n", bodies["n"] + 1))
    kernel = kernel_for(define_workflow(id="no-retake", input=Num).pipe(stage).build())
    run_id = _start(kernel, "no-retake")

    def crash() -> None:
        raise RuntimeError("the worker died between execution and outcome")

    faults.inject("stage.executing", crash)
    with pytest.raises(RuntimeError):
        process_available_jobs(kernel, "w", max_jobs=1)
    faults.inject("stage.executing", None)
    assert bodies["n"] == 1
    job = WorkflowJob.objects.get(workflow_run_id=run_id)
    assert (job.status, job.worker_id, job.attempt) == (Status.RUNNING, "w", 1)
    with transaction.atomic():
        assert stage_lease._adopt_orphan(kernel, "w") is None
    # The same job leased by a commit whose acknowledgement this process never saw (its body
    # not started here) is taken back: the guard is what kept it from being run again.
    monkeypatch.setattr(stage_lease, "_executed", stage_lease._ExecutedTokens(16))
    with transaction.atomic():
        orphan = stage_lease._adopt_orphan(kernel, "w")
    assert orphan is not None and (orphan.job.pk, orphan.job.attempt) == (job.pk, 1)
