"""Signals (issue 18 item 4): ``send_signal`` and ``wait_for_signal`` stages, in-process with
a fake clock: buffered, exactly once and in order, idempotent by key, timeout, wrong
payload, terminal run, prompt wake-up, fingerprints."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from pydantic import BaseModel

from django_workflows import (
    InvalidCommandError,
    RunNotFoundError,
    RunTerminalError,
    StageContext,
    WorkflowDefinitionError,
    define_stage,
    define_workflow,
    send_signal,
    wait_for_signal,
)
from django_workflows.kernel import CancelRun, CreateRun, Kernel
from django_workflows.kernel import events as ev
from django_workflows.kernel.handlers.run_signal import MAX_SIGNAL_PAYLOAD_BYTES
from django_workflows.models import OutboxEvent, Status, WorkflowSignal, WorkflowStage
from django_workflows.signals import list_signals
from django_workflows.testing import FakeClock, drive, run_workflow

pytestmark = pytest.mark.django_db

KernelFor = Callable[..., Kernel]


class Approved(BaseModel):
    by: str
    amount: int = 0


def _echo(ctx: StageContext[Approved, Any]) -> dict[str, Any]:
    return {"by": ctx.input.by}


def _flow(workflow_id: str = "sig", **kw: Any) -> Any:
    return (
        define_workflow(id=workflow_id)
        .pipe(wait_for_signal(id="approved", payload=Approved, **kw))
        .pipe(define_stage(id="after", input=Approved, execute=_echo))
        .build()
    )


def _two_waits() -> Any:
    return (
        define_workflow(id="sig2")
        .pipe(wait_for_signal(id="first", signal="go"))
        .pipe(wait_for_signal(id="second", signal="go"))
        .build()
    )


def _start(kernel: Kernel, workflow_id: str = "sig") -> str:
    return str(kernel.dispatch(CreateRun(workflow_id=workflow_id)).workflow_run_id)


def test_a_signal_sent_before_the_stage_waits_is_buffered_and_consumed() -> None:
    """Sent right after run creation (PENDING): stored; the stage consumes it on its first
    poll and its output is the validated payload; the next stage receives it."""
    result = run_workflow(_flow(), signals=[("approved", {"by": "alice", "amount": 3})])
    assert result.status == "COMPLETED"
    assert result.stages["approved"] == {"by": "alice", "amount": 3}
    assert result.output == {"by": "alice"}
    assert ev.SIGNAL_RECEIVED in result.event_types
    (row,) = WorkflowSignal.objects.filter(run_id=result.run_id)
    assert row.consumed_at is not None
    assert (row.consumed_stage_id, row.consumed_generation) == ("approved", 0)
    assert row.consumed_by_id == result.stage_records[0].pk


def test_two_waits_consume_two_signals_exactly_once_in_order() -> None:
    result = run_workflow(_two_waits(), signals=[("go", {"n": 1}), ("go", {"n": 2})])
    assert result.status == "COMPLETED"
    assert result.stages == {"first": {"n": 1}, "second": {"n": 2}}
    rows = list(WorkflowSignal.objects.filter(run_id=result.run_id).order_by("id"))
    assert [r.consumed_stage_id for r in rows] == ["first", "second"]


def test_one_signal_wakes_only_one_of_two_waits(kernel_for: KernelFor, clock: FakeClock) -> None:
    """Exactly once: one signal completes the first wait; the second keeps waiting."""
    kernel = kernel_for(_two_waits())
    run_id = _start(kernel, "sig2")
    send_signal(run_id, "go", {"n": 1}, kernel=kernel)
    drive(kernel, run_id, rounds=6)
    stages = {r.stage_id: r.status for r in WorkflowStage.objects.filter(run_id=run_id)}
    assert stages == {"first": Status.COMPLETED, "second": Status.SUSPENDED}
    assert WorkflowSignal.objects.filter(run_id=run_id, consumed_at__isnull=True).count() == 0


@pytest.mark.django_db(transaction=True)
def test_a_signal_sent_while_waiting_wakes_the_stage_at_once(
    kernel_for: KernelFor, clock: FakeClock, transport: Any
) -> None:
    """The waiting stage's next_poll_at becomes now (no waiting for the 1-hour poll interval)
    and the ticker is woken after commit; the next tick, at the same clock time, completes."""
    kernel = kernel_for(_flow(poll_interval_seconds=3600))
    run_id = _start(kernel)
    drive(kernel, run_id, rounds=3, advance_seconds=0)
    record = WorkflowStage.objects.get(run_id=run_id, stage_id="approved")
    assert record.status == Status.SUSPENDED
    assert record.next_poll_at > clock.now()
    woken_before = transport.ticker_wakeups
    result = send_signal(run_id, "approved", {"by": "bob"}, actor="user:bob", kernel=kernel)
    assert (result.stored, result.woke) == (True, True)
    assert WorkflowStage.objects.get(pk=record.pk).next_poll_at == clock.now()
    assert transport.ticker_wakeups == woken_before + 1
    run = drive(kernel, run_id, rounds=3, advance_seconds=0)
    assert run.status == Status.COMPLETED
    assert run.output == {"by": "bob"}


def test_a_repeated_key_is_a_duplicate(kernel_for: KernelFor, clock: FakeClock) -> None:
    kernel = kernel_for(_two_waits())
    run_id = _start(kernel, "sig2")
    first = send_signal(run_id, "go", {"n": 1}, key="k1", kernel=kernel)
    again = send_signal(run_id, "go", {"n": 99}, key="k1", kernel=kernel)
    assert first.stored and not again.stored and again.duplicate
    assert again.signal_id == first.signal_id
    assert WorkflowSignal.objects.filter(run_id=run_id).count() == 1
    assert (
        OutboxEvent.objects.filter(workflow_run_id=run_id, event_type=ev.SIGNAL_RECEIVED).count()
        == 1
    )
    # a retried send after the run finished is still answered as a duplicate
    kernel.dispatch(CancelRun(run_id))
    late = send_signal(run_id, "go", {"n": 1}, key="k1", kernel=kernel)
    assert not late.stored and late.signal_id == first.signal_id
    with pytest.raises(RunTerminalError):
        send_signal(run_id, "go", {"n": 1}, key="k2", kernel=kernel)
    # the same key on another run is another signal
    other = _start(kernel, "sig2")
    assert send_signal(other, "go", None, key="k1", kernel=kernel).stored


def test_no_signal_before_the_timeout_fails_stage_and_run(
    kernel_for: KernelFor, clock: FakeClock
) -> None:
    kernel = kernel_for(_flow(timeout_seconds=60))
    run_id = _start(kernel)
    drive(kernel, run_id, rounds=3, advance_seconds=0)
    record = WorkflowStage.objects.get(run_id=run_id, stage_id="approved")
    assert record.next_poll_at <= record.max_wait_until  # polled at the deadline, not later
    clock.advance(61)
    run = drive(kernel, run_id, rounds=2, advance_seconds=0)
    assert run.status == Status.FAILED
    assert run.error["error_type"] == "SignalTimeout"
    assert "got no signal 'approved' before its timeout" in run.error["message"]
    with pytest.raises(RunTerminalError, match="finished run takes no signals"):
        send_signal(run_id, "approved", {"by": "late"}, kernel=kernel)


def test_on_timeout_complete_uses_the_timeout_output() -> None:
    flow = (
        define_workflow(id="sig-to")
        .pipe(
            wait_for_signal(
                id="approved",
                payload=Approved,
                timeout_seconds=10,
                on_timeout="complete",
                timeout_output={"by": "nobody"},
            )
        )
        .build()
    )
    result = run_workflow(flow)
    assert result.status == "COMPLETED"
    assert result.stages["approved"] == {"by": "nobody", "amount": 0}


def test_a_payload_that_fails_the_schema_fails_the_stage() -> None:
    result = run_workflow(_flow(), signals=[("approved", {"amount": "many"})])
    assert result.status == "FAILED"
    assert result.error["error_type"] == "SignalPayloadInvalid"
    message = result.stage_error("approved")
    assert "has an invalid payload for stage 'approved'" in message
    assert "by" in message and "amount" in message
    assert WorkflowSignal.objects.get(run_id=result.run_id).consumed_at is not None


def test_bad_sends_name_the_field_and_write_nothing(kernel_for: KernelFor) -> None:
    kernel = kernel_for(_flow())
    run_id = _start(kernel)
    bad: list[tuple[dict[str, Any], str]] = [
        ({"name": "has space"}, "name"),
        ({"name": ""}, "name"),
        ({"name": "ok", "payload": float("nan")}, "payload"),
        ({"name": "ok", "payload": "x" * (MAX_SIGNAL_PAYLOAD_BYTES + 1)}, "payload"),
        ({"name": "ok", "payload": {"a": "\x00"}}, "payload"),
        ({"name": "ok", "key": ""}, "key"),
        ({"name": "ok", "actor": 5}, "actor"),
    ]
    for kwargs, field in bad:
        name = kwargs.pop("name")
        with pytest.raises(InvalidCommandError) as info:
            send_signal(run_id, name, kernel=kernel, **kwargs)
        assert info.value.field == field, (name, kwargs)
    with pytest.raises(InvalidCommandError) as info:
        send_signal("not-a-uuid", "ok", kernel=kernel)
    assert info.value.field == "workflow_run_id"
    with pytest.raises(RunNotFoundError):
        send_signal("00000000-0000-0000-0000-000000000000", "ok", kernel=kernel)
    kernel.dispatch(CancelRun(run_id))
    with pytest.raises(RunTerminalError):
        send_signal(run_id, "ok", kernel=kernel)
    assert WorkflowSignal.objects.count() == 0
    assert not OutboxEvent.objects.filter(event_type=ev.SIGNAL_RECEIVED).exists()


def test_list_signals_shows_pending_and_consumed(kernel_for: KernelFor) -> None:
    kernel = kernel_for(_two_waits())
    run_id = _start(kernel, "sig2")
    send_signal(run_id, "go", 1, kernel=kernel, actor="user:a")
    send_signal(run_id, "other", 2, kernel=kernel)
    drive(kernel, run_id, rounds=4, advance_seconds=0)
    rows = list_signals(run_id)
    assert [(r.name, r.payload, r.actor) for r in rows] == [("go", 1, "user:a"), ("other", 2, None)]
    assert [r.consumed_stage_id for r in rows] == ["first", None]
    assert [r.name for r in list_signals(run_id, pending=True)] == ["other"]


def test_the_definition_checks_its_arguments() -> None:
    for kwargs, text in [
        ({"signal": "bad name"}, "not a valid signal name"),
        ({"timeout_seconds": -1}, "timeout_seconds"),
        ({"on_timeout": "skip"}, "on_timeout"),
        ({"on_timeout": "complete"}, "needs timeout_seconds"),
        (
            {"on_timeout": "complete", "timeout_seconds": 5, "timeout_output": {}},
            "timeout_output does not match",
        ),
        ({"poll_interval_seconds": 0}, "poll_interval_seconds"),
    ]:
        with pytest.raises(WorkflowDefinitionError, match=text):
            wait_for_signal(id="w", payload=Approved, **kwargs)


def test_signal_stages_appear_in_structure_and_fingerprint_only_when_used() -> None:
    flow = _flow()
    stage = flow.structure()["groups"][0][0]
    assert stage["signal"] == {"name": "approved", "timeout_seconds": None, "on_timeout": "fail"}
    assert "signal" not in flow.structure()["groups"][1][0]
    material = flow.fingerprint_material()["groups"]
    assert material[0][0]["signal"] == {"name": "approved", "on_timeout": "fail"}
    assert "signal" not in material[1][0]
    renamed = (
        define_workflow(id="sig")
        .pipe(wait_for_signal(id="approved", signal="other", payload=Approved))
        .pipe(define_stage(id="after", input=Approved, execute=_echo))
        .build()
    )
    assert renamed.fingerprint() != flow.fingerprint()


def test_waiting_reasons_name_the_signal_and_its_timeout(
    kernel_for: KernelFor, clock: FakeClock
) -> None:
    from django_workflows.management.commands._waiting import run_waiting
    from django_workflows.runs import waiting_reasons

    kernel = kernel_for(_flow(timeout_seconds=3600))
    run_id = _start(kernel)
    run = drive(kernel, run_id, rounds=3, advance_seconds=0)
    record = WorkflowStage.objects.get(run_id=run_id, stage_id="approved")
    (reason,) = waiting_reasons(run)
    assert (reason.reason, reason.stage_id, reason.signal, reason.at) == (
        "signal",
        "approved",
        "approved",
        record.max_wait_until,
    )
    assert reason.message == (
        f"waiting for signal 'approved' (timeout at {record.max_wait_until.isoformat()})"
    )
    (cli,) = run_waiting(run)
    assert cli.command == f"python manage.py workflows_signal {run_id} approved --payload '<JSON>'"


def test_the_cli_sends_signals_and_reports_errors(kernel_for: KernelFor, clock: FakeClock) -> None:
    import io

    from django.core.management import CommandError, call_command

    kernel = kernel_for(_flow())  # the command dispatches through the default kernel
    run_id = _start(kernel)
    out = io.StringIO()
    call_command(
        "workflows_signal",
        run_id,
        "approved",
        "--payload",
        '{"by": "cli"}',
        "--key",
        "k",
        stdout=out,
    )
    assert out.getvalue().startswith("stored signal ")
    out = io.StringIO()
    call_command("workflows_signal", run_id, "approved", "--key", "k", stdout=out)
    assert "duplicate: key 'k' was already used for signal" in out.getvalue()
    row = WorkflowSignal.objects.get(run_id=run_id)
    assert row.payload == {"by": "cli"} and row.actor.startswith("cli")
    for argv, text in [
        ([run_id, "approved", "--payload", "{nope"], "--payload: not JSON"),
        ([run_id, "bad name"], "name: 'bad name' is not a valid signal name"),
        (["xyz", "approved"], "not a valid run id"),
        (["00000000-0000-0000-0000-000000000000", "approved"], "not found"),
        ([run_id, "approved", "--key", ""], "--key: expected a non-empty string"),
    ]:
        with pytest.raises(CommandError, match=text):
            call_command("workflows_signal", *argv, stdout=io.StringIO())
    kernel.dispatch(CancelRun(run_id))
    with pytest.raises(CommandError, match="finished run takes no signals"):
        call_command("workflows_signal", run_id, "approved", stdout=io.StringIO())
    assert WorkflowSignal.objects.filter(run_id=run_id).count() == 1


def test_an_approval_decision_is_a_signal_consumed_with_the_stage(
    kernel_for: KernelFor, clock: FakeClock
) -> None:
    """``approve`` keeps writing its provenance annotations and also sends ``approval.<stage>``
    (key ``approval:<stage>:<generation>``): the stage is due at once - no clock move past its
    poll interval - and the poll that completes it consumes the signal; a rejection that
    fails the run consumes it too."""
    from django_workflows.approval import approval_stage, approve, reject

    flow = (
        define_workflow(id="sig-approval")
        .pipe(approval_stage(id="review", poll_interval_seconds=3600))
        .build()
    )
    strict = (
        define_workflow(id="sig-approval-strict")
        .pipe(approval_stage(id="review", poll_interval_seconds=3600, fail_on_reject=True))
        .build()
    )
    kernel = kernel_for(flow, strict)
    run_id = _start(kernel, "sig-approval")
    drive(kernel, run_id, rounds=3, advance_seconds=0)
    record = WorkflowStage.objects.get(run_id=run_id, stage_id="review")
    assert record.suspended_state["signal"] == "approval.review"
    approve(run_id, by="alice", comment="ok", kernel=kernel)
    signal = WorkflowSignal.objects.get(run_id=run_id)
    assert (signal.name, signal.idempotency_key, signal.actor) == (
        "approval.review",
        "approval:review:0",
        "user:alice",
    )
    assert signal.payload["outcome"] == "approved" and signal.payload["by"] == "alice"
    assert WorkflowStage.objects.get(pk=record.pk).next_poll_at == clock.now()
    run = drive(kernel, run_id, rounds=3, advance_seconds=0)
    assert run.status == Status.COMPLETED and run.output["decided_by"] == "alice"
    signal.refresh_from_db()
    assert (signal.consumed_stage_id, signal.consumed_by_id) == ("review", record.pk)
    assert kernel.annotations.list(run_id, key="decision.outcome")[0].value == "approved"

    failing = _start(kernel, "sig-approval-strict")
    drive(kernel, failing, rounds=3, advance_seconds=0)
    reject(failing, by="bob", reason="no", kernel=kernel)
    run = drive(kernel, failing, rounds=3, advance_seconds=0)
    assert run.status == Status.FAILED and run.error["error_type"] == "ApprovalRejected"
    assert WorkflowSignal.objects.get(run_id=failing).consumed_at is not None
