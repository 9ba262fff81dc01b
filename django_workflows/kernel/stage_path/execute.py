"""Step 2 of the stage path (:mod:`..delivery`): run the stage body, no transaction open,
while the heartbeat (:mod:`..heartbeat`) keeps the lease and watches the stage's timeout.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from django.db import connection

from ...conf import workflow_settings
from .. import timeouts
from ..executor import ExecutionOutcome
from ..faults import fault_point
from ..heartbeat import Heartbeat, NoHeartbeat
from ..services import KernelStageServices
from . import Delivery
from . import lease as lease_step
from .outcome import commit_outcome
from .records import NO_ITEM, run_stage

if TYPE_CHECKING:
    from ..dispatch import Kernel

logger = logging.getLogger("django_workflows.worker")


def execute(kernel: Kernel, delivery: Delivery) -> tuple[ExecutionOutcome, KernelStageServices]:
    """Step 2: run the stage body (no transaction) while the heartbeat keeps the lease.

    A stage stopped by django-q2's ``timeout`` (its ``TimeoutException``, a ``SystemExit``
    raised by SIGALRM) becomes a failed outcome naming that timeout, with the exception kept
    in ``outcome.stopped`` so :func:`..delivery.deliver` re-raises it once the outcome committed.

    A stage with a timeout (:func:`.timeouts.stage_timeout_seconds`) is watched by the
    heartbeat (:meth:`Heartbeat.watch`): a delivery that passed its deadline returns the
    ``StageTimeout`` failure instead of what the body returned or raised, and a body still
    running after the grace has that failure committed for it (:func:`_commit_overdue`).
    """
    d = delivery
    lease_step._executed.note(d.job.pk, d.job.attempt)
    services = KernelStageServices(
        clock=kernel.clock,
        blobs=kernel.blobs,
        workflow_type=d.run.workflow_type,
        run_id=d.run.pk,
        stage_id=d.node.stage.id,
        stage_pk=d.record.pk,
    )
    services.item_index = d.job.item_index
    if d.job.item_index is not None:
        services.item_token = (d.job.pk, d.job.attempt)
    interval = float(workflow_settings.HEARTBEAT_INTERVAL_SECONDS)
    timeout = timeouts.stage_timeout_seconds(d.node.stage)
    # Inside an enclosing transaction (a test's atomic block, the test kit) the lease is not
    # visible to the heartbeat thread's connection until that transaction commits: a beat
    # could only report the lease lost (or wait for the test's row locks), so there is none,
    # and no watchdog either: a stage timeout is then judged when the body returns (below).
    beating = Heartbeat if not connection.in_atomic_block else NoHeartbeat
    beat = beating(kernel, d.job.pk, interval, d.run.pk, attempt=d.job.attempt)
    if timeout is not None:
        beat.watch(timeout, lambda: _commit_overdue(kernel, d, services, timeout))
    began = time.monotonic()
    try:
        with beat:
            services.lease_lost = beat.lost
            outcome = run_stage(
                kernel,
                d.workflow,
                d.node,
                d.run,
                d.record,
                d.job.payload.get("config") or None,
                d.outputs,
                d.resume_state,
                services,
                d.started_at,
                d.job.payload.get("item") if d.job.item_index is not None else NO_ITEM,
            )
    except BaseException as exc:
        if not is_task_timeout(exc):
            raise
        outcome = ExecutionOutcome(
            error=task_timeout_message(d.node.stage.id, time.monotonic() - began),
            error_type="TaskTimeout",
            stopped=exc,
        )
    if timeout is not None and beating is NoHeartbeat and time.monotonic() - began > timeout:
        beat.timed_out.set()  # as the watchdog would have: a test sees the production outcome
    if beat.timed_out.is_set():  # past the deadline: whatever the body returned is discarded
        stopped = outcome.stopped
        outcome = timeouts.timed_out(d.node.stage, timeout)  # type: ignore[arg-type]
        outcome.stopped = stopped
    fault_point("stage.executing")
    return outcome, services


def _commit_overdue(
    kernel: Kernel, d: Delivery, services: KernelStageServices, timeout: float
) -> None:
    """The watchdog's step 3 (heartbeat thread) for a body still running past its timeout and
    grace: commit its ``StageTimeout`` failure through the fenced outcome transaction (nothing
    commits if the delivery no longer owns the job), then free the worker
    (:func:`.timeouts.recycle_worker`).
    """
    try:
        commit_outcome(kernel, d, timeouts.timed_out(d.node.stage, timeout), services, None)
    finally:
        timeouts.recycle_worker(d.node.stage.id, d.job.pk)


def is_task_timeout(exc: BaseException) -> bool:
    """Whether ``exc`` is django-q2's ``TimeoutException`` (a ``SystemExit`` subclass raised in
    the task by SIGALRM once ``Q_CLUSTER["timeout"]`` has passed; the guard kills the worker
    process about 3 s later).
    """
    try:
        from django_q.exceptions import TimeoutException
    except ImportError:  # pragma: no cover - django-q2 is a dependency
        return False
    return isinstance(exc, TimeoutException)


def task_timeout_message(stage_id: str, stage_seconds: float) -> str:
    """The error of a stage stopped by django-q2's timeout (``Q_CLUSTER["timeout"]`` seconds,
    counted from the start of the django-q2 task, which may have delivered earlier stages).
    """
    try:
        from django_q.conf import Conf

        limit = f"{Conf.TIMEOUT} s"
    except Exception:  # pragma: no cover - settings without Q_CLUSTER
        limit = "unset"
    return (
        f"TaskTimeout: stage {stage_id!r} was stopped by django-q2's timeout "
        f"(Q_CLUSTER['timeout'] = {limit}) after {stage_seconds:.1f} s in the stage; the "
        "timeout counts from the start of the django-q2 task. Raise Q_CLUSTER['timeout'] (and "
        "'retry' above it) if the stage needs longer"
    )
