"""``run.rerunFrom`` (SPEC §4.5, K-RR-1..7; catalogue A.5, D.4; Part I items 8 and 10) and the
``workflows_rerun`` management command.
"""

from __future__ import annotations

import io
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError

from django_workflows import StageContext, define_stage, define_workflow, registry, rerun_from
from django_workflows.definition import Workflow
from django_workflows.kernel import (
    CancelRun,
    ClaimPendingRuns,
    CreateRun,
    IdempotencyInProgressError,
    Kernel,
    RerunFrom,
    RunNotFoundError,
    RunStateError,
    StageNotFoundError,
    WorkflowNotFoundError,
    idempotency,
)
from django_workflows.kernel import events as ev
from django_workflows.kernel.runtime import get_kernel
from django_workflows.models import (
    IdempotencyKey,
    OutboxEvent,
    Status,
    WorkflowAnnotation,
    WorkflowBlob,
    WorkflowJob,
    WorkflowRun,
    WorkflowStage,
)
from django_workflows.testing import FakeClock, RecordingTransport, run_to_completion
from tests.workflows import Num, two_stage

pytestmark = pytest.mark.django_db(transaction=True)

KernelFor = Callable[..., Kernel]


class Counting:
    """Stage factory that counts executions per stage and records the context it saw."""

    def __init__(self, broken: str | None = None) -> None:
        self.calls: dict[str, int] = {}
        self.contexts: dict[str, list[dict[str, Any]]] = {}
        self.broken = broken  # this stage returns an invalid output (non-retryable failure)

    def stage(self, stage_id: str, n: int) -> Any:
        def execute(ctx: StageContext[Num, Any]) -> Any:
            self.calls[stage_id] = self.calls.get(stage_id, 0) + 1
            self.contexts.setdefault(stage_id, []).append(
                {k: v.value for k, v in ctx.workflow_context.items()}
            )
            ctx.storage.save(f"by-{stage_id}", {"call": self.calls[stage_id]})
            ctx.annotate(f"test.{stage_id}", self.calls[stage_id])
            if stage_id == self.broken:
                return {"wrong": True}
            return Num(value=ctx.input.value + n)

        return define_stage(id=stage_id, input=Num, output=Num, execute=execute)


def _four(counting: Counting) -> Workflow:
    builder = define_workflow(id="four", input=Num)
    for i, sid in enumerate(("s1", "s2", "s3", "s4"), start=1):
        builder = builder.pipe(counting.stage(sid, i))
    return builder.build()


def _finished_run(kernel: Kernel, workflow_id: str = "four", value: int = 0) -> uuid.UUID:
    run_id = kernel.dispatch(CreateRun(workflow_id=workflow_id, input={"value": value}))
    run_to_completion(kernel, run_id.workflow_run_id)
    return uuid.UUID(run_id.workflow_run_id)


def _statuses(run_id: uuid.UUID) -> dict[str, tuple[str, int]]:
    return {
        s.stage_id: (s.status, s.generation) for s in WorkflowStage.objects.filter(run_id=run_id)
    }


def _pending_jobs(run_id: uuid.UUID) -> list[str]:
    return list(
        WorkflowJob.objects.filter(workflow_run_id=run_id, status=Status.PENDING).values_list(
            "stage_id", flat=True
        )
    )


def test_rerun_deletes_and_recreates_the_target_group(kernel_for: KernelFor) -> None:
    """K-RR-3..6, SM-7, SM-17, A.5 :61, EV-11: rerun from stage 2 of 2 -> ``deleted_stages ==
    ["add-10"]``; run RUNNING; add-10 PENDING (generation 1); add-1 still COMPLETED; exactly one
    new job; ``workflow:started`` appended."""
    kernel = kernel_for(two_stage())
    run_id = _finished_run(kernel, "two-stage")
    jobs_before = WorkflowJob.objects.filter(workflow_run_id=run_id).count()

    result = kernel.dispatch(RerunFrom(run_id, "add-10"))

    assert (result.workflow_run_id, result.from_stage_id, result.deleted_stages) == (
        str(run_id),
        "add-10",
        ["add-10"],
    )
    assert WorkflowRun.objects.get(pk=run_id).status == Status.RUNNING
    assert _statuses(run_id) == {"add-1": (Status.COMPLETED, 0), "add-10": (Status.PENDING, 1)}
    assert WorkflowJob.objects.filter(workflow_run_id=run_id).count() == jobs_before + 1
    assert _pending_jobs(run_id) == ["add-10"]
    last = OutboxEvent.objects.filter(workflow_run_id=run_id).order_by("-sequence").first()
    assert last is not None and last.event_type == ev.WORKFLOW_STARTED


def test_rerun_attempt_is_previous_max_plus_one(kernel_for: KernelFor) -> None:
    """K-RR-5, SM-30, A.5 :100: the target stage's generation goes 0 -> 1 -> 2 over two reruns."""
    kernel = kernel_for(two_stage())
    run_id = _finished_run(kernel, "two-stage")
    for expected in (1, 2):
        kernel.dispatch(RerunFrom(run_id, "add-10"))
        assert _statuses(run_id)["add-10"] == (Status.PENDING, expected)
        run_to_completion(kernel, run_id)
        assert _statuses(run_id)["add-10"] == (Status.COMPLETED, expected)


def test_rerun_from_the_first_stage_recreates_only_group_one(kernel_for: KernelFor) -> None:
    """K-RR-5/6, K-TR-6, SM-30, A.5 :155: rerun from stage 1 deletes both records; stage 1 is
    PENDING with generation 1 and a job; stage 2 is not recreated until the transition, which
    gives it the inherited generation 1."""
    kernel = kernel_for(two_stage())
    run_id = _finished_run(kernel, "two-stage")

    result = kernel.dispatch(RerunFrom(run_id, "add-1"))

    assert sorted(result.deleted_stages) == ["add-1", "add-10"]
    assert _statuses(run_id) == {"add-1": (Status.PENDING, 1)}
    assert _pending_jobs(run_id) == ["add-1"]
    run = run_to_completion(kernel, run_id)
    assert run.status == Status.COMPLETED
    assert _statuses(run_id) == {"add-1": (Status.COMPLETED, 1), "add-10": (Status.COMPLETED, 1)}


def test_rerun_from_stage_three_of_four_keeps_earlier_stages(kernel_for: KernelFor) -> None:
    """K-RR-3..7, A.5 EX :80/:152/:412/:488: rerun from s3 deletes s3 and s4 only; s1, s2 stay
    COMPLETED and are not executed again; s3 is PENDING with exactly one job; s3 sees the
    earlier outputs in its context; the run completes again with the same output."""
    counting = Counting()
    kernel = kernel_for(_four(counting))
    run_id = _finished_run(kernel)

    result = kernel.dispatch(RerunFrom(run_id, "s3"))

    assert sorted(result.deleted_stages) == ["s3", "s4"]
    assert _statuses(run_id) == {
        "s1": (Status.COMPLETED, 0),
        "s2": (Status.COMPLETED, 0),
        "s3": (Status.PENDING, 1),
    }
    assert _pending_jobs(run_id) == ["s3"]
    run = run_to_completion(kernel, run_id)
    assert (run.status, run.output) == (Status.COMPLETED, {"value": 10})
    assert counting.calls == {"s1": 1, "s2": 1, "s3": 2, "s4": 2}
    assert counting.contexts["s3"][-1] == {"s1": 1, "s2": 3}


def test_rerun_clears_the_previous_outcome_of_the_run(
    kernel_for: KernelFor, clock: FakeClock
) -> None:
    """K-RR-4, A.5 EX :225: after the rerun the run is RUNNING with output, duration and
    completed_at cleared, totals 0; ``started_at`` keeps the run's first start (issue 10: a rerun
    is recorded by its marker, not by overwriting when the run started)."""
    kernel = kernel_for(two_stage())
    run_id = _finished_run(kernel, "two-stage")
    WorkflowRun.objects.filter(pk=run_id).update(total_cost=1.5, total_tokens=99)
    first_start = WorkflowRun.objects.get(pk=run_id).started_at
    clock.advance(60)

    kernel.dispatch(RerunFrom(run_id, "add-10", actor="user:alice", reason="bad <b>input</b>"))

    run = WorkflowRun.objects.get(pk=run_id)
    assert (run.status, run.output, run.duration_ms, run.completed_at) == (
        Status.RUNNING,
        None,
        None,
        None,
    )
    assert (run.total_cost, run.total_tokens, run.started_at) == (0, 0, first_start)
    assert first_start is not None and first_start < clock.now()
    started = OutboxEvent.objects.filter(
        workflow_run_id=run_id, event_type="workflow:started"
    ).order_by("-sequence")[0]
    assert started.payload["rerun"] == {
        "from_stage_id": "add-10",
        "generation": 1,
        "actor": "user:alice",
        "reason": "bad <b>input</b>",
    }


def test_rerun_from_stage_one_reads_the_run_input_again(kernel_for: KernelFor) -> None:
    """K-RR-7, A.5 EX :269: rerunning from stage 1 executes it again with the run's input."""
    counting = Counting()
    kernel = kernel_for(_four(counting))
    run_id = _finished_run(kernel, value=100)
    kernel.dispatch(RerunFrom(run_id, "s1"))
    run = run_to_completion(kernel, run_id)
    assert counting.calls["s1"] == 2
    assert run.output == {"value": 110}


def test_rerun_of_a_failed_run_skips_its_completed_stages(kernel_for: KernelFor) -> None:
    """K-RR-7, SM-7, A.5 T/07 :239-:535: a run FAILED at s2 is rerun from s2: s1 is not executed
    again, s2 receives s1's output and the run completes."""
    counting = Counting(broken="s2")
    kernel = kernel_for(_four(counting))
    run_id = _finished_run(kernel)
    assert WorkflowRun.objects.get(pk=run_id).status == Status.FAILED
    counting.broken = None  # the bug is fixed

    kernel.dispatch(RerunFrom(run_id, "s2"))

    run = run_to_completion(kernel, run_id)
    assert (run.status, run.output) == (Status.COMPLETED, {"value": 10})
    assert counting.calls == {"s1": 1, "s2": 2, "s3": 1, "s4": 1}


def test_rerun_removes_what_the_deleted_stages_stored(kernel_for: KernelFor) -> None:
    """Part I item 8, DM-54, K-RR-6, EC-33: the rerun deletes the output blobs and the
    ``ctx.storage`` values written by the deleted stages; what earlier stages stored and what
    another run stored under the same key survive."""
    counting = Counting()
    kernel = kernel_for(_four(counting))
    run_id = _finished_run(kernel)
    other = _finished_run(kernel)

    def stored(rid: uuid.UUID) -> set[tuple[str, str]]:
        rows = WorkflowBlob.objects.filter(run_id=rid).values_list("stage_id", "key")
        return {(sid, key.rsplit("/", 1)[-1]) for sid, key in rows}

    before_other = stored(other)
    kernel.dispatch(RerunFrom(run_id, "s3"))

    assert stored(run_id) == {
        ("s1", "output.json"),
        ("s1", "by-s1"),
        ("s2", "output.json"),
        ("s2", "by-s2"),
    }
    assert stored(other) == before_other


def test_rerun_keeps_annotations_of_deleted_stages_unlinked(kernel_for: KernelFor) -> None:
    """K-RR-3, AN-13, DM-13: annotations written by a deleted stage survive the rerun with
    their stage link cleared; the re-execution adds rows with the new generation."""
    counting = Counting()
    kernel = kernel_for(_four(counting))
    run_id = _finished_run(kernel)
    kernel.dispatch(RerunFrom(run_id, "s4"))
    old = WorkflowAnnotation.objects.get(run_id=run_id, key="test.s4")
    assert (old.stage_record_id, old.generation, old.value) == (None, 0, 1)

    run_to_completion(kernel, run_id)

    rows = WorkflowAnnotation.objects.filter(run_id=run_id, key="test.s4").order_by("id")
    assert [(a.generation, a.value) for a in rows] == [(0, 1), (1, 2)]


@pytest.mark.parametrize("state", ["pending", "running", "cancelled"])
def test_rerun_refuses_runs_that_are_not_completed_or_failed(
    kernel_for: KernelFor, state: str
) -> None:
    """K-RR-1, SM-7: PENDING, RUNNING and CANCELLED runs cannot be rerun; the message names the
    status and "Must be COMPLETED or FAILED"; nothing changes."""
    kernel = kernel_for(two_stage())
    run_id = kernel.dispatch(CreateRun(workflow_id="two-stage", input={"value": 1}))
    run_id = uuid.UUID(run_id.workflow_run_id)
    if state != "pending":
        kernel.dispatch(ClaimPendingRuns(worker_id="w"))
    if state == "cancelled":
        kernel.dispatch(CancelRun(run_id))
    status = WorkflowRun.objects.get(pk=run_id).status
    events = OutboxEvent.objects.count()

    with pytest.raises(RunStateError, match=rf"in {status} state\. Must be COMPLETED or FAILED"):
        kernel.dispatch(RerunFrom(run_id, "add-1"))

    assert WorkflowRun.objects.get(pk=run_id).status == status
    assert OutboxEvent.objects.count() == events


def test_rerun_refuses_unknown_run_workflow_or_stage(kernel_for: KernelFor) -> None:
    """K-RR-1, A.5 EX :336: an unknown run, an unregistered workflow or a stage id that is not
    in the workflow raise; nothing changes."""
    kernel = kernel_for(two_stage())
    run_id = _finished_run(kernel, "two-stage")
    with pytest.raises(RunNotFoundError):
        kernel.dispatch(RerunFrom(uuid.uuid4(), "add-1"))
    with pytest.raises(StageNotFoundError, match="Stage 'nope' not found in workflow"):
        kernel.dispatch(RerunFrom(run_id, "nope"))
    kernel.registry.unregister("two-stage")
    with pytest.raises(WorkflowNotFoundError, match="not found in registry"):
        kernel.dispatch(RerunFrom(run_id, "add-1"))
    assert WorkflowRun.objects.get(pk=run_id).status == Status.COMPLETED
    assert len(_statuses(run_id)) == 2


def test_rerun_needs_every_earlier_group_completed(kernel_for: KernelFor) -> None:
    """Part I item 10, K-RR-2, EC-39, A.5 EX :370: a rerun past a group that never executed, or
    whose stage FAILED, is refused naming that stage; nothing changes."""
    counting = Counting(broken="s2")
    kernel = kernel_for(_four(counting))
    run_id = _finished_run(kernel)  # FAILED at s2: s3, s4 never executed
    before = _statuses(run_id)

    for target in ("s3", "s4"):
        with pytest.raises(
            RunStateError,
            match=rf"Cannot rerun from '{target}': previous stages have not been executed "
            r"successfully \(stage 's2' in group 2 is FAILED\)",
        ):
            kernel.dispatch(RerunFrom(run_id, target))
    assert _statuses(run_id) == before
    assert WorkflowRun.objects.get(pk=run_id).status == Status.FAILED


def test_rerun_past_a_group_that_never_ran_is_refused(kernel_for: KernelFor) -> None:
    """Part I item 10, K-RR-2, A.5 EX :370: a run that failed at claim time (workflow missing,
    K-CP-2) has no records: a rerun from stage 2 is refused ("never executed"); a rerun from
    stage 1 is allowed and completes the run."""
    wf = two_stage()
    kernel = kernel_for(wf)
    created = kernel.dispatch(CreateRun(workflow_id="two-stage", input={"value": 1}))
    kernel.registry.unregister("two-stage")
    kernel.dispatch(ClaimPendingRuns(worker_id="w"))
    run_id = uuid.UUID(created.workflow_run_id)
    assert WorkflowRun.objects.get(pk=run_id).status == Status.FAILED
    kernel.registry.register(wf)

    with pytest.raises(
        RunStateError,
        match=r"previous stages have not been executed successfully \(stage 'add-1' in group 1 "
        r"is never executed\)",
    ):
        kernel.dispatch(RerunFrom(run_id, "add-10"))

    assert kernel.dispatch(RerunFrom(run_id, "add-1")).deleted_stages == []
    assert run_to_completion(kernel, run_id).output == {"value": 12}


def test_rerun_with_an_idempotency_key_replays_without_rerunning(kernel_for: KernelFor) -> None:
    """K-10, K-11, K-RR, issue 3 item 1: a second rerun with the same key returns the first
    result and changes nothing (no new generation, job or event), even after the run finished
    again; a key in progress is refused."""
    kernel = kernel_for(two_stage())
    run_id = _finished_run(kernel, "two-stage")
    first = kernel.dispatch(RerunFrom(run_id, "add-10", idempotency_key="rr-1"))
    run_to_completion(kernel, run_id)
    snapshot = (_statuses(run_id), WorkflowJob.objects.count(), OutboxEvent.objects.count())

    again = kernel.dispatch(RerunFrom(run_id, "add-10", idempotency_key="rr-1"))

    assert again == first
    assert (_statuses(run_id), WorkflowJob.objects.count(), OutboxEvent.objects.count()) == (
        snapshot
    )
    assert IdempotencyKey.objects.get(key="rr-1").command_type == "run.rerunFrom"
    idempotency.acquire("rr-2", "run.rerunFrom", now=kernel.clock.now(), stale_after_seconds=None)
    with pytest.raises(IdempotencyInProgressError, match=r"run\.rerunFrom"):
        kernel.dispatch(RerunFrom(run_id, "add-10", idempotency_key="rr-2"))


def test_rerun_enqueues_in_its_transaction_and_wakes_workers_after_commit(
    kernel_for: KernelFor, transport: RecordingTransport
) -> None:
    """K-7, EC-2 (Part I: jobs are rows of our database): the rerun's job commits with the
    rerun, and workers are woken once it committed; a refused rerun wakes nobody."""
    kernel = kernel_for(two_stage())
    run_id = _finished_run(kernel, "two-stage")
    before = transport.worker_wakeups
    with pytest.raises(StageNotFoundError):
        kernel.dispatch(RerunFrom(run_id, "nope"))
    assert transport.worker_wakeups == before

    kernel.dispatch(RerunFrom(run_id, "add-10"))

    assert transport.worker_wakeups == before + 1


# --------------------------------------------------------------------------------------------
# manage.py workflows_rerun and rerun_from()
# --------------------------------------------------------------------------------------------


@pytest.fixture
def global_two_stage() -> Iterator[str]:
    """``two-stage`` registered in the default registry (what management commands use)."""
    registry.register(two_stage("rerun-cli"))
    try:
        yield "rerun-cli"
    finally:
        registry.unregister("rerun-cli")


def _call(*args: str) -> str:
    out = io.StringIO()
    call_command("workflows_rerun", *args, stdout=out, stderr=io.StringIO())
    return out.getvalue()


def test_rerun_command_reruns_and_replays_with_a_key(global_two_stage: str) -> None:
    """K-RR-3..6, K-10, issue 3 item 1: ``workflows_rerun <run> <stage>`` prints the deleted
    stages and the new generation; with ``--idempotency-key`` a repeat changes nothing."""
    kernel = get_kernel()
    run_id = _finished_run(kernel, global_two_stage)

    out = _call(str(run_id), "add-10", "--idempotency-key", "cli-1")

    assert f"rerun of {run_id} from add-10" in out
    assert "deleted stages: add-10" in out
    assert "generation: 1" in out
    assert WorkflowRun.objects.get(pk=run_id).status == Status.RUNNING
    jobs = WorkflowJob.objects.count()
    _call(str(run_id), "add-10", "--idempotency-key", "cli-1")
    assert WorkflowJob.objects.count() == jobs
    assert run_to_completion(kernel, run_id).output == {"value": 11}
    assert rerun_from(run_id, "add-1") == ["add-1", "add-10"]


def test_rerun_command_errors_are_precise(global_two_stage: str) -> None:
    """K-RR-1, Part I item 10: malformed or unknown run ids, unknown stages, runs in the wrong
    state and an empty key raise ``CommandError`` with the kernel's message."""
    kernel = get_kernel()
    with pytest.raises(CommandError, match="is not a valid run id"):
        _call("not-a-uuid", "add-1")
    missing = uuid.uuid4()
    with pytest.raises(CommandError, match=f"Workflow run {missing} not found"):
        _call(str(missing), "add-1")
    pending = kernel.dispatch(CreateRun(workflow_id=global_two_stage, input={"value": 1}))
    with pytest.raises(CommandError, match=r"in PENDING state\. Must be COMPLETED or FAILED"):
        _call(pending.workflow_run_id, "add-1")
    run_id = _finished_run(kernel, global_two_stage)
    with pytest.raises(CommandError, match="Stage 'nope' not found in workflow 'rerun-cli'"):
        _call(str(run_id), "nope")
    with pytest.raises(CommandError, match="--idempotency-key: must not be empty"):
        _call(str(run_id), "add-1", "--idempotency-key", " ")
    assert WorkflowRun.objects.get(pk=run_id).status == Status.COMPLETED


def test_rerun_idempotency_key_reused_for_another_run_is_refused(kernel_for) -> None:
    """K-10: a key that answered a rerun of run A does not silently 'replay' for run B."""
    from django_workflows.kernel import CreateRun, IdempotencyKeyReusedError, RerunFrom
    from django_workflows.models import WorkflowRun
    from django_workflows.testing import run_to_completion
    from tests.workflows import two_stage

    kernel = kernel_for(two_stage())
    first = kernel.dispatch(CreateRun("two-stage", {"value": 1})).workflow_run_id
    second = kernel.dispatch(CreateRun("two-stage", {"value": 2})).workflow_run_id
    run_to_completion(kernel, first)
    run_to_completion(kernel, second)

    done = kernel.dispatch(RerunFrom(first, "add-10", idempotency_key="fix-1"))
    again = kernel.dispatch(RerunFrom(first, "add-10", idempotency_key="fix-1"))
    assert again.replayed and again.deleted_stages == done.deleted_stages
    with pytest.raises(IdempotencyKeyReusedError, match=rf"run {first} from stage 'add-10'"):
        kernel.dispatch(RerunFrom(second, "add-10", idempotency_key="fix-1"))
    assert WorkflowRun.objects.get(pk=second).status == "COMPLETED"
