"""Bounded re-delivery (Part I item 3, EC-21): what happens to a job that was delivered
``max_attempts`` times without finishing.

A job whose ``job.execute`` keeps raising (infrastructure error) or whose worker keeps dying is
never re-leased forever. When :meth:`JobQueue.dequeue` or ``lease.reapStale`` finds a job whose
next delivery would exceed ``max_attempts`` it calls :func:`give_up_job`, which settles the job
in the kernel's terms, in the caller's transaction and under the run's row lock (the RUNNING
guard of Part I item 1):

* the stage record is PENDING or RUNNING -> stage FAILED with the give-up message
  (``stage:failed``, an ERROR log), job FAILED, then ``run.transition`` in the same
  transaction, so the run fails with that message (``workflow:failed``) - or waits for a
  sibling that is still active;
* the stage record is already FAILED -> job FAILED, ``run.transition`` (the stage keeps its own
  error);
* the stage record is COMPLETED (the worker died after Phase 3) -> job COMPLETED,
  ``run.transition`` advances the run;
* the stage record is SUSPENDED -> job SUSPENDED at the stage's next poll time; the poller
  resumes it;
* the run is not RUNNING, or the stage record is gone (a rerun deleted it) -> only the job is
  FAILED.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from django.db import transaction

from .. import telemetry
from ..logging import delivery_context
from ..models import Status, WorkflowJob, WorkflowStage
from . import events as ev
from .commands import TransitionRun
from .locking import LOCKED, try_lock_run
from .outbox import append_events, new_causation_id
from .store import duration_ms, update_stage, write_log

if TYPE_CHECKING:
    from .dispatch import Kernel

logger = logging.getLogger("django_workflows.worker")

#: ``run.error["error_type"]`` of a run failed because its stage's job was delivered
#: ``max_attempts`` times without finishing.
DELIVERIES_EXHAUSTED = "DeliveriesExhausted"


def give_up_job(
    kernel: Kernel, job: WorkflowJob, message: str, error_type: str = DELIVERIES_EXHAUSTED
) -> bool:
    """Settle ``job`` (locked by the caller's transaction, read with its current status) whose
    deliveries are used up, or that must not be delivered any more (``error_type`` is then what
    ``run.error["error_type"]`` records, e.g. ``"QueueTimeout"``); see the module docstring for
    each case.

    Returns ``False`` without writing anything when another transaction holds the run row
    (the caller leaves the job for a later pass: waiting here could deadlock with
    ``run.cancel``). If settling raises, the error is logged and only the job is FAILED, so a
    broken run can never keep a job in the queue; ``run.reapStuck`` then fails the run.
    """
    with delivery_context(job.workflow_run_id, job.stage_id, job.attempt, None):
        try:
            with transaction.atomic():
                settled = _give_up(kernel, job, message, error_type)
        except Exception:
            logger.exception("Could not settle exhausted job %s; failing the job only", job.pk)
            settled = kernel.queue.settle(job, Status.FAILED, error=message)
        if settled:
            telemetry.job_given_up(job.workflow_id, job.stage_id, job.queue, error_type)
        return settled


def _give_up(kernel: Kernel, job: WorkflowJob, message: str, error_type: str) -> bool:
    run = try_lock_run(job.workflow_run_id)
    if run is LOCKED:
        return False
    queue = kernel.queue
    status = getattr(run, "status", None)
    if status != Status.RUNNING:
        return queue.settle(job, Status.FAILED, error=message)
    record = WorkflowStage.objects.filter(run_id=job.workflow_run_id, stage_id=job.stage_id).first()
    if record is None:
        logger.warning("Exhausted job %s has no stage record %r", job.pk, job.stage_id)
        return queue.settle(job, Status.FAILED, error=message)
    if job.item_index is not None:  # a map item (issue 18 item 3): it fails for good
        return _give_up_item(kernel, run, record, job, message)
    if record.status == Status.SUSPENDED:
        return queue.settle(job, Status.SUSPENDED, next_poll_at=record.next_poll_at)

    now = kernel.clock.now()
    events = []
    if record.status == Status.COMPLETED:
        queue.settle(job, Status.COMPLETED)
    elif record.status == Status.FAILED:
        queue.settle(job, Status.FAILED, error=message)
    else:
        duration = duration_ms(record.started_at, now)
        update_stage(
            record.pk,
            now,
            status=Status.FAILED,
            completed_at=now,
            duration_ms=duration,
            error_message=message,
            next_poll_at=None,
            # run.transition copies it into run.error (the run fails in this transaction).
            metrics={**(record.metrics or {}), "error_type": error_type},
        )
        events.append(
            ev.event(
                ev.STAGE_FAILED,
                job.workflow_run_id,
                now,
                stage_id=record.stage_id,
                stage_name=record.stage_name,
                error=message,
            )
        )
        queue.settle(job, Status.FAILED, error=message)
        write_log(
            now,
            "ERROR",
            f"Stage {record.stage_id} failed: {message}",
            run_id=job.workflow_run_id,
            stage_pk=record.pk,
            metadata={"job_id": job.pk, "attempt": job.attempt, "max_attempts": job.max_attempts},
        )

    from .handlers import run_transition

    out = run_transition.handle(kernel, TransitionRun(job.workflow_run_id))
    append_events([*events, *out.events], new_causation_id(), now)
    telemetry.runs_ended_at_commit(run.workflow_id, out.events, run.started_at, now)
    return True


def _give_up_item(
    kernel: Kernel, run: Any, record: WorkflowStage, job: WorkflowJob, message: str
) -> bool:
    """An exhausted map item: the job FAILED, then the item settles as failed
    (:func:`.mapping.settle_item`: counters, promotion, the stage's failure policy) and the
    run is transitioned when that was the stage's last item.
    """
    from .handlers import run_transition
    from .mapping import settle_item

    now = kernel.clock.now()
    if not kernel.queue.settle(job, Status.FAILED, error=message):
        return False
    workflow = kernel.registry.get(job.workflow_id)
    if record.status != Status.RUNNING or workflow is None or not workflow.has_stage(job.stage_id):
        return True
    settled = settle_item(
        kernel, run, workflow.node(job.stage_id), record.pk, job, now, error=message
    )
    events = settled.events
    if settled.finished:
        events += run_transition.handle(kernel, TransitionRun(job.workflow_run_id)).events
    append_events(events, new_causation_id(), now)
    return True
