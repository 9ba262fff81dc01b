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
   ``ctx.is_cancelled()``, that its result will be discarded).
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
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any

from django.db import connection, transaction

from ..conf import workflow_settings
from ..definition.workflow import StageNode, Workflow
from ..models import Status, WorkflowJob, WorkflowRun, WorkflowStage
from . import events as ev
from .errors import StageNotFoundError, WorkflowNotFoundError
from .executor import ExecutionOutcome
from .faults import fault_point
from .handlers.job_execute import run_stage, start_stage, write_outcome
from .handlers.run_claim_pending import start_claimed_run
from .handlers.run_transition import advance
from .locking import LOCKED, claim_next_pending_run, lock_run, try_lock_run
from .outbox import append_events, new_causation_id
from .services import KernelStageServices, forget_run, note_run_not_running
from .store import load_outputs, stages_of, write_log

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


class _Unexecutable(Exception):
    """The leased job's workflow or stage is not registered in this process."""


class _Discard(Exception):
    """Raised inside the outcome transaction to roll it back: the token no longer owns the job."""


# --- 1. Lease ---------------------------------------------------------------------------------


def lease(kernel: Kernel, worker_id: str) -> Delivery | None:
    """Transaction 1: lease the next ready job (or claim a PENDING run and lease its first job)
    and start its stage. ``None`` when there is no work.

    A job whose run is not RUNNING is failed as a ghost, a job whose stage record is already
    COMPLETED (K-JE-5) is completed and its run transitioned, and the next job is tried.

    Raises:
        WorkflowNotFoundError, StageNotFoundError: the job names a workflow or stage this
            process does not have; the lease stays committed and expires (re-delivery is
            bounded by ``max_attempts``).
    """
    while True:
        unexecutable: Exception | None = None
        with transaction.atomic():
            events: list[dict[str, Any]] = []
            locked: dict[int, WorkflowRun | None] = {}

            def run_is_free(job: WorkflowJob, locked: dict[int, Any] = locked) -> bool:
                run = try_lock_run(job.workflow_run_id)
                if run is LOCKED:  # never wait for a run while holding a job (deadlocks)
                    return False
                locked[job.pk] = run  # type: ignore[assignment]
                return True

            job = kernel.queue.lease_next(worker_id, accept=run_is_free)
            run: WorkflowRun | None
            records: list[WorkflowStage] | None = None
            if job is not None:
                run = locked[job.pk]
            else:
                run = claim_next_pending_run()
                if run is None:
                    return None
                started = start_claimed_run(kernel, run, worker_id, events, reserve_for=worker_id)
                if started is None or not started.jobs:
                    append_events(events, new_causation_id(), kernel.clock.now())
                    continue  # the run was failed instead (committed): look again
                job, records = started.jobs[0], started.records
            try:
                delivery = begin(kernel, job, run, events, records=records)
            except _Unexecutable as exc:
                delivery, unexecutable = None, exc.__cause__
            append_events(events, new_causation_id(), kernel.clock.now())
            fault_point("lease.before_commit")
        if unexecutable is not None:
            raise unexecutable
        if delivery is not None:
            fault_point("lease.after_commit")
            return delivery


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
    already COMPLETED: completed and the run transitioned).

    Raises:
        _Unexecutable: the workflow or stage is not registered here (the lease stays).
    """
    workflow = kernel.registry.get(job.workflow_id)
    try:
        if workflow is None:
            raise WorkflowNotFoundError(job.workflow_id)
        if not workflow.has_stage(job.stage_id):
            raise StageNotFoundError(workflow.id, job.stage_id, workflow.stage_ids)
    except (WorkflowNotFoundError, StageNotFoundError) as exc:
        raise _Unexecutable() from exc
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
    events.append(
        ev.event(
            ev.STAGE_STARTED,
            run.pk,
            now,
            stage_id=node.stage.id,
            stage_name=node.stage.name,
            stage_number=node.stage_number,
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
    )


# --- 2. Execute -------------------------------------------------------------------------------


def execute(kernel: Kernel, delivery: Delivery) -> tuple[ExecutionOutcome, KernelStageServices]:
    """Step 2: run the stage body (no transaction) while the heartbeat keeps the lease."""
    d = delivery
    services = KernelStageServices(
        clock=kernel.clock,
        blobs=kernel.blobs,
        workflow_type=d.run.workflow_type,
        run_id=d.run.pk,
        stage_id=d.node.stage.id,
        stage_pk=d.record.pk,
    )
    interval = float(workflow_settings.HEARTBEAT_INTERVAL_SECONDS)
    with Heartbeat(kernel, d.job.pk, interval, d.run.pk, attempt=d.job.attempt) as beat:
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
    fault_point("stage.executing")
    return outcome, services


# --- 3. Outcome -------------------------------------------------------------------------------


def commit_outcome(
    kernel: Kernel,
    delivery: Delivery,
    outcome: ExecutionOutcome,
    services: KernelStageServices,
    worker_id: str | None,
    stop: threading.Event | None = None,
) -> Outcome:
    """Transaction 3: settle the job fenced by the delivery's token, write the outcome,
    transition the run and (with ``worker_id``, unless ``stop`` is set by then) lease the
    run's next stage to this worker.
    """
    d = delivery
    job = d.job
    try:
        with transaction.atomic():
            run = lock_run(d.run.pk)
            if run is None or run.status != Status.RUNNING:
                status = run.status if run is not None else "DELETED"
                error = (
                    f"Workflow run {d.run.pk} was {status} after stage execution; "
                    "the result was discarded (expected RUNNING)"
                )
                if kernel.queue.fail(job.pk, error, attempt=job.attempt) is None:
                    raise _Discard()  # not ours any more either: a stale delivery
                return Outcome("ghost", error=error)
            now = kernel.clock.now()
            result = _settle_job(kernel, job, outcome)
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
                following = _transition(kernel, d, run, stage_result, events, now, reserve_for)
            append_events(events, d.causation_id, now)
            fault_point("outcome.before_commit")
    except _Discard:
        _log_discarded(kernel, d, outcome)
        return Outcome("discarded", error=outcome.error)
    fault_point("outcome.after_commit")
    return Outcome(
        stage_result.outcome,
        error=stage_result.error,
        retrying=result == Status.PENDING,
        next=following,
    )


def _settle_job(kernel: Kernel, job: WorkflowJob, outcome: ExecutionOutcome) -> str | None:
    """The fence: move the job out of RUNNING only if it is still at this delivery's attempt.
    Returns its new status, or ``None`` if the delivery no longer owns the job.
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
) -> Delivery | None:
    """Advance the run in the outcome transaction; returns the next stage's delivery when the
    transition leased one to ``worker_id``.
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
    step = advance(kernel, d.workflow, run, records, now, outputs=outputs, reserve_for=worker_id)
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
) -> Outcome:
    """Steps 2 and 3 for one leased delivery; see :func:`commit_outcome`."""
    outcome, services = execute(kernel, delivery)
    return commit_outcome(kernel, delivery, outcome, services, worker_id, stop)


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
) -> WorkResult:
    """Deliver jobs until there is no work, ``max_jobs`` deliveries were made, or ``stop`` is
    set (H-42; Part I item 18: a stop request lets the current delivery finish). A delivery
    that leased its run's next stage continues with it before leasing anything else - unless
    ``stop`` was set meanwhile: then that next stage is released to the queue unstarted
    (:meth:`JobQueue.release`) and one worker is woken for it.

    ``stop``: anything with ``is_set()`` (a ``threading.Event``, or the worker process's
    :class:`.supervisor.StopSignal`).
    """
    out = WorkResult()
    current: Delivery | None = None
    while True:
        if current is None:
            if out.processed >= max_jobs or (stop is not None and stop.is_set()):
                break
            current = lease(kernel, worker_id)
            if current is None:
                break
        elif stop is not None and stop.is_set():
            # The last outcome leased the run's next stage just before the stop: hand it to
            # another worker at once instead of starting it (a stopping worker starts nothing).
            if kernel.queue.release(current.job.pk, attempt=current.job.attempt):
                kernel.transport.wake_workers(1)
            break
        can_continue = out.processed + 1 < max_jobs
        result = deliver(kernel, current, worker_id if can_continue else None, stop)
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
        _beater.add(self)
        return self

    def __exit__(self, *exc: object) -> None:
        _beater.remove(self)
        if self.run_id is not None:
            forget_run(self.run_id)


class _Beater:
    """The process's heartbeat thread: beats every registered :class:`Heartbeat` when due.
    Beat errors are logged and ignored (H-2); the thread's connection is closed after one.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._beats: dict[int, Heartbeat] = {}
        self._thread: threading.Thread | None = None

    def add(self, beat: Heartbeat) -> None:
        with self._cond:
            beat.next_beat = time.monotonic() + beat.interval
            self._beats[id(beat)] = beat
            if self._thread is None or not self._thread.is_alive():
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

    def _loop(self) -> None:
        while True:
            with self._cond:
                if not self._beats:
                    connection.close()  # idle: hold no connection (a test database may go)
                now = time.monotonic()
                due = [b for b in self._beats.values() if b.next_beat <= now]
                if not due:
                    wake = min((b.next_beat for b in self._beats.values()), default=now + 60)
                    self._cond.wait(max(0.0, wake - now))
                    continue
                for b in due:
                    b.next_beat = now + b.interval
            for b in due:
                if id(b) not in self._beats:
                    continue  # its delivery ended meanwhile
                try:
                    b.beat()
                except Exception:
                    logger.exception("Heartbeat for job %s failed", b.job_id)
                    connection.close()


_beater = _Beater()


def in_flight() -> list[Heartbeat]:
    """The heartbeats of the deliveries this process is executing now (step 2), each with
    its job id, fencing ``attempt`` and ``lost`` flag (the graceful stop releases them).
    """
    return _beater.beats()
