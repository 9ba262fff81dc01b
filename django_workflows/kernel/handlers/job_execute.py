"""``job.execute`` (SPEC §4.6): a thin entry into the stage path (:mod:`..delivery`).

It resolves the workflow, the stage and the run (errors raise, K-JE-1), picks the job of that
(run, stage) - the stage's newest job - and delivers it the way a worker
does: :func:`..stage_path.lease.lease_job` (transaction 1: the run locked, the job leased, the
RUNNING guard, K-JE-5, the stage started), :func:`..stage_path.execute.execute` (the body,
no transaction), :func:`..stage_path.outcome.commit_outcome` (transaction 3: the job settled
fenced by its token, the outcome written and the run transitioned, in one commit). The next
stage is not continued here: its jobs are queued for the workers. The stage runs with its
job's config (the run's config map); a ``config`` that differs from it is refused
(:class:`..errors.InvalidCommandError`, ``field="config"``), nothing changed.

Deliberate difference from SPEC K-JE-19 / H-5: the command settles the job and transitions
the run (the production path), it does not leave them to the caller.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ... import telemetry
from ...models import Status, WorkflowJob, WorkflowRun
from ..commands import ExecuteJob, ExecuteJobResult
from ..errors import (
    InvalidCommandError,
    RunNotFoundError,
    StageNotFoundError,
    WorkflowNotFoundError,
)
from ..locking import parse_run_id
from ..stage_path.execute import execute
from ..stage_path.lease import lease_job
from ..stage_path.outcome import commit_outcome
from ..store import load_outputs, stages_of

if TYPE_CHECKING:
    from ..dispatch import Kernel

#: The worker id of a job leased by ``job.execute`` itself (one that was PENDING).
WORKER_ID = "job.execute"


def handle(kernel: Kernel, cmd: ExecuteJob) -> ExecuteJobResult:
    workflow = kernel.registry.get(cmd.workflow_id)
    if workflow is None:
        raise WorkflowNotFoundError(cmd.workflow_id)
    if not workflow.has_stage(cmd.stage_id):
        raise StageNotFoundError(workflow.id, cmd.stage_id, workflow.stage_ids)
    run_id = parse_run_id(cmd.workflow_run_id)
    if not WorkflowRun.objects.filter(pk=run_id).exists():
        raise RunNotFoundError(run_id)
    jobs = WorkflowJob.objects.filter(workflow_run_id=run_id, stage_id=cmd.stage_id)
    job_id, payload = jobs.order_by("-id").values_list("pk", "payload").first() or (None, None)
    job_config = (payload or {}).get("config") or {}
    if cmd.config and cmd.config != job_config:
        raise InvalidCommandError(
            f"config differs from the config of the job of stage {cmd.stage_id!r} (the run's "
            "config map): the stage runs with the job's config; leave config empty or pass "
            "the run's",
            field="config",
        )
    delivery = None
    if job_id is not None:
        delivery, _ = lease_job(kernel, job_id, WORKER_ID)
    if delivery is None:
        return _not_started(kernel, run_id, cmd, job_id)
    with telemetry.delivering(delivery) as seen:  # log fields; spans and metrics if enabled
        with seen.step("execute"):
            outcome, services = execute(kernel, delivery)
        with seen.step("outcome"):
            done = commit_outcome(kernel, delivery, outcome, services, None)
        seen.ended(done)
    if done.result is not None:
        result: ExecuteJobResult = done.result
        return result
    if done.outcome == "ghost":
        return ExecuteJobResult("failed", error=done.error, ghost=True, retryable=False)
    return ExecuteJobResult(
        "completed" if done.outcome == "completed" else "failed",
        error=done.error,
        retryable=False if done.outcome == "discarded" else None,
    )


def _not_started(
    kernel: Kernel, run_id: object, cmd: ExecuteJob, job_id: int | None
) -> ExecuteJobResult:
    """The answer when the stage was not started: the run is not RUNNING (a ghost, K-JE-3),
    the stage already COMPLETED (its stored output, K-JE-5), or there is no job to deliver.
    """
    run = WorkflowRun.objects.get(pk=run_id)
    if run.status != Status.RUNNING:
        return ExecuteJobResult(
            "failed",
            error=f"Workflow run {run.pk} is {run.status}, not RUNNING; job not executed",
            ghost=True,
            retryable=False,
        )
    record = next((r for r in stages_of(run.pk) if r.stage_id == cmd.stage_id), None)
    if record is not None and record.status == Status.COMPLETED:
        return ExecuteJobResult(
            "completed", output=load_outputs(kernel.blobs, [record]).get(cmd.stage_id)
        )
    if job_id is None:
        raise InvalidCommandError(
            f"Run {run.pk} has no job for stage {cmd.stage_id!r} to execute "
            "(its group has not been reached yet)"
        )
    status = WorkflowJob.objects.filter(pk=job_id).values_list("status", flat=True).first()
    return ExecuteJobResult(
        "failed",
        error=f"Job {job_id} of stage {cmd.stage_id!r} is {status}; it was not executed",
        retryable=False,
    )
