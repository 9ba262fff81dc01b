"""``run.rerunFrom`` (SPEC §4.5, K-RR-1..7; Part I items 8 and 10).

Refuses (nothing changed) unless the run is COMPLETED or FAILED, the workflow is registered, the
stage exists, and every earlier execution group is COMPLETED (Part I item 10, naming the stage
that is not). Then, in one transaction: delete the records of the target group and later groups
(their annotations survive with the stage link nulled, AN-13), take back the run's jobs still
out (PENDING, SUSPENDED or RUNNING with a live lease -> CANCELLED, issue 17), delete what those
stages stored in the blob store, reset the run to RUNNING (``started_at`` keeps the first
start), create PENDING records of the target group with ``generation = previous max + 1`` (the rerun
generation), enqueue their jobs, and append
``workflow:started`` with the rerun marker (``rerun``: from which stage, generation, actor,
reason).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ...models import Status, WorkflowStage
from .. import events as ev
from ..commands import RerunFrom, RerunFromResult
from ..errors import RunNotFoundError, RunStateError, StageNotFoundError, WorkflowNotFoundError
from ..jsonvalue import storable_text
from ..locking import lock_run, parse_run_id
from ..stage_path.conditions import open_groups
from ..stage_path.transition import advance_new_group
from ..store import create_missing_stages, stages_of, update_run
from ..versions import ensure_stored
from .base import HandlerOutput, enqueue_stage_jobs
from .run_cancel import cancel_children

if TYPE_CHECKING:
    from ...definition.workflow import Workflow
    from ..dispatch import Kernel


def handle(kernel: Kernel, cmd: RerunFrom) -> HandlerOutput:
    run_id = parse_run_id(cmd.workflow_run_id)
    run = lock_run(run_id)
    if run is None:
        raise RunNotFoundError(run_id)
    if run.status not in (Status.COMPLETED, Status.FAILED):
        raise RunStateError(
            f"Cannot rerun workflow run {run_id} in {run.status} state. Must be COMPLETED or FAILED"
        )
    workflow = kernel.registry.get(run.workflow_id)
    if workflow is None:
        raise WorkflowNotFoundError(run.workflow_id)
    if not workflow.has_stage(cmd.from_stage_id):
        raise StageNotFoundError(workflow.id, cmd.from_stage_id, workflow.stage_ids)
    target = workflow.node(cmd.from_stage_id).execution_group
    if workflow.has_conditions:
        target = rerun_group(workflow, cmd.from_stage_id)
    records = stages_of(run_id)
    by_id = {r.stage_id: r for r in records}
    for group in range(1, target):
        for node in workflow.stages_in_group(group):
            rec = by_id.get(node.stage.id)
            if rec is None or rec.status not in (Status.COMPLETED, Status.SKIPPED):
                state = rec.status if rec else "never executed"
                raise RunStateError(
                    f"Cannot rerun from {cmd.from_stage_id!r}: previous stages have not been "
                    f"executed successfully (stage {node.stage.id!r} in group {group} is {state})"
                )
    deleted = [r for r in records if r.execution_group >= target]
    generation = max((r.generation for r in deleted), default=0) + 1
    now = kernel.clock.now()
    deleted_ids = [r.stage_id for r in deleted]
    # Take back every job of the old generation still out, a live lease or not (issue 17):
    # the fence (job id, status RUNNING, attempt) then refuses its late outcome.
    kernel.queue.cancel_by_run(run_id, running=True)
    # A rerun child-workflow stage starts a new child (a new generation, a new key); an old
    # generation's child still active is cancelled, so only the new one's output can count.
    child_stages = [
        n.stage.id for n in workflow.nodes if n.stage.child and n.stage.id in deleted_ids
    ]
    child_events = (
        cancel_children(
            kernel, run_id, f"parent run {run_id} reran stage(s)", stage_ids=child_stages
        )
        if child_stages
        else []
    )
    kernel.blobs.delete_stage_blobs(str(run_id), deleted_ids)
    WorkflowStage.objects.filter(pk__in=[r.pk for r in deleted]).delete()
    # started_at keeps the run's first start (an operator asked "when did this run start",
    # not "when was it last rerun": the rerun time is in the marker below).
    update_run(
        run_id,
        now,
        status=Status.RUNNING,
        completed_at=None,
        duration_ms=None,
        output=None,
        error=None,
        total_cost=0,
        total_tokens=0,
        # The rerun's stages come from this process's definition: the run now follows its
        # version (issue 12 item 3), so workers of that version run the new jobs.
        definition_version=workflow.version,
    )
    run.status = Status.RUNNING
    run.definition_version = workflow.version
    ensure_stored(workflow, now)
    started = ev.event(ev.WORKFLOW_STARTED, run_id, now, rerun=_marker(cmd, generation))
    if workflow.has_conditions:  # issue 18: the conditions are decided again
        kept = [r for r in records if r.execution_group < target]
        opened = open_groups(
            kernel,
            workflow,
            run,
            kept,
            target,
            generation=generation,
            now=now,
            map_opener=advance_new_group,
        )
        return HandlerOutput(
            RerunFromResult(str(run_id), cmd.from_stage_id, deleted_ids),
            [*child_events, started, *opened.events],
        )
    new = create_missing_stages(
        run, workflow.stages_in_group(target), generation=generation, now=now
    )
    started = [ev.event(ev.WORKFLOW_STARTED, run_id, now, rerun=_marker(cmd, generation))]
    if workflow.has_maps:  # issue 18 item 3: a map stage's items are created anew
        others = [r for r in records if r.execution_group < target]
        step = advance_new_group(kernel, workflow, run, others, new, now, target, [], None, None)
        return HandlerOutput(
            RerunFromResult(str(run_id), cmd.from_stage_id, deleted_ids),
            [*child_events, *started, *step.events],
        )
    enqueue_stage_jobs(kernel.queue, run, new, workflow=workflow)
    return HandlerOutput(
        RerunFromResult(str(run_id), cmd.from_stage_id, deleted_ids), [*child_events, *started]
    )


def rerun_group(workflow: Workflow, stage_id: str) -> int:
    """The first group a rerun from ``stage_id`` re-opens: its own, or - for a stage of a
    branch block - the block's first group, so the branch is chosen again (issue 18)."""
    node = workflow.node(stage_id)
    if node.branch is None:
        return node.execution_group
    block = node.branch.id
    return min(
        n.execution_group for n in workflow.nodes if n.branch is not None and n.branch.id == block
    )


#: Longest rerun reason kept in the marker (characters).
MAX_REASON_CHARS = 2000


def _marker(cmd: RerunFrom, generation: int) -> dict[str, object]:
    """The rerun marker of the ``workflow:started`` event: from which stage, the new
    generation, who and why (``None`` members left out)."""
    marker: dict[str, object] = {"from_stage_id": cmd.from_stage_id, "generation": generation}
    if cmd.actor:
        marker["actor"] = str(cmd.actor)[:200]
    if cmd.reason:
        marker["reason"] = storable_text(str(cmd.reason))[:MAX_REASON_CHARS]
    return marker
