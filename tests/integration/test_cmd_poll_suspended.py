"""``stage.pollSuspended`` against the database (SPEC §4.7; catalogue A.7; Part I items 1, 6,
9, 11).

Every test suspends a run the way a host does: ``run.create``, ``run.claimPending``, dequeue the
job, ``job.execute`` (which suspends) and ``queue.suspend``; then moves the fake clock to the
stage's next poll and dispatches ``stage.pollSuspended``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from datetime import timedelta
from typing import Any

import pytest
from django.db import connection

from django_workflows import (
    CompletionCheck,
    Suspend,
    define_async_batch_stage,
    define_stage,
    define_workflow,
)
from django_workflows.blobs import DatabaseBlobStore, output_key
from django_workflows.definition import Stage, Workflow
from django_workflows.kernel import (
    CancelRun,
    ClaimPendingRuns,
    CreateRun,
    ExecuteJob,
    FlushOutbox,
    Kernel,
    PollSuspendedStages,
)
from django_workflows.kernel.commands import PollSuspendedStagesResult
from django_workflows.models import (
    OutboxEvent,
    Status,
    WorkflowAnnotation,
    WorkflowBlob,
    WorkflowJob,
    WorkflowRun,
    WorkflowStage,
)
from django_workflows.testing import CollectingSink, FakeClock
from tests.markers import postgres_only
from tests.workflows import Num, add

pytestmark = pytest.mark.django_db(transaction=True)

KernelFor = Callable[..., Kernel]

POLL_SECONDS = 5
MAX_WAIT_SECONDS = 60


class Checker:
    """A scripted ``check_completion``: answers in turn (the last one repeats). An answer is a
    :class:`CompletionCheck`, an exception to raise, or a callable ``(state, ctx) -> answer``.
    """

    def __init__(self, *answers: Any) -> None:
        self.answers = list(answers)
        self.states: list[dict[str, Any]] = []

    @property
    def calls(self) -> int:
        return len(self.states)

    def __call__(self, state: dict[str, Any], ctx: Any) -> CompletionCheck:
        self.states.append(state)
        answer = self.answers[min(self.calls, len(self.answers)) - 1]
        if isinstance(answer, BaseException):
            raise answer
        if callable(answer):
            return answer(state, ctx)  # type: ignore[no-any-return]
        return answer  # type: ignore[no-any-return]


def _batch(check: Checker, stage_id: str = "batch") -> Stage:
    def submit(ctx: Any) -> Suspend:
        return Suspend(
            state={"batch_id": f"b-{stage_id}"},
            poll_interval_seconds=POLL_SECONDS,
            max_wait_seconds=MAX_WAIT_SECONDS,
        )

    return define_async_batch_stage(id=stage_id, execute=submit, check_completion=check, output=Num)


def _workflow(*stages: Stage, workflow_id: str = "poll-wf") -> Workflow:
    builder = define_workflow(id=workflow_id)
    builder = builder.pipe(stages[0]) if len(stages) == 1 else builder.parallel(list(stages))
    return builder.build()


def _suspend_run(kernel: Kernel, workflow_id: str = "poll-wf") -> str:
    """A RUNNING run whose group-1 stages are SUSPENDED, with SUSPENDED job rows (each job
    leased and delivered through ``job.execute``, the production stage path)."""
    run_id = str(kernel.dispatch(CreateRun(workflow_id=workflow_id, input={})).workflow_run_id)
    (claimed,) = kernel.dispatch(ClaimPendingRuns(worker_id="w")).claimed
    for _ in claimed.job_ids:
        job = kernel.queue.dequeue("w")
        assert job is not None
        result = kernel.dispatch(
            ExecuteJob(
                workflow_run_id=run_id,
                workflow_id=workflow_id,
                stage_id=job.stage_id,
                config={},
            )
        )
        assert result.outcome == "suspended"
        # the outcome transaction suspended the job itself (the production stage path)
        assert WorkflowJob.objects.get(pk=job.pk).status == Status.SUSPENDED
    return run_id


def _poll(kernel: Kernel) -> PollSuspendedStagesResult:
    return kernel.dispatch(PollSuspendedStages())


def _counts(result: PollSuspendedStagesResult) -> tuple[int, int, int]:
    return result.checked, result.resumed, result.failed


def _record(run_id: str, stage_id: str = "batch") -> WorkflowStage:
    return WorkflowStage.objects.get(run_id=run_id, stage_id=stage_id)


def _job(run_id: str, stage_id: str = "batch") -> WorkflowJob:
    return WorkflowJob.objects.get(workflow_run_id=run_id, stage_id=stage_id)


def _run(run_id: str) -> WorkflowRun:
    return WorkflowRun.objects.get(pk=run_id)


def _outbox_types(run_id: str) -> list[str]:
    return list(
        OutboxEvent.objects.filter(workflow_run_id=run_id)
        .order_by("sequence")
        .values_list("event_type", flat=True)
    )


def _run_blob_keys(run_id: str) -> list[str]:
    return sorted(WorkflowBlob.objects.filter(run_id=run_id).values_list("key", flat=True))


# --- catalogue A.7 ----------------------------------------------------------------------------


def test_poll_resumes_a_ready_stage(kernel_for: KernelFor, clock: FakeClock) -> None:
    """K-PS-6.2, SM-26: a ready check completes the stage with its output blob and completes
    the SUSPENDED job; the run is left for ``run.transition``.
    """
    check = Checker(CompletionCheck.done({"value": 7}))
    kernel = kernel_for(_workflow(_batch(check)))
    run_id = _suspend_run(kernel)
    clock.advance(POLL_SECONDS)

    result = _poll(kernel)

    assert _counts(result) == (1, 1, 0)
    assert check.calls == 1
    assert check.states[0]["batch_id"] == "b-batch"
    record = _record(run_id)
    assert record.status == Status.COMPLETED
    assert record.next_poll_at is None
    assert record.completed_at == clock.now()
    assert record.duration_ms == POLL_SECONDS * 1000
    key = output_key(_run(run_id).workflow_type, run_id, "batch")
    assert record.output_data == {"_artifactKey": key}
    assert WorkflowBlob.objects.get(key=key).data == {"value": 7}
    assert _job(run_id).status == Status.COMPLETED
    assert _run(run_id).status == Status.RUNNING
    assert _outbox_types(run_id)[-1] == "stage:completed"


def test_poll_ready_without_output_resumes_each_run_once(
    kernel_for: KernelFor, clock: FakeClock
) -> None:
    """K-PS-6.2, K-PS-1: ready without output completes the stages without a blob;
    ``resumed_workflow_run_ids`` lists the run once although two of its stages resumed.
    """
    check = Checker(CompletionCheck.done())
    kernel = kernel_for(_workflow(_batch(check, "batch-a"), _batch(check, "batch-b")))
    run_id = _suspend_run(kernel)
    clock.advance(POLL_SECONDS)

    result = _poll(kernel)

    assert _counts(result) == (2, 2, 0)
    assert result.resumed_workflow_run_ids == [run_id]
    for stage_id in ("batch-a", "batch-b"):
        record = _record(run_id, stage_id)
        assert record.status == Status.COMPLETED
        assert record.next_poll_at is None
        assert record.output_data is None
    assert _run_blob_keys(run_id) == []


@pytest.mark.parametrize(
    ("answer", "delay"),
    [(CompletionCheck.not_ready(), POLL_SECONDS), (CompletionCheck.not_ready(30), 30)],
    ids=["poll-interval", "next-check-in"],
)
def test_poll_not_ready_reschedules(
    kernel_for: KernelFor, clock: FakeClock, answer: CompletionCheck, delay: int
) -> None:
    """K-PS-6.4: not ready -> still SUSPENDED, next poll after ``next_check_in_seconds`` or the
    stage's poll interval; nothing is checked again before then.
    """
    check = Checker(answer)
    kernel = kernel_for(_workflow(_batch(check)))
    run_id = _suspend_run(kernel)
    clock.advance(POLL_SECONDS)

    assert _counts(_poll(kernel)) == (1, 0, 0)

    record = _record(run_id)
    assert record.status == Status.SUSPENDED
    assert record.next_poll_at == clock.now() + timedelta(seconds=delay)
    assert _job(run_id).status == Status.SUSPENDED
    assert _counts(_poll(kernel)) == (0, 0, 0)
    assert check.calls == 1


def test_poll_without_due_stages_returns_zeros(kernel_for: KernelFor) -> None:
    """K-PS-1: nothing suspended, or nothing due yet -> zeros, no check."""
    check = Checker(CompletionCheck.done({"value": 1}))
    kernel = kernel_for(_workflow(_batch(check)))
    assert _poll(kernel) == PollSuspendedStagesResult()

    run_id = _suspend_run(kernel)

    assert _poll(kernel) == PollSuspendedStagesResult()
    assert check.calls == 0
    assert _record(run_id).status == Status.SUSPENDED


@pytest.mark.parametrize(
    ("answer", "error"),
    [
        (CompletionCheck.failed("provider rejected the batch"), "provider rejected the batch"),
        (RuntimeError("provider down"), "RuntimeError: provider down"),
    ],
    ids=["error-result", "exception"],
)
def test_poll_failed_check_fails_stage_and_run(
    kernel_for: KernelFor, clock: FakeClock, sink: CollectingSink, answer: Any, error: str
) -> None:
    """K-PS-6.1, K-PS-7: an error (returned or raised) fails stage and run together."""
    kernel = kernel_for(_workflow(_batch(Checker(answer))))
    run_id = _suspend_run(kernel)
    clock.advance(POLL_SECONDS)

    assert _counts(_poll(kernel)) == (1, 0, 1)

    record = _record(run_id)
    assert record.status == Status.FAILED
    assert record.error_message == error
    assert record.next_poll_at is None
    run = _run(run_id)
    assert run.status == Status.FAILED
    assert run.completed_at == clock.now()
    kernel.dispatch(FlushOutbox())
    failed = [e for e in sink.events if e["type"] in ("stage:failed", "workflow:failed")]
    assert [(e["type"], e["error"]) for e in failed] == [
        ("stage:failed", error),
        ("workflow:failed", error),
    ]


def test_poll_past_max_wait_fails_stage_and_run(kernel_for: KernelFor, clock: FakeClock) -> None:
    """K-PS-6.3, EC-12: not ready after ``max_wait_until`` -> stage and run FAILED with an error
    naming ``maxWaitUntil`` and the stage.
    """
    check = Checker(CompletionCheck.not_ready())
    kernel = kernel_for(_workflow(_batch(check)))
    run_id = _suspend_run(kernel)
    clock.advance(MAX_WAIT_SECONDS + 1)

    assert _counts(_poll(kernel)) == (1, 0, 1)

    assert check.calls == 1
    record = _record(run_id)
    assert record.status == Status.FAILED
    assert "max_wait_until" in (record.error_message or "")
    assert "batch" in (record.error_message or "")
    assert _run(run_id).status == Status.FAILED


def test_poll_due_before_max_wait_stays_suspended(kernel_for: KernelFor, clock: FakeClock) -> None:
    """K-PS-6.4: a due poll before ``max_wait_until`` neither resumes nor fails."""
    kernel = kernel_for(_workflow(_batch(Checker(CompletionCheck.not_ready()))))
    run_id = _suspend_run(kernel)
    deadline = _record(run_id).max_wait_until
    clock.advance(MAX_WAIT_SECONDS - 1)

    assert _counts(_poll(kernel)) == (1, 0, 0)

    record = _record(run_id)
    assert record.status == Status.SUSPENDED
    assert record.max_wait_until == deadline
    assert _run(run_id).status == Status.RUNNING


def test_poll_cancel_during_check_discards_the_ready_result(
    kernel_for: KernelFor, clock: FakeClock
) -> None:
    """K-PS-5, EC-6, AN-6: a run cancelled while ``check_completion`` runs wins; the ready
    result, its blob and its annotations are dropped and the stage is CANCELLED.
    """

    def cancel_then_ready(state: dict[str, Any], ctx: Any) -> CompletionCheck:
        ctx.annotate("batch.rows", 10, emit_event=True)
        assert kernel.dispatch(CancelRun(ctx.workflow_run_id, reason="user")).cancelled
        return CompletionCheck.done({"value": 1})

    kernel = kernel_for(_workflow(_batch(Checker(cancel_then_ready))))
    run_id = _suspend_run(kernel)
    clock.advance(POLL_SECONDS)

    result = _poll(kernel)

    assert _counts(result) == (1, 0, 0)
    assert result.resumed_workflow_run_ids == []
    assert _run(run_id).status == Status.CANCELLED
    record = _record(run_id)
    assert record.status == Status.CANCELLED
    assert record.output_data is None
    assert _run_blob_keys(run_id) == []
    assert not WorkflowAnnotation.objects.filter(run_id=run_id).exists()
    types_ = _outbox_types(run_id)
    assert types_[-1] == "workflow:cancelled"
    assert "stage:completed" not in types_
    assert "annotation:created" not in types_


# --- Part I -----------------------------------------------------------------------------------


def test_poll_resumed_output_not_matching_model_fails_stage_and_run(
    kernel_for: KernelFor, clock: FakeClock
) -> None:
    """Part I item 6 (EC-34, overrides K-PS-6.2's raw fallback): a resumed output that fails the
    output model fails the stage and the run with the field path; nothing is stored.
    """
    check = Checker(CompletionCheck.done({"value": "lots"}))
    kernel = kernel_for(_workflow(_batch(check)))
    run_id = _suspend_run(kernel)
    clock.advance(POLL_SECONDS)

    result = _poll(kernel)

    assert _counts(result) == (1, 0, 1)
    assert result.resumed_workflow_run_ids == []
    record = _record(run_id)
    assert record.status == Status.FAILED
    assert "ValidationError" in (record.error_message or "")
    assert "value" in (record.error_message or "")
    assert "batch" in (record.error_message or "")
    assert _run(run_id).status == Status.FAILED
    assert _run_blob_keys(run_id) == []
    assert _job(run_id).status == Status.FAILED


def test_poll_failed_check_marks_the_job_failed(kernel_for: KernelFor, clock: FakeClock) -> None:
    """Part I item 9 (EC-38): a suspended stage that fails takes its SUSPENDED job row with it."""
    kernel = kernel_for(_workflow(_batch(Checker(CompletionCheck.failed("quota exceeded")))))
    run_id = _suspend_run(kernel)
    assert _job(run_id).status == Status.SUSPENDED
    clock.advance(POLL_SECONDS)

    assert _counts(_poll(kernel)) == (1, 0, 1)

    job = _job(run_id)
    assert job.status == Status.FAILED
    assert job.last_error == "quota exceeded"
    assert job.completed_at == clock.now()


def _other_workflows(case: str) -> tuple[Workflow, ...]:
    if case == "workflow":
        return ()
    if case == "stage":
        return (_workflow(add(1, "other")),)
    sync = define_stage(id="batch", execute=lambda ctx: {"value": 1})
    return (_workflow(sync),)


@pytest.mark.parametrize(
    ("case", "reason"),
    [
        ("workflow", "not found in registry"),
        ("stage", "not found in workflow"),
        ("check", "no check_completion"),
    ],
)
def test_poll_preflight_failure_fails_stage_and_run(
    kernel_for: KernelFor, clock: FakeClock, case: str, reason: str
) -> None:
    """Part I item 11 (EC-40a, overrides K-PS-3): a missing workflow, stage or
    ``check_completion`` fails stage AND run together (and the stage's job).
    """
    kernel = kernel_for(_workflow(_batch(Checker(CompletionCheck.done({"value": 1})))))
    run_id = _suspend_run(kernel)
    # An unversioned run (definition_version ""): any definition polls it. A versioned run is
    # left for a worker of its own version instead (issue 12 item 3,
    # tests/integration/test_definition_versions.py).
    WorkflowRun.objects.filter(pk=run_id).update(definition_version="")
    other = kernel_for(*_other_workflows(case))
    clock.advance(POLL_SECONDS)

    assert _counts(_poll(other)) == (1, 0, 1)

    record = _record(run_id)
    assert record.status == Status.FAILED
    assert reason in (record.error_message or "")
    assert record.next_poll_at is None
    assert _run(run_id).status == Status.FAILED
    assert _job(run_id).status == Status.FAILED
    assert _outbox_types(run_id)[-2:] == ["stage:failed", "workflow:failed"]


@pytest.mark.parametrize("status", [Status.FAILED, Status.COMPLETED])
def test_poll_stage_of_finished_run_is_cancelled_without_check(
    kernel_for: KernelFor, clock: FakeClock, status: str
) -> None:
    """Part I item 11 (EC-40b, overrides K-PS-9): a suspended stage of a run that is no longer
    RUNNING is CANCELLED (with its job) and ``check_completion`` is never called.
    """
    check = Checker(CompletionCheck.done({"value": 1}))
    kernel = kernel_for(_workflow(_batch(check)))
    run_id = _suspend_run(kernel)
    WorkflowRun.objects.filter(pk=run_id).update(status=status)
    clock.advance(POLL_SECONDS)

    assert _counts(_poll(kernel)) == (1, 0, 0)

    assert check.calls == 0
    record = _record(run_id)
    assert record.status == Status.CANCELLED
    assert record.next_poll_at is None
    assert record.completed_at == clock.now()
    assert _job(run_id).status == Status.CANCELLED
    assert _run(run_id).status == status
    assert _run_blob_keys(run_id) == []


class _HookedBlobs(DatabaseBlobStore):
    """A blob store that calls ``hook`` once, inside the poll's write transaction."""

    hook: Callable[[], None] | None = None

    def put_many(self, items: Iterable[tuple[str, Any]], **kwargs: Any) -> None:
        hook, self.hook = self.hook, None
        if hook is not None:
            hook()
        super().put_many(items, **kwargs)


@postgres_only
def test_poll_write_holds_the_run_lock_against_a_concurrent_cancel(
    kernel_for: KernelFor, clock: FakeClock
) -> None:
    """Part I item 1 (EC-25, K-PS-5): a cancel that starts while a poll writes its outcome
    waits for the run row lock; the resume commits first, then the cancel.
    """
    blobs = _HookedBlobs(clock)
    kernel = kernel_for(
        _workflow(_batch(Checker(CompletionCheck.done({"value": 3})))), blob_store=blobs
    )
    run_id = _suspend_run(kernel)
    clock.advance(POLL_SECONDS)
    outcome: dict[str, Any] = {}

    def cancel() -> None:
        try:
            outcome["cancelled"] = kernel.dispatch(CancelRun(run_id)).cancelled
        finally:
            connection.close()

    thread = threading.Thread(target=cancel)

    def during_write() -> None:
        thread.start()
        thread.join(timeout=1.0)
        outcome["blocked"] = thread.is_alive()

    blobs.hook = during_write
    result = _poll(kernel)
    thread.join(timeout=10)

    assert outcome == {"blocked": True, "cancelled": True}
    assert _counts(result) == (1, 1, 0)
    assert _record(run_id).status == Status.COMPLETED
    assert _run(run_id).status == Status.CANCELLED
    assert _outbox_types(run_id)[-2:] == ["stage:completed", "workflow:cancelled"]
