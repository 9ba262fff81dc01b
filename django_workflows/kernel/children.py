"""Child runs: the kernel's side of a child-workflow stage (issue 18 item 5; the stage itself
is :func:`django_workflows.children.child_workflow`).

* **Start** (:func:`start_child`): inside the parent stage's outcome transaction - after the
  RUNNING guard locked the parent run, before the fenced job update - the child run is created
  through ``run.create`` with the idempotency key :func:`child_key` (parent run, stage,
  generation) and the parent's ids. A delivery that loses its job rolls the child back with
  it; a key already recorded replays the same child, so one parent stage generation has at
  most one child. A child that cannot be created (unknown workflow, invalid input or config,
  nesting deeper than :data:`MAX_DEPTH`) fails the parent stage, not retried.
* **Wake** (:func:`wake_parent`): a child run's end (COMPLETED or FAILED in
  :mod:`.stage_path.transition` - exhausted deliveries end there too -, CANCELLED in
  ``run.cancel``, FAILED by a completion check, by the stuck-run reaper or at claim) sets its
  parent stage's ``next_poll_at`` to now and wakes the ticker after commit, so the parent's
  ``check_completion`` reads the child at the next tick. Runs without a parent pay nothing:
  the check reads the locked row's ``parent_run_id``. The parent's regular poll
  (``poll_interval_seconds``) is the fallback for a wake-up lost with its process.
* **Cancel** (:func:`.handlers.run_cancel.cancel_children`): ``run.cancel`` of a parent
  cancels its non-terminal children first (their rows locked before the parent's stage rows
  are written, the order a child's wake takes too, so the two never deadlock), recursively, in
  the same transaction.
"""

from __future__ import annotations

from datetime import datetime
from typing import TYPE_CHECKING, Any

from django.db import transaction
from django.db.models import F

from ..models import Status, WorkflowRun, WorkflowStage
from .commands import CancelRun, CreateRun
from .errors import WorkflowError

if TYPE_CHECKING:
    from ..definition.stage import Stage
    from .dispatch import Kernel
    from .executor import ExecutionOutcome

#: ``suspended_state["kind"]`` of a parent stage waiting for its child run.
CHILD_KIND = "django_workflows.child"
#: The deepest a chain of child runs may nest (a parent's parent's ... parent): a cycle
#: through workflow ids resolved at run time stops here with a clear error.
MAX_DEPTH = 8
#: ``error_type`` of a parent stage whose child run could not be created.
CHILD_START_FAILED = "ChildRunNotStarted"


def child_key(run_id: Any, stage_id: str, generation: int) -> str:
    """The idempotency key of the child run started by ``stage_id`` of run ``run_id`` at rerun
    ``generation``: ``"child:<run>:<stage>:<generation>"`` (a rerun is a new generation, so a
    new child)."""
    return f"child:{run_id}:{stage_id}:{generation}"


def start_child(
    kernel: Kernel,
    run: WorkflowRun,
    record: WorkflowStage,
    stage: Stage,
    outcome: ExecutionOutcome,
) -> None:
    """Create (or replay) the child run of a child-workflow stage's suspend ``outcome``, for a
    caller in the outcome transaction that holds the parent run's row lock (see the module
    docstring). Records ``child_run_id`` in the suspend state; on a refusal turns ``outcome``
    into a final failure naming the child workflow and the reason.
    """
    spec = stage.child
    assert spec is not None and outcome.suspend is not None
    state = outcome.suspend.state
    problem: str | None = None
    depth = _depth(run)
    if depth >= MAX_DEPTH:
        problem = f"child runs may nest at most {MAX_DEPTH} deep (this run is at depth {depth})"
    else:
        try:
            # A savepoint of its own: a refusal rolls back only the child's rows.
            created = kernel.dispatch(
                CreateRun(
                    workflow_id=spec.workflow_id,
                    input=state.get("input", {}),
                    config=spec.config,
                    priority=run.priority,
                    idempotency_key=child_key(run.pk, record.stage_id, record.generation),
                    parent_run_id=str(run.pk),
                    parent_stage_id=record.stage_id,
                    parent_generation=record.generation,
                )
            )
        except WorkflowError as exc:
            problem = str(exc)
        else:
            # "input" stays: a retried outcome transaction (a lost connection) creates the
            # child again from it, and its key returns the same child once one committed.
            state["child_run_id"] = created.workflow_run_id
            return
    outcome.suspend = None
    outcome.error = (
        f"Stage {record.stage_id!r} could not start its child run of workflow "
        f"{spec.workflow_id!r}: {problem}"
    )
    outcome.error_type = CHILD_START_FAILED
    outcome.retryable = False


def _depth(run: WorkflowRun) -> int:
    """How many ancestors ``run`` has (at most :data:`MAX_DEPTH` reads, child stages only)."""
    depth, parent = 0, run.parent_run_id
    while parent is not None and depth < MAX_DEPTH:
        depth += 1
        parent = (
            WorkflowRun.objects.filter(pk=parent).values_list("parent_run_id", flat=True).first()
        )
    return depth


def wake_parent(kernel: Kernel, run: WorkflowRun, now: datetime) -> None:
    """A child ``run`` ended: make its parent's waiting stage due now and wake the ticker
    after commit. Call only for a run with a ``parent_run_id`` (one UPDATE). The stage's
    ``version`` is bumped, so a poll that read the child just before it ended cannot push the
    next check back (its reschedule is stale)."""
    woken = WorkflowStage.objects.filter(
        run_id=run.parent_run_id,
        stage_id=run.parent_stage_id,
        generation=run.parent_generation,
        status=Status.SUSPENDED,
    ).update(next_poll_at=now, updated_at=now, version=F("version") + 1)
    if woken:
        transaction.on_commit(kernel.transport.wake_ticker)


def cancel_child_of(kernel: Kernel, record: WorkflowStage, reason: str) -> None:
    """The child run of a waiting child-workflow stage ``record`` (if it has one), cancelled in
    its own transaction: for a parent stage cancelled by the poll because its run left RUNNING
    by another way than ``run.cancel``."""
    state = record.suspended_state or {}
    child_id = state.get("child_run_id") if state.get("kind") == CHILD_KIND else None
    if child_id:
        kernel.dispatch(CancelRun(child_id, reason=reason))
