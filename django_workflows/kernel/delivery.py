"""One delivery of a job, from lease to commit: the path every stage takes (SPEC §4.6, §7.2).

A worker runs this story in a loop (:func:`work`):

1. **Lease** (one transaction, only when the worker holds no job yet): lock the next ready
   job (``SKIP LOCKED``; highest priority, then oldest run first), or else claim a PENDING run
   and insert its first job already leased to this worker; stamp the lease with the database's
   clock (:mod:`.leases`); lock the run and check it is RUNNING (the RUNNING guard); mark the
   stage record RUNNING and append ``stage:started``. Once committed, the job belongs to this
   delivery, identified by its token: the job id and the ``attempt`` it was leased with.
2. **Execute** (no transaction): run the stage body while a heartbeat refreshes the lease,
   fenced by the token (a heartbeat that finds the token gone tells the stage, through
   ``ctx.is_cancelled()``, that its result will be discarded). A stage with a timeout
   (:mod:`.timeouts`) is watched by the same heartbeat thread: past the deadline
   ``ctx.is_cancelled()`` turns true and the outcome becomes a ``StageTimeout`` failure; a body
   still running after the grace has that failure committed for it through step 3 (fenced)
   and its worker process recycled.
3. **Outcome** (one transaction): lock the run (RUNNING guard), settle the job *fenced by the
   token* (``UPDATE ... WHERE id = ? AND status = RUNNING AND attempt = ?``), write the
   outcome (stage record, output blob, annotations, logs, events), transition the run (the
   next group's stage records and jobs; the first new job is leased to this worker at once,
   its stage marked RUNNING), and append every event with gap-free sequences. Either all of
   it commits or none of it: a stage can no longer be COMPLETED without its transition.

   A delivery whose lease was taken over (paused past its lease, a skewed clock, a lost
   connection) matches no row: the transaction rolls back and the result is discarded like a
   ghost - no record, output or event changes, only a WARN log line. A run that left RUNNING
   (cancelled) makes the result a ghost: only the job is failed, without retry.
4. If step 3 leased the next stage, go to 2 with it; otherwise to 1.

Transactions 1 and 3 (and each heartbeat) that hit a dead database connection - terminated,
closed by ``idle_session_timeout`` while the stage ran, or refused during a database restart -
are run again on a new connection (:func:`.connections.retry_on_disconnect`, for up to
``RECONNECT_SECONDS``). That is safe because a rolled-back lease leased nothing and the outcome
is fenced by the token; a retried outcome that finds the job already settled at its own
attempt by this very outcome (its COMMIT reached the database, the acknowledgement did not) is
reported committed, not discarded, and a job that a lost commit leased to this worker is
taken back (:func:`_adopt_orphan`). A connection kill so costs one retried write, not a
delivery.

So a trivial stage that continues its run costs one transaction. Crash windows: before a
lease commits nothing happened; after it the job is RUNNING and its lease expires, so
``lease.reapStale`` releases it for another delivery (bounded by ``max_attempts``); before
the outcome commits nothing of the outcome happened; after it everything did. The fault
points of :mod:`.faults` sit at each of these boundaries.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any

from django.db import connection, transaction

from ..conf import workflow_settings
from ..definition.stage import Stage
from ..definition.workflow import StageNode, Workflow
from ..models import Status, WorkflowJob, WorkflowRun, WorkflowStage
from . import events as ev
from . import timeouts
from .connections import discard_connection, retry_on_disconnect
from .executor import ExecutionOutcome
from .faults import fault_point
from .handlers.job_execute import run_stage, start_stage, write_outcome
from .handlers.run_claim_pending import start_claimed_run
from .handlers.run_transition import advance
from .locking import LOCKED, claim_next_pending_run, lock_run, try_lock_run
from .outbox import append_events, caused_by, new_causation_id
from .services import KernelStageServices, forget_run, note_run_not_running
from .store import load_outputs, run_error, stages_of, update_run, update_stage, write_log

if TYPE_CHECKING:
    from .dispatch import Kernel
    from .supervisor import StopSignal

logger = logging.getLogger("django_workflows.worker")


@dataclass
class Delivery:
    """A leased job and everything its execution needs, read in the lease transaction.

    ``job.attempt`` is the delivery's fencing token. ``records`` are the run's stage records
    as of the lease; ``outputs`` the raw outputs (``{stage_id: output}``) of the earlier
    groups' COMPLETED records.
    """

    job: WorkflowJob
    workflow: Workflow
    node: StageNode
    run: WorkflowRun
    record: WorkflowStage
    records: list[WorkflowStage]
    outputs: dict[str, Any]
    resume_state: Any
    started_at: datetime
    causation_id: str = field(default_factory=new_causation_id)


@dataclass
class Outcome:
    """How a delivery ended: ``completed``, ``suspended``, ``failed`` (``retrying`` when the
    job went back to the queue), ``ghost`` (the run left RUNNING) or ``discarded`` (the lease
    was taken over). ``next`` is the delivery this worker leased in the same transaction.
    """

    outcome: str
    error: str | None = None
    retrying: bool = False
    next: Delivery | None = None


class _Discard(Exception):
    """Raised inside the outcome transaction to roll it back: the token no longer owns the job."""


# --- 1. Lease ---------------------------------------------------------------------------------


def lease(kernel: Kernel, worker_id: str, queues: frozenset[str] | None = None) -> Delivery | None:
    """Transaction 1: lease the next ready job (or claim a PENDING run and lease its first job)
    and start its stage. ``None`` when there is no work.

    ``queues``: the queues this worker serves (``None``: all). Only their jobs are leased; a
    claimed run whose first jobs are of other queues is started, its jobs left PENDING for
    their queues' workers (woken after commit), and the next job is tried. Only jobs and
    PENDING runs of definition versions this process's registry runs are leased or claimed
    (``kernel.registry.runnable_versions()``; issue 12 item 3): the others stay for a
    worker that has their version.

    A job whose run is not RUNNING is failed as a ghost, a job whose stage record is already
    COMPLETED (K-JE-5) is completed and its run transitioned, and the next job is tried.
    A transaction that hit a dead database connection (one killed while the worker sat idle
    between tasks, typically) is run again on a new one (:mod:`.connections`).

    A job whose workflow or stage the loaded definition lacks (a reused explicit version, a
    wrong ``takes_over``) is failed with its run at once, naming the versions and the stage
    (``run.error["error_type"]`` ``"DefinitionMismatch"`` or ``"WorkflowNotFound"``), and
    the next job is tried.

    Raises:
        django.db.OperationalError: the database stayed unreachable for ``RECONNECT_SECONDS``.
    """
    while True:
        retried: list[BaseException] = []
        found = retry_on_disconnect(
            lambda retried=retried: _lease_transaction(
                kernel, worker_id, queues, adopt=bool(retried)
            ),
            what="lease",
            on_retry=retried.append,
        )
        if found is _AGAIN:
            continue  # failed instead, or not this worker's queue (committed): look again
        if found is None:
            return None
        fault_point("lease.after_commit")
        return found


#: :func:`_lease_transaction` committed a settlement instead of a delivery: lease again.
_AGAIN: Any = object()


def _lease_transaction(
    kernel: Kernel, worker_id: str, queues: frozenset[str] | None = None, *, adopt: bool = False
) -> Delivery | None:
    """One try of transaction 1 (safe to run again: a rolled-back try leased nothing).
    ``None``: no work; :data:`_AGAIN`: a claimed run was failed instead or its first jobs are
    of queues this worker does not serve, or the job was settled without executing; else the
    delivery.
    ``adopt`` (a retry after a dead connection): first take back a job that the lost try
    may have leased after all (:func:`_adopt_orphan`).
    """
    with transaction.atomic():
        if adopt:
            orphan = _adopt_orphan(kernel, worker_id, resumable=False)
            if orphan is not None:
                return orphan
        events: list[dict[str, Any]] = []
        locked: dict[int, WorkflowRun | None] = {}

        def run_is_free(job: WorkflowJob, locked: dict[int, Any] = locked) -> bool:
            run = try_lock_run(job.workflow_run_id)
            if run is LOCKED:  # never wait for a run while holding a job (deadlocks)
                return False
            locked[job.pk] = run  # type: ignore[assignment]
            return True

        versions = kernel.registry.runnable_versions()  # issue 12 item 3: same statement
        job = kernel.queue.lease_next(
            worker_id, accept=run_is_free, queues=queues, versions=versions
        )
        run: WorkflowRun | None
        records: list[WorkflowStage] | None = None
        if job is not None:
            run = locked[job.pk]
        else:
            run = claim_next_pending_run(versions)
            if run is None:
                return None
            started = start_claimed_run(
                kernel, run, worker_id, events, reserve_for=worker_id, serves=queues
            )
            if started is None or not started.jobs or started.jobs[0].worker_id != worker_id:
                append_events(events, new_causation_id(), kernel.clock.now())
                return _AGAIN
            job, records = started.jobs[0], started.records
        delivery = begin(kernel, job, run, events, records=records)
        append_events(events, new_causation_id(), kernel.clock.now())
        fault_point("lease.before_commit")
    return _AGAIN if delivery is None else delivery


def begin(
    kernel: Kernel,
    job: WorkflowJob,
    run: WorkflowRun | None,
    events: list[dict[str, Any]],
    *,
    records: list[WorkflowStage] | None = None,
    outputs: dict[str, Any] | None = None,
) -> Delivery | None:
    """Start the stage of a job leased in the current transaction, whose run the caller has
    locked (``None``: the run is gone): the RUNNING guard, then phase 1 (record RUNNING,
    ``stage:started`` appended to ``events``). ``records``/``outputs``: what the caller
    already holds of the run (saves reading it again).

    Returns the delivery, or ``None`` when the job was settled instead (ghost: failed; stage
    already COMPLETED: completed and the run transitioned; the workflow or the stage is not in
    the loaded definition: job, stage and run failed at once, :func:`_fail_mismatch`).
    """
    workflow = kernel.registry.get(job.workflow_id)
    if workflow is None or not workflow.has_stage(job.stage_id):
        _fail_mismatch(kernel, job, run, workflow, events)
        return None
    node = workflow.node(job.stage_id)
    if run is None or run.status != Status.RUNNING:
        status = run.status if run is not None else "DELETED"
        kernel.queue.fail(
            job.pk,
            f"Workflow run {job.workflow_run_id} is {status}, not RUNNING; job not executed",
            attempt=job.attempt,
            max_attempts=job.max_attempts,
        )
        return None
    if records is None:
        records = stages_of(run.pk)
    record = next((r for r in records if r.stage_id == node.stage.id), None)
    now = kernel.clock.now()
    if record is not None and record.status == Status.COMPLETED:
        # K-JE-5: the stage already completed (an earlier delivery committed its outcome).
        kernel.queue.complete(job.pk, attempt=job.attempt)
        events += advance(kernel, workflow, run, records, now).events
        return None
    known = outputs or {}
    earlier = [
        r
        for r in records
        if r.execution_group < node.execution_group and r.status == Status.COMPLETED
    ]
    missing = [r for r in earlier if r.stage_id not in known]
    loaded = load_outputs(kernel.blobs, missing) if missing else {}
    earlier_outputs = {r.stage_id: known.get(r.stage_id, loaded.get(r.stage_id)) for r in earlier}
    resume_state = record.suspended_state if record is not None else None
    record = start_stage(run, node, record, job.payload.get("config") or {}, now)
    causation = new_causation_id()  # the delivery's: its stage:started, then its outcome's
    events.append(
        caused_by(
            ev.event(
                ev.STAGE_STARTED,
                run.pk,
                now,
                stage_id=node.stage.id,
                stage_name=node.stage.name,
                stage_number=node.stage_number,
            ),
            causation,
        )
    )
    records = [r for r in records if r.stage_id != record.stage_id] + [record]
    return Delivery(
        job=job,
        workflow=workflow,
        node=node,
        run=run,
        record=record,
        records=records,
        outputs=earlier_outputs,
        resume_state=resume_state,
        started_at=now,
        causation_id=causation,
    )


class _ExecutedTokens:
    """The delivery tokens (job id, attempt) whose stage body this process started, the most
    recent :data:`_EXECUTED_KEPT` of them: :func:`_adopt_orphan` never takes one of them back.
    """

    def __init__(self, kept: int) -> None:
        self._kept = kept
        self._tokens: dict[tuple[int, int], None] = {}
        self._lock = threading.Lock()

    def note(self, job_id: int, attempt: int) -> None:
        with self._lock:
            self._tokens[(job_id, attempt)] = None
            while len(self._tokens) > self._kept:
                self._tokens.pop(next(iter(self._tokens)))

    def seen(self, job_id: int, attempt: int) -> bool:
        with self._lock:
            return (job_id, attempt) in self._tokens


_EXECUTED_KEPT = 4096
_executed = _ExecutedTokens(_EXECUTED_KEPT)
#: Jobs leased to this worker that one take-back looks at (normally there is one at most).
_ADOPT_SCAN = 8


def mismatch_message(job: WorkflowJob, run: WorkflowRun | None, workflow: Workflow | None) -> str:
    """Why a leased job cannot run here: its workflow is not registered, or the loaded
    definition (a reused explicit version, a wrong ``takes_over``) lacks its stage. Names the
    run's definition version, the loaded version and the missing stage.
    """
    version = run.definition_version if run is not None else job.definition_version
    if workflow is None:
        return (
            f"Workflow {job.workflow_id!r} not found in registry: run {job.workflow_run_id} "
            f"(definition version {version!r}) cannot run its stage {job.stage_id!r} here"
        )
    return (
        f"Definition mismatch: run {job.workflow_run_id} of workflow {workflow.id!r} was "
        f"started by definition version {version!r}; the loaded definition is version "
        f"{workflow.version!r} (runs {', '.join(map(repr, workflow.runs_versions))}) and has "
        f"no stage {job.stage_id!r} (its stages: {', '.join(workflow.stage_ids)}). Give a "
        "changed definition a new version, or drop the wrong takes_over"
    )


def _fail_mismatch(
    kernel: Kernel,
    job: WorkflowJob,
    run: WorkflowRun | None,
    workflow: Workflow | None,
    events: list[dict[str, Any]],
) -> None:
    """Settle a job the loaded definition cannot execute, in the lease transaction (issue 12
    item 3): the job FAILED (no redelivery: every delivery would fail the same way), and if
    the run is RUNNING its stage record FAILED, its PENDING/SUSPENDED jobs cancelled and the
    run FAILED with ``run.error`` ``error_type`` ``"DefinitionMismatch"`` (stage missing)
    or ``"WorkflowNotFound"`` (workflow missing, as K-CP-2), ``workflow:failed`` appended to
    ``events``. Runs only on this path: the stage path's statements are unchanged.
    """
    message = mismatch_message(job, run, workflow)
    error_type = "WorkflowNotFound" if workflow is None else "DefinitionMismatch"
    kernel.queue.fail(job.pk, message, attempt=job.attempt, max_attempts=job.max_attempts)
    logger.error(message)
    if run is None or run.status != Status.RUNNING:
        return
    now = kernel.clock.now()
    for record in stages_of(run.pk):
        if record.stage_id == job.stage_id and record.status not in (
            Status.COMPLETED,
            Status.FAILED,
        ):
            update_stage(
                record.pk, now, status=Status.FAILED, error_message=message, completed_at=now
            )
    kernel.queue.cancel_by_run(run.pk)
    update_run(
        run.pk,
        now,
        status=Status.FAILED,
        completed_at=now,
        error=run_error(job.stage_id, message, error_type, delivery=job.attempt),
    )
    run.status = Status.FAILED
    write_log(now, "ERROR", message, run_id=run.pk, metadata={"code": error_type})
    events.append(ev.event(ev.WORKFLOW_FAILED, run.pk, now, error=message))


def _adopt_orphan(
    kernel: Kernel, worker_id: str, *, run_id: Any = None, resumable: bool = True
) -> Delivery | None:
    """In the caller's transaction, take back a job leased to ``worker_id`` by a commit whose
    acknowledgement was lost (the worker saw a dead connection, the database had committed):
    RUNNING, this worker's, its stage record RUNNING, executed by nobody (a worker id names
    one process, which runs one delivery at a time, so none of its deliveries holds it; and
    a job whose body this process already started is never taken back, see
    :class:`_ExecutedTokens`). Its lease is refreshed
    and it is delivered with its own attempt - so the lost acknowledgement costs no delivery.

    Only called on the retry after a connection error (never on the happy path).
    ``resumable=False`` skips async-batch stages: a lease that resumed a suspended stage
    cleared its resume state in the lost commit, so that job is left to lease expiry.
    ``run_id`` limits the search to one run (an outcome's continuation).
    """
    jobs = WorkflowJob.objects.select_for_update(skip_locked=True).filter(
        status=Status.RUNNING, worker_id=worker_id
    )
    if run_id is not None:
        jobs = jobs.filter(workflow_run_id=run_id)
    # Never a job this process has already started executing at that attempt: whatever left
    # it RUNNING, running its body again under the same attempt would be a second delivery
    # that nothing counts (it is left to lease expiry and re-delivered with a new attempt).
    job = next(
        (j for j in jobs.order_by("id")[:_ADOPT_SCAN] if not _executed.seen(j.pk, j.attempt)),
        None,
    )
    if job is None:
        return None
    workflow = kernel.registry.get(job.workflow_id)
    if workflow is None or not workflow.has_stage(job.stage_id):
        return None
    node = workflow.node(job.stage_id)
    if not resumable and node.stage.mode == "async-batch":
        return None
    run = try_lock_run(job.workflow_run_id)
    if run is LOCKED or run is None or run.status != Status.RUNNING:  # type: ignore[union-attr]
        return None
    records = stages_of(run.pk)  # type: ignore[union-attr]
    record = next((r for r in records if r.stage_id == node.stage.id), None)
    if record is None or record.status != Status.RUNNING:
        return None
    if not kernel.queue.touch(job.pk, attempt=job.attempt):
        return None
    earlier = [
        r
        for r in records
        if r.execution_group < node.execution_group and r.status == Status.COMPLETED
    ]
    logger.warning(
        "Stage %s job %s attempt %s: leased to this worker by a commit whose acknowledgement "
        "was lost; delivering it",
        node.stage.id,
        job.pk,
        job.attempt,
    )
    return Delivery(
        job=job,
        workflow=workflow,
        node=node,
        run=run,  # type: ignore[arg-type]
        record=record,
        records=records,
        outputs=load_outputs(kernel.blobs, earlier) if earlier else {},
        resume_state=None,
        started_at=record.started_at or kernel.clock.now(),
    )


# --- 2. Execute -------------------------------------------------------------------------------


def execute(kernel: Kernel, delivery: Delivery) -> tuple[ExecutionOutcome, KernelStageServices]:
    """Step 2: run the stage body (no transaction) while the heartbeat keeps the lease.

    A stage stopped by django-q2's ``timeout`` (its ``TimeoutException``, a ``SystemExit``
    raised by SIGALRM) becomes a failed outcome naming that timeout, with the exception kept
    in ``outcome.stopped`` so :func:`deliver` re-raises it once the outcome committed.

    A stage with a timeout (:func:`.timeouts.stage_timeout_seconds`) is watched by the
    heartbeat (:meth:`Heartbeat.watch`): a delivery that passed its deadline returns the
    ``StageTimeout`` failure instead of what the body returned or raised, and a body still
    running after the grace has that failure committed for it (:func:`_commit_overdue`).
    """
    d = delivery
    _executed.note(d.job.pk, d.job.attempt)
    services = KernelStageServices(
        clock=kernel.clock,
        blobs=kernel.blobs,
        workflow_type=d.run.workflow_type,
        run_id=d.run.pk,
        stage_id=d.node.stage.id,
        stage_pk=d.record.pk,
    )
    interval = float(workflow_settings.HEARTBEAT_INTERVAL_SECONDS)
    timeout = timeouts.stage_timeout_seconds(d.node.stage)
    # Inside an enclosing transaction (a test's atomic block, the test kit) the lease is not
    # visible to the heartbeat thread's connection until that transaction commits: a beat
    # could only report the lease lost (or wait for the test's row locks), so there is none,
    # and no watchdog either: a stage timeout is then judged when the body returns (below).
    beating = Heartbeat if not connection.in_atomic_block else _NoHeartbeat
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
            )
    except BaseException as exc:
        if not is_task_timeout(exc):
            raise
        outcome = ExecutionOutcome(
            error=task_timeout_message(d.node.stage.id, time.monotonic() - began),
            error_type="TaskTimeout",
            stopped=exc,
        )
    if timeout is not None and beating is _NoHeartbeat and time.monotonic() - began > timeout:
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


# --- 3. Outcome -------------------------------------------------------------------------------


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
                if committed.outcome == "completed" and worker_id is not None:
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
        result = _settle_job(kernel, job, outcome, d.node.stage)
        if result is None:
            raise _Discard()
        stage_result, events = write_outcome(
            kernel, run, d.node, d.record, outcome, services, d.started_at, now
        )
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
        if stage_result.outcome == "suspended" or result == Status.PENDING:
            transaction.on_commit(kernel.transport.wake_ticker)
        else:
            stopping = stop is not None and stop.is_set()
            reserve_for = None if stopping else worker_id
            following = _transition(kernel, d, run, stage_result, events, now, reserve_for, queues)
        append_events(events, d.causation_id, now)
        fault_point("outcome.before_commit")
    fault_point("outcome.after_commit")
    return Outcome(
        stage_result.outcome,
        error=stage_result.error,
        retrying=result == Status.PENDING,
        next=following,
    )


_GHOST_SUFFIX = "the result was discarded (expected RUNNING)"


def _adopt_continuation(kernel: Kernel, d: Delivery, worker_id: str) -> Delivery | None:
    """The next stage that the lost-acknowledgement outcome leased to this worker, if any."""

    def adopt() -> Delivery | None:
        with transaction.atomic():
            return _adopt_orphan(kernel, worker_id, run_id=d.run.pk)

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


def _settle_job(
    kernel: Kernel, job: WorkflowJob, outcome: ExecutionOutcome, stage: Stage
) -> str | None:
    """The fence: move the job out of RUNNING only if it is still at this delivery's attempt.
    Returns its new status, or ``None`` if the delivery no longer owns the job.

    The one retry decision of the stage path: a failure is retried unless the outcome says it
    is final (``retryable=False``: validation errors, :class:`StageFailed`) or the job's
    deliveries are used up (``job.max_attempts``, the stage's ``retry=`` or the setting);
    the back-off follows the stage's ``retry=`` policy, else the settings.
    """
    queue = kernel.queue
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
    if outcome.suspend is not None:
        ok = queue.suspend(job.pk, outcome.suspend.next_poll_at, attempt=job.attempt)
        return Status.SUSPENDED if ok else None
    return Status.COMPLETED if queue.complete(job.pk, attempt=job.attempt) else None


def _transition(
    kernel: Kernel,
    d: Delivery,
    run: WorkflowRun,
    stage_result: Any,
    events: list[dict[str, Any]],
    now: datetime,
    worker_id: str | None,
    queues: frozenset[str] | None = None,
) -> Delivery | None:
    """Advance the run in the outcome transaction; returns the next stage's delivery when the
    transition leased one to ``worker_id`` (only a stage of one of its ``queues``).
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
        return None
    return begin(
        kernel, step.reserved_job, run, events, records=records + step.new_records, outputs=outputs
    )


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


# --- The loop ---------------------------------------------------------------------------------


def deliver(
    kernel: Kernel,
    delivery: Delivery,
    worker_id: str | None,
    stop: threading.Event | None = None,
    queues: frozenset[str] | None = None,
) -> Outcome:
    """Steps 2 and 3 for one leased delivery; see :func:`commit_outcome`.

    Raises:
        django_q.exceptions.TimeoutException: django-q2's timeout stopped the stage; it is
            re-raised after the failed outcome committed (the task must end: django-q2 kills
            the worker process moments later).
    """
    outcome, services = execute(kernel, delivery)
    if outcome.stopped is not None:
        commit_outcome(kernel, delivery, outcome, services, None, stop, queues)
        raise outcome.stopped
    return commit_outcome(kernel, delivery, outcome, services, worker_id, stop, queues)


@dataclass
class WorkResult:
    processed: int = 0
    succeeded: int = 0
    failed: int = 0


def work(
    kernel: Kernel,
    worker_id: str,
    *,
    max_jobs: int = 1,
    stop: threading.Event | StopSignal | None = None,
    queues: frozenset[str] | None = None,
) -> WorkResult:
    """Deliver jobs until there is no work, ``max_jobs`` deliveries were made, or ``stop`` is
    set (H-42; Part I item 18: a stop request lets the current delivery finish). A delivery
    that leased its run's next stage continues with it before leasing anything else - unless
    ``stop`` was set meanwhile: then that next stage is released to the queue unstarted
    (:meth:`JobQueue.release`) and one worker of its queue is woken for it.

    ``stop``: anything with ``is_set()`` (a ``threading.Event``, or the worker process's
    :class:`.supervisor.StopSignal`). ``queues``: the queues this worker serves (``None``: all;
    issue 8 item 5).
    """
    out = WorkResult()
    current: Delivery | None = None
    while True:
        if current is None:
            if out.processed >= max_jobs or (stop is not None and stop.is_set()):
                break
            current = lease(kernel, worker_id, queues)
            if current is None:
                break
        elif stop is not None and stop.is_set():
            # The last outcome leased the run's next stage just before the stop: hand it to
            # another worker at once instead of starting it (a stopping worker starts nothing).
            job = current.job
            if retry_on_disconnect(
                lambda job=job: kernel.queue.release(job.pk, attempt=job.attempt),
                what=f"release of job {job.pk}",
            ):
                kernel.transport.wake_workers(1, queue=job.queue)
            break
        can_continue = out.processed + 1 < max_jobs
        result = deliver(kernel, current, worker_id if can_continue else None, stop, queues)
        out.processed += 1
        if result.outcome in ("failed", "ghost", "discarded"):
            out.failed += 1
        else:
            out.succeeded += 1
        current = result.next
    return out


# --- Heartbeat --------------------------------------------------------------------------------


class Heartbeat:
    """Refreshes a job's lease every ``interval_seconds`` while the ``with`` block runs (H-2),
    fenced by ``attempt`` when given. ``lost`` is set once the lease was found taken over; a run
    that left RUNNING is noted for ``ctx.is_cancelled()`` (Part I item 15).

    The beats are sent by one long-lived thread per process (:class:`_Beater`), with its own
    database connection, so a delivery costs no thread start and no new connection.
    """

    def __init__(
        self,
        kernel: Kernel,
        job_id: int,
        interval_seconds: float,
        run_id: object = None,
        *,
        attempt: int | None = None,
    ) -> None:
        self.kernel = kernel
        self.job_id = job_id
        self.run_id = run_id
        self.attempt = attempt
        self.interval = interval_seconds
        self.lost = threading.Event()
        self.next_beat = 0.0
        #: The stage timeout watched by the heartbeat thread (:meth:`watch`), in seconds.
        self.timeout_seconds: float | None = None
        #: Monotonic time of the deadline, then of the end of its grace (set when entered).
        self.deadline: float | None = None
        #: Set (by the heartbeat thread, only while the delivery executes) at the deadline.
        self.timed_out = threading.Event()
        #: Set once the grace ended with the body still running (``on_overdue`` was called).
        self.overdue = threading.Event()
        self._on_overdue: Callable[[], None] | None = None
        self._beater: _Beater | None = None

    def watch(self, timeout_seconds: float, on_overdue: Callable[[], None]) -> Heartbeat:
        """Watch a stage timeout (:mod:`.timeouts`): ``timeout_seconds`` after the block is
        entered, :attr:`timed_out` and :attr:`lost` are set (``ctx.is_cancelled()`` turns
        true); ``STAGE_TIMEOUT_GRACE_SECONDS`` later, if the block still runs,
        ``on_overdue()`` is called in the heartbeat thread. Leaving the block first (under the
        heartbeat thread's lock) ends the watch: a delivery is timed out or not, never both.
        """
        self.timeout_seconds = timeout_seconds
        self._on_overdue = on_overdue
        return self

    def check_deadline(self, now: float) -> bool:
        """Called by the heartbeat thread with the registry lock held: mark the delivery timed
        out at its deadline. Returns ``True`` when the grace has ended too (the caller then
        runs :meth:`fire_overdue` outside the lock)."""
        if self.deadline is None or now < self.deadline:
            return False
        if not self.timed_out.is_set():
            self.timed_out.set()
            self.lost.set()  # ctx.is_cancelled(): stop, the result will be discarded
            self.deadline = now + timeouts.grace_seconds()
            logger.warning(
                "Job %s delivery %s passed its timeout of %g s; cancelling it (grace %g s)",
                self.job_id,
                self.attempt,
                self.timeout_seconds,
                timeouts.grace_seconds(),
            )
            return False
        self.deadline = None
        self.overdue.set()
        return True

    def fire_overdue(self) -> None:
        """The grace ended with the body still running: call ``on_overdue``."""
        if self._on_overdue is not None:
            self._on_overdue()

    def beat(self) -> None:
        """Refresh the lease and note a run that left RUNNING (Part I item 15)."""
        if not self.kernel.queue.touch(self.job_id, attempt=self.attempt):
            if self.attempt is not None:
                self.lost.set()
        if (
            self.run_id is not None
            and not WorkflowRun.objects.filter(pk=self.run_id, status=Status.RUNNING).exists()
        ):
            note_run_not_running(self.run_id)

    def __enter__(self) -> Heartbeat:
        self._beater = _beater
        self._beater.add(self)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._beater is not None:
            self._beater.remove(self)
        if self.run_id is not None:
            forget_run(self.run_id)


class _Beater:
    """The process's heartbeat thread: beats every registered :class:`Heartbeat` when due, and
    is the watchdog of their stage timeouts (:meth:`Heartbeat.watch`). Beat errors are logged
    and ignored (H-2); the thread's connection is closed after one, so a terminated connection
    is never used again (:mod:`.connections`).

    ``thread=False`` (tests): no thread is started; the test calls :meth:`run_due` with the
    monotonic time it wants.
    """

    def __init__(self, *, thread: bool = True) -> None:
        self._cond = threading.Condition()
        self._beats: dict[int, Heartbeat] = {}
        self._thread: threading.Thread | None = None
        self._threaded = thread

    def add(self, beat: Heartbeat) -> None:
        with self._cond:
            now = time.monotonic()
            beat.next_beat = now + beat.interval
            if beat.timeout_seconds is not None:
                beat.deadline = now + beat.timeout_seconds
            self._beats[id(beat)] = beat
            if self._threaded and (self._thread is None or not self._thread.is_alive()):
                self._thread = threading.Thread(target=self._loop, name="heartbeats", daemon=True)
                self._thread.start()
            self._cond.notify()

    def remove(self, beat: Heartbeat) -> None:
        with self._cond:
            self._beats.pop(id(beat), None)
            if not self._beats:
                self._cond.notify()

    def beats(self) -> list[Heartbeat]:
        with self._cond:
            return list(self._beats.values())

    def _due(self, now: float) -> tuple[list[Heartbeat], list[Heartbeat]]:
        """With the lock held: (heartbeats whose timeout grace ended, heartbeats due a beat);
        deadlines reached are marked on the way (:meth:`Heartbeat.check_deadline`)."""
        overdue = [b for b in self._beats.values() if b.check_deadline(now)]
        due = [b for b in self._beats.values() if b.next_beat <= now]
        for b in due:
            b.next_beat = now + b.interval
        return overdue, due

    def _wait_seconds(self, now: float) -> float:
        wake = min(
            (min(b.next_beat, b.deadline or b.next_beat) for b in self._beats.values()),
            default=now + 60,
        )
        return max(0.0, wake - now)

    def run_due(self, now: float) -> None:
        """One pass at monotonic time ``now``: mark deadlines, commit overdue timeouts, beat."""
        with self._cond:
            overdue, due = self._due(now)
        self._send(overdue, due)

    def _loop(self) -> None:
        while True:
            with self._cond:
                if not self._beats:
                    connection.close()  # idle: hold no connection (a test database may go)
                now = time.monotonic()
                overdue, due = self._due(now)
                if not due and not overdue:
                    self._cond.wait(self._wait_seconds(now))
                    continue
            self._send(overdue, due)

    def _send(self, overdue: list[Heartbeat], due: list[Heartbeat]) -> None:
        for b in overdue:
            try:
                b.fire_overdue()
            except Exception:
                logger.exception("Committing the timeout of job %s failed", b.job_id)
                discard_connection()
        for b in due:
            if id(b) not in self._beats:
                continue  # its delivery ended meanwhile
            try:
                # A dead connection is discarded and the beat sent again at once on a new
                # one; if that fails too, the next beat tries again (a lease is several
                # beats long, so one lost beat does not lose it).
                retry_on_disconnect(b.beat, what=f"heartbeat of job {b.job_id}", window_seconds=0)
            except Exception:
                logger.exception("Heartbeat for job %s failed", b.job_id)
                discard_connection()


_beater = _Beater()


class _NoHeartbeat(Heartbeat):
    """A :class:`Heartbeat` that never beats: for a delivery inside an enclosing transaction
    (see :func:`execute`)."""

    def __enter__(self) -> Heartbeat:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


def in_flight() -> list[Heartbeat]:
    """The heartbeats of the deliveries this process is executing now (step 2), each with
    its job id, fencing ``attempt`` and ``lost`` flag (the graceful stop releases them).
    """
    return _beater.beats()
