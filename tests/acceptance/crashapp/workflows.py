"""Workflows whose stages stop at a known point, so a test can kill the cluster there.

The tests pass a directory in ``CRASH_DIR``. A blocking stage (or ``check_completion``) appends
one line per entry to ``{CRASH_DIR}/{run_id}.{name}.entries``; on its first entry it also writes
``{run_id}.{name}.blocked`` and then waits ``CRASH_BLOCK_SECONDS`` (default 60) - long enough
for the test to SIGKILL the cluster, bounded so a broken test cannot hang. Later entries go
straight through.

* ``crash-pipeline``: prepare -> hang (blocks on its first delivery) -> finish.
* ``crash-poll``: prepare -> batch (async batch; the first ``check_completion`` blocks) -> finish.
* ``race-pipeline``: a -> [b | c] -> d (async batch, ready after a random number of polls) -> e,
  every sync stage sleeping a few random milliseconds; run by the cancel race test.
* ``timeout-pipeline``: timed (``timeout_seconds=1.5``; its first delivery, or every one with
  ``always``, overruns: a ``time.sleep`` loop, a sleep in C, a loop that asks
  ``ctx.is_cancelled()`` and ignores it, or one that returns a late result once cancelled) ->
  after; run by the stage timeout tests.
* ``signal-pipeline``: approved (``wait_for_signal``, payload ``Approval``) -> book (returns the
  payload); run by the signal acceptance test.
* ``family-parent``: kid (a child-workflow stage running ``family-child``: one stage sleeping
  a few random milliseconds) -> done; run by the child cancel race test.
"""

from __future__ import annotations

import ctypes
import os
import random
import time
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from django_workflows import (
    CompletionCheck,
    StageContext,
    Suspend,
    define_async_batch_stage,
    define_workflow,
    register,
    stage,
    wait_for_signal,
)
from django_workflows.children import child_workflow


def crash_dir() -> Path:
    return Path(os.environ["CRASH_DIR"])


def enter(run_id: str, name: str) -> int:
    """Record one entry into ``name`` of the run; returns how many entries there were so far."""
    path = crash_dir() / f"{run_id}.{name}.entries"
    with open(path, "a") as fh:
        fh.write(f"{os.getpid()}\n")
    return len(path.read_text().splitlines())


def block_first_entry(run_id: str, name: str) -> int:
    """Block on the first entry (after writing the ``.blocked`` marker); returns the count."""
    count = enter(run_id, name)
    if count == 1:
        (crash_dir() / f"{run_id}.{name}.blocked").write_text(str(os.getpid()))
        deadline = time.monotonic() + float(os.environ.get("CRASH_BLOCK_SECONDS", "60"))
        while time.monotonic() < deadline:
            time.sleep(0.05)
    return count


# --- crash-pipeline and crash-poll ---------------------------------------------------------------


class CrashInput(BaseModel):
    label: str = "crash"


class Prepared(BaseModel):
    label: str
    token: str


class Delivered(BaseModel):
    label: str
    deliveries: int


class Finished(BaseModel):
    label: str
    deliveries: int
    summary: str


@stage(id="prepare", input=CrashInput, output=Prepared)
def prepare(ctx: StageContext[CrashInput, Any]) -> Prepared:
    return Prepared(label=ctx.input.label, token=f"{ctx.input.label}-{ctx.workflow_run_id[:8]}")


@stage(id="hang", input=Prepared, output=Delivered)
def hang(ctx: StageContext[Prepared, Any]) -> Delivered:
    """Blocks on its first delivery; the re-delivery after a crash goes through."""
    count = block_first_entry(ctx.workflow_run_id, "hang")
    return Delivered(label=ctx.input.label, deliveries=count)


@stage(id="finish", input=Delivered, output=Finished)
def finish(ctx: StageContext[Delivered, Any]) -> Finished:
    prepared: Prepared = ctx.require("prepare")
    return Finished(
        label=ctx.input.label,
        deliveries=ctx.input.deliveries,
        summary=f"{prepared.token}:{ctx.input.deliveries}",
    )


crash_pipeline = register(
    define_workflow(id="crash-pipeline", name="Crash: blocking stage", input=CrashInput)
    .pipe(prepare)
    .pipe(hang)
    .pipe(finish)
    .build()
)


def submit_batch(ctx: StageContext[Prepared, Any]) -> Suspend:
    enter(ctx.workflow_run_id, "submit")
    return Suspend(
        state={"batch_id": f"batch-{ctx.workflow_run_id}", "label": ctx.input.label},
        poll_interval_seconds=0.2,
        max_wait_seconds=300,
    )


def batch_ready(state: dict[str, Any], ctx: Any) -> CompletionCheck:
    """Blocks on the first poll; the next poll (after a crash) reports the batch done."""
    count = block_first_entry(ctx.workflow_run_id, "poll")
    return CompletionCheck.done({"label": state["label"], "deliveries": count})


batch = define_async_batch_stage(
    id="batch",
    input=Prepared,
    output=Delivered,
    execute=submit_batch,
    check_completion=batch_ready,
)

crash_poll = register(
    define_workflow(id="crash-poll", name="Crash: blocking poll", input=CrashInput)
    .pipe(prepare)
    .pipe(batch)
    .pipe(finish)
    .build()
)


# --- race-pipeline -------------------------------------------------------------------------------


class RaceInput(BaseModel):
    seed: int = 0


class Step(BaseModel):
    seed: int
    path: list[str] = Field(default_factory=list)


class Joined(BaseModel):
    b: Step
    c: Step


def _nap() -> None:
    time.sleep(random.uniform(0.0, 0.2))


@stage(id="a", input=RaceInput, output=Step)
def race_a(ctx: StageContext[RaceInput, Any]) -> Step:
    _nap()
    return Step(seed=ctx.input.seed, path=["a"])


@stage(id="b", input=Step, output=Step)
def race_b(ctx: StageContext[Step, Any]) -> Step:
    _nap()
    return Step(seed=ctx.input.seed, path=[*ctx.input.path, "b"])


@stage(id="c", input=Step, output=Step)
def race_c(ctx: StageContext[Step, Any]) -> Step:
    _nap()
    return Step(seed=ctx.input.seed, path=[*ctx.input.path, "c"])


def race_submit(ctx: StageContext[Joined, Any]) -> Suspend:
    _nap()
    return Suspend(
        state={"batch_id": f"race-{ctx.workflow_run_id}", "seed": ctx.input.b.seed},
        poll_interval_seconds=0.1,
        max_wait_seconds=300,
    )


def race_check(state: dict[str, Any], ctx: Any) -> CompletionCheck:
    if random.random() < 0.5:
        return CompletionCheck.not_ready(0.1)
    return CompletionCheck.done({"seed": state["seed"], "path": ["a", "b", "c", "d"]})


race_d = define_async_batch_stage(
    id="d", input=Joined, output=Step, execute=race_submit, check_completion=race_check
)


@stage(id="e", input=Step, output=Step)
def race_e(ctx: StageContext[Step, Any]) -> Step:
    _nap()
    return Step(seed=ctx.input.seed, path=[*ctx.input.path, "e"])


race_pipeline = register(
    define_workflow(id="race-pipeline", name="Cancel race", input=RaceInput)
    .pipe(race_a)
    .parallel([race_b, race_c])
    .pipe(race_d)
    .pipe(race_e)
    .build()
)


# The fault and routing tests' workflows (they use ``crash_dir`` and ``enter`` above).
from . import faults, limits, mapping, routing, schedules, versions  # noqa: E402, F401

# --- timeout-pipeline -----------------------------------------------------------------------------


class TimeoutInput(BaseModel):
    mode: str = "python"  # python | c | stubborn | polite
    always: bool = False


class Timed(BaseModel):
    mode: str
    delivery: int
    late: bool = False


@stage(id="timed", input=TimeoutInput, output=Timed, timeout_seconds=1.5)
def timed(ctx: StageContext[TimeoutInput, Any]) -> Timed:
    """Overruns its 1.5 s timeout on its first delivery (on every one with ``always``)."""
    count = enter(ctx.workflow_run_id, "timed")
    mode = ctx.input.mode
    if count == 1 or ctx.input.always:
        if mode == "python":
            for _ in range(600):  # 30 s in Python, never looking at ctx.is_cancelled()
                time.sleep(0.05)
        elif mode == "c":
            ctypes.CDLL(None).sleep(30)  # 30 s inside libc's sleep(3)
        elif mode == "stubborn":
            end = time.monotonic() + 30
            while time.monotonic() < end:
                ctx.is_cancelled()  # asked, and ignored
                time.sleep(0.01)
        elif mode == "polite":
            end = time.monotonic() + 30
            while not ctx.is_cancelled() and time.monotonic() < end:
                time.sleep(0.01)
            (crash_dir() / f"{ctx.workflow_run_id}.timed.late").write_text(str(os.getpid()))
            return Timed(mode=mode, delivery=count, late=True)  # a late result
    return Timed(mode=mode, delivery=count)


@stage(id="after", input=Timed, output=Timed)
def after(ctx: StageContext[Timed, Any]) -> Timed:
    enter(ctx.workflow_run_id, "after")
    return ctx.input


timeout_pipeline = register(
    define_workflow(id="timeout-pipeline", name="Timeouts: overrunning stage", input=TimeoutInput)
    .pipe(timed)
    .pipe(after)
    .build()
)


# --- signals (issue 18 item 4) ----------------------------------------------------------------


class Approval(BaseModel):
    by: str
    amount: int


def booked(ctx: StageContext[Approval, Any]) -> Approval:
    return ctx.input


signal_pipeline = register(
    define_workflow(id="signal-pipeline", name="Signals: wait for 'approved'")
    .pipe(wait_for_signal(id="approved", payload=Approval, timeout_seconds=120))
    .pipe(stage(id="book", input=Approval, output=Approval)(booked))
    .build()
)


# --- family-parent / family-child --------------------------------------------------------------


class FamilyInput(BaseModel):
    seed: int


class FamilyOut(BaseModel):
    seed: int
    value: int


@stage(id="work", input=FamilyInput, output=FamilyOut)
def family_work(ctx: StageContext[FamilyInput, Any]) -> FamilyOut:
    rng = random.Random(ctx.input.seed)
    time.sleep(rng.uniform(0.0, 0.4))
    return FamilyOut(seed=ctx.input.seed, value=ctx.input.seed * 7)


family_child = register(
    define_workflow(id="family-child", name="Child race: child", input=FamilyInput)
    .pipe(family_work)
    .build()
)


@stage(id="done", input=FamilyOut, output=FamilyOut)
def family_done(ctx: StageContext[FamilyOut, Any]) -> FamilyOut:
    return ctx.input


family_parent = register(
    define_workflow(id="family-parent", name="Child race: parent", input=FamilyInput)
    .pipe(
        child_workflow(
            id="kid",
            workflow=family_child,
            input=lambda ctx: {"seed": ctx.input.seed},
            stage_input=FamilyInput,
        )
    )
    .pipe(family_done)
    .build()
)
