"""The stage record's writes on the stage path (SPEC §4.6, K-JE-6..17; Part I items 7, 9):
starting a stage (step 1 of :mod:`..delivery`), running its body through the executor
(step 2) and writing its outcome (step 3: COMPLETED with the output blob / SUSPENDED / FAILED,
the buffered annotations, the events in order). The callers hold the transactions and the
fence; nothing here touches the job queue or the run's status.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from functools import partial
from typing import TYPE_CHECKING, Any

from ...blobs import artifact_key, output_key
from ...definition.mapping import map_results
from ...definition.workflow import StageNode, Workflow
from ...models import Status, WorkflowRun, WorkflowStage
from .. import events as ev
from ..commands import ExecuteJobResult
from ..executor import ExecutionInput, ExecutionOutcome
from ..rows import Write
from ..services import KernelStageServices
from ..store import (
    group_output,
    started_fields,
    update_stage,
    update_stage_write,
    write_annotations,
)
from .conditions import group_input

if TYPE_CHECKING:
    from ..dispatch import Kernel

#: :func:`run_stage`'s ``item`` when the job is not a map item.
NO_ITEM: Any = object()


@dataclass
class Unsent:
    """What :func:`write_outcome` leaves its caller to do with the fence (issue 19).

    ``writes``: statements built but not sent (the stage record's update, the output blob's
    upsert when the blob store keeps blobs in this database), for the fence's statement to
    carry (:func:`..rows.update`). ``after_fence``: writes to a blob store outside the
    database, which no rollback undoes (SPEC K-1b): the caller makes them only once the fence
    held, so a delivery whose lease was taken over never overwrites the output its successor
    stored under the same key.
    """

    writes: list[Write] = field(default_factory=list)
    after_fence: list[Callable[[], None]] = field(default_factory=list)


def write_outcome(
    kernel: Kernel,
    run: WorkflowRun,
    node: StageNode,
    record: WorkflowStage,
    outcome: ExecutionOutcome,
    services: KernelStageServices,
    start: datetime,
    now: datetime,
    unsent: Unsent | None = None,
) -> tuple[ExecuteJobResult, list[dict[str, Any]]]:
    """Phase 3's writes (K-JE-12..17), for a caller that holds the run's row lock and found it
    RUNNING: the stage record's outcome (COMPLETED with the output blob / SUSPENDED / FAILED),
    the buffered annotations, and the events in order (progress, the outcome event,
    ``annotation:created``). Returns the result and the events to append.

    ``unsent`` (:class:`Unsent`): a COMPLETED outcome's stage record update and output blob
    are left to the caller instead of being written here - as statements its fence carries
    (:mod:`.outcome`, issue 19), or, for a blob store outside the database, as a put to make
    once the fence held. The record in memory is updated either way.
    """
    events = list(_progress_events(run.pk, outcome, now))
    last = _pending_progress(services)
    if outcome.error is not None:
        result = _fail(node, record, outcome, start, now, events, last)
    elif outcome.suspend is not None:
        result = _suspend(node, record, outcome, now, events, last)
    else:
        result = _complete(kernel, run, node, record, outcome, start, now, events, unsent)
    events += write_annotations(
        run.pk,
        outcome.annotations,
        now=now,
        scope="stage",
        scope_id=node.stage.id,
        stage_pk=record.pk,
        generation=record.generation,
    )
    return result, events


def start_stage(
    run: WorkflowRun,
    node: StageNode,
    record: WorkflowStage | None,
    config: dict[str, Any],
    now: datetime,
) -> WorkflowStage:
    """Phase 1's write: upsert the record to RUNNING (K-JE-6), clearing the previous execution's
    error, suspension and progress (Part I item 9). Returns the record as written.
    """
    fields = started_fields(now)
    if record is not None and update_stage(record.pk, now, **fields):
        for name, value in fields.items():
            setattr(record, name, value)
        return record
    return WorkflowStage.objects.create(
        created_at=now,
        updated_at=now,
        run=run,
        stage_id=node.stage.id,
        stage_name=node.stage.name,
        stage_number=node.stage_number,
        execution_group=node.execution_group,
        config=(config or {}).get(node.stage.id) or {},
        **fields,
    )


def run_stage(
    kernel: Kernel,
    workflow: Workflow,
    node: StageNode,
    run: WorkflowRun,
    record: WorkflowStage,
    config: dict[str, Any] | None,
    raw_outputs: dict[str, Any],
    resume_state: Any,
    services: KernelStageServices,
    start: datetime,
    item: Any = NO_ITEM,
) -> ExecutionOutcome:
    """Phase 2 (no transaction): resolve the input from the previous group (WF-40/41) and run
    the stage through the executor with the outputs of earlier groups as its context
    (Part I item 7). ``raw_outputs``: ``{stage_id: output}`` of earlier groups' COMPLETED
    records. ``config``: the whole run-config map (``None``: the run's). ``item``: a map
    item's JSON (issue 18 item 3), the stage's input instead of the previous group's output.
    """
    group = node.execution_group
    skipped: frozenset[str] = frozenset()
    if item is not NO_ITEM:
        present, raw_input = True, item
    elif workflow.has_conditions:  # issue 18: skipped stages are passed over (no query)
        present, raw_input, skipped = group_input(workflow, node, run.input, raw_outputs)
    elif group == 1:
        present, raw_input = True, run.input
    else:
        present, raw_input = group_output(workflow, group - 1, raw_outputs)
    if not present:
        return ExecutionOutcome(
            error=f"Stage {node.stage.id!r} is missing the output of execution group {group - 1}",
            error_type="MissingStageOutput",
        )
    context = {}
    for stage_id, data in raw_outputs.items():
        producer = workflow.get_stage(stage_id)
        if producer is not None and workflow.has_maps and workflow.node(stage_id).map:
            context[stage_id] = map_results(producer).model_validate(data)
        else:
            context[stage_id] = producer.load_output(data) if producer else data
    return kernel.executor.run(
        ExecutionInput(
            workflow=workflow,
            stage=node.stage,
            workflow_run_id=str(run.pk),
            stage_record_id=str(record.pk),
            stage_number=node.stage_number,
            generation=record.generation,
            raw_input=raw_input,
            config=config or run.config or {},
            resume_state=resume_state,
            workflow_context=context,
            services=services,
            now=start,
            skipped=skipped,
        )
    )


def _ms(start: datetime, end: datetime) -> int:
    return int((end - start).total_seconds() * 1000)


def _progress_events(run_id: uuid.UUID, outcome: ExecutionOutcome, now: datetime):  # type: ignore[no-untyped-def]
    for item in outcome.progress:
        yield ev.event(ev.STAGE_PROGRESS, run_id, now, **item)


def _pending_progress(services: KernelStageServices) -> dict[str, Any]:
    """The last progress of a throttled burst, written with a failed/suspended outcome."""
    if services.pending_progress is None:
        return {}
    value, message = services.pending_progress
    return {"progress": value, "progress_message": message[:2000]}


def _write(
    record: WorkflowStage, now: datetime, unsent: list[Write] | None = None, **fields: Any
) -> None:
    """Update the stage record in the database (or append the update to ``unsent``, for the
    caller to send) and in memory (the caller keeps using it)."""
    if unsent is not None:
        unsent.append(update_stage_write(record.pk, now, **fields))
    else:
        update_stage(record.pk, now, **fields)
    for name, value in fields.items():
        setattr(record, name, value)


def _metrics(start: datetime, now: datetime, custom: dict[str, Any] | None) -> dict[str, Any]:
    return {
        "start_time": start.isoformat(),
        "end_time": now.isoformat(),
        "duration_ms": _ms(start, now),
        **(custom or {}),
    }


def _fail(
    node: StageNode,
    record: WorkflowStage,
    outcome: ExecutionOutcome,
    start: datetime,
    now: datetime,
    events: list[dict[str, Any]],
    last_progress: dict[str, Any],
) -> ExecuteJobResult:
    _write(
        record,
        now,
        status=Status.FAILED,
        completed_at=now,
        duration_ms=_ms(start, now),
        error_message=outcome.error,
        # The traceback and error type ride in the same UPDATE (no extra statement on the
        # stage path); run.transition copies the error type into run.error.
        metrics=failure_metrics(record.metrics, outcome.error_type, outcome.traceback),
        **last_progress,
    )
    events.append(
        ev.event(
            ev.STAGE_FAILED,
            record.run_id,
            now,
            stage_id=node.stage.id,
            stage_name=node.stage.name,
            error=outcome.error,
        )
    )
    return ExecuteJobResult("failed", error=outcome.error, retryable=outcome.retryable)


def failure_metrics(
    metrics: dict[str, Any] | None, error_type: str | None, traceback: str | None
) -> dict[str, Any] | None:
    """A failed stage record's ``metrics``: ``traceback`` (the stage body's, if it raised)
    and ``error_type`` (the kind of failure, copied into ``run.error``) over the record's
    metrics; the previous delivery's traceback is dropped.
    """
    out = {k: v for k, v in (metrics or {}).items() if k not in ("traceback", "error_type")}
    if traceback:
        out["traceback"] = traceback
    if error_type:
        out["error_type"] = error_type
    return out or metrics


def _suspend(
    node: StageNode,
    record: WorkflowStage,
    outcome: ExecutionOutcome,
    now: datetime,
    events: list[dict[str, Any]],
    last_progress: dict[str, Any],
) -> ExecuteJobResult:
    s = outcome.suspend
    assert s is not None
    _write(
        record,
        now,
        status=Status.SUSPENDED,
        suspended_state=s.state,
        next_poll_at=s.next_poll_at,
        poll_interval_ms=s.poll_interval_ms,
        max_wait_until=s.max_wait_until,
        metrics=s.metrics,
        **last_progress,
    )
    events.append(
        ev.event(
            ev.STAGE_SUSPENDED,
            record.run_id,
            now,
            stage_id=node.stage.id,
            stage_name=node.stage.name,
            next_poll_at=s.next_poll_at.isoformat(),
        )
    )
    events.append(ev.event(ev.WORKFLOW_SUSPENDED, record.run_id, now, stage_id=node.stage.id))
    return ExecuteJobResult("suspended", next_poll_at=s.next_poll_at)


def _complete(
    kernel: Kernel,
    run: WorkflowRun,
    node: StageNode,
    record: WorkflowStage,
    outcome: ExecutionOutcome,
    start: datetime,
    now: datetime,
    events: list[dict[str, Any]],
    unsent: Unsent | None = None,
) -> ExecuteJobResult:
    result = outcome.result
    assert result is not None
    sid = node.stage.id
    key = output_key(run.workflow_type, str(run.pk), sid)
    blobs: list[tuple[str, Any]] = [(key, outcome.output)]
    output_data: dict[str, Any] = {"_artifactKey": key}
    if result.artifacts:
        keys = {
            name: artifact_key(run.workflow_type, str(run.pk), sid, name)
            for name in result.artifacts
        }
        blobs += [(keys[name], value) for name, value in result.artifacts.items()]
        output_data["_artifactKeys"] = keys
    if unsent is None:
        kernel.blobs.put_many(blobs, run_id=str(run.pk), stage_id=sid)
    else:
        statement = getattr(kernel.blobs, "put_many_write", None)
        write = statement(blobs, run_id=str(run.pk), stage_id=sid) if statement else None
        if write is not None:
            unsent.writes.append(write)
        else:  # outside the database: only once the fence held (SPEC K-1b)
            put = partial(kernel.blobs.put_many, blobs, run_id=str(run.pk), stage_id=sid)
            unsent.after_fence.append(put)
    duration = _ms(start, now)
    _write(
        record,
        now,
        unsent.writes if unsent is not None else None,
        status=Status.COMPLETED,
        completed_at=now,
        duration_ms=duration,
        output_data=output_data,
        metrics=_metrics(start, now, result.metrics),
        embedding_info=result.embeddings,
        progress=100.0,
    )
    events.append(
        ev.event(
            ev.STAGE_COMPLETED,
            run.pk,
            now,
            stage_id=sid,
            stage_name=node.stage.name,
            duration_ms=duration,
        )
    )
    return ExecuteJobResult("completed", output=outcome.output)
