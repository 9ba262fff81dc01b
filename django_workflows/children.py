"""Child workflows: a stage that starts a run of another workflow and takes its output (issue
18 item 5; see docs/child-workflows.md)::

    from django_workflows.children import child_workflow

    ship = child_workflow(
        id="ship",
        workflow=shipping,  # a built Workflow, or its id
        input=lambda ctx: {"order_id": ctx.require("validate").order_id},
    )
    orders = define_workflow(id="orders").pipe(validate).pipe(ship).build()

The stage is an async-batch stage (suspend/poll): its delivery computes the child's input and
suspends; the outcome transaction creates the child run (``parent_run_id`` /
``parent_stage_id`` / ``parent_generation`` set, idempotency key
``child:<parent run>:<stage>:<generation>``), so a redelivery never makes two children and a
rerun (a new generation) makes a new one. No worker is held while the child runs. The child's
end wakes the parent stage at once; its completion check then reads the child:

* COMPLETED: the stage completes with the child run's output (validated with the stage's
  output model: ``output=``, else the child's last stage's output model when it has one);
* FAILED: the stage (and the parent run) fails, ``error_type`` ``"ChildRunFailed"``, with a
  message naming the child run, its workflow, its failed stage and error;
* CANCELLED: fails likewise with ``"ChildRunCancelled"`` and the cancel reason.

Cancelling the parent cancels its non-terminal children (recursively, in the same
transaction); rerunning the stage cancels the old generation's child if it is still active.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from pydantic import BaseModel

from .definition.context import CompletionContext, StageContext
from .definition.results import CompletionCheck, StageFailed, Suspend
from .definition.stage import (
    DEFAULT_QUEUE,
    AnyInput,
    ChildSpec,
    Stage,
    WorkflowDefinitionError,
    check_model_argument,
    define_async_batch_stage,
    seconds_error,
    validate_id,
)
from .definition.workflow import Workflow
from .kernel.children import CHILD_KIND
from .models import Status, WorkflowRun

#: ``error_type`` of a parent stage whose child run FAILED.
CHILD_FAILED = "ChildRunFailed"
#: ``error_type`` of a parent stage whose child run was CANCELLED.
CHILD_CANCELLED = "ChildRunCancelled"

__all__ = ["CHILD_CANCELLED", "CHILD_FAILED", "CHILD_KIND", "child_runs", "child_workflow"]


def child_workflow(
    *,
    id: str,
    workflow: Workflow | str,
    input: Callable[[StageContext[Any, Any]], Any],
    config: Mapping[str, Any] | None = None,
    name: str | None = None,
    description: str = "",
    dependencies: tuple[str, ...] | list[str] = (),
    stage_input: type[BaseModel] | None = None,
    output: type[BaseModel] | None = None,
    poll_interval_seconds: float = 30.0,
    queue: str = DEFAULT_QUEUE,
) -> Stage:
    """A stage that starts a child run of ``workflow`` and completes with its output.

    Args:
        id: the stage id.
        workflow: the child workflow: a built :class:`~.definition.workflow.Workflow` (checked
            for cycles at build time; the test kit registers it), or a workflow id resolved in
            the kernel's registry when the stage runs (an unknown id fails the stage naming it).
        input: ``input(ctx) -> dict`` (or a pydantic model): the child run's input, from the
            stage's context (``ctx.input``, ``ctx.require(...)``). Validated against the child
            workflow's input model; an invalid one fails the stage, not retried.
        config: the child run's config map ``{stage_id: {...}}`` (``None``: its defaults).
        name / description / dependencies / queue: as for any stage.
        stage_input: this stage's own input model (default: :class:`AnyInput`, any value,
            as ``ctx.input.root``).
        output: the stage's output model (default: the child's last stage's output model
            when that group is a single stage with one; else any JSON).
        poll_interval_seconds: how often the parent looks at the child when no wake-up came
            (> 0; the child's end wakes it at once, so this only bounds a missed wake-up).

    Raises:
        WorkflowDefinitionError: ``workflow`` is neither a Workflow nor a valid id, ``input`` is
            not callable, ``config`` is not a mapping, or ``poll_interval_seconds`` is not a
            positive number (each naming the stage and the argument).
    """
    validate_id("stage", id)
    check_model_argument(f"child_workflow {id!r}", "stage_input", stage_input)
    check_model_argument(f"child_workflow {id!r}", "output", output)
    if isinstance(workflow, Workflow):
        child: Workflow | None = workflow
        workflow_id = workflow.id
    elif isinstance(workflow, str):
        child, workflow_id = None, validate_id("workflow", workflow)
    else:
        raise WorkflowDefinitionError(
            f"child_workflow {id!r}: workflow must be a built Workflow or a workflow id, "
            f"got {workflow!r}"
        )
    if not callable(input):
        raise WorkflowDefinitionError(
            f"child_workflow {id!r}: input must be a function input(ctx) -> dict giving the "
            f"child run's input, got {input!r}"
        )
    if config is not None and not isinstance(config, Mapping):
        raise WorkflowDefinitionError(
            f"child_workflow {id!r}: config must be a mapping {{stage_id: {{...}}}} or None, "
            f"got {type(config).__name__}"
        )
    problem = seconds_error(poll_interval_seconds) if poll_interval_seconds is not None else None
    if poll_interval_seconds is None or problem:
        raise WorkflowDefinitionError(
            f"child_workflow {id!r}: poll_interval_seconds {problem or 'may not be None'}"
        )
    if child is not None and config:
        unknown = sorted(set(config) - set(child.stage_ids))
        if unknown:
            raise WorkflowDefinitionError(
                f"child_workflow {id!r}: config names stages {', '.join(unknown)} that "
                f"workflow {workflow_id!r} does not have (its stages: "
                f"{', '.join(child.stage_ids)})"
            )
    spec = ChildSpec(
        workflow_id=workflow_id,
        workflow=child,
        input=input,
        config=dict(config) if config is not None else None,
        poll_interval_seconds=float(poll_interval_seconds),
    )

    def execute(ctx: StageContext[Any, Any]) -> Suspend:
        payload = spec.input(ctx)
        if isinstance(payload, BaseModel):
            payload = payload.model_dump(mode="json", by_alias=True)
        if not isinstance(payload, dict):
            raise StageFailed(
                f"child_workflow {ctx.stage_id!r}: input(ctx) must return a dict (the child "
                f"run's input), got {type(payload).__name__}",
                error_type="ChildInputInvalid",
            )
        if spec.workflow is not None:
            error = spec.workflow.input_errors(payload)
            if error:
                raise StageFailed(
                    f"child_workflow {ctx.stage_id!r}: invalid input for workflow "
                    f"{spec.workflow_id!r}: {error}",
                    error_type="ChildInputInvalid",
                )
        ctx.log("INFO", f"starting a child run of workflow {spec.workflow_id!r}")
        return Suspend(
            state={
                "batch_id": f"child:{ctx.workflow_run_id}:{ctx.stage_id}:{ctx.generation}",
                "kind": CHILD_KIND,
                "workflow_id": spec.workflow_id,
                # Replaced by "child_run_id" when the outcome transaction creates the child.
                "input": payload,
            },
            poll_interval_seconds=spec.poll_interval_seconds,
            max_wait_seconds=0,
        )

    def check(state: dict[str, Any], ctx: CompletionContext) -> CompletionCheck:
        return read_child(state)

    made = define_async_batch_stage(
        id=id,
        name=name or id,
        description=description or f"Runs workflow {workflow_id!r} as a child run",
        input=stage_input if stage_input is not None else AnyInput,
        output=output if output is not None else _last_output_model(child),
        execute=execute,
        check_completion=check,
        dependencies=dependencies,
        queue=queue,
    )
    made.child = spec
    return made


def _last_output_model(workflow: Workflow | None) -> type[BaseModel] | None:
    if workflow is None:
        return None
    last = workflow.stages_in_group(workflow.group_count)
    return last[0].stage.output_model if len(last) == 1 else None


def read_child(state: dict[str, Any]) -> CompletionCheck:
    """The completion check of a child-workflow stage: its child run's state as a
    :class:`CompletionCheck` (see the module docstring).

    Raises:
        StageFailed: the child run FAILED, was CANCELLED, or is missing.
    """
    child_id = state.get("child_run_id")
    row = (
        WorkflowRun.objects.filter(pk=child_id)
        .values("status", "output", "error", "workflow_id")
        .first()
        if child_id
        else None
    )
    if row is None:
        raise StageFailed(
            f"child run {child_id or '(none recorded)'} of workflow "
            f"{state.get('workflow_id')!r} not found",
            error_type="ChildRunMissing",
        )
    status = row["status"]
    name = f"child run {child_id} (workflow {row['workflow_id']!r})"
    if status == Status.COMPLETED:
        return CompletionCheck.done(row["output"])
    if status == Status.FAILED:
        error = row["error"] or {}
        where = f" at stage {error['stage_id']!r}" if error.get("stage_id") else ""
        raise StageFailed(
            f"{name} failed{where}: {error.get('message') or 'no error recorded'}",
            error_type=CHILD_FAILED,
        )
    if status == Status.CANCELLED:
        reason = ((row["output"] or {}).get("error") or {}).get("message") or "no reason given"
        raise StageFailed(f"{name} was cancelled: {reason}", error_type=CHILD_CANCELLED)
    return CompletionCheck.not_ready()


def child_runs(run_id: Any) -> list[dict[str, Any]]:
    """The child runs of ``run_id``, oldest first: ``[{"id", "workflow_id", "status",
    "parent_stage_id", "parent_generation", "created_at", "completed_at"}]`` (one query)."""
    return [
        {**row, "id": str(row["id"])}
        for row in WorkflowRun.objects.filter(parent_run_id=run_id)
        .order_by("created_at", "parent_generation", "id")
        .values(
            "id",
            "workflow_id",
            "status",
            "parent_stage_id",
            "parent_generation",
            "created_at",
            "completed_at",
        )
    ]
