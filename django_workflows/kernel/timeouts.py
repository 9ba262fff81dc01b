"""Stage timeouts and the queue-wait limit (issue 12 item 2).

**Stage timeout** (start-to-close, per delivery): ``timeout_seconds`` on the stage, else
``DEFAULT_STAGE_TIMEOUT_SECONDS``. The process's heartbeat thread is the watchdog
(:class:`.delivery.Heartbeat` carries the deadline; nothing is added to the stage path of a
stage without a timeout, and nothing is queried for one with it until it fires):

1. at the deadline the delivery is marked timed out and ``ctx.is_cancelled()`` turns true; a
   body that returns within ``STAGE_TIMEOUT_GRACE_SECONDS`` has its result replaced by the
   :class:`StageTimeout` failure, committed by the delivery's own outcome transaction;
2. a body still running at the end of the grace has the same failure committed for it by the
   watchdog, through the same fenced outcome transaction (it commits only while the job is
   still RUNNING at the delivery's attempt, so a stage that finished exactly at the deadline
   is never both completed and timed out), and then the worker is recycled
   (:func:`recycle_worker`: in a django-q2 worker process ``os._exit``, and django-q2's
   Sentinel starts a fresh worker). The body's late result, if it ever comes, matches no fence
   and is discarded.

The failure is retryable: it is retried per the stage's retry policy (``max_attempts`` and the
back-off), like any stage failure.

**Queue-wait limit** (schedule-to-start): ``queue_timeout_seconds`` on the stage, else
``DEFAULT_QUEUE_TIMEOUT_SECONDS``. The maintenance tick fails a ready job that no worker leased
in time (:func:`fail_unstarted_jobs`, one query per tick, and none while no stage has a limit),
its stage and its run, naming the queue whose workers were missing.

``Q_CLUSTER['timeout']`` stays the last resort: system check ``django_workflows.W003`` wants it
above every stage timeout plus the grace.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from django.db import transaction
from django.db.models import Q

from ..conf import workflow_settings
from ..definition.stage import Stage
from ..models import Status, WorkflowJob
from .errors import WorkflowError
from .executor import ExecutionOutcome, error_text

if TYPE_CHECKING:
    from ..definition.workflow import Workflow
    from .dispatch import Kernel

logger = logging.getLogger("django_workflows.worker")


class StageTimeout(WorkflowError):
    """A delivery of a stage ran past its ``timeout_seconds``; the error of the failed stage
    is ``"StageTimeout: stage 'x' timed out after N s (timeout_seconds=N)"``."""


class QueueTimeout(WorkflowError):
    """No worker of a stage's queue leased its ready job within ``queue_timeout_seconds``."""


def stage_timeout_seconds(stage: Stage) -> float | None:
    """The stage's delivery timeout in seconds: its ``timeout_seconds``, else
    ``DEFAULT_STAGE_TIMEOUT_SECONDS``; ``None``: no limit."""
    value = stage.timeout_seconds
    if value is None:
        value = workflow_settings.DEFAULT_STAGE_TIMEOUT_SECONDS
    return float(value) if value is not None else None


def queue_timeout_seconds(stage: Stage) -> float | None:
    """The stage's queue-wait limit in seconds: its ``queue_timeout_seconds``, else
    ``DEFAULT_QUEUE_TIMEOUT_SECONDS``; ``None``: a ready job waits for a worker forever."""
    value = stage.queue_timeout_seconds
    if value is None:
        value = workflow_settings.DEFAULT_QUEUE_TIMEOUT_SECONDS
    return float(value) if value is not None else None


def grace_seconds() -> float:
    """``STAGE_TIMEOUT_GRACE_SECONDS``: how long a timed-out body may take to return."""
    return float(workflow_settings.STAGE_TIMEOUT_GRACE_SECONDS)


def timed_out(stage: Stage, seconds: float) -> ExecutionOutcome:
    """The failed outcome of a delivery of ``stage`` past its timeout of ``seconds``
    (retryable: the stage's retry policy decides)."""
    error = StageTimeout(
        f"stage {stage.id!r} timed out after {seconds:g} s (timeout_seconds={seconds:g})"
    )
    return ExecutionOutcome(error=error_text(error), error_type=StageTimeout.__name__)


def is_timeout_error(error: str | None) -> bool:
    """Whether a stage error is a :class:`StageTimeout` failure."""
    return bool(error) and error.startswith(f"{StageTimeout.__name__}: ")  # type: ignore[union-attr]


# --- freeing the worker -----------------------------------------------------------------------

_recycle: Callable[[], None] | None = None


def set_recycle(action: Callable[[], None] | None) -> None:
    """Install how this process frees a worker whose stage body is still running past its
    timeout and grace (the django-q2 transport installs ``os._exit``, so the Sentinel starts
    a fresh worker process). ``None``: nothing is done beyond a WARN log (the body keeps its
    thread until it returns; its late result is discarded)."""
    global _recycle
    _recycle = action


def recycle_worker(stage_id: str, job_id: int) -> None:
    """Free the worker of a stage body that ignored its timeout (see :func:`set_recycle`)."""
    if _recycle is None:
        logger.warning(
            "Stage %s (job %s) still runs past its timeout and grace; its timeout is committed "
            "and its late result will be discarded, but this process cannot be recycled, so "
            "the thread stays busy until the body returns",
            stage_id,
            job_id,
        )
        return
    logger.warning(
        "Stage %s (job %s) still runs past its timeout and grace: recycling this worker process",
        stage_id,
        job_id,
    )
    _recycle()


# --- the queue-wait limit ---------------------------------------------------------------------


def queue_timeout_message(queue: str, stage_id: str, seconds: float) -> str:
    """``"QueueTimeout: no worker of queue 'gpu' picked up the job within 60 s (...)"``."""
    error = QueueTimeout(
        f"no worker of queue {queue!r} picked up the job within {seconds:g} s (stage "
        f"{stage_id!r}, queue_timeout_seconds={seconds:g}); is a worker of that queue running?"
    )
    return error_text(error)


def _limits(workflows: Iterable[Workflow]) -> dict[float, dict[str, list[str]]]:
    """``{seconds: {workflow_id: [stage_id, ...]}}`` of every stage with a queue-wait limit."""
    found: dict[float, dict[str, list[str]]] = {}
    for workflow in workflows:
        for stage in workflow.stages:
            seconds = queue_timeout_seconds(stage)
            if seconds is not None:
                found.setdefault(seconds, {}).setdefault(workflow.id, []).append(stage.id)
    return found


def unstarted_jobs_filter(kernel: Kernel, workflows: Iterable[Workflow] | None = None) -> Q | None:
    """The jobs past their queue-wait limit: PENDING, ready for longer than their stage's
    limit (ready since the later of ``updated_at``, when the job was enqueued, retried or
    released, and ``next_poll_at``, the end of a retry back-off, in lease time). ``None`` when
    no stage has a limit.
    """
    chosen = list(workflows if workflows is not None else kernel.registry)
    limits = _limits(chosen)
    if not limits:
        return None
    queues = sorted(
        {s.queue for w in chosen for s in w.stages if queue_timeout_seconds(s) is not None}
    )
    now = kernel.clock.now()
    overdue = Q(pk__in=[])
    for seconds, stages in limits.items():
        which = Q(pk__in=[])
        for workflow_id, stage_ids in stages.items():
            which |= Q(workflow_id=workflow_id, stage_id__in=stage_ids)
        ready_since = Q(updated_at__lte=now - timedelta(seconds=seconds)) & (
            Q(next_poll_at__isnull=True) | Q(next_poll_at__lte=kernel.lease_clock.offset(-seconds))
        )
        overdue |= which & ready_since
    # status and queue lead wf_job_queue_claim_idx: only the waiting jobs of these queues
    return Q(status=Status.PENDING, queue__in=queues) & overdue


def fail_unstarted_jobs(kernel: Kernel, *, limit: int = 20) -> int:
    """Maintenance step: fail up to ``limit`` jobs past their queue-wait limit, each with its
    stage and run (:func:`.redelivery.give_up_job`, no retry: another delivery would wait for
    the same missing workers). One query when nothing is overdue; none while no stage has a
    limit. Returns the number failed.
    """
    where = unstarted_jobs_filter(kernel)
    if where is None:
        return 0
    from .redelivery import give_up_job

    failed = 0
    with transaction.atomic():
        jobs = list(
            WorkflowJob.objects.select_for_update(skip_locked=True)
            .filter(where)
            .order_by("id")[:limit]
        )
        for job in jobs:
            workflow = kernel.registry.get(job.workflow_id)
            stage = workflow.get_stage(job.stage_id) if workflow is not None else None
            seconds = queue_timeout_seconds(stage) if stage is not None else None
            if seconds is None:  # pragma: no cover - the filter only matches such stages
                continue
            message = queue_timeout_message(job.queue, job.stage_id, seconds)
            if give_up_job(kernel, job, message, QueueTimeout.__name__):
                failed += 1
                logger.warning("Job %s of stage %s: %s", job.pk, job.stage_id, message)
    return failed


def describe(stage: Stage) -> dict[str, Any]:
    """The stage's effective timeouts for listings: ``{"timeout_seconds": float | None,
    "queue_timeout_seconds": float | None}``."""
    return {
        "timeout_seconds": stage_timeout_seconds(stage),
        "queue_timeout_seconds": queue_timeout_seconds(stage),
    }


def text(stage: Stage) -> str:
    """``"timeout 600 s, queue wait 60 s"``: the stage's effective timeouts for listings
    (``workflows_list``, the admin's stage table); ``""`` when it has none."""
    limits = describe(stage)
    parts = []
    if limits["timeout_seconds"] is not None:
        parts.append(f"timeout {limits['timeout_seconds']:g} s")
    if limits["queue_timeout_seconds"] is not None:
        parts.append(f"queue wait {limits['queue_timeout_seconds']:g} s")
    return ", ".join(parts)
