"""``job.execute`` (SPEC §4.6, K-JE-1..19; Part I items 1, 6, 7, 9).

Pre-flight (no transaction): resolve workflow, stage and run (errors raise, K-JE-1); a run that
is not RUNNING is a ghost (K-JE-3); a COMPLETED record returns its stored output without running
the stage again (K-JE-5).

Phase 1 (one transaction, RUNNING guard): the stage record becomes RUNNING with
``started_at``; the previous execution's error, suspension and progress fields are cleared
(Part I item 9); ``stage:started`` is appended. Committed, so other readers see it.

Phase 2 (no transaction): resolve the input from the previous group (WF-40/41) and run the stage
through the executor with the outputs of earlier groups as its context (Part I item 7).

Phase 3 (one transaction, RUNNING guard = row lock on the run, Part I item 1): write the outcome
(COMPLETED with the output blob / SUSPENDED / FAILED), the buffered annotations and the events
(progress, then the outcome event, then ``annotation:created``). If the run left RUNNING the
transaction rolls back everything and the result is a ghost failure. ``job.execute`` never
touches the job queue or the run status (K-JE-19).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from django.db import transaction

from ...models import Status, WorkflowRun
from .. import events as ev
from ..commands import ExecuteJob, ExecuteJobResult
from ..errors import RunNotFoundError, RunNotRunningError, StageNotFoundError, WorkflowNotFoundError
from ..locking import parse_run_id, require_running
from ..outbox import append_events, new_causation_id
from ..services import KernelStageServices
from ..stage_path.records import run_stage, start_stage, write_outcome
from ..store import load_outputs, stages_of, write_log

if TYPE_CHECKING:
    from ..dispatch import Kernel


def _ghost(exc: RunNotRunningError, after: bool = False) -> ExecuteJobResult:
    if after:
        error = (
            f"Workflow run {exc.run_id} was {exc.status} after stage execution; "
            "the result was discarded (expected RUNNING)"
        )
    else:
        error = str(exc)
    return ExecuteJobResult("failed", error=error, ghost=True, retryable=False)


def handle(kernel: Kernel, cmd: ExecuteJob) -> ExecuteJobResult:
    workflow = kernel.registry.get(cmd.workflow_id)
    if workflow is None:
        raise WorkflowNotFoundError(cmd.workflow_id)
    if not workflow.has_stage(cmd.stage_id):
        raise StageNotFoundError(workflow.id, cmd.stage_id, workflow.stage_ids)
    node = workflow.node(cmd.stage_id)
    run_id = parse_run_id(cmd.workflow_run_id)
    run = WorkflowRun.objects.filter(pk=run_id).first()
    if run is None:
        raise RunNotFoundError(run_id)
    start = kernel.clock.now()
    causation = cmd.idempotency_key or new_causation_id()
    if run.status != Status.RUNNING:
        return _ghost(RunNotRunningError(run_id, run.status))

    records = stages_of(run_id)
    record = next((r for r in records if r.stage_id == node.stage.id), None)
    if record is not None and record.status == Status.COMPLETED:
        return ExecuteJobResult(
            "completed", output=load_outputs(kernel.blobs, [record]).get(node.stage.id)
        )
    earlier = [
        r
        for r in records
        if r.execution_group < node.execution_group and r.status == Status.COMPLETED
    ]
    raw_outputs = load_outputs(kernel.blobs, earlier)
    resume_state = record.suspended_state if record is not None else None

    # Phase 1
    try:
        with transaction.atomic():
            require_running(run_id)
            record = start_stage(run, node, record, cmd.config, start)
            append_events(
                [
                    ev.event(
                        ev.STAGE_STARTED,
                        run_id,
                        start,
                        stage_id=node.stage.id,
                        stage_name=node.stage.name,
                        stage_number=node.stage_number,
                    )
                ],
                causation,
                start,
            )
    except RunNotRunningError as exc:
        return _ghost(exc)

    # Phase 2
    services = KernelStageServices(
        clock=kernel.clock,
        blobs=kernel.blobs,
        workflow_type=run.workflow_type,
        run_id=run_id,
        stage_id=node.stage.id,
        stage_pk=record.pk,
    )
    outcome = run_stage(
        kernel, workflow, node, run, record, cmd.config, raw_outputs, resume_state, services, start
    )
    for warning in outcome.warnings:
        write_log(
            kernel.clock.now(),
            "WARN",
            warning,
            run_id=run_id,
            stage_pk=record.pk,
            metadata={"stage_id": node.stage.id},
        )

    # Phase 3
    try:
        with transaction.atomic():
            run = require_running(run_id)
            now = kernel.clock.now()
            result, events = write_outcome(kernel, run, node, record, outcome, services, start, now)
            append_events(events, causation, now)
    except RunNotRunningError as exc:
        return _ghost(exc, after=True)
    if result.outcome == "failed":
        write_log(
            kernel.clock.now(),
            "ERROR",
            f"Stage {node.stage.id} failed: {result.error}",
            run_id=run_id,
            stage_pk=record.pk,
        )
    return result
