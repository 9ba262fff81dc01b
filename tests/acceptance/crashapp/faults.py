"""Workflows of the fault tests (paused worker, clock skew, crash at a commit boundary).

Every execution of a stage body appends one JSON line ``{"pid", "pgid", "t", "run", "stage",
"entry"}`` to ``{CRASH_DIR}/executions.jsonl`` (one ``O_APPEND`` write, so concurrent writers
never interleave), so a test can count how often each stage really ran, and where and when:
``pgid`` is the process group (the cluster's main pid), ``t`` the wall-clock start
(``time.time()``).

* ``pause-pipeline``: first -> slow -> reader -> gate.
  ``slow`` on its first delivery writes ``{run}.slow.blocked`` (its pid) and waits for
  ``{run}.slow.resume`` - the test pauses that worker with SIGSTOP meanwhile; after the resume
  it returns (``late="success"``) or raises (``late="fail"``: a non-retryable validation error,
  ``late="retryable"``: a plain exception). Every other delivery returns at once. The output
  names the delivery (entry number and pid), so the test can tell whose output was kept.
  With ``CRASH_SLOW_CANCELLABLE=1`` the wait also ends once ``ctx.is_cancelled()`` is true
  (the graceful-stop test: a released delivery returns its late result).
  ``reader`` copies what it read from ``slow``. ``gate`` on its first entry writes
  ``{run}.gate.blocked`` and waits for ``{run}.gate.go``: it holds the run RUNNING until the
  late delivery of ``slow`` has been dealt with.
* ``fault-pipeline``: a -> [b | c] -> d; every stage sleeps ``CRASH_STAGE_SECONDS`` (default 0)
  and passes on what it read, so ``d``'s output shows the whole path. With
  ``CRASH_EXIT_IN_STAGE=<stage id>`` the first execution of that stage (the first process to
  create ``CRASH_EXIT_ONCE_FILE``) ends its worker process with ``os._exit(70)`` inside the
  body.
* ``conn-pipeline``: one -> two; each stage records its execution and sleeps
  ``CONN_STAGE_SECONDS`` without touching the database (``"5"``: 5 s; ``"1-3"``: a random
  1-3 s per stage) - the connection resilience tests kill the workers' connections meanwhile.
  ``sleepy``: one stage that sleeps ``CONN_STAGE_SECONDS`` on its first delivery only (the
  django-q2 timeout test).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from django_workflows import StageContext, define_workflow, register, stage

from .workflows import crash_dir, enter


def record_execution(run_id: str, stage_id: str, entry: int = 0, **extra: Any) -> None:
    """Append one line for this execution of ``stage_id`` to ``executions.jsonl``: pid,
    process group, time, run, stage, entry and ``extra`` members."""
    line = json.dumps(
        {
            "pid": os.getpid(),
            "pgid": os.getpgid(0),
            "at": time.time(),
            "run": run_id,
            "stage": stage_id,
            "entry": entry,
            **extra,
        }
    )
    fd = os.open(crash_dir() / "executions.jsonl", os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)


def wait_for_file(path: Path, cancelled: Callable[[], bool] | None = None) -> bool:
    """Wait (bounded by ``CRASH_BLOCK_SECONDS``, default 60) until ``path`` exists, or until
    ``cancelled()`` is true (then ``False``).
    """
    deadline = time.monotonic() + float(os.environ.get("CRASH_BLOCK_SECONDS", "60"))
    while time.monotonic() < deadline:
        if path.exists():
            return True
        if cancelled is not None and cancelled():
            return False
        time.sleep(0.05)
    return False


# --- pause-pipeline ------------------------------------------------------------------------------


class PauseInput(BaseModel):
    late: str = "success"


class Slow(BaseModel):
    late: str
    delivery: int = 0
    pid: int = 0


class Read(BaseModel):
    delivery: int
    pid: int


class _Never(BaseModel):
    required: int


@stage(id="first", input=PauseInput, output=Slow)
def pause_first(ctx: StageContext[PauseInput, Any]) -> Slow:
    record_execution(ctx.workflow_run_id, "first")
    return Slow(late=ctx.input.late)


@stage(id="slow", input=Slow, output=Slow)
def pause_slow(ctx: StageContext[Slow, Any]) -> Slow:
    run_id = ctx.workflow_run_id
    count = enter(run_id, "slow")
    record_execution(run_id, "slow", count)
    if count == 1:
        (crash_dir() / f"{run_id}.slow.blocked").write_text(str(os.getpid()))
        cancellable = ctx.is_cancelled if os.environ.get("CRASH_SLOW_CANCELLABLE") else None
        wait_for_file(crash_dir() / f"{run_id}.slow.resume", cancellable)
        if ctx.input.late == "fail":
            _Never.model_validate({})  # a ValidationError: not retryable
        if ctx.input.late == "retryable":
            raise RuntimeError("late failure of the paused delivery")
    return Slow(late=ctx.input.late, delivery=count, pid=os.getpid())


@stage(id="reader", input=Slow, output=Read)
def pause_reader(ctx: StageContext[Slow, Any]) -> Read:
    record_execution(ctx.workflow_run_id, "reader")
    return Read(delivery=ctx.input.delivery, pid=ctx.input.pid)


@stage(id="gate", input=Read, output=Read)
def pause_gate(ctx: StageContext[Read, Any]) -> Read:
    run_id = ctx.workflow_run_id
    count = enter(run_id, "gate")
    record_execution(run_id, "gate", count)
    if count == 1:
        (crash_dir() / f"{run_id}.gate.blocked").write_text(str(os.getpid()))
        wait_for_file(crash_dir() / f"{run_id}.gate.go")
    return ctx.input


pause_pipeline = register(
    define_workflow(id="pause-pipeline", name="Faults: paused worker", input=PauseInput)
    .pipe(pause_first)
    .pipe(pause_slow)
    .pipe(pause_reader)
    .pipe(pause_gate)
    .build()
)


# --- fault-pipeline ------------------------------------------------------------------------------


class FaultInput(BaseModel):
    n: int = 0


class Trail(BaseModel):
    n: int
    path: list[str] = Field(default_factory=list)


class Joined(BaseModel):
    b: Trail
    c: Trail


def exit_once(once_file: str) -> None:
    """``os._exit(70)`` if this process is the first to create ``once_file``."""
    try:
        os.close(os.open(once_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL))
    except FileExistsError:
        return
    os._exit(70)


def _work(ctx: StageContext[Any, Any], stage_id: str) -> None:
    record_execution(ctx.workflow_run_id, stage_id)
    time.sleep(float(os.environ.get("CRASH_STAGE_SECONDS", "0")))
    if os.environ.get("CRASH_EXIT_IN_STAGE") == stage_id:
        exit_once(os.environ["CRASH_EXIT_ONCE_FILE"])


@stage(id="a", input=FaultInput, output=Trail)
def fault_a(ctx: StageContext[FaultInput, Any]) -> Trail:
    _work(ctx, "a")
    return Trail(n=ctx.input.n, path=["a"])


@stage(id="b", input=Trail, output=Trail)
def fault_b(ctx: StageContext[Trail, Any]) -> Trail:
    _work(ctx, "b")
    return Trail(n=ctx.input.n, path=[*ctx.input.path, "b"])


@stage(id="c", input=Trail, output=Trail)
def fault_c(ctx: StageContext[Trail, Any]) -> Trail:
    _work(ctx, "c")
    return Trail(n=ctx.input.n, path=[*ctx.input.path, "c"])


@stage(id="d", input=Joined, output=Trail)
def fault_d(ctx: StageContext[Joined, Any]) -> Trail:
    _work(ctx, "d")
    return Trail(n=ctx.input.b.n, path=[*ctx.input.b.path, *ctx.input.c.path[1:], "d"])


fault_pipeline = register(
    define_workflow(id="fault-pipeline", name="Faults: a -> [b | c] -> d", input=FaultInput)
    .pipe(fault_a)
    .parallel([fault_b, fault_c])
    .pipe(fault_d)
    .build()
)


# --- conn-pipeline and sleepy ----------------------------------------------------------


def _idle(ctx: StageContext[Any, Any], stage_id: str) -> None:
    """Sleep like an I/O-bound stage (no database use) for ``CONN_STAGE_SECONDS``."""
    import random

    record_execution(ctx.workflow_run_id, stage_id)
    spec = os.environ.get("CONN_STAGE_SECONDS", "1")
    low, _, high = spec.partition("-")
    time.sleep(random.uniform(float(low), float(high)) if high else float(low))


@stage(id="one", input=FaultInput, output=Trail)
def conn_one(ctx: StageContext[FaultInput, Any]) -> Trail:
    _idle(ctx, "one")
    return Trail(n=ctx.input.n, path=["one"])


@stage(id="two", input=Trail, output=Trail)
def conn_two(ctx: StageContext[Trail, Any]) -> Trail:
    _idle(ctx, "two")
    return Trail(n=ctx.input.n, path=[*ctx.input.path, "two"])


conn_pipeline = register(
    define_workflow(id="conn-pipeline", name="Faults: one -> two (idle)", input=FaultInput)
    .pipe(conn_one)
    .pipe(conn_two)
    .build()
)


@stage(id="sleepy", input=FaultInput, output=Trail)
def sleepy(ctx: StageContext[FaultInput, Any]) -> Trail:
    count = enter(ctx.workflow_run_id, "sleepy")
    record_execution(ctx.workflow_run_id, "sleepy", count)
    if count == 1:
        time.sleep(float(os.environ.get("CONN_STAGE_SECONDS", "1")))
    return Trail(n=count, path=["sleepy"])


sleepy_pipeline = register(
    define_workflow(
        id="sleepy-pipeline", name="Faults: past the django-q2 timeout", input=FaultInput
    )
    .pipe(sleepy)
    .build()
)


# --- poller ---------------------------------------------------------------------------------------


class PollerInput(BaseModel):
    label: str = ""


class Polled(BaseModel):
    label: str


def _poller_wait(ctx: StageContext[PollerInput, Any]) -> Any:
    from django_workflows import Suspend

    return Suspend(
        state={"batch_id": f"poll-{ctx.workflow_run_id}", "label": ctx.input.label},
        poll_interval_seconds=0.2,
    )


def _poller_ready(state: dict[str, Any], ctx: Any) -> Any:
    """Not ready until ``{CRASH_DIR}/{run}.wait.done`` exists: every poll of the maintenance
    tick changes the suspended stage row (``version`` + 1), so a test sees ticks poll."""
    from django_workflows import CompletionCheck

    if (crash_dir() / f"{ctx.workflow_run_id}.wait.done").exists():
        return CompletionCheck.done({"label": state["label"]})
    return CompletionCheck.not_ready()


def _define_poller() -> Any:
    from django_workflows import define_async_batch_stage

    wait = define_async_batch_stage(
        id="wait",
        input=PollerInput,
        output=Polled,
        execute=_poller_wait,
        check_completion=_poller_ready,
    )
    return register(
        define_workflow(id="poller", name="Faults: polled forever", input=PollerInput)
        .pipe(wait)
        .build()
    )


#: ``poller``: one async-batch stage polled every 0.2 s until ``{run}.wait.done`` exists (the
#: multi-host test of a host cut mid-transaction watches the polls go on).
poller = _define_poller()
