"""Step 3 of the stage path (:mod:`..delivery`): transaction 3 settles the job fenced by the
delivery's token, writes the outcome (:mod:`.records`), transitions the run
(:mod:`.transition`) and leases the run's next stage to the same worker; a delivery that lost
its job is discarded, one whose run left RUNNING is a ghost.
"""

from __future__ import annotations

import logging
import threading
from datetime import datetime
from typing import TYPE_CHECKING, Any

from django.db import transaction

from ... import telemetry
from ...definition.stage import Stage
from ...models import Status, WorkflowJob, WorkflowRun, WorkflowStage
from .. import rows, timeouts
from ..children import start_child
from ..commands import ExecuteJobResult
from ..connections import retry_on_disconnect
from ..executor import ExecutionOutcome
from ..faults import fault_point
from ..limits import wake_freed
from ..locking import lock_run
from ..mapping import settle_item
from ..mapping_poll import suspended_payload
from ..outbox import append_events
from ..savepoints import rollback_point
from ..services import KernelStageServices
from ..store import stages_of, write_annotations, write_log
from . import Delivery, Outcome, _Discard
from .lease import _AGAIN, _BUSY, HeldRun, _adopt_orphan, begin, lease_within
from .records import Unsent, write_outcome
from .transition import advance

if TYPE_CHECKING:
    from ..dispatch import Kernel

logger = logging.getLogger("django_workflows.worker")


def commit_outcome(
    kernel: Kernel,
    delivery: Delivery,
    outcome: ExecutionOutcome,
    services: KernelStageServices,
    worker_id: str | None,
    stop: threading.Event | None = None,
    queues: frozenset[str] | None = None,
) -> Outcome:
    """Transaction 3: settle the job fenced by the delivery's token, write the outcome,
    transition the run and (with ``worker_id``, unless ``stop`` is set by then) lease the
    run's next stage to this worker if it serves that stage's queue (``queues``; ``None``:
    all).
    """
    d = delivery
    retries: list[BaseException] = []
    try:
        return retry_on_disconnect(
            lambda: _outcome_transaction(kernel, d, outcome, services, worker_id, stop, queues),
            what=f"outcome of stage {d.node.stage.id} (job {d.job.pk}, attempt {d.job.attempt})",
            on_retry=retries.append,
        )
    except _Discard:
        if retries:  # the connection died: maybe after our COMMIT reached the database
            committed = _committed_before(d, outcome)
            if committed is not None:
                if committed.outcome != "ghost" and worker_id is not None:
                    committed.next = _adopt_continuation(kernel, d, worker_id)
                logger.warning(
                    "Stage %s delivery %s of job %s: its outcome had committed before the "
                    "connection was lost (COMMIT acknowledgement lost)",
                    d.node.stage.id,
                    d.job.attempt,
                    d.job.pk,
                )
                return committed
        retry_on_disconnect(lambda: _log_discarded(kernel, d, outcome), what="discard log")
        telemetry.lease_lost(d)
        return Outcome("discarded", error=outcome.error)


def _outcome_transaction(
    kernel: Kernel,
    d: Delivery,
    outcome: ExecutionOutcome,
    services: KernelStageServices,
    worker_id: str | None,
    stop: threading.Event | None,
    queues: frozenset[str] | None = None,
) -> Outcome:
    """One try of transaction 3; see :func:`_stage_transaction`. The fault point
    ``outcome.after_commit`` follows the commit (not a ghost's).
    """
    result = _stage_transaction(kernel, d, outcome, services, worker_id, stop, queues)
    if result.outcome != "ghost":
        fault_point("outcome.after_commit")
    return result


def _stage_transaction(
    kernel: Kernel,
    d: Delivery,
    outcome: ExecutionOutcome,
    services: KernelStageServices,
    worker_id: str | None,
    stop: threading.Event | None,
    queues: frozenset[str] | None = None,
) -> Outcome:
    """One try of transaction 3 (safe to run again: the fence makes a second commit of the
    same outcome impossible). Raises :class:`_Discard` when the token no longer owns the job.
    """
    job = d.job
    with transaction.atomic():
        run = lock_run(d.run.pk)
        if run is None or run.status != Status.RUNNING:
            status = run.status if run is not None else "DELETED"
            error = f"Workflow run {d.run.pk} was {status} after stage execution; {_GHOST_SUFFIX}"
            if kernel.queue.fail(job.pk, error, attempt=job.attempt) is None:
                raise _Discard()  # not ours any more either: a stale delivery
            return Outcome("ghost", error=error)
        now = kernel.clock.now()
        if outcome.suspend is not None and d.node.stage.child is not None:
            # A child-workflow stage: its child run commits with this outcome or not at all.
            start_child(kernel, run, d.record, d.node.stage, outcome)
        if job.item_index is not None:  # a map item (issue 18 item 3)
            return _item_outcome(kernel, d, run, outcome, services, now, worker_id, stop, queues)
        # The stage record's outcome, then the fence. A completed stage's record update and
        # output blob are not sent on their own: they ride in the fence's UPDATE (on
        # PostgreSQL one statement for the three; issue 19), and a fence that holds no more
        # rolls all of it back with the transaction. A blob store outside the database is
        # written only once the fence held (no rollback undoes it).
        unsent = Unsent()
        stage_result, events = write_outcome(
            kernel, run, d.node, d.record, outcome, services, d.started_at, now, unsent
        )
        result = _settle_job(kernel, job, outcome, d.node.stage, unsent.writes)
        if result is None:
            raise _Discard()
        for put in unsent.after_fence:
            put()
        wake_freed(kernel.transport, d.workflow, job.queue)  # free unless limited (issue 18)
        for warning in outcome.warnings:
            write_log(now, "WARN", warning, run_id=run.pk, stage_pk=d.record.pk)
        if stage_result.outcome == "failed":
            write_log(
                now,
                "ERROR",
                f"Stage {d.node.stage.id} failed: {stage_result.error}",
                run_id=run.pk,
                stage_pk=d.record.pk,
            )
        following: Delivery | None = None
        held: HeldRun | None = None
        stopping = stop is not None and stop.is_set()
        reserve_for = None if stopping else worker_id
        if stage_result.outcome == "suspended" or result == Status.PENDING:
            transaction.on_commit(kernel.transport.wake_ticker)
        else:
            following, held = _transition(
                kernel, d, run, stage_result, events, now, reserve_for, queues
            )
        telemetry.runs_ended_at_commit(d.workflow.id, events, run.started_at, now)
        # Not continuing its own run, the worker leases its next delivery in this same
        # commit (issue 19: one transaction fewer per lease; runs locked without waiting).
        # The lease's events join the outcome's: a sibling stage of this run costs no
        # sequence bump of its own.
        looked = following is None and reserve_for is not None
        found: Any = None
        if looked:
            found = _lease_next(kernel, reserve_for, queues, held, events)  # type: ignore[arg-type]
            following = None if found is _AGAIN or found is _FAILED or found is _BUSY else found
        append_events(events, d.causation_id, now)
        fault_point("outcome.before_commit")
    return Outcome(
        stage_result.outcome,
        error=stage_result.error,
        retrying=result == Status.PENDING,
        next=following,
        result=stage_result,
        no_work=looked and found is None,  # _BUSY: the worker leases again on its own
    )


#: :func:`_lease_next` failed (logged); the worker leases again in a transaction of its own.
_FAILED: Any = object()


def _lease_next(
    kernel: Kernel,
    worker_id: str,
    queues: frozenset[str] | None,
    held: HeldRun | None,
    events: list[dict[str, Any]],
) -> Any:
    """The worker's next delivery, leased in the outcome's transaction
    (:func:`.lease.lease_within`), inside a savepoint: whatever goes wrong while leasing
    another job (a missing output blob of its run, a blob store's error, a failed statement)
    rolls back the lease only, never the outcome it rides with; :data:`_FAILED` then, and the
    worker's next :func:`.lease.lease` meets the error in its own transaction, as before.
    The savepoint is never released, only rolled back to (:func:`..savepoints.rollback_point`:
    the commit ends it, one round trip fewer).

    The lease's events (with their own causation) are added to the outcome's ``events`` once
    the lease held; a rolled-back lease adds none.
    """
    leased: list[dict[str, Any]] = []
    try:
        with rollback_point():
            found = lease_within(kernel, worker_id, queues, held, events_out=leased)
    except Exception:
        if transaction.get_connection().needs_rollback:
            raise  # the savepoint could not be rolled back (a dead connection): not ours to hide
        logger.exception("Leasing the next delivery with an outcome failed; leasing on its own")
        return _FAILED
    events += leased
    return found


_GHOST_SUFFIX = "the result was discarded (expected RUNNING)"


def _item_outcome(
    kernel: Kernel,
    d: Delivery,
    run: WorkflowRun,
    outcome: ExecutionOutcome,
    services: KernelStageServices,
    now: datetime,
    worker_id: str | None,
    stop: threading.Event | None,
    queues: frozenset[str] | None,
) -> Outcome:
    """Transaction 3 for a map item, inside :func:`_outcome_transaction` (run locked and
    RUNNING): the fenced job update (COMPLETED with its ``item_output``, back to PENDING for a
    retry, or FAILED), the item's annotations (scope ``"item"``, scope id its index) and
    warnings, then :func:`..mapping.settle_item`; the last item's settlement completes the
    stage and transitions the run (the next stage may be leased to this worker).
    """
    job = d.job
    index = job.item_index
    error = outcome.error
    if error is None and outcome.suspend is not None:  # an async-batch item: polled on its own
        s = outcome.suspend
        payload = suspended_payload(job.payload or {}, s)
        if not kernel.queue.suspend(
            job.pk, s.next_poll_at, attempt=job.attempt, extra={"payload": payload}
        ):
            raise _Discard()
        events = write_annotations(
            run.pk, outcome.annotations, now=now, scope="item", scope_id=str(index),
            stage_pk=d.record.pk, generation=d.record.generation,
        )  # fmt: skip
        append_events(events, d.causation_id, now)
        transaction.on_commit(kernel.transport.wake_ticker)
        fault_point("outcome.before_commit")
        return Outcome("suspended")
    if error is not None:
        retry = outcome.retryable is not False and job.attempt < job.max_attempts
        status = kernel.queue.fail(
            job.pk,
            error,
            should_retry=retry,
            attempt=job.attempt,
            max_attempts=job.max_attempts,
            policy=d.node.stage.retry,
        )
    else:
        done = kernel.queue.complete(
            job.pk, attempt=job.attempt, extra={"item_output": outcome.output}
        )
        status = Status.COMPLETED if done else None
    if status is None:
        raise _Discard()
    events: list[dict[str, Any]] = write_annotations(
        run.pk,
        outcome.annotations,
        now=now,
        scope="item",
        scope_id=str(index),
        stage_pk=d.record.pk,
        generation=d.record.generation,
    )
    for warning in outcome.warnings:
        write_log(now, "WARN", warning, run_id=run.pk, stage_pk=d.record.pk)
    if error is not None:
        write_log(
            now,
            "WARN" if status == Status.PENDING else "ERROR",
            f"Stage {d.node.stage.id} item {index} failed: {error}",
            run_id=run.pk,
            stage_pk=d.record.pk,
            metadata={"item_index": index, "attempt": job.attempt},
        )
    following: Delivery | None = None
    if status == Status.PENDING:
        transaction.on_commit(kernel.transport.wake_ticker)
    else:
        stopping = stop is not None and stop.is_set()
        reserve_for = None if stopping else worker_id
        settled = settle_item(
            kernel,
            run,
            d.node,
            d.record.pk,
            job,
            now,
            error=error if status else None,
            reserve_for=reserve_for,
        )
        events += settled.events
        if settled.promoted is not None:  # the next item, leased to this worker
            following = begin(
                kernel, settled.promoted, run, events, records=d.records, outputs=d.outputs
            )
        if settled.finished:
            following, _ = _transition(
                kernel,
                d,
                run,
                ExecuteJobResult("completed", output=settled.output),
                events,
                now,
                reserve_for,
                queues,
            )
    append_events(events, d.causation_id, now)
    telemetry.runs_ended_at_commit(d.workflow.id, events, run.started_at, now)
    fault_point("outcome.before_commit")
    return Outcome(
        "completed" if error is None else "failed",
        error=error,
        retrying=status == Status.PENDING,
        next=following,
    )


def _adopt_continuation(kernel: Kernel, d: Delivery, worker_id: str) -> Delivery | None:
    """The delivery that the lost-acknowledgement outcome leased to this worker, if any."""

    def adopt() -> Delivery | None:
        with transaction.atomic():  # its run's next stage, or a job of another run leased next
            return _adopt_orphan(kernel, worker_id)

    return retry_on_disconnect(adopt, what="continuation after a lost acknowledgement")


def _committed_before(d: Delivery, outcome: ExecutionOutcome) -> Outcome | None:
    """After a retried outcome transaction found the job gone from its token: was it this
    delivery's own earlier try that settled it (its COMMIT reached the database, the
    acknowledgement did not)? Only then is the job still at this delivery's attempt, in the
    status this outcome gives it, with the stage record showing this outcome. Two reads, on
    this rare path only. The outcome's continuation (a next stage leased to this worker in
    that commit), if any, is not resumed: its lease expires and it is delivered again.
    """
    job = WorkflowJob.objects.filter(pk=d.job.pk).values("status", "attempt", "last_error").first()
    if job is None or job["attempt"] != d.job.attempt:
        return None
    if job["status"] == Status.FAILED and (job["last_error"] or "").endswith(_GHOST_SUFFIX):
        return Outcome("ghost", error=job["last_error"])
    if d.job.item_index is not None:  # a map item: its job alone shows its outcome
        return _item_committed_before(job, outcome)
    record = WorkflowStage.objects.filter(pk=d.record.pk).values("status", "error_message").first()
    if record is None:
        return None
    if outcome.error is not None:
        mine = record["status"] == Status.FAILED and record["error_message"] == outcome.error
        if mine and job["status"] in (Status.PENDING, Status.FAILED):
            if job["last_error"] == outcome.error:
                return Outcome(
                    "failed", error=outcome.error, retrying=job["status"] == Status.PENDING
                )
        return None
    if outcome.suspend is not None:
        both = job["status"] == record["status"] == Status.SUSPENDED
        return Outcome("suspended") if both else None
    both = job["status"] == record["status"] == Status.COMPLETED
    return Outcome("completed") if both else None


def _item_committed_before(job: dict[str, Any], outcome: ExecutionOutcome) -> Outcome | None:
    """:func:`_committed_before` for a map item (its stage record stays RUNNING)."""
    if outcome.error is not None:
        mine = (
            job["status"] in (Status.PENDING, Status.FAILED) and job["last_error"] == outcome.error
        )
        if mine:
            return Outcome("failed", error=outcome.error, retrying=job["status"] == Status.PENDING)
        return None
    if outcome.suspend is not None:
        return Outcome("suspended") if job["status"] == Status.SUSPENDED else None
    return Outcome("completed") if job["status"] == Status.COMPLETED else None


def _settle_job(
    kernel: Kernel,
    job: WorkflowJob,
    outcome: ExecutionOutcome,
    stage: Stage,
    unsent: list[rows.Write],
) -> str | None:
    """The fence: move the job out of RUNNING only if it is still at this delivery's attempt.
    Returns its new status, or ``None`` if the delivery no longer owns the job. ``unsent``:
    the outcome's writes not sent yet (:func:`.records.write_outcome`), sent with the fence.

    The one retry decision of the stage path: a failure is retried unless the outcome says it
    is final (``retryable=False``: validation errors, :class:`StageFailed`) or the job's
    deliveries are used up (``job.max_attempts``, the stage's ``retry=`` or the setting);
    the back-off follows the stage's ``retry=`` policy, else the settings.
    """
    queue = kernel.queue
    if outcome.error is None and outcome.suspend is None:
        done = queue.complete(job.pk, attempt=job.attempt, carrying=unsent)
        return Status.COMPLETED if done else None
    rows.send(unsent)  # (none: only a completed outcome leaves writes unsent)
    if outcome.error is not None:
        retry = outcome.retryable is not False and job.attempt < job.max_attempts
        return queue.fail(
            job.pk,
            outcome.error,
            should_retry=retry,
            attempt=job.attempt,
            max_attempts=job.max_attempts,
            policy=stage.retry,
        )
    ok = queue.suspend(job.pk, outcome.suspend.next_poll_at, attempt=job.attempt)
    return Status.SUSPENDED if ok else None


def _transition(
    kernel: Kernel,
    d: Delivery,
    run: WorkflowRun,
    stage_result: Any,
    events: list[dict[str, Any]],
    now: datetime,
    worker_id: str | None,
    queues: frozenset[str] | None = None,
) -> tuple[Delivery | None, HeldRun | None]:
    """Advance the run in the outcome transaction; returns the next stage's delivery when the
    transition leased one to ``worker_id`` (only a stage of one of its ``queues``), and the
    run as this transaction holds it (:class:`.lease.HeldRun`) when the transition left it
    as it was (a sibling stage still open): the worker's next lease may take a sibling's job
    with it.
    """
    d.record.status = Status.COMPLETED if stage_result.outcome == "completed" else Status.FAILED
    d.record.error_message = stage_result.error
    if len(d.workflow.stages_in_group(d.node.execution_group)) > 1:
        records = stages_of(run.pk)  # siblings may have changed since the lease
    else:
        records = d.records  # a single-stage group: nothing else can have changed
    outputs = dict(d.outputs)
    if stage_result.outcome == "completed":
        outputs[d.node.stage.id] = stage_result.output
    step = advance(
        kernel, d.workflow, run, records, now, outputs=outputs, reserve_for=worker_id, serves=queues
    )
    events += step.events
    if step.reserved_job is None:
        # noop: the run stays RUNNING with these very records (nothing opened or ended)
        return None, HeldRun(run, records, outputs) if step.result.action == "noop" else None
    following = begin(
        kernel, step.reserved_job, run, events, records=records + step.new_records,
        outputs=outputs, started=step.started_record,
    )  # fmt: skip
    return following, None


def _log_discarded(kernel: Kernel, d: Delivery, outcome: ExecutionOutcome) -> None:
    what = "failure" if outcome.error is not None else "result"
    message = (
        f"Stage {d.node.stage.id} delivery {d.job.attempt} of job {d.job.pk}: its lease was "
        f"taken over before it finished; its {what} was discarded"
    )
    if timeouts.is_timeout_error(outcome.error):
        message = (
            f"Stage {d.node.stage.id} delivery {d.job.attempt} of job {d.job.pk} returned after "
            "its timeout had been committed (or its lease was taken over); its late result "
            "was discarded"
        )
    logger.warning(message)
    write_log(
        kernel.clock.now(),
        "WARN",
        message,
        run_id=d.run.pk,
        metadata={"job_id": d.job.pk, "attempt": d.job.attempt, "stage_id": d.node.stage.id},
    )
