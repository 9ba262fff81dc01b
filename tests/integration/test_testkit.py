"""The test kit (issue 11 item 3): run_workflow, stage overrides, the pytest plugin's fixtures,
and in-process driving inside a test's transaction (plain ``django_db``) as well as with
``transaction=True``, on SQLite and PostgreSQL."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from django.db import connection
from pydantic import BaseModel

from django_workflows import (
    CompletionCheck,
    StageContext,
    StageResult,
    Suspend,
    define_async_batch_stage,
    define_stage,
    define_workflow,
    stage,
)
from django_workflows.approval import approval_stage
from django_workflows.conventions import Decision
from django_workflows.kernel import CreateRun, delivery
from django_workflows.kernel.hosting import run_maintenance_tick
from django_workflows.models import WorkflowRun
from django_workflows.testing import (
    FakeClock,
    make_kernel,
    override_stage,
    run_to_completion,
    run_workflow,
)

#: Every driving test runs both ways: inside the test's transaction and with real commits.
BOTH_DB_MODES = pytest.mark.parametrize(
    "db_mode",
    [
        pytest.param("atomic", marks=pytest.mark.django_db),
        pytest.param("transactional", marks=pytest.mark.django_db(transaction=True)),
    ],
)


class Order(BaseModel):
    sku: str
    qty: int


class Priced(BaseModel):
    cost: float


class Reserved(BaseModel):
    reserved: bool


def order_workflow(calls: dict[str, int] | None = None) -> Any:
    """validate -> [reserve | price-shipping] -> confirm (annotates a decision)."""
    calls = calls if calls is not None else {}

    @stage(id="validate", input=Order, output=Order)
    def validate(ctx: StageContext[Order, Any]) -> Order:
        ctx.log("info", "validating", sku=ctx.input.sku)
        return ctx.input

    @stage(id="reserve", input=Order, output=Reserved)
    def reserve(ctx: StageContext[Order, Any]) -> Reserved:
        return Reserved(reserved=True)

    @stage(id="price-shipping", input=Order, output=Priced)
    def price(ctx: StageContext[Order, Any]) -> Priced:
        calls["price"] = calls.get("price", 0) + 1
        raise RuntimeError("the shipping API is not reachable from tests")

    @stage(id="confirm", dependencies=["validate"])
    def confirm(ctx: StageContext[Any, Any]) -> dict[str, Any]:
        cost = ctx.require("price-shipping").cost
        ctx.annotate(Decision.outcome, "confirmed", emit_event=True)
        ctx.log("warn", "expensive" if cost > 10 else "cheap", cost=cost)
        return {"sku": ctx.require("validate").sku, "cost": cost}

    return (
        define_workflow(id="order", input=Order)
        .pipe(validate)
        .parallel([reserve, price])
        .pipe(confirm)
        .build()
    )


# --- driving inside the test's transaction ------------------------------------------------


@pytest.mark.django_db
def test_a_tick_inside_the_tests_transaction_keeps_the_connection() -> None:
    """The regression of issue 11: ``run_maintenance_tick`` called ``close_old_connections``,
    which closes a connection whose autocommit is off - the test's own transaction - so the
    next statement failed with "the connection is closed" (PostgreSQL)."""
    kernel = make_kernel(order_workflow())
    run_id = kernel.dispatch(CreateRun("order", {"sku": "a", "qty": 1})).workflow_run_id
    run_maintenance_tick(kernel, "t")
    assert connection.in_atomic_block and not connection.closed_in_transaction
    assert WorkflowRun.objects.get(pk=run_id).status == "RUNNING"  # claimed, still usable


@BOTH_DB_MODES
def test_run_workflow_with_an_override_returns_outputs_annotations_events_and_logs(
    db_mode: str,
) -> None:
    calls: dict[str, int] = {}
    wf = order_workflow(calls)
    result = run_workflow(
        wf, {"sku": "a-1", "qty": 2}, overrides={"price-shipping": lambda ctx: Priced(cost=12.5)}
    )
    assert result.status == "COMPLETED", result.error
    assert result.error is None
    assert result.output == {"sku": "a-1", "cost": 12.5}
    assert result.stages == {
        "validate": {"sku": "a-1", "qty": 2},
        "reserve": {"reserved": True},
        "price-shipping": {"cost": 12.5},
        "confirm": {"sku": "a-1", "cost": 12.5},
    }
    assert calls == {}  # the real body never ran
    assert result.annotation("decision.outcome") == "confirmed"
    assert [(a.scope, a.scope_id, a.key) for a in result.annotations] == [
        ("stage", "confirm", "decision.outcome")
    ]
    assert result.event_types[0] == "workflow:created"
    assert result.event_types[-1] == "workflow:completed"
    assert "annotation:created" in result.event_types
    assert [(log.level, log.message, log.stage.stage_id) for log in result.logs] == [
        ("INFO", "validating", "validate"),
        ("WARN", "expensive", "confirm"),
    ]
    assert result.logs[1].metadata == {"cost": 12.5}
    assert str(result.run.pk) == result.run_id


@BOTH_DB_MODES
def test_a_failed_run_reports_its_error(db_mode: str) -> None:
    wf = order_workflow()
    result = run_workflow(
        wf, {"sku": "a", "qty": 1}, overrides={"price-shipping": {"cost": "free"}}
    )
    assert result.status == "FAILED"
    assert result.error is not None
    assert result.error["stage_id"] == "price-shipping"
    assert "invalid output of stage 'price-shipping'" in result.error["message"]
    assert "cost" in result.stage_error("price-shipping")
    assert result.stage_error("reserve") is None
    assert "confirm" not in result.stages
    with pytest.raises(KeyError, match="has no record of stage 'confirm'; it has: validate"):
        result.stage_error("confirm")


@BOTH_DB_MODES
def test_retries_and_polls_come_due_without_choosing_advance_seconds(db_mode: str) -> None:
    """``advance_seconds=None`` (the default) jumps the fake clock to the next retry back-off
    or completion check: two failed deliveries (2 s and 4 s back-off) and a stage polled every
    hour finish in a handful of rounds."""
    attempts = {"n": 0}

    def flaky(ctx: StageContext[Any, Any]) -> dict[str, int]:
        attempts["n"] += 1
        if attempts["n"] < 3:
            raise RuntimeError(f"flaky {attempts['n']}")
        return {"value": 1}

    checks = {"n": 0}

    def submit(ctx: StageContext[Any, Any]) -> Suspend:
        return Suspend(state={"batch_id": "b"}, poll_interval_seconds=3600)

    def check(state: dict[str, Any], ctx: Any) -> CompletionCheck:
        checks["n"] += 1
        return (
            CompletionCheck.done({"value": 2}) if checks["n"] >= 2 else CompletionCheck.not_ready()
        )

    clock = FakeClock()
    wf = (
        define_workflow(id="slow")
        .pipe(define_stage(id="flaky", execute=flaky))
        .pipe(define_async_batch_stage(id="batch", execute=submit, check_completion=check))
        .build()
    )
    start = clock.now()
    result = run_workflow(wf, {}, clock=clock, max_rounds=10)
    assert result.status == "COMPLETED", result.error
    assert attempts["n"] == 3 and checks["n"] == 2
    assert result.output == {"value": 2}
    # 2 s + 4 s of back-off, then two hourly polls: the clock moved exactly that far.
    assert (clock.now() - start).total_seconds() == pytest.approx(2 + 4 + 2 * 3600, abs=1)


@BOTH_DB_MODES
def test_advance_seconds_moves_the_clock_by_a_fixed_step(db_mode: str) -> None:
    attempts = {"n": 0}

    def flaky(ctx: StageContext[Any, Any]) -> dict[str, int]:
        attempts["n"] += 1
        if attempts["n"] < 2:
            raise RuntimeError("once")
        return {}

    wf = define_workflow(id="step").pipe(define_stage(id="flaky", execute=flaky)).build()
    with pytest.raises(
        AssertionError,
        match=r"not terminal after 3 rounds: RUNNING \(waiting: "
        r"flaky: delivery 2 of 3 after back-off\)",
    ):
        run_workflow(wf, {}, advance_seconds=0.5, max_rounds=3)  # 1.5 s < the 2 s back-off
    result = run_workflow(wf, {}, advance_seconds=1, max_rounds=4)
    assert result.status == "COMPLETED"


@BOTH_DB_MODES
def test_deliveries_inside_the_tests_transaction_have_no_heartbeat(db_mode: str) -> None:
    """Inside an enclosing transaction another connection cannot see the lease, so a heartbeat
    could only report it lost: there is none. With real commits the heartbeat runs."""
    seen: list[int] = []

    def body(ctx: StageContext[Any, Any]) -> dict[str, Any]:
        seen.append(len(delivery.in_flight()))
        assert not ctx.is_cancelled()
        return {}

    wf = define_workflow(id="beat").pipe(define_stage(id="s", execute=body)).build()
    assert run_workflow(wf).status == "COMPLETED"
    assert seen == ([0] if db_mode == "atomic" else [1])


@BOTH_DB_MODES
def test_an_approval_nobody_decides_says_what_the_run_waits_for(db_mode: str) -> None:
    wf = define_workflow(id="needs-ok").pipe(approval_stage(id="review")).build()
    with pytest.raises(AssertionError, match="review: waiting for an approval decision"):
        run_workflow(wf, {}, max_rounds=3)


@BOTH_DB_MODES
def test_run_to_completion_with_a_kernel_from_make_kernel(db_mode: str) -> None:
    """The lower-level pair still works (and under a plain django_db now)."""
    kernel = make_kernel(order_workflow())
    with override_stage(kernel.registry.get("order"), "price-shipping", {"cost": 1.0}):
        run_id = kernel.dispatch(CreateRun("order", {"sku": "b", "qty": 1})).workflow_run_id
        run = run_to_completion(kernel, run_id)
    assert run.status == "COMPLETED"
    assert run.output == {"sku": "b", "cost": 1.0}


# --- overrides ------------------------------------------------------------------------------


@pytest.mark.django_db
def test_override_stage_leaves_the_definition_alone_and_nests() -> None:
    calls: dict[str, int] = {}
    wf = order_workflow(calls)
    real = wf.get_stage("price-shipping").execute
    with override_stage(wf, "price-shipping", lambda ctx: {"cost": 1}):
        with override_stage(wf, "price-shipping", lambda ctx: StageResult({"cost": 2})):
            inner = run_workflow(wf, {"sku": "a", "qty": 1})
        outer = run_workflow(wf, {"sku": "a", "qty": 1})
    assert wf.get_stage("price-shipping").execute is real
    assert (inner.stages["price-shipping"], outer.stages["price-shipping"]) == (
        {"cost": 2.0},
        {"cost": 1.0},
    )
    after = run_workflow(wf, {"sku": "a", "qty": 1}, max_rounds=10)
    assert after.status == "FAILED" and calls["price"] == 3  # the real body, with retries
    assert "the shipping API is not reachable" in after.error["message"]


@pytest.mark.django_db
def test_an_override_gets_the_stages_context() -> None:
    got: dict[str, Any] = {}

    def fake(ctx: StageContext[Order, Any]) -> Priced:
        got.update(input=ctx.input, stage=ctx.stage_id, validate=ctx.require("validate"))
        return Priced(cost=ctx.input.qty * 2)

    result = run_workflow(
        order_workflow(), {"sku": "s", "qty": 4}, overrides={"price-shipping": fake}
    )
    assert got == {
        "input": Order(sku="s", qty=4),
        "stage": "price-shipping",
        "validate": Order(sku="s", qty=4),
    }
    assert result.output["cost"] == 8.0


@pytest.mark.django_db
def test_an_async_batch_stage_overridden_with_an_output_completes_at_once() -> None:
    def never(state: Any, ctx: Any) -> CompletionCheck:
        raise AssertionError("not polled")

    batch = define_async_batch_stage(
        id="batch",
        execute=lambda ctx: Suspend(state={"batch_id": "x"}),
        check_completion=never,
        output=Priced,
    )
    wf = define_workflow(id="batchy").pipe(batch).build()
    result = run_workflow(wf, overrides={"batch": Priced(cost=3)})
    assert result.status == "COMPLETED" and result.output == {"cost": 3.0}
    assert "stage:suspended" not in result.event_types


def test_bad_overrides_are_refused_before_anything_is_written() -> None:
    wf = order_workflow()
    with pytest.raises(
        KeyError,
        match=r"stage\(s\) nope not in workflow 'order'; valid stage "
        r"ids: validate, reserve, price-shipping, confirm",
    ):
        run_workflow(wf, {"sku": "a", "qty": 1}, overrides={"nope": lambda ctx: 1})
    with pytest.raises(KeyError, match="valid stage ids: validate"):
        with override_stage(wf, "nope", lambda ctx: 1):
            pass
    with pytest.raises(TypeError, match="got the class Priced"):
        with override_stage(wf, "price-shipping", Priced):
            pass
    with pytest.raises(TypeError, match="overrides must be a mapping"):
        run_workflow(wf, {}, overrides=[("price-shipping", 1)])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="expects a built Workflow"):
        run_workflow(define_workflow(id="x"), {})  # type: ignore[arg-type]


@pytest.mark.django_db
def test_invalid_input_raises_and_writes_nothing() -> None:
    from django_workflows.kernel import InvalidWorkflowInputError

    with pytest.raises(InvalidWorkflowInputError, match="qty"):
        run_workflow(order_workflow(), {"sku": "a"})
    assert not WorkflowRun.objects.exists()


# --- the pytest plugin ------------------------------------------------------------------------


@pytest.mark.django_db
def test_fixtures_share_the_fake_clock(
    fake_clock: FakeClock, workflows_kernel: Any, run_workflow: Any
) -> None:
    wf = order_workflow()
    kernel = workflows_kernel(wf)
    assert kernel.clock is fake_clock and kernel.registry.get("order") is wf
    before = fake_clock.now()
    result = run_workflow(wf, {"sku": "a", "qty": 1}, overrides={"price-shipping": {"cost": 1}})
    assert result.kernel.clock is fake_clock
    assert result.run.created_at == before
    # the fixture also accepts the kernel it made
    again = run_workflow(
        wf, {"sku": "a", "qty": 1}, kernel=kernel, overrides={"price-shipping": {"cost": 2}}
    )
    assert again.kernel is kernel and again.output["cost"] == 2.0


def test_the_plugin_is_registered_and_needs_no_django(tmp_path: Path) -> None:
    """A project without Django settings still runs pytest with the plugin installed, and
    ``fake_clock`` works there (no database, no configured Django)."""
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "test_plain.py").write_text(
        textwrap.dedent(
            """
            import sys

            def test_clock(fake_clock):
                assert "django_workflows.testing.pytest_plugin" in sys.modules
                assert "django_workflows.models" not in sys.modules
                t = fake_clock.now()
                assert (fake_clock.advance(5) - t).total_seconds() == 5
            """
        )
    )
    env = {k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "1 passed" in proc.stdout


@BOTH_DB_MODES
def test_drive_stops_halfway_so_a_test_can_approve(db_mode: str) -> None:
    from django_workflows.approval import ApprovalDecision, approve
    from django_workflows.testing import collect_result, drive

    def publish(ctx: StageContext[ApprovalDecision, Any]) -> dict[str, Any]:
        return {"published": ctx.input.approved, "by": ctx.input.decided_by}

    wf = (
        define_workflow(id="reviewed")
        .pipe(approval_stage(id="review", poll_interval_seconds=60))
        .pipe(define_stage(id="publish", input=ApprovalDecision, execute=publish))
        .build()
    )
    kernel = make_kernel(wf)
    run_id = kernel.dispatch(CreateRun("reviewed", {})).workflow_run_id
    assert drive(kernel, run_id, rounds=3).status == "RUNNING"
    approve(run_id, by="alice", comment="ok", kernel=kernel)
    run = run_to_completion(kernel, run_id, advance_seconds=None, max_rounds=5)
    result = collect_result(kernel, run)
    assert result.output == {"published": True, "by": "alice"}
    assert result.annotation("decision.outcome") == "approved"


@pytest.mark.django_db
def test_a_stage_timeout_applies_inside_the_tests_transaction_too() -> None:
    """Inside a test's transaction there is no heartbeat thread, so no watchdog: the timeout is
    judged when the body returns, and a body that overran fails with ``StageTimeout`` as in
    production instead of completing (a test asserting success would hide the timeout)."""
    import time

    @stage(id="slow", timeout_seconds=0.05, retry=1)
    def slow(ctx: StageContext[Order]) -> Priced:
        time.sleep(0.15)  # real time is what the timeout measures
        return Priced(cost=1.0)

    @stage(id="quick", timeout_seconds=30, retry=1)
    def quick(ctx: StageContext[Order]) -> Priced:
        return Priced(cost=2.0)

    assert connection.in_atomic_block
    order = {"sku": "a-1", "qty": 1}
    overran = run_workflow(define_workflow(id="tk-slow", input=Order).pipe(slow).build(), order)
    assert overran.status == "FAILED"
    assert overran.run.error["error_type"] == "StageTimeout", overran.run.error
    assert "timed out after 0.05 s" in overran.run.error["message"]
    fine = run_workflow(define_workflow(id="tk-quick", input=Order).pipe(quick).build(), order)
    assert (fine.status, fine.output) == ("COMPLETED", {"cost": 2.0})
