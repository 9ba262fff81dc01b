"""Annotation races that need real row locks (PostgreSQL only; skipped on SQLite).

* A cancel commits while ``job.execute`` of a stage with buffered annotations is completing:
  Phase 3 waits on the run row lock the cancel holds, then finds the run CANCELLED and rolls
  back - no annotation and no event of that stage survive (AN-6, K-JE-15, Part I item 1).
* Concurrent attaches with one idempotency key: one row, one ``annotation:created``
  (Part I item 16 under concurrency; the run row lock serialises the dedupe check).
* ``approve`` and ``reject`` racing on one approval stage: exactly one decision.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest
from django.db import connection

from django_workflows import StageContext, define_stage, define_workflow
from django_workflows.approval import (
    ApprovalConflictError,
    approval_stage,
    approve,
    find_decision,
    reject,
)
from django_workflows.conventions import Decision
from django_workflows.kernel import (
    AnnotationSpec,
    CancelRun,
    ClaimPendingRuns,
    CreateRun,
    Kernel,
)
from django_workflows.kernel import events as ev
from django_workflows.kernel.handlers import run_cancel
from django_workflows.kernel.hosting import execute_job, process_available_jobs
from django_workflows.kernel.stage_path import lease as stage_lease
from django_workflows.kernel.stage_path import outcome as stage_outcome
from django_workflows.models import (
    OutboxEvent,
    Status,
    WorkflowAnnotation,
    WorkflowBlob,
    WorkflowRun,
    WorkflowStage,
)
from tests.markers import postgres_only

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.postgres, postgres_only]

WAIT_SECONDS = 10.0
KernelFor = Callable[..., Kernel]


class _Thread:
    """Runs ``fn`` on its own connection; keeps the return value or the exception."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self._fn = fn
        self.value: Any = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, daemon=True)
        self._thread.start()

    def _main(self) -> None:
        try:
            self.value = self._fn()
        except BaseException as exc:
            self.error = exc
        finally:
            connection.close()

    def join(self) -> Any:
        self._thread.join(WAIT_SECONDS * 2)
        assert not self._thread.is_alive(), "a worker thread hung"
        return self.error if self.error is not None else self.value


def _backend_pid() -> int:
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        return int(cursor.fetchone()[0])


def _wait_until_blocked_by_me(waiter: int) -> None:
    me = _backend_pid()
    deadline = time.monotonic() + WAIT_SECONDS
    with connection.cursor() as cursor:
        while True:
            cursor.execute("SELECT %s = ANY(pg_blocking_pids(%s))", [me, waiter])
            if cursor.fetchone()[0]:
                return
            assert time.monotonic() < deadline, f"backend {waiter} never blocked on {me}"
            time.sleep(0.002)


def _wait(event: threading.Event, what: str) -> None:
    assert event.wait(WAIT_SECONDS), f"timed out waiting for {what}"


@pytest.mark.parametrize("winner", ["cancel", "completion"])
def test_cancel_committing_while_annotated_stage_completes(
    kernel_for: KernelFor, monkeypatch: pytest.MonkeyPatch, winner: str
) -> None:
    """AN-6, K-JE-15, EC-25, Part I item 1: the stage buffers annotations (string, typed and
    batch forms, two with ``emit_event``) and progress, then completes while a cancel runs.

    ``winner="cancel"``: the cancel holds the run row lock when Phase 3 asks for it; Phase 3
    waits, the cancel commits, Phase 3 sees CANCELLED and rolls back - no stage annotation,
    no ``annotation:created``, no ``stage:completed``/``stage:progress``, no output blob; the
    run-scope annotation written at creation stays. ``winner="completion"``: Phase 3 holds the
    lock and the cancel waits - every annotation and event of the stage is there, before
    ``workflow:cancelled``.
    """
    pids: dict[str, int] = {}
    cancel_locked, in_phase3, worker_locked, cancel_ready = (threading.Event() for _ in range(4))
    real_require = run_cancel.lock_run
    real_lock = run_cancel.lock_run
    calls = {"guard": 0}

    def require_running(run_id: uuid.UUID) -> WorkflowRun:
        calls["guard"] += 1
        if calls["guard"] == 2:  # Phase 3
            in_phase3.set()
            if winner == "cancel":
                _wait(cancel_locked, "the cancel to lock the run")
        run = real_require(run_id)
        if calls["guard"] == 2 and winner == "completion":
            worker_locked.set()
            _wait(cancel_ready, "the cancel thread")
            _wait_until_blocked_by_me(pids["cancel"])  # the cancel waits for this lock
        return run

    def lock_run(run_id: uuid.UUID) -> WorkflowRun | None:
        run = real_lock(run_id)
        if winner == "cancel":
            cancel_locked.set()
            _wait_until_blocked_by_me(pids["worker"])
        return run

    # the stage path's RUNNING guards: before the stage starts, then in the outcome transaction
    monkeypatch.setattr(stage_lease, "lock_run", require_running)
    monkeypatch.setattr(stage_outcome, "lock_run", require_running)
    monkeypatch.setattr(run_cancel, "lock_run", lock_run)

    def body(ctx: StageContext[Any, Any]) -> dict[str, int]:
        ctx.annotate("acme.string", 1, emit_event=True)
        ctx.annotate(Decision.outcome, "ship")
        ctx.annotate({"attributes": {"acme.a": 1, "acme.b": 2}, "emit_event": True})
        ctx.progress(50, "half")
        return {"done": 1}

    # A second stage keeps the run RUNNING after the first one's outcome (the outcome and the
    # transition commit together), so the cancel that waited still has a run to cancel.
    after = define_stage(id="after", execute=lambda ctx: {"ok": 1})
    wf = define_workflow(id="race-ann").pipe(define_stage(id="s", execute=body)).pipe(after)
    wf = wf.build()
    kernel = kernel_for(wf)
    run_id = kernel.dispatch(
        CreateRun(workflow_id="race-ann", annotations=(AnnotationSpec({"trigger.source": "t"}),))
    ).workflow_run_id
    kernel.dispatch(ClaimPendingRuns(worker_id="w"))
    job = kernel.queue.dequeue("w")
    assert job is not None

    def work() -> str:
        pids["worker"] = _backend_pid()
        return execute_job(kernel, job).outcome

    def cancel() -> bool:
        pids["cancel"] = _backend_pid()
        cancel_ready.set()
        _wait(in_phase3 if winner == "cancel" else worker_locked, "the worker's Phase 3")
        return bool(kernel.dispatch(CancelRun(run_id, reason="race")).cancelled)

    worker, canceller = _Thread(work), _Thread(cancel)
    outcome, cancelled = worker.join(), canceller.join()
    assert cancelled is True
    run = WorkflowRun.objects.get(pk=run_id)
    assert run.status == Status.CANCELLED
    types = list(
        OutboxEvent.objects.filter(workflow_run_id=run_id)
        .order_by("sequence")
        .values_list("event_type", flat=True)
    )
    stage_rows = WorkflowAnnotation.objects.filter(run_id=run_id, scope="stage")
    assert WorkflowAnnotation.objects.filter(run_id=run_id, scope="run").count() == 1
    if winner == "cancel":
        assert outcome == "ghost"
        assert stage_rows.count() == 0
        for absent in (ev.ANNOTATION_CREATED, ev.STAGE_COMPLETED, ev.STAGE_PROGRESS):
            assert absent not in types, types
        assert not WorkflowBlob.objects.filter(run_id=run_id).exists()
        assert WorkflowStage.objects.get(run_id=run_id, stage_id="s").status == Status.CANCELLED
        assert types[-1] == ev.WORKFLOW_CANCELLED
    else:
        assert outcome == "completed"
        assert sorted(stage_rows.values_list("key", flat=True)) == [
            "acme.a",
            "acme.b",
            "acme.string",
            "decision.outcome",
        ]
        assert types.count(ev.ANNOTATION_CREATED) == 3
        assert types.index(ev.WORKFLOW_CANCELLED) > max(
            i for i, t in enumerate(types) if t == ev.ANNOTATION_CREATED
        )


def test_concurrent_attaches_with_one_key_write_one_row_and_one_event(
    kernel_for: KernelFor,
) -> None:
    """Part I item 16, AN-8, EC-29: 12 threads attach the same key and idempotency key with
    ``emit_event`` at once; the run row lock serialises them - one row, one event."""
    wf = define_workflow(id="attach-race").pipe(define_stage(id="s", execute=lambda c: 1)).build()
    kernel = kernel_for(wf)
    run_id = kernel.dispatch(CreateRun(workflow_id="attach-race")).workflow_run_id
    barrier = threading.Barrier(12)

    def attach(n: int) -> int:
        barrier.wait(WAIT_SECONDS)
        return kernel.annotations.attach(
            run_id, {"acme.once": n}, idempotency_key="same", emit_event=True
        ).created

    threads = [_Thread(lambda n=n: attach(n)) for n in range(12)]
    created = [t.join() for t in threads]
    assert sorted(created) == [0] * 11 + [1], created
    assert WorkflowAnnotation.objects.filter(run_id=run_id).count() == 1
    events = OutboxEvent.objects.filter(workflow_run_id=run_id, event_type=ev.ANNOTATION_CREATED)
    assert events.count() == 1


def test_concurrent_approve_and_reject_record_one_decision(kernel_for: KernelFor) -> None:
    """Approval on annotations: ``approve`` and ``reject`` racing on one waiting stage - one
    wins, the other raises ApprovalConflictError; one ``decision.outcome`` row."""
    wf = define_workflow(id="approval-race").pipe(approval_stage(id="review")).build()
    kernel = kernel_for(wf)
    run_id = kernel.dispatch(CreateRun(workflow_id="approval-race")).workflow_run_id
    kernel.dispatch(ClaimPendingRuns(worker_id="w"))
    process_available_jobs(kernel, "w", max_jobs=5)
    assert WorkflowStage.objects.get(run_id=run_id).status == Status.SUSPENDED
    barrier = threading.Barrier(2)

    def go(fn: Callable[..., Any], who: str) -> Any:
        barrier.wait(WAIT_SECONDS)
        return fn(run_id, by=who, kernel=kernel)

    threads = [_Thread(lambda: go(approve, "alice")), _Thread(lambda: go(reject, "bob"))]
    outcomes = [t.join() for t in threads]
    errors = [o for o in outcomes if isinstance(o, BaseException)]
    assert len(errors) == 1 and isinstance(errors[0], ApprovalConflictError), outcomes
    rows = WorkflowAnnotation.objects.filter(run_id=run_id, key=Decision.outcome.key)
    assert rows.count() == 1
    decision = find_decision(run_id, "review", 0)
    assert decision is not None
    assert decision.decided_by == ("alice" if decision.approved else "bob")
