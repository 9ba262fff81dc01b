"""Idempotency keys (SPEC §4.0.1, K-10..14, DM-21/22; catalogue A.12, C.6; EC-15, EC-16).

Same-key replays of ``run.create`` (A.12 :45/:72) and of ``job.execute`` (A.12 :93/:159) are in
``test_cmd_run_create.py`` and ``test_cmd_job_execute.py``; fifty concurrent ``run.create`` with
one key are in ``test_concurrency_pg.py``. This module pins the procedure itself: scoping,
replays that write nothing, keys in progress, stale reclaim on the kernel's clock, release on
raise, and the per-delivery keys of ``job.execute``.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest

from django_workflows import StageContext, define_stage, define_workflow
from django_workflows.kernel import (
    ClaimPendingRuns,
    CreateRun,
    ExecuteJob,
    IdempotencyInProgressError,
    IdempotencyKeyReusedError,
    Kernel,
    WorkflowNotFoundError,
    idempotency,
)
from django_workflows.kernel.hosting import process_available_jobs
from django_workflows.kernel.runtime import build_kernel
from django_workflows.models import IdempotencyKey, OutboxEvent, Status, WorkflowJob, WorkflowRun
from django_workflows.testing import FakeClock
from tests.workflows import Num, two_stage

pytestmark = pytest.mark.django_db(transaction=True)

KernelFor = Callable[..., Kernel]
CREATE = "run.create"


def _create(kernel: Kernel, key: str | None = "k-1", workflow_id: str = "two-stage") -> str:
    cmd = CreateRun(workflow_id=workflow_id, input={"value": 1}, idempotency_key=key)
    return str(kernel.dispatch(cmd).workflow_run_id)


# --------------------------------------------------------------------------------------------
# The dispatch procedure (A.12)
# --------------------------------------------------------------------------------------------


def test_replay_returns_the_cached_result_and_writes_nothing(
    kernel_for: KernelFor, clock: FakeClock
) -> None:
    """K-10, K-CR-8, EC-16, A.12 :286: a replay returns the first result without running the
    handler: no second run, no outbox row, the key row unchanged (completed, created_at of the
    first call)."""
    kernel = kernel_for(two_stage())
    run_id = _create(kernel)
    key_row = IdempotencyKey.objects.get()
    assert (key_row.state, key_row.created_at) == (IdempotencyKey.State.COMPLETED, clock.now())
    assert key_row.result["workflow_run_id"] == run_id
    assert key_row.result["status"] == Status.PENDING
    events = OutboxEvent.objects.count()
    clock.advance(3600)

    assert _create(kernel) == run_id

    assert WorkflowRun.objects.count() == 1
    assert OutboxEvent.objects.count() == events
    assert IdempotencyKey.objects.get().created_at == key_row.created_at


def test_keys_are_scoped_by_command_type(kernel_for: KernelFor) -> None:
    """K-11, A.12 :228, C.6 :1574: the same key string used for ``run.create`` and
    ``job.execute`` are independent - both commands execute."""
    kernel = kernel_for(two_stage())
    run_id = _create(kernel, key="shared")
    kernel.dispatch(ClaimPendingRuns(worker_id="w"))

    result = kernel.dispatch(
        ExecuteJob(
            workflow_run_id=run_id,
            workflow_id="two-stage",
            stage_id="add-1",
            idempotency_key="shared",
        )
    )

    assert (result.outcome, result.output) == ("completed", {"value": 2})
    assert sorted(IdempotencyKey.objects.values_list("command_type", flat=True)) == [
        "job.execute",
        CREATE,
    ]


def test_key_in_progress_is_refused_with_a_clear_error(kernel_for: KernelFor) -> None:
    """K-10, K-20, A.12 :315: a key held by another dispatcher raises
    IdempotencyInProgressError naming the key and command type; nothing is written."""
    kernel = kernel_for(two_stage())
    idempotency.acquire("busy", CREATE, now=kernel.clock.now(), stale_after_seconds=None)

    with pytest.raises(IdempotencyInProgressError) as info:
        _create(kernel, key="busy")

    assert (info.value.key, info.value.command_type) == ("busy", CREATE)
    assert (
        str(info.value) == "Command run.create with idempotency key 'busy' is already in progress"
    )
    assert WorkflowRun.objects.count() == 0
    assert IdempotencyKey.objects.get().state == IdempotencyKey.State.IN_PROGRESS


def test_stuck_key_is_reclaimed_after_ten_minutes_of_kernel_time(
    kernel_for: KernelFor, clock: FakeClock
) -> None:
    """K-1, K-12, EC-15, Part I item 12, A.12 :335: a key left in progress by a dispatcher that
    died is refused until the kernel's (fake) clock has moved 10 minutes, then reclaimed."""
    kernel = kernel_for(two_stage())
    idempotency.acquire("stuck", CREATE, now=clock.now(), stale_after_seconds=None)
    clock.advance(599)
    with pytest.raises(IdempotencyInProgressError):
        _create(kernel, key="stuck")
    clock.advance(1)

    run_id = _create(kernel, key="stuck")

    assert WorkflowRun.objects.filter(pk=run_id).exists()
    row = IdempotencyKey.objects.get()
    assert (row.state, row.created_at) == (IdempotencyKey.State.COMPLETED, clock.now())


def test_custom_stale_seconds_are_honoured(kernel_for: KernelFor, clock: FakeClock) -> None:
    """K-1, K-12, A.12 :370: ``Kernel(idempotency_stale_seconds=60)`` reclaims after 1 min;
    ``None`` never reclaims (not even an hour later)."""
    kernel = kernel_for(two_stage(), idempotency_stale_seconds=60)
    idempotency.acquire("k", CREATE, now=clock.now(), stale_after_seconds=None)
    clock.advance(59)
    with pytest.raises(IdempotencyInProgressError):
        _create(kernel, key="k")
    clock.advance(1)
    assert _create(kernel, key="k")

    never = kernel_for(two_stage(), idempotency_stale_seconds=None)
    idempotency.acquire("n", CREATE, now=clock.now(), stale_after_seconds=None)
    clock.advance(3600)
    with pytest.raises(IdempotencyInProgressError):
        _create(never, key="n")


def test_stale_seconds_setting_configures_the_default_kernel(settings: Any) -> None:
    """K-1: ``DJANGO_WORKFLOWS["IDEMPOTENCY_STALE_SECONDS"]`` reaches the default kernel
    (``None`` disables reclaiming); the default is 600 s."""
    assert build_kernel().idempotency_stale_seconds == 600.0
    settings.DJANGO_WORKFLOWS = {**settings.DJANGO_WORKFLOWS, "IDEMPOTENCY_STALE_SECONDS": 90}
    assert build_kernel().idempotency_stale_seconds == 90.0
    settings.DJANGO_WORKFLOWS = {**settings.DJANGO_WORKFLOWS, "IDEMPOTENCY_STALE_SECONDS": None}
    assert build_kernel().idempotency_stale_seconds is None


def test_raising_handler_releases_its_key_and_writes_nothing(kernel_for: KernelFor) -> None:
    """K-10, K-5, EC-16, A.12 :393/:417: a command that raises (workflow missing) releases its
    key and leaves no outbox row; after the workflow is registered the same key succeeds."""
    kernel = kernel_for()
    with pytest.raises(WorkflowNotFoundError):
        _create(kernel, key="retry-me")
    assert IdempotencyKey.objects.count() == 0
    assert OutboxEvent.objects.count() == 0

    kernel.registry.register(two_stage())
    run_id = _create(kernel, key="retry-me")

    assert WorkflowRun.objects.filter(pk=run_id).exists()
    assert OutboxEvent.objects.count() == 1


def test_release_errors_are_swallowed_and_the_command_error_propagates(
    kernel_for: KernelFor, monkeypatch: pytest.MonkeyPatch
) -> None:
    """K-10: if releasing the key fails too, the caller still sees the command's own error."""
    kernel = kernel_for()

    def broken_release(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("release failed")

    monkeypatch.setattr(idempotency, "release", broken_release)
    with pytest.raises(WorkflowNotFoundError):
        _create(kernel, key="k")


def test_key_is_recorded_in_the_runs_transaction(
    kernel_for: KernelFor, monkeypatch: pytest.MonkeyPatch
) -> None:
    """K-10, EC-48, issue 7: the key is recorded in the run's own transaction, so a failure to
    record it rolls the run back too: no run behind a missing (or "in progress") key, and a
    retry creates the run exactly once."""
    kernel = kernel_for(two_stage())
    real_record = idempotency.record

    def broken_record(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("cache unavailable")

    monkeypatch.setattr(idempotency, "record", broken_record)
    with pytest.raises(RuntimeError, match="cache unavailable"):
        _create(kernel, key="k")
    assert IdempotencyKey.objects.count() == 0
    assert WorkflowRun.objects.count() == 0
    assert OutboxEvent.objects.count() == 0

    monkeypatch.setattr(idempotency, "record", real_record)
    run_id = _create(kernel, key="k")
    assert _create(kernel, key="k") == run_id
    assert WorkflowRun.objects.count() == 1


def test_job_deliveries_write_no_idempotency_keys(kernel_for: KernelFor, clock: FakeClock) -> None:
    """H-3, SM-31, issue 7: a delivery is identified by its job's lease and attempt (the
    fencing token), not by an idempotency-key row: a failed first delivery and its retry
    leave no ``job.execute`` keys behind, and the retry runs the stage again."""
    calls = {"n": 0}

    def flaky(ctx: StageContext[Num, Any]) -> Num:
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("transient")
        return Num(value=ctx.input.value + 1)

    wf = define_workflow(id="flaky", input=Num).pipe(
        define_stage(id="s", input=Num, output=Num, execute=flaky)
    )
    kernel = kernel_for(wf.build())
    run_id = _create(kernel, key=None, workflow_id="flaky")
    kernel.dispatch(ClaimPendingRuns(worker_id="w"))

    assert process_available_jobs(kernel, "w").failed == 1
    clock.advance(2)  # retry back-off of the first delivery
    assert process_available_jobs(kernel, "w").succeeded == 1

    job = WorkflowJob.objects.get(workflow_run_id=run_id)
    assert not IdempotencyKey.objects.filter(command_type="job.execute").exists()
    assert (job.status, job.attempt, calls["n"]) == (Status.COMPLETED, 2, 2)


# --------------------------------------------------------------------------------------------
# The key store (C.6, K-12, DM-21/22)
# --------------------------------------------------------------------------------------------


def test_key_store_acquire_complete_replay_release(clock: FakeClock) -> None:
    """K-12, DM-21, C.6 :1525/:1533/:1543/:1563/:1574: new -> acquired; again -> in_progress;
    completed -> replay with the stored result; a released key is acquirable again; another
    command type is independent."""
    now = clock.now()
    assert idempotency.acquire("k", CREATE, now=now, stale_after_seconds=None).outcome == (
        "acquired"
    )
    assert idempotency.acquire("k", CREATE, now=now, stale_after_seconds=None).outcome == (
        "in_progress"
    )
    assert idempotency.acquire("k", "job.execute", now=now, stale_after_seconds=None).outcome == (
        "acquired"
    )
    idempotency.complete("k", CREATE, {"answer": 42})
    replay = idempotency.acquire("k", CREATE, now=now, stale_after_seconds=None)
    assert (replay.outcome, replay.result) == ("replay", {"answer": 42})

    idempotency.release("k", "job.execute")
    assert idempotency.acquire("k", "job.execute", now=now, stale_after_seconds=None).outcome == (
        "acquired"
    )
    idempotency.release("k", CREATE)  # a completed key is never released
    assert idempotency.acquire("k", CREATE, now=now, stale_after_seconds=None).outcome == "replay"


def test_key_store_stale_reclaim_rules(clock: FakeClock) -> None:
    """K-12, DM-22, C.6 :1588/:1603/:1618/:1645: without a threshold an in-progress key is
    never reclaimed; 9 min < 10 min -> in_progress; at 10 min -> acquired (re-stamped) and
    immediately after -> in_progress; a completed key is replayed even 24 h later."""
    start = clock.now()
    idempotency.acquire("a", CREATE, now=start, stale_after_seconds=None)
    later = start + timedelta(hours=1)
    assert idempotency.acquire("a", CREATE, now=later, stale_after_seconds=None).outcome == (
        "in_progress"
    )

    idempotency.acquire("b", CREATE, now=start, stale_after_seconds=600)
    nine = start + timedelta(minutes=9)
    ten = start + timedelta(minutes=10)
    assert idempotency.acquire("b", CREATE, now=nine, stale_after_seconds=600).outcome == (
        "in_progress"
    )
    assert idempotency.acquire("b", CREATE, now=ten, stale_after_seconds=600).outcome == (
        "acquired"
    )
    assert IdempotencyKey.objects.get(key="b").created_at == ten
    assert idempotency.acquire("b", CREATE, now=ten, stale_after_seconds=600).outcome == (
        "in_progress"
    )

    idempotency.complete("b", CREATE, {"done": True})
    day = ten + timedelta(hours=24)
    assert idempotency.acquire("b", CREATE, now=day, stale_after_seconds=600).outcome == "replay"


@pytest.mark.parametrize(
    ("change", "difference"),
    [
        ({"workflow_id": "other"}, "workflow 'two-stage' (this request names 'other')"),
        ({"input": {"value": 2}}, "another input"),
        ({"config": {"add-1": {}}}, "another config"),
        ({"priority": 9}, "another priority"),
        ({"annotations": ({"attributes": {"acme.x": 1}},)}, "other annotations"),
    ],
)
def test_replaying_a_key_with_another_request_is_refused_naming_the_key(
    kernel_for: KernelFor, change: dict[str, Any], difference: str
) -> None:
    """Issue 7: the same key with another workflow, input, config or priority is a conflict, not a
    silent replay of the first run: ``IdempotencyKeyReusedError`` names the key and what
    differs, and nothing is written."""
    kernel = kernel_for(two_stage(), two_stage("other"))
    run_id = _create(kernel, key="order-42")
    counts = (WorkflowRun.objects.count(), OutboxEvent.objects.count())
    request: dict[str, Any] = {"workflow_id": "two-stage", "input": {"value": 1}, **change}

    with pytest.raises(IdempotencyKeyReusedError) as raised:
        kernel.dispatch(CreateRun(idempotency_key="order-42", **request))

    message = str(raised.value)
    assert "'order-42'" in message and run_id in message and difference in message
    assert raised.value.field == "idempotency_key"
    assert (WorkflowRun.objects.count(), OutboxEvent.objects.count()) == counts
    # the same request again is still a plain replay
    assert _create(kernel, key="order-42") == run_id
