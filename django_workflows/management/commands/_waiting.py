"""What a run waits for, as the CLI says it (``workflows_status``, ``workflows_run --wait``):
the reasons the admin and the API show (:func:`django_workflows.runs.waiting_reasons`), each
with the command that unblocks it where there is one (issue 17 section 5), plus what only an
outside look sees: no live worker at all, or a worker that stopped renewing its lease.

* ``approval``: ``python manage.py workflows_approve <run id>`` (or ``workflows_reject``);
  ``--stage <id>`` when several approvals wait.
* ``signal``: ``python manage.py workflows_signal <run id> <name> --payload '<JSON>'``.
* ``child``: ``python manage.py workflows_status <child run id>`` (what the child waits for).
* ``no_worker`` (no live worker serves the job's queue): ``python manage.py qcluster`` for the
  ``default`` queue, ``python manage.py workflows_worker --queue <q>`` for another; a version
  no live worker runs has no command (deploy workers of that version).
* ``claim`` (a PENDING run) while no worker is live at all: nobody runs the maintenance tick
  that claims it, so it is ``no_worker`` too.
* ``executing`` whose lease was not renewed for two heartbeat intervals: the worker is gone
  (``stale_lease``): a worker takes the stage again once its lease is
  ``STALE_LEASE_SECONDS`` old - a stage shown RUNNING 62% is not busy.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django_workflows.conf import workflow_settings
from django_workflows.kernel import routing
from django_workflows.models import Status, WorkflowJob, WorkflowRun, WorkflowStage
from django_workflows.runs import WaitingReason, waiting_reasons

#: The queue whose workers a plain ``qcluster`` starts.
DEFAULT_QUEUE = routing.DEFAULT_QUEUE


@dataclass(frozen=True)
class CliWaiting:
    """One thing a run waits for.

    Attributes:
        reason: a :class:`~django_workflows.runs.WaitingReason` reason (``claim``,
            ``job_queued``, ``retry``, ``executing``, ``poll``, ``approval``, ``signal``,
            ``no_worker``) or ``stale_lease`` (the worker holding the stage stopped renewing
            its lease).
        stage_id: the stage concerned (``None`` for a PENDING run).
        message: one sentence (``"waiting for an approval decision"``).
        command: the command that unblocks it, or ``None``.
        at: when it is due (next poll, retry time), if known.
    """

    reason: str
    stage_id: str | None
    message: str
    command: str | None = None
    at: datetime | None = None

    def text(self) -> str:
        """``"waiting for a default worker (stage a; run: python manage.py qcluster)"``."""
        parts = [f"stage {self.stage_id}"] if self.stage_id else []
        if self.command:
            parts.append(f"run: {self.command}")
        return f"{self.message} ({'; '.join(parts)})" if parts else self.message

    def document(self) -> dict[str, Any]:
        """The ``--json`` form: ``{"reason", "stage_id", "message", "command", "at"}``."""
        return {
            "reason": self.reason,
            "stage_id": self.stage_id,
            "message": self.message,
            "command": self.command,
            "at": self.at,
        }


def worker_command(queue: str) -> str:
    """The command that starts a worker serving ``queue``."""
    if queue == DEFAULT_QUEUE:
        return "python manage.py qcluster"
    return f"python manage.py workflows_worker --queue {queue}"


def run_waiting(
    run: WorkflowRun,
    stages: list[WorkflowStage] | None = None,
    jobs: dict[str, WorkflowJob] | None = None,
) -> list[CliWaiting]:
    """What ``run`` waits for (``[]`` for a terminal run), in stage order.

    ``stages``: the run's stage records (read when ``None``); ``jobs``: its jobs by stage id
    (any status: only PENDING and RUNNING ones count; read when ``None``). A few queries:
    :func:`~django_workflows.runs.waiting_reasons`' (the presence rows once), plus the
    database's clock when a stage is executing.
    """
    if run.status not in (Status.PENDING, Status.RUNNING):
        return []
    from django_workflows.kernel.runtime import get_kernel

    lease_clock = get_kernel().lease_clock
    live: set[str] | None = None

    def live_queues() -> set[str]:  # one query, shared with waiting_reasons
        nonlocal live
        if live is None:
            live = routing.live_queues(lease_clock=lease_clock)
        return live

    if jobs is None:
        jobs = (
            {job.stage_id: job for job in WorkflowJob.objects.filter(workflow_run_id=run.pk)}
            if run.status == Status.RUNNING
            else {}
        )
    open_jobs = {
        sid: job for sid, job in jobs.items() if job.status in (Status.PENDING, Status.RUNNING)
    }
    reasons = waiting_reasons(run, stages, open_jobs, live_queues=live_queues)
    now: datetime | None = None
    out = []
    for reason in reasons:
        if reason.reason == "executing":
            job = open_jobs.get(reason.stage_id or "")
            if job is not None and job.locked_at is not None:
                if now is None:
                    now = lease_clock.read()
                out.append(_executing(reason, job, now, live_queues()))
                continue
        out.append(_explained(run, reason, open_jobs.get(reason.stage_id or ""), live_queues))
    return out


def _explained(
    run: WorkflowRun, reason: WaitingReason, job: WorkflowJob | None, live_queues: Any
) -> CliWaiting:
    if reason.reason == "approval":
        stage = f" --stage {reason.stage_id}"
        return CliWaiting(
            "approval",
            reason.stage_id,
            reason.message,
            f"python manage.py workflows_approve {run.pk}{stage} "
            f"(or workflows_reject {run.pk}{stage} --reason ...)",
            reason.at,
        )
    if reason.reason == "signal":
        return CliWaiting(
            "signal",
            reason.stage_id,
            reason.message,
            f"python manage.py workflows_signal {run.pk} {reason.signal} --payload '<JSON>'",
            reason.at,
        )
    if reason.reason == "child" and reason.child_run_id:
        return CliWaiting(
            "child",
            reason.stage_id,
            reason.message,
            f"python manage.py workflows_status {reason.child_run_id}",
            reason.at,
        )
    if reason.reason == "claim" and not live_queues():
        return CliWaiting(
            "no_worker",
            None,
            "waiting for a worker: no worker is live to claim the run",
            worker_command(DEFAULT_QUEUE),
        )
    if reason.reason == "no_worker":
        # No live worker serves the job's queue: start one. (A version no live worker runs
        # has no command: deploy workers of that version.)
        unserved = job is not None and job.queue not in live_queues()
        return CliWaiting(
            "no_worker",
            reason.stage_id,
            reason.message,
            worker_command(job.queue) if unserved and job is not None else None,
            reason.at,
        )
    return CliWaiting(reason.reason, reason.stage_id, reason.message, None, reason.at)


def _executing(
    reason: WaitingReason, job: WorkflowJob, now: datetime, live: set[str]
) -> CliWaiting:
    """An ``executing`` stage, unless its worker stopped renewing the lease (two heartbeat
    intervals and 5 s, judged on the database's clock): then ``stale_lease``."""
    heartbeat = float(workflow_settings.HEARTBEAT_INTERVAL_SECONDS)
    age = (now - job.locked_at).total_seconds() if job.locked_at else 0.0
    if age <= 2 * heartbeat + 5:
        who = f" {job.worker_id}" if job.worker_id else ""
        return CliWaiting("executing", reason.stage_id, f"worker{who} is executing the stage")
    stale = float(workflow_settings.STALE_LEASE_SECONDS)
    left = max(0.0, stale - age)
    served = job.queue in live
    message = (
        f"waiting for a worker: {job.worker_id or 'its worker'} stopped renewing the lease "
        f"{age:.0f} s ago; the stage is taken again when the lease is {stale:g} s old "
        f"(in {left:.0f} s)"
    )
    if not served:
        message += f" by a {job.queue} worker, and none is live"
    return CliWaiting(
        "stale_lease",
        reason.stage_id,
        message,
        None if served else worker_command(job.queue),
        job.locked_at + timedelta(seconds=stale) if job.locked_at else None,
    )
