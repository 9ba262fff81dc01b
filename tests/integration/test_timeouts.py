"""Stage timeouts and the queue-wait limit (issue 12 item 2), in process.

The heartbeat thread is the watchdog; here it is a :class:`heartbeat._Beater` without a thread,
driven by the test (``run_due(now)``, a monotonic time of the test's choosing), so no test
waits for real time to pass. The stage bodies call it themselves to "let time pass" while
they run. Lease time and the kernel clock are the :class:`FakeClock`.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from django.db import connection
from django.test import override_settings
from django.test.utils import CaptureQueriesContext

from django_workflows import StageContext, define_stage, define_workflow
from django_workflows.definition.stage import WorkflowDefinitionError, stage
from django_workflows.kernel import ClaimPendingRuns, CreateRun, delivery, heartbeat, timeouts
from django_workflows.kernel.hosting import process_available_jobs, run_maintenance_tick
from django_workflows.kernel.stage_path import execute as stage_execute
from django_workflows.models import (
    OutboxEvent,
    Status,
    WorkflowBlob,
    WorkflowJob,
    WorkflowLog,
    WorkflowRun,
    WorkflowStage,
)
from django_workflows.testing import FakeClock
from tests.markers import postgres_only
from tests.workflows import Num, add

pytestmark = pytest.mark.django_db(transaction=True)

GRACE = 5.0


@pytest.fixture
def watchdog(monkeypatch: pytest.MonkeyPatch) -> Iterator[heartbeat._Beater]:
    """The heartbeat thread, driven by hand."""
    beater = heartbeat._Beater(thread=False)
    monkeypatch.setattr(heartbeat, "_beater", beater)
    recycled: list[str] = []
    timeouts.set_recycle(lambda: recycled.append("recycled"))
    beater.recycled = recycled  # type: ignore[attr-defined]
    yield beater
    timeouts.set_recycle(None)


def _later(seconds: float) -> float:
    """A monotonic time ``seconds`` from now (what the watchdog would see then)."""
    return time.monotonic() + seconds


def _start(kernel: Any, workflow_id: str, value: int = 0) -> str:
    run_id = kernel.dispatch(CreateRun(workflow_id, {"value": value})).workflow_run_id
    kernel.dispatch(ClaimPendingRuns("claimer"))
    return str(run_id)


def _events(run_id: Any, event_type: str) -> list[OutboxEvent]:
    return list(
        OutboxEvent.objects.filter(workflow_run_id=run_id, event_type=event_type).order_by(
            "sequence"
        )
    )


def _assert_gap_free(run_id: Any) -> None:
    sequences = list(
        OutboxEvent.objects.filter(workflow_run_id=run_id)
        .order_by("sequence")
        .values_list("sequence", flat=True)
    )
    assert sequences == list(range(1, len(sequences) + 1))


def _slow_stage(
    watchdog: heartbeat._Beater, behaviours: list[str], *, timeout: float = 10, **kwargs: Any
) -> Any:
    """A stage whose n-th delivery does ``behaviours[n]`` (the last one repeats):

    * ``"fast"``: returns ``input + 100 * (n + 1)`` at once;
    * ``"polite"``: lets the deadline pass, sees ``ctx.is_cancelled()`` and returns a (late)
      result within the grace;
    * ``"stubborn"``: lets the deadline and the grace pass (the watchdog commits the timeout
      meanwhile), ignoring ``ctx.is_cancelled()``, then returns a late result.
    """
    seen: dict[str, Any] = {"n": 0, "cancelled": []}

    def execute(ctx: StageContext[Num, Any]) -> Num:
        n = seen["n"]
        seen["n"] += 1
        how = behaviours[min(n, len(behaviours) - 1)]
        if how in ("polite", "stubborn"):
            assert not ctx.is_cancelled()
            watchdog.run_due(_later(timeout + 0.1))  # the deadline passes
            seen["cancelled"].append(ctx.is_cancelled())
            if how == "stubborn":
                watchdog.run_due(_later(timeout + GRACE + 1))  # and the grace
        return Num(value=ctx.input.value + 100 * (n + 1))

    st = define_stage(id="slow", input=Num, output=Num, execute=execute, **kwargs)
    st.seen = seen  # type: ignore[attr-defined]
    if "timeout_seconds" not in kwargs:
        st.timeout_seconds = timeout
    return st


# --- definition ---------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [0, -1, float("nan"), float("inf"), True, "10", [1]])
@pytest.mark.parametrize("field", ["timeout_seconds", "queue_timeout_seconds"])
def test_a_bad_timeout_is_refused_at_definition_naming_the_stage_and_field(
    bad: Any, field: str
) -> None:
    with pytest.raises(WorkflowDefinitionError, match=f"Stage 'x': {field} must be a"):
        define_stage(id="x", execute=lambda ctx: None, **{field: bad})
    with pytest.raises(WorkflowDefinitionError, match=field):
        stage(id="x", **{field: bad})(lambda ctx: None)


def test_timeouts_on_each_way_of_defining_a_stage_and_the_defaults() -> None:
    @stage(id="dec", timeout_seconds=30, queue_timeout_seconds=60)
    def dec(ctx: Any) -> None:
        return None

    from django_workflows import define_async_batch_stage

    batch = define_async_batch_stage(
        id="b", execute=lambda c: None, check_completion=lambda s, c: None, timeout_seconds=2.5
    )
    plain = define_stage(id="p", execute=lambda c: None)
    assert (dec.timeout_seconds, dec.queue_timeout_seconds) == (30, 60)
    assert batch.timeout_seconds == 2.5
    assert timeouts.describe(plain) == {"timeout_seconds": None, "queue_timeout_seconds": None}
    with override_settings(
        DJANGO_WORKFLOWS={"DEFAULT_STAGE_TIMEOUT_SECONDS": 120, "DEFAULT_QUEUE_TIMEOUT_SECONDS": 9}
    ):
        assert timeouts.describe(plain) == {"timeout_seconds": 120.0, "queue_timeout_seconds": 9.0}
        assert timeouts.describe(dec) == {"timeout_seconds": 30.0, "queue_timeout_seconds": 60.0}


# --- stage timeouts -----------------------------------------------------------------------------


def test_a_body_that_returns_within_the_grace_fails_with_the_timeout_and_is_retried(
    kernel_for: Any, clock: FakeClock, watchdog: heartbeat._Beater
) -> None:
    """Past the deadline ``ctx.is_cancelled()`` is true; the body's result is discarded and
    the delivery fails with ``StageTimeout`` (naming stage and limit), committed by the
    delivery itself (no recycling); the retry policy re-delivers it, which completes."""
    slow = _slow_stage(watchdog, ["polite", "fast"], timeout=10)
    kernel = kernel_for(define_workflow(id="t-polite", input=Num).pipe(slow).pipe(add(1)).build())
    run_id = _start(kernel, "t-polite")

    first = process_available_jobs(kernel, "w", max_jobs=1)
    assert (first.processed, first.failed) == (1, 1)
    assert slow.seen["cancelled"] == [True]
    assert watchdog.recycled == []  # type: ignore[attr-defined]
    [failed] = _events(run_id, "stage:failed")
    expected = "StageTimeout: stage 'slow' timed out after 10 s (timeout_seconds=10)"
    assert failed.payload["error"] == expected
    job = WorkflowJob.objects.get(workflow_run_id=run_id, stage_id="slow")
    assert (job.status, job.last_error) == (Status.PENDING, expected)

    clock.advance(60)  # the retry back-off
    process_available_jobs(kernel, "w", max_jobs=5)
    run = WorkflowRun.objects.get(pk=run_id)
    assert (run.status, run.output) == (Status.COMPLETED, {"value": 201})  # 2nd delivery's
    assert not WorkflowBlob.objects.filter(data={"value": 100}).exists()  # the late one
    _assert_gap_free(run_id)


def test_a_body_that_ignores_the_cancel_has_its_timeout_committed_and_its_worker_recycled(
    kernel_for: Any, clock: FakeClock, watchdog: heartbeat._Beater
) -> None:
    """Past the grace the watchdog commits the timeout for the still-running body (fenced) and
    recycles the worker; the body's late result then matches no fence and is discarded (no
    record, output or event changes, a WARN log); the retry completes."""
    slow = _slow_stage(watchdog, ["stubborn", "fast"], timeout=3)
    kernel = kernel_for(define_workflow(id="t-stub", input=Num).pipe(slow).pipe(add(1)).build())
    run_id = _start(kernel, "t-stub")

    done = process_available_jobs(kernel, "w", max_jobs=1)

    assert (done.processed, done.failed) == (1, 1)
    assert watchdog.recycled == ["recycled"]  # type: ignore[attr-defined]
    [failed] = _events(run_id, "stage:failed")
    assert failed.payload["error"].startswith("StageTimeout: stage 'slow' timed out after 3 s")
    assert WorkflowLog.objects.filter(
        level="WARN", message__contains="its late result was discarded"
    ).exists()
    clock.advance(60)
    process_available_jobs(kernel, "w", max_jobs=5)
    run = WorkflowRun.objects.get(pk=run_id)
    assert (run.status, run.output) == (Status.COMPLETED, {"value": 201})
    assert [e.payload["stage_id"] for e in _events(run_id, "stage:completed")] == ["slow", "add-1"]
    _assert_gap_free(run_id)


@override_settings(
    DJANGO_WORKFLOWS={
        "MAX_ATTEMPTS": 2,
        "HEARTBEAT_INTERVAL_SECONDS": 30.0,
        "TRANSPORT": "django_workflows.transport.inline.NullTransport",
    }
)
def test_a_stage_that_always_times_out_fails_its_run_after_its_retries(
    kernel_for: Any, clock: FakeClock, watchdog: heartbeat._Beater
) -> None:
    slow = _slow_stage(watchdog, ["polite"], timeout=1.5)
    kernel = kernel_for(define_workflow(id="t-always", input=Num).pipe(slow).build())
    run_id = _start(kernel, "t-always")
    for _ in range(4):
        process_available_jobs(kernel, "w", max_jobs=5)
        clock.advance(60)
    run = WorkflowRun.objects.get(pk=run_id)
    assert run.status == Status.FAILED
    assert run.error is not None
    assert (run.error["stage_id"], run.error["error_type"]) == ("slow", "StageTimeout")
    assert slow.seen["n"] == 2
    assert len(_events(run_id, "stage:failed")) == 2
    record = WorkflowStage.objects.get(run_id=run_id, stage_id="slow")
    assert record.error_message == (
        "StageTimeout: stage 'slow' timed out after 1.5 s (timeout_seconds=1.5)"
    )


def test_the_default_stage_timeout_applies_to_stages_without_their_own(
    kernel_for: Any, watchdog: heartbeat._Beater, settings: Any
) -> None:
    settings.DJANGO_WORKFLOWS = {**settings.DJANGO_WORKFLOWS, "DEFAULT_STAGE_TIMEOUT_SECONDS": 7}
    slow = _slow_stage(watchdog, ["polite"], timeout=7, timeout_seconds=None)
    assert slow.timeout_seconds is None
    kernel = kernel_for(define_workflow(id="t-default", input=Num).pipe(slow).build())
    run_id = _start(kernel, "t-default")
    process_available_jobs(kernel, "w", max_jobs=1)
    [failed] = _events(run_id, "stage:failed")
    assert failed.payload["error"] == (
        "StageTimeout: stage 'slow' timed out after 7 s (timeout_seconds=7)"
    )


def test_a_stage_that_finishes_before_the_deadline_is_not_watched_afterwards(
    kernel_for: Any, watchdog: heartbeat._Beater
) -> None:
    """Leaving the heartbeat block ends the watch: a deadline passing between the body's
    return and the outcome commit changes nothing."""
    slow = _slow_stage(watchdog, ["fast"], timeout=1)
    kernel = kernel_for(define_workflow(id="t-fast", input=Num).pipe(slow).build())
    run_id = _start(kernel, "t-fast")
    d = delivery.lease(kernel, "w")
    assert d is not None
    outcome, services = delivery.execute(kernel, d)
    watchdog.run_due(_later(100))  # deadline and grace pass before the commit
    result = delivery.commit_outcome(kernel, d, outcome, services, None)
    assert result.outcome == "completed"
    assert watchdog.recycled == []  # type: ignore[attr-defined]
    assert WorkflowRun.objects.get(pk=run_id).status == Status.COMPLETED


@pytest.mark.parametrize("first", ["watchdog", "stage"])
def test_a_stage_finishing_exactly_at_the_deadline_is_completed_or_timed_out_never_both(
    kernel_for: Any, watchdog: heartbeat._Beater, first: str
) -> None:
    """The watchdog's timeout and the body's result race for the same fence (the job RUNNING at
    the delivery's attempt): whichever commits first wins, the other is discarded."""
    slow = _slow_stage(watchdog, ["fast"], timeout=1)
    kernel = kernel_for(define_workflow(id="t-race", input=Num).pipe(slow).build())
    run_id = _start(kernel, "t-race")
    d = delivery.lease(kernel, "w")
    assert d is not None
    outcome, services = delivery.execute(kernel, d)
    assert outcome.error is None

    def watchdog_commit() -> None:
        stage_execute._commit_overdue(kernel, d, services, 1)

    def stage_commit() -> str:
        return delivery.commit_outcome(kernel, d, outcome, services, None).outcome

    if first == "watchdog":
        watchdog_commit()
        assert stage_commit() == "discarded"
        expected = (Status.FAILED, "stage:failed", "stage:completed")
    else:
        assert stage_commit() == "completed"
        watchdog_commit()
        expected = (Status.COMPLETED, "stage:completed", "stage:failed")
    record = WorkflowStage.objects.get(run_id=run_id, stage_id="slow")
    assert record.status == expected[0]
    assert len(_events(run_id, expected[1])) == 1
    assert _events(run_id, expected[2]) == []
    _assert_gap_free(run_id)


def test_a_stage_with_a_timeout_costs_no_extra_statement(
    kernel_for: Any, watchdog: heartbeat._Beater
) -> None:
    """The watch is in memory: a timed stage that finishes in time costs what an untimed one
    costs."""
    counts = []
    for timeout in (None, 30.0):
        st = define_stage(
            id="s", input=Num, output=Num, execute=lambda c: c.input, timeout_seconds=timeout
        )
        kernel = kernel_for(define_workflow(id=f"t-cost-{len(counts)}", input=Num).pipe(st).build())
        _start(kernel, f"t-cost-{len(counts)}")
        d = delivery.lease(kernel, "w")
        assert d is not None
        with CaptureQueriesContext(connection) as queries:
            delivery.deliver(kernel, d, None)
        counts.append(len(queries))
    assert counts[0] == counts[1]


# --- queue-wait limit ---------------------------------------------------------------------------


def test_a_job_no_worker_of_its_queue_picks_up_in_time_fails_its_stage_and_run(
    kernel_for: Any, clock: FakeClock
) -> None:
    gpu = define_stage(
        id="embed",
        input=Num,
        output=Num,
        execute=lambda c: c.input,
        queue="gpu",
        queue_timeout_seconds=60,
    )
    kernel = kernel_for(define_workflow(id="t-queue", input=Num).pipe(add(1)).pipe(gpu).build())
    run_id = _start(kernel, "t-queue")
    process_available_jobs(kernel, "cpu-worker", max_jobs=5, queues=frozenset({"default"}))
    job = WorkflowJob.objects.get(workflow_run_id=run_id, stage_id="embed")
    assert job.status == Status.PENDING

    clock.advance(59)
    assert run_maintenance_tick(kernel, "ticker").queue_timed_out == 0
    assert WorkflowRun.objects.get(pk=run_id).status == Status.RUNNING

    clock.advance(2)
    tick = run_maintenance_tick(kernel, "ticker")

    assert tick.queue_timed_out == 1
    message = (
        "QueueTimeout: no worker of queue 'gpu' picked up the job within 60 s (stage 'embed', "
        "queue_timeout_seconds=60); is a worker of that queue running?"
    )
    run = WorkflowRun.objects.get(pk=run_id)
    assert run.status == Status.FAILED
    assert run.error is not None
    assert (run.error["stage_id"], run.error["error_type"]) == ("embed", "QueueTimeout")
    assert run.error["message"] == message
    record = WorkflowStage.objects.get(run_id=run_id, stage_id="embed")
    assert (record.status, record.error_message) == (Status.FAILED, message)
    assert WorkflowJob.objects.get(pk=job.pk).status == Status.FAILED
    assert [e.payload["error"] for e in _events(run_id, "stage:failed")] == [message]
    assert len(_events(run_id, "workflow:failed")) == 1
    assert run_maintenance_tick(kernel, "ticker").queue_timed_out == 0
    _assert_gap_free(run_id)


def test_the_queue_wait_counts_from_the_end_of_a_retry_back_off(
    kernel_for: Any, clock: FakeClock, settings: Any
) -> None:
    """A retried job waits out its back-off first; the limit counts from when it is ready."""
    settings.DJANGO_WORKFLOWS = {
        **settings.DJANGO_WORKFLOWS,
        "DEFAULT_QUEUE_TIMEOUT_SECONDS": 30,
        "RETRY_BACKOFF_BASE_SECONDS": 100,
    }
    calls = {"n": 0}

    def flaky(ctx: Any) -> Num:
        calls["n"] += 1
        raise RuntimeError("first delivery fails")

    st = define_stage(id="flaky", input=Num, output=Num, execute=flaky)
    kernel = kernel_for(define_workflow(id="t-backoff", input=Num).pipe(st).build())
    run_id = _start(kernel, "t-backoff")
    process_available_jobs(kernel, "w", max_jobs=1)
    assert WorkflowJob.objects.get(workflow_run_id=run_id).status == Status.PENDING
    clock.advance(100 + 29)  # back-off over, 29 s of waiting
    assert run_maintenance_tick(kernel, "ticker").queue_timed_out == 0
    clock.advance(2)
    assert run_maintenance_tick(kernel, "ticker").queue_timed_out == 1
    assert WorkflowRun.objects.get(pk=run_id).status == Status.FAILED


def test_no_queue_wait_query_while_no_stage_has_a_limit(kernel_for: Any) -> None:
    kernel = kernel_for(define_workflow(id="t-none", input=Num).pipe(add(1)).build())
    with CaptureQueriesContext(connection) as queries:
        assert timeouts.fail_unstarted_jobs(kernel) == 0
    assert len(queries) == 0


# --- system check -------------------------------------------------------------------------------


def test_check_warns_when_django_q2_timeout_is_not_above_a_stage_timeout_plus_grace(
    settings: Any,
) -> None:
    from django_workflows.checks import check_settings, check_stage_timeouts
    from django_workflows.definition.registry import registry

    long = define_stage(id="long", execute=lambda c: None, timeout_seconds=100)
    gpu = define_stage(id="gpu", execute=lambda c: None, timeout_seconds=20, queue="gpu")
    registry.register(define_workflow(id="t-check").pipe(long).pipe(gpu).build())
    try:
        settings.Q_CLUSTER = {**settings.Q_CLUSTER, "timeout": 104, "retry": 200}
        settings.DJANGO_WORKFLOWS = {
            **settings.DJANGO_WORKFLOWS,
            "STAGE_TIMEOUT_GRACE_SECONDS": 5,
            "QUEUES": {"gpu": "gpu"},
        }
        settings.Q_CLUSTER = {**settings.Q_CLUSTER, "ALT_CLUSTERS": {"gpu": {"timeout": 25}}}
        found = check_stage_timeouts()
        assert [m.id for m in found] == ["django_workflows.W003", "django_workflows.W003"]
        from django_workflows.kernel.routing import default_cluster

        default = next(m.msg for m in found if f"{default_cluster()!r}" in m.msg)
        assert "t-check/long (100 s)" in default and "104 s" in default
        assert "t-check/gpu (20 s)" in next(m.msg for m in found if "'gpu'" in m.msg)
        settings.Q_CLUSTER = {
            **settings.Q_CLUSTER,
            "timeout": 106,
            "ALT_CLUSTERS": {"gpu": {"timeout": 26}},
        }
        assert check_stage_timeouts() == []
        settings.DJANGO_WORKFLOWS = {
            **settings.DJANGO_WORKFLOWS,
            "DEFAULT_STAGE_TIMEOUT_SECONDS": 0,
            "DEFAULT_QUEUE_TIMEOUT_SECONDS": "60",
            "STAGE_TIMEOUT_GRACE_SECONDS": -1,
        }
        errors = [m for m in check_settings() if m.id == "django_workflows.E002"]
        text = " | ".join(m.msg for m in errors)
        assert "STAGE_TIMEOUT_GRACE_SECONDS" in text
        assert "DEFAULT_STAGE_TIMEOUT_SECONDS'] must be a positive" in text
        assert "DEFAULT_QUEUE_TIMEOUT_SECONDS'] must be a number of seconds or None" in text
    finally:
        registry.unregister("t-check")


# --- where stages are shown ---------------------------------------------------------------------


def test_workflows_list_admin_and_api_show_the_timeouts(admin_client: Any) -> None:
    import json
    from io import StringIO

    from django.core.management import call_command

    from django_workflows.definition.registry import registry
    from django_workflows.kernel.runtime import get_kernel

    timed = define_stage(
        id="timed",
        input=Num,
        output=Num,
        execute=lambda c: c.input,
        timeout_seconds=600,
        queue_timeout_seconds=60,
    )
    registry.register(define_workflow(id="t-shown", input=Num).pipe(timed).pipe(add(1)).build())
    try:
        out = StringIO()
        call_command("workflows_list", stdout=out)
        [line] = [x for x in out.getvalue().splitlines() if x.strip().startswith("1  timed")]
        assert line.endswith("(timeout 600 s, queue wait 60 s)")
        [add_line] = [x for x in out.getvalue().splitlines() if x.strip().startswith("2  add-1")]
        assert "timeout" not in add_line
        out = StringIO()
        call_command("workflows_list", "--json", stdout=out)
        [doc] = [w for w in json.loads(out.getvalue())["workflows"] if w["id"] == "t-shown"]
        assert doc["stages"][0]["timeout_seconds"] == 600
        assert doc["stages"][1]["queue_timeout_seconds"] is None

        from django_workflows.api.views import definition_document

        stage_doc = definition_document(registry.get("t-shown"))["execution_groups"][0]
        assert stage_doc["stages"][0]["timeout_seconds"] == 600

        run_id = get_kernel().dispatch(CreateRun("t-shown", {"value": 1})).workflow_run_id
        page = admin_client.get(f"/admin/django_workflows/workflowrun/{run_id}/change/")
        assert page.status_code == 200
        assert "timeout 600 s, queue wait 60 s" in page.content.decode()
    finally:
        registry.unregister("t-shown")


@postgres_only
def test_with_notify_the_check_counts_the_time_a_work_task_may_lease_before_a_stage(
    settings: Any,
) -> None:
    """Issue 19: a lingering work task may start a stage ``WORK_TASK_SECONDS`` into its life,
    so with NOTIFY wake-ups W003 also counts that lead (60 + 5 + 50 >= 104); without them the
    same stage fits (60 + 5 < 104)."""
    from django_workflows.checks import check_stage_timeouts
    from django_workflows.definition.registry import registry

    registry.register(
        define_workflow(id="t-lead")
        .pipe(define_stage(id="mid", execute=lambda c: None, timeout_seconds=60))
        .build()
    )
    try:
        settings.Q_CLUSTER = {**settings.Q_CLUSTER, "timeout": 104, "retry": 200}
        base = {**settings.DJANGO_WORKFLOWS, "STAGE_TIMEOUT_GRACE_SECONDS": 5}
        settings.DJANGO_WORKFLOWS = {**base, "WAKE_WITH_NOTIFY": False}
        assert not [m for m in check_stage_timeouts() if "t-lead/mid" in m.msg]
        settings.DJANGO_WORKFLOWS = {**base, "WAKE_WITH_NOTIFY": "auto", "WORK_TASK_SECONDS": 50}
        found = [m for m in check_stage_timeouts() if "t-lead/mid" in m.msg]
        assert [m.id for m in found] == ["django_workflows.W003"]
        assert "WORK_TASK_SECONDS" in found[0].msg
    finally:
        registry.unregister("t-lead")
