"""Human approval built on annotations (``django_workflows.approval``; SPEC §6, AN-21, AN-51,
AN-12/13).

The approval stage suspends; a decision attached from outside (``approve`` / ``reject``) is
picked up by the next poll and becomes the stage output. Runs are driven in-process with a
fake clock.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest

from django_workflows import StageContext, define_stage, define_workflow
from django_workflows.approval import (
    APPROVAL_KIND,
    ApprovalConflictError,
    ApprovalDecision,
    approval_stage,
    approve,
    find_decision,
    reject,
    waiting_approvals,
)
from django_workflows.conventions import Approval, Decision
from django_workflows.kernel import (
    CreateRun,
    InvalidCommandError,
    Kernel,
    RerunFrom,
    RunNotFoundError,
    RunStateError,
)
from django_workflows.kernel import events as ev
from django_workflows.kernel.hosting import process_available_jobs, run_maintenance_tick
from django_workflows.models import OutboxEvent, Status, WorkflowRun, WorkflowStage
from django_workflows.testing import FakeClock

pytestmark = pytest.mark.django_db(transaction=True)

KernelFor = Callable[..., Kernel]
SEEN: dict[str, Any] = {}


def _after(ctx: StageContext[ApprovalDecision, Any]) -> dict[str, Any]:
    SEEN["decision"] = ctx.input
    return {"approved": ctx.input.approved}


def _flow(workflow_id: str = "needs-ok", **kwargs: Any) -> Any:
    return (
        define_workflow(id=workflow_id)
        .pipe(approval_stage(id="review", poll_interval_seconds=2, **kwargs))
        .pipe(define_stage(id="after", input=ApprovalDecision, execute=_after))
        .build()
    )


def _drive(kernel: Kernel, clock: FakeClock, rounds: int = 3, step: float = 3.0) -> None:
    """Ticks and jobs, moving the clock past the poll interval each round."""
    for _ in range(rounds):
        run_maintenance_tick(kernel, "w")
        process_available_jobs(kernel, "w", max_jobs=20)
        clock.advance(step)
    run_maintenance_tick(kernel, "w")


def _waiting_run(kernel: Kernel, clock: FakeClock, workflow_id: str = "needs-ok", **kw: Any) -> str:
    run_id = kernel.dispatch(CreateRun(workflow_id=workflow_id, **kw)).workflow_run_id
    _drive(kernel, clock, rounds=2)
    return run_id


def test_approval_stage_waits_then_resumes_with_the_decision(
    kernel_for: KernelFor, clock: FakeClock
) -> None:
    """The approval stage suspends (state kind ``django_workflows.approval``) and keeps polling
    while nothing is decided; ``approve`` writes decision.outcome, approval.approvers,
    approval.timestamp and decision.rationale on the stage (scope stage, its generation, actor
    user:alice, one ``annotation:created`` each, AN-40, AN-51); the next poll completes the
    stage with an ApprovalDecision that the next stage receives."""
    kernel = kernel_for(_flow())
    run_id = _waiting_run(kernel, clock)
    record = WorkflowStage.objects.get(run_id=run_id, stage_id="review")
    assert record.status == Status.SUSPENDED
    assert record.suspended_state["kind"] == APPROVAL_KIND
    assert [w.stage_id for w in waiting_approvals(run_id)] == ["review"]

    result = approve(run_id, by="alice", comment="looks good", kernel=kernel)
    assert (result.stage_id, result.outcome, result.recorded, result.generation) == (
        "review",
        "approved",
        True,
        0,
    )
    rows = kernel.annotations.list(run_id, scope_id="review")
    assert {r.key: r.value for r in rows} == {
        "decision.outcome": "approved",
        "approval.timestamp": clock.now().isoformat(),
        "decision.rationale": "looks good",
        "approval.approvers": ["alice"],
    }
    for r in rows:
        assert (r.scope, r.generation, r.actor, r.stage_record_id) == (
            "stage",
            0,
            {"kind": "user", "id": "alice"},
            str(record.pk),
        )
    assert (
        OutboxEvent.objects.filter(workflow_run_id=run_id, event_type=ev.ANNOTATION_CREATED).count()
        == 4
    )

    _drive(kernel, clock)
    run = WorkflowRun.objects.get(pk=run_id)
    assert run.status == Status.COMPLETED
    assert run.output == {"approved": True}
    decision = SEEN["decision"]
    assert isinstance(decision, ApprovalDecision)
    assert (decision.approved, decision.decided_by, decision.approvers, decision.rationale) == (
        True,
        "alice",
        ["alice"],
        "looks good",
    )
    assert waiting_approvals(run_id) == []


def test_approval_stage_not_ready_without_a_decision(
    kernel_for: KernelFor, clock: FakeClock
) -> None:
    """Without a decision (or with an unrelated ``decision.outcome`` on another scope) the stage
    stays SUSPENDED, polled again after its interval."""
    kernel = kernel_for(_flow())
    run_id = _waiting_run(kernel, clock)
    kernel.annotations.attach(run_id, {Decision.outcome: "approved"})  # run scope: not a vote
    _drive(kernel, clock, rounds=3)
    record = WorkflowStage.objects.get(run_id=run_id, stage_id="review")
    assert record.status == Status.SUSPENDED
    assert record.next_poll_at is not None
    # polled by the last tick and rescheduled after the 2 s poll interval
    assert record.next_poll_at == clock.now() + timedelta(seconds=2)


def test_rejection_completes_with_approved_false(kernel_for: KernelFor, clock: FakeClock) -> None:
    """A rejection completes the stage with ``approved=False``, the reason and no approvers;
    ``approval.approvers`` is not written."""
    kernel = kernel_for(_flow())
    run_id = _waiting_run(kernel, clock)
    reject(run_id, by="bob", reason="numbers are off", kernel=kernel)
    assert kernel.annotations.list(run_id, key=Approval.approvers.key) == []
    _drive(kernel, clock)
    run = WorkflowRun.objects.get(pk=run_id)
    assert run.status == Status.COMPLETED
    assert run.output == {"approved": False}
    decision = SEEN["decision"]
    assert (decision.outcome, decision.decided_by, decision.rationale, decision.approvers) == (
        "rejected",
        "bob",
        "numbers are off",
        [],
    )


def test_rejection_fails_the_run_with_fail_on_reject(
    kernel_for: KernelFor, clock: FakeClock
) -> None:
    """``fail_on_reject=True``: a rejection fails stage and run with the reason, recorded as
    its own error type (a person decided; not an async batch's ``BatchFailed``)."""
    kernel = kernel_for(_flow(fail_on_reject=True))
    run_id = _waiting_run(kernel, clock)
    reject(run_id, by="bob", reason="no", kernel=kernel)
    _drive(kernel, clock)
    run = WorkflowRun.objects.get(pk=run_id)
    assert run.status == Status.FAILED
    record = WorkflowStage.objects.get(run_id=run_id, stage_id="review")
    assert record.error_message == "Rejected by bob: no"
    assert run.error["error_type"] == "ApprovalRejected"
    assert run.error["stage_id"] == "review"
    assert run.error["message"] == "Rejected by bob: no"


def test_first_decision_wins(kernel_for: KernelFor, clock: FakeClock) -> None:
    """The same decision again is a no-op (``recorded=False``, nothing written); the opposite
    one raises ApprovalConflictError naming the first."""
    kernel = kernel_for(_flow())
    run_id = _waiting_run(kernel, clock)
    assert approve(run_id, by="alice", kernel=kernel).recorded is True
    count = len(kernel.annotations.list(run_id))
    assert approve(run_id, by="alice", kernel=kernel).recorded is False
    with pytest.raises(ApprovalConflictError, match="already approved by alice"):
        reject(run_id, by="bob", kernel=kernel)
    assert len(kernel.annotations.list(run_id)) == count


def test_allowed_approvers(kernel_for: KernelFor, clock: FakeClock) -> None:
    """``allowed_approvers``: others are refused by approve/reject (field ``by``), and a
    decision attached by someone else directly is ignored by the stage."""
    kernel = kernel_for(_flow(allowed_approvers=["carol"]))
    run_id = _waiting_run(kernel, clock)
    with pytest.raises(InvalidCommandError) as info:
        approve(run_id, by="mallory", kernel=kernel)
    assert info.value.field == "by"
    kernel.annotations.attach(
        run_id,
        {Decision.outcome: "approved"},
        actor={"kind": "user", "id": "mallory"},
        scope="stage",
        scope_id="review",
    )
    _drive(kernel, clock, rounds=2)
    assert WorkflowStage.objects.get(run_id=run_id, stage_id="review").status == Status.SUSPENDED
    approve(run_id, by="carol", kernel=kernel)
    _drive(kernel, clock)
    assert SEEN["decision"].decided_by == "carol"
    assert WorkflowRun.objects.get(pk=run_id).status == Status.COMPLETED


def test_allowed_approvers_from_run_config(kernel_for: KernelFor, clock: FakeClock) -> None:
    """ApprovalConfig: a run's config overrides the definition's allowed approvers."""
    kernel = kernel_for(_flow(workflow_id="cfg-ok"))
    run_id = _waiting_run(
        kernel, clock, "cfg-ok", config={"review": {"allowed_approvers": ["dave"]}}
    )
    assert waiting_approvals(run_id)[0].allowed_approvers == ("dave",)
    with pytest.raises(InvalidCommandError):
        approve(run_id, by="alice", kernel=kernel)
    assert approve(run_id, by="dave", kernel=kernel).recorded


def test_decide_errors(kernel_for: KernelFor, clock: FakeClock) -> None:
    """Unknown run -> RunNotFoundError; a run that is not RUNNING or has nothing waiting ->
    RunStateError; bad outcome or actor -> InvalidCommandError."""
    kernel = kernel_for(_flow())
    with pytest.raises(RunNotFoundError):
        approve(uuid.uuid4(), by="alice", kernel=kernel)
    pending = kernel.dispatch(CreateRun(workflow_id="needs-ok")).workflow_run_id
    with pytest.raises(RunStateError, match="PENDING"):
        approve(pending, by="alice", kernel=kernel)
    run_id = _waiting_run(kernel, clock)
    with pytest.raises(RunStateError, match="stage 'after'"):
        approve(run_id, by="alice", stage_id="after", kernel=kernel)
    with pytest.raises(InvalidCommandError) as info:
        approve(run_id, by=" ", kernel=kernel)
    assert info.value.field == "by"
    from django_workflows.approval import decide

    with pytest.raises(InvalidCommandError):
        decide(run_id, "maybe", by="alice", kernel=kernel)  # type: ignore[arg-type]


def test_several_waiting_approvals_need_a_stage_id(kernel_for: KernelFor, clock: FakeClock) -> None:
    """Two approval stages in one parallel group: deciding needs ``stage_id``."""
    wf = (
        define_workflow(id="two-reviews")
        .parallel([approval_stage(id="legal"), approval_stage(id="editor")])
        .build()
    )
    kernel = kernel_for(wf)
    run_id = _waiting_run(kernel, clock, "two-reviews")
    with pytest.raises(InvalidCommandError) as info:
        approve(run_id, by="alice", kernel=kernel)
    assert info.value.field == "stage_id"
    approve(run_id, by="alice", stage_id="legal", kernel=kernel)
    reject(run_id, by="bob", stage_id="editor", kernel=kernel)
    _drive(kernel, clock)
    run = WorkflowRun.objects.get(pk=run_id)
    assert run.status == Status.COMPLETED
    assert run.output["legal"]["approved"] is True
    assert run.output["editor"]["approved"] is False


def test_rerun_asks_again_and_keeps_the_old_decision(
    kernel_for: KernelFor, clock: FakeClock
) -> None:
    """AN-12, AN-13: after ``run.rerunFrom("review")`` the stage waits again (generation 1); the
    earlier decision stays in the timeline with generation 0 and no stage link, and does not
    count for the new generation."""
    kernel = kernel_for(_flow())
    run_id = _waiting_run(kernel, clock)
    approve(run_id, by="alice", kernel=kernel)
    _drive(kernel, clock)
    assert WorkflowRun.objects.get(pk=run_id).status == Status.COMPLETED
    kernel.dispatch(RerunFrom(run_id, "review"))
    _drive(kernel, clock, rounds=2)
    assert [(w.stage_id, w.generation) for w in waiting_approvals(run_id)] == [("review", 1)]
    assert find_decision(run_id, "review", 1) is None
    old = kernel.annotations.list(run_id, key=Decision.outcome.key)
    assert [(r.generation, r.stage_record_id) for r in old] == [(0, None)]
    reject(run_id, by="bob", kernel=kernel)
    _drive(kernel, clock)
    assert WorkflowRun.objects.get(pk=run_id).output == {"approved": False}
    assert [r.generation for r in kernel.annotations.list(run_id, key=Decision.outcome.key)] == [
        0,
        1,
    ]


def test_approval_deadline_fails_the_run(kernel_for: KernelFor, clock: FakeClock) -> None:
    """``max_wait_seconds``: no decision in time fails stage and run (K-PS-6.3)."""
    kernel = kernel_for(_flow(max_wait_seconds=10))
    run_id = _waiting_run(kernel, clock)
    _drive(kernel, clock, rounds=5)
    assert WorkflowRun.objects.get(pk=run_id).status == Status.FAILED
    error = WorkflowStage.objects.get(run_id=run_id, stage_id="review").error_message
    assert "max_wait_until" in error


def test_approval_stage_rejects_bad_settings() -> None:
    """approval_stage: a non-positive poll interval or negative deadline is a definition error."""
    with pytest.raises(ValueError, match="poll_interval_seconds"):
        approval_stage(id="r", poll_interval_seconds=0)
    with pytest.raises(ValueError, match="max_wait_seconds"):
        approval_stage(id="r", max_wait_seconds=-1)
