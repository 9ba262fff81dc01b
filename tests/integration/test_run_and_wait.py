"""``run_and_wait`` (SPEC H-30..32): dispatch first, poll, stage-change callback, abort,
timeout, in-process driving; on SQLite and PostgreSQL, inside the test's transaction and with
real commits."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from pydantic import BaseModel

from django_workflows import (
    RunWaitAborted,
    RunWaitTimeout,
    StageContext,
    StageSnapshot,
    define_stage,
    define_workflow,
    run_and_wait,
)
from django_workflows.kernel import InvalidWorkflowInputError, WorkflowNotFoundError
from django_workflows.models import WorkflowRun
from django_workflows.testing import FakeClock, make_kernel

BOTH_DB_MODES = pytest.mark.parametrize(
    "db_mode",
    [
        pytest.param("atomic", marks=pytest.mark.django_db),
        pytest.param("transactional", marks=pytest.mark.django_db(transaction=True)),
    ],
)


class Num(BaseModel):
    value: int


def add(n: int, stage_id: str) -> Any:
    def execute(ctx: StageContext[Num, Any]) -> Num:
        return Num(value=ctx.input.value + n)

    return define_stage(id=stage_id, input=Num, output=Num, execute=execute)


def two_stage() -> Any:
    return define_workflow(id="two", input=Num).pipe(add(1, "one")).pipe(add(10, "ten")).build()


class FakeTime:
    """``sleep``/``monotonic`` pair: sleeping moves the fake monotonic clock."""

    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds

    def monotonic(self) -> float:
        return self.now


@BOTH_DB_MODES
def test_drive_runs_the_run_in_process_and_reports_each_stage_change(db_mode: str) -> None:
    kernel = make_kernel(two_stage())
    changes: list[tuple[tuple[str, str], ...]] = []
    fake = FakeTime()
    result = run_and_wait(
        "two",
        {"value": 1},
        kernel=kernel,
        drive=True,
        on_stage_change=lambda stages: changes.append(
            tuple((s.stage_id, s.status) for s in stages)
        ),
        sleep=fake.sleep,
        monotonic=fake.monotonic,
    )
    assert result.status == "COMPLETED" and result.output == {"value": 12}
    assert result.error is None
    assert result.run.pk == WorkflowRun.objects.get().pk and result.run_id == str(result.run.pk)
    assert [s.stage_id for s in result.stages] == ["one", "ten"]
    assert all(isinstance(s, StageSnapshot) and s.status == "COMPLETED" for s in result.stages)
    assert result.stages[0].execution_group == 1 and result.stages[1].execution_group == 2
    assert result.duration_ms is not None and result.total_cost == 0
    # one round per group, no sleep while there is work; every change reported once
    assert fake.sleeps == []
    assert changes[-1] == (("one", "COMPLETED"), ("ten", "COMPLETED"))
    assert len(changes) == len(set(changes))


@BOTH_DB_MODES
def test_a_failed_run_is_returned_with_its_error(db_mode: str) -> None:
    def boom(ctx: Any) -> Num:
        return {"value": "not a number"}  # type: ignore[return-value]

    wf = define_workflow(id="bad").pipe(define_stage(id="b", output=Num, execute=boom)).build()
    result = run_and_wait("bad", {}, kernel=make_kernel(wf), drive=True, sleep=lambda s: None)
    assert result.status == "FAILED"
    assert result.error["stage_id"] == "b" and result.error["error_type"] == "ValidationError"
    assert "invalid output of stage 'b'" in result.error["message"]


@pytest.mark.django_db
def test_the_first_poll_always_counts_as_a_change_and_sleeps_use_poll_interval() -> None:
    """Without workers (drive=False) the run stays PENDING: the callback fires once (the
    first poll), then the loop sleeps poll_interval until the timeout says why."""
    kernel = make_kernel(two_stage())
    fake = FakeTime()
    changes: list[Any] = []
    with pytest.raises(
        RunWaitTimeout,
        match=r"not terminal after 10 s: it is PENDING \(no "
        r"worker took it\? start a cluster, or pass drive=True\)",
    ) as caught:
        run_and_wait(
            "two",
            {"value": 1},
            kernel=kernel,
            poll_interval=3,
            timeout=10,
            on_stage_change=changes.append,
            sleep=fake.sleep,
            monotonic=fake.monotonic,
        )
    assert changes == [()]  # no stage records yet; reported once
    assert fake.sleeps == [3, 3, 3, 1]  # the last sleep is cut to the timeout
    assert caught.value.status == "PENDING"
    assert isinstance(caught.value, TimeoutError)
    assert WorkflowRun.objects.get(pk=caught.value.run_id).status == "PENDING"  # it goes on


@pytest.mark.django_db
def test_abort_stops_the_wait_before_and_between_polls() -> None:
    kernel = make_kernel(two_stage())
    abort = threading.Event()
    abort.set()
    with pytest.raises(RunWaitAborted, match="run_and_wait aborted") as caught:
        run_and_wait("two", {"value": 1}, kernel=kernel, abort=abort)
    assert WorkflowRun.objects.filter(pk=caught.value.run_id).exists()  # dispatched first

    class SetDuringSleep:
        def __init__(self) -> None:
            self.flag = False
            self.waits: list[float] = []

        def is_set(self) -> bool:
            return self.flag

        def wait(self, seconds: float) -> bool:  # the abortable sleep
            self.waits.append(seconds)
            self.flag = True
            return True

    signal = SetDuringSleep()
    with pytest.raises(RunWaitAborted):
        run_and_wait("two", {"value": 1}, kernel=kernel, abort=signal, poll_interval=7)
    assert signal.waits == [7]


@pytest.mark.django_db
def test_a_command_that_raises_starts_nothing() -> None:
    kernel = make_kernel(two_stage())
    calls: list[Any] = []
    with pytest.raises(InvalidWorkflowInputError, match="value"):
        run_and_wait("two", {"value": "x"}, kernel=kernel, on_stage_change=calls.append)
    with pytest.raises(WorkflowNotFoundError):
        run_and_wait("nope", {}, kernel=kernel, on_stage_change=calls.append)
    assert calls == [] and not WorkflowRun.objects.exists()


@pytest.mark.django_db
def test_bad_arguments_are_refused_before_the_run_is_created() -> None:
    kernel = make_kernel(two_stage())
    with pytest.raises(ValueError, match="poll_interval must be a number of seconds > 0"):
        run_and_wait("two", {"value": 1}, kernel=kernel, poll_interval=0)
    with pytest.raises(ValueError, match="timeout must be a number of seconds >= 0"):
        run_and_wait("two", {"value": 1}, kernel=kernel, timeout=-1)
    assert not WorkflowRun.objects.exists()


@BOTH_DB_MODES
def test_drive_waits_out_a_retry_back_off_with_poll_interval_sleeps(db_mode: str) -> None:
    """A retry back-off is time the driver cannot skip: it sleeps poll_interval until the job
    is due (here the kernel's fake clock moves with each sleep)."""
    clock = FakeClock()
    attempts = {"n": 0}

    def flaky(ctx: Any) -> dict[str, int]:
        attempts["n"] += 1
        if attempts["n"] == 1:
            raise RuntimeError("once")
        return {"ok": 1}

    wf = define_workflow(id="flaky").pipe(define_stage(id="f", execute=flaky)).build()
    sleeps: list[float] = []

    def sleep(seconds: float) -> None:
        sleeps.append(seconds)
        clock.advance(seconds)

    result = run_and_wait(
        "flaky", {}, kernel=make_kernel(wf, clock=clock), drive=True, poll_interval=1, sleep=sleep
    )
    assert result.status == "COMPLETED" and attempts["n"] == 2
    assert sleeps == [1, 1]  # the default 2 s back-off
