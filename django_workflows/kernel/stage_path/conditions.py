"""Conditional stages and branches in the transition rules (issue 18 items 1 and 2).

Only workflows with a ``when=`` or a ``.branch()`` (``Workflow.has_conditions``) come here:
the plain stage path is unchanged. :func:`open_groups` is called where an execution group is
opened (:func:`.transition.advance`, the run's claim, rerun), in that caller's transaction
under the run lock, so every decision is made once and durably:

* a stage whose ``when`` is false, or whose branch was not chosen, gets a SKIPPED record with
  its ``skip_reason``, no job, and a ``stage:skipped`` event; a branch block's choice appends
  ``branch:chosen`` (the choice is then read back from the block's non-skipped records);
* a group whose stages are all skipped is passed: the next one is opened in the same
  transaction; past the last group the run completes (:func:`run_output`);
* a predicate that raises, or a ``choose`` returning an undeclared name, fails the run
  (``ConditionError`` / ``BranchNotFound``, on the stage concerned).

Inputs after a skipped stage (:func:`group_input`): a skipped stage of a parallel group is
``None`` in the group's output; a stage after a group that was skipped as a whole receives
the output of the closest earlier group that was not (the run input if none).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any

from ...definition.conditions import ConditionContext
from ...definition.workflow import StageNode, Workflow
from ...models import Status, WorkflowJob, WorkflowRun, WorkflowStage
from .. import events as ev
from .. import rows
from ..handlers.base import enqueue_stage_jobs, job_leased_to
from ..store import create_missing_stages, duration_ms, load_outputs, run_error, update_run

if TYPE_CHECKING:
    from ..dispatch import Kernel

#: Longest skip reason / condition error kept (characters).
MAX_REASON_CHARS = 2000


@dataclass
class Opened:
    """What :func:`open_groups` did: ``outcome`` ``"advanced"`` (``group`` opened, its
    ``new_records`` and ``jobs``), ``"completed"`` or ``"failed"``; the ``events`` to append.
    """

    outcome: str
    group: int = 0
    events: list[dict[str, Any]] = field(default_factory=list)
    new_records: list[WorkflowStage] = field(default_factory=list)
    jobs: list[WorkflowJob] = field(default_factory=list)
    reserved_job: WorkflowJob | None = None


class _Failed(Exception):
    def __init__(self, node: StageNode, message: str, error_type: str) -> None:
        super().__init__(message)
        self.node, self.message, self.error_type = node, message, error_type


def open_groups(
    kernel: Kernel,
    workflow: Workflow,
    run: WorkflowRun,
    records: Iterable[WorkflowStage],
    group: int,
    *,
    generation: int,
    now: datetime,
    outputs: dict[str, Any] | None = None,
    reserve_for: str | None = None,
    serves: frozenset[str] | None = None,
    map_opener: Any = None,
) -> Opened:
    """Open execution group ``group`` of a run whose row the caller locked (RUNNING), skipping
    its stages whose condition is false and passing on while a whole group is skipped.

    ``map_opener``: :func:`.transition.advance_new_group`, required when the workflow has map
    stages (passed in: this module is imported by :mod:`.transition`).

    ``records``: the run's current stage records (none of group ``group`` or later).
    ``outputs``: raw outputs ``{stage_id: output}`` the caller already holds.
    """
    records = list(records)
    by_id = {r.stage_id: r for r in records}
    cache: dict[str, Any] = dict(outputs or {})
    choices: dict[str, str] = {}
    events: list[dict[str, Any]] = []
    parsed: list[Any] = []

    def load(stage_id: str) -> Any:
        if stage_id not in cache:
            rec = by_id.get(stage_id)
            cache.update(load_outputs(kernel.blobs, [rec]) if rec is not None else {})
        data = cache.get(stage_id)
        producer = workflow.get_stage(stage_id)
        return producer.load_output(data) if producer is not None and data is not None else data

    def context(node: StageNode) -> ConditionContext:
        if not parsed:
            parsed.append(workflow.parse_input(run.input))
        earlier = frozenset(
            n.stage.id for n in workflow.nodes if n.execution_group < node.execution_group
        )
        skipped = frozenset(sid for sid, r in by_id.items() if r.status == Status.SKIPPED)
        return ConditionContext(
            input=parsed[0],
            config=run.config or {},
            stage_id=node.stage.id,
            earlier=earlier,
            skipped=skipped,
            load=load,
        )

    while True:
        nodes = workflow.stages_in_group(group)
        if not nodes:
            return _complete(kernel, workflow, run, records, cache, now, events)
        try:
            decided = [
                (n, _skip_reason(workflow, n, by_id, choices, context, events, now, run))
                for n in nodes
            ]
        except _Failed as failure:
            return _fail(run, records, failure, generation, now, events)
        skipped = [(n, reason) for n, reason in decided if reason is not None]
        if skipped:
            new = [_skipped_record(run, n, reason, generation, now) for n, reason in skipped]
            rows.insert(new)
            for rec in new:
                records.append(rec)
                by_id[rec.stage_id] = rec
                events.append(
                    ev.event(
                        ev.STAGE_SKIPPED,
                        run.pk,
                        now,
                        stage_id=rec.stage_id,
                        stage_name=rec.stage_name,
                        reason=rec.skip_reason,
                    )
                )
        runnable = [n for n, reason in decided if reason is None]
        if runnable:
            new = create_missing_stages(
                run, runnable, generation=generation, now=now, records=records
            )
            if workflow.has_maps:  # a map stage fans out (or settles at once): item 3
                if map_opener is None:
                    raise RuntimeError("open_groups: a workflow with map stages needs map_opener")
                step = map_opener(
                    kernel, workflow, run, records, new, now, group, events, reserve_for,
                    serves, cache,
                )  # fmt: skip
                return Opened(
                    step.result.action,
                    step.result.next_group or group,
                    step.events,
                    step.new_records,
                    [step.reserved_job] if step.reserved_job is not None else [],
                    step.reserved_job,
                )
            jobs = enqueue_stage_jobs(
                kernel.queue, run, new, workflow=workflow, reserve_for=reserve_for, serves=serves
            )
            return Opened("advanced", group, events, new, jobs, job_leased_to(jobs, reserve_for))
        group += 1


def _skip_reason(
    workflow: Workflow,
    node: StageNode,
    by_id: dict[str, WorkflowStage],
    choices: dict[str, str],
    context: Any,
    events: list[dict[str, Any]],
    now: datetime,
    run: WorkflowRun,
) -> str | None:
    """Why ``node`` is skipped, or ``None`` if it runs. Raises :class:`_Failed`."""
    spot = node.branch
    if spot is not None:
        chosen = choices.get(spot.id) or _recorded_choice(workflow, spot.id, by_id)
        if chosen is None:
            chosen = _choose(node, context(node))
            events.append(
                ev.event(
                    ev.BRANCH_CHOSEN,
                    run.pk,
                    now,
                    branch_id=spot.id,
                    branch=chosen,
                    branches=list(spot.branches),
                    stage_id=node.stage.id,
                )
            )
        choices[spot.id] = chosen
        if chosen != spot.name:
            return f"branch {chosen!r} of {spot.id!r} was chosen; this stage is on {spot.name!r}"
    if node.when is None:
        return None
    try:
        result = node.when.fn(context(node))
    except Exception as exc:
        raise _Failed(
            node,
            f"ConditionError: the when= condition {node.when.name!r} of stage "
            f"{node.stage.id!r} raised {type(exc).__name__}: {exc}"[:MAX_REASON_CHARS],
            "ConditionError",
        ) from None
    return None if result else node.when.skip_reason()[:MAX_REASON_CHARS]


def _choose(node: StageNode, ctx: ConditionContext) -> str:
    spot = node.branch
    assert spot is not None
    try:
        chosen = spot.choose(ctx)
    except Exception as exc:
        raise _Failed(
            node,
            f"ConditionError: the choose function of branch block {spot.id!r} raised "
            f"{type(exc).__name__}: {exc}"[:MAX_REASON_CHARS],
            "ConditionError",
        ) from None
    if not isinstance(chosen, str) or chosen not in spot.branches:
        raise _Failed(
            node,
            f"BranchNotFound: branch block {spot.id!r} chose {chosen!r}, which is not one of "
            f"its branches: {', '.join(spot.branches)}"[:MAX_REASON_CHARS],
            "BranchNotFound",
        )
    return chosen


def _recorded_choice(workflow: Workflow, block: str, by_id: dict[str, WorkflowStage]) -> str | None:
    """The branch chosen earlier in this run: the branch of a non-skipped record of the block
    (the transaction that made the choice opened a group of the chosen branch)."""
    for stage_id, rec in by_id.items():
        if rec.status == Status.SKIPPED or not workflow.has_stage(stage_id):
            continue
        spot = workflow.node(stage_id).branch
        if spot is not None and spot.id == block:
            return spot.name
    return None


def _skipped_record(
    run: WorkflowRun, node: StageNode, reason: str, generation: int, now: datetime
) -> WorkflowStage:
    return _settled_record(run, node, generation, now, status=Status.SKIPPED, skip_reason=reason)


def _settled_record(
    run: WorkflowRun, node: StageNode, generation: int, now: datetime, **fields: Any
) -> WorkflowStage:
    """A new (unsaved) stage record of ``node`` that never gets a job: SKIPPED, or FAILED
    because its condition could not be decided; ``fields``: its status and reason."""
    return rows.new(
        WorkflowStage,
        created_at=now,
        updated_at=now,
        run_id=run.pk,
        stage_id=node.stage.id,
        stage_name=node.stage.name,
        stage_number=node.stage_number,
        execution_group=node.execution_group,
        generation=generation,
        completed_at=now,
        config=(run.config or {}).get(node.stage.id) or {},
        **fields,
    )


def _fail(
    run: WorkflowRun,
    records: list[WorkflowStage],
    failure: _Failed,
    generation: int,
    now: datetime,
    events: list[dict[str, Any]],
) -> Opened:
    """The run fails on the stage whose condition (or branch choice) could not be decided:
    its record is FAILED with the error (no job), the run FAILED naming it."""
    node = failure.node
    rec = _settled_record(
        run,
        node,
        generation,
        now,
        status=Status.FAILED,
        error_message=failure.message,
        metrics={"error_type": failure.error_type},
    )
    rows.insert([rec])
    records.append(rec)
    update_run(
        run.pk,
        now,
        status=Status.FAILED,
        completed_at=now,
        duration_ms=duration_ms(run.started_at, now),
        error=run_error(node.stage.id, failure.message, failure.error_type, generation=generation),
    )
    events.append(
        ev.event(
            ev.STAGE_FAILED,
            run.pk,
            now,
            stage_id=node.stage.id,
            stage_name=node.stage.name,
            error=failure.message,
        )
    )
    events.append(ev.event(ev.WORKFLOW_FAILED, run.pk, now, error=failure.message))
    return Opened("failed", node.execution_group, events)


def _complete(
    kernel: Kernel,
    workflow: Workflow,
    run: WorkflowRun,
    records: list[WorkflowStage],
    cache: dict[str, Any],
    now: datetime,
    events: list[dict[str, Any]],
) -> Opened:
    total_cost = sum(float((r.metrics or {}).get("total_cost") or 0) for r in records)
    total_tokens = sum(int((r.metrics or {}).get("total_tokens") or 0) for r in records)
    last = effective_group(workflow, workflow.group_count + 1, _present(records))
    if last:
        ids = {n.stage.id for n in workflow.stages_in_group(last)}
        missing = [r for r in records if r.stage_id in ids and r.stage_id not in cache]
        if missing:
            cache.update(load_outputs(kernel.blobs, missing))
    output = run_output(workflow, records, cache)
    duration = duration_ms(run.started_at, now)
    update_run(
        run.pk,
        now,
        status=Status.COMPLETED,
        completed_at=now,
        duration_ms=duration,
        output=output,
        total_cost=total_cost,
        total_tokens=total_tokens,
    )
    events.append(
        ev.event(
            ev.WORKFLOW_COMPLETED,
            run.pk,
            now,
            duration_ms=duration,
            output=output,
            total_cost=total_cost,
            total_tokens=total_tokens,
        )
    )
    return Opened("completed", events=events)


def _present(records: Iterable[WorkflowStage]) -> frozenset[str]:
    return frozenset(r.stage_id for r in records if r.status == Status.COMPLETED)


def effective_group(workflow: Workflow, group: int, present: frozenset[str]) -> int:
    """The group whose output a stage of ``group`` receives: the closest earlier group with
    a stage that ran (not skipped as a whole), ``0`` for the run input. ``present``: the ids
    of the earlier stages that COMPLETED."""
    g = group - 1
    while g >= 1:
        nodes = workflow.stages_in_group(g)
        if any(not n.conditional or n.stage.id in present for n in nodes):
            return g
        g -= 1
    return 0


def group_value(workflow: Workflow, group: int, outputs: dict[str, Any]) -> tuple[bool, Any]:
    """The output of ``group`` when some of its stages may be skipped: a single stage's
    output; for a parallel group ``{stage_id: output}`` with ``None`` for a skipped stage."""
    nodes = workflow.stages_in_group(group)
    if len(nodes) == 1:
        sid = nodes[0].stage.id
        return (sid in outputs, outputs.get(sid))
    return True, {
        n.stage.id: outputs.get(n.stage.id) for n in nodes if n.stage.id in outputs or n.conditional
    }


def group_input(
    workflow: Workflow, node: StageNode, run_input: Any, outputs: dict[str, Any]
) -> tuple[bool, Any, frozenset[str]]:
    """``(present, raw input, skipped stage ids)`` of ``node`` in a workflow with conditions
    (no database access). ``outputs``: ``{stage_id: raw output}`` of the earlier groups'
    COMPLETED stages; an earlier conditional stage absent from it was SKIPPED."""
    present = frozenset(outputs)
    skipped = frozenset(
        n.stage.id
        for n in workflow.nodes
        if n.execution_group < node.execution_group and n.conditional and n.stage.id not in present
    )
    source = effective_group(workflow, node.execution_group, present)
    if source == 0:
        return True, run_input, skipped
    ok, value = group_value(workflow, source, outputs)
    return ok, value, skipped


def run_output(
    workflow: Workflow, records: Iterable[WorkflowStage], outputs: dict[str, Any]
) -> Any:
    """The output of a completed run with conditions: the output of its last group that was
    not skipped as a whole (a skipped member of a parallel group is ``None``); ``None`` when
    every stage was skipped."""
    last = effective_group(workflow, workflow.group_count + 1, _present(records))
    if last == 0:
        return None
    return group_value(workflow, last, outputs)[1]
