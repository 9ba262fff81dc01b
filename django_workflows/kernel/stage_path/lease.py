"""Step 1 of the stage path (:mod:`..delivery`): transaction 1 leases the next ready job (or
claims a PENDING run and leases its first job), checks the run is RUNNING (the RUNNING guard),
and starts the stage (record RUNNING, ``stage:started``); a job the loaded definition cannot
run is failed with its run; a job a lost commit leased to this worker is taken back.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from django.db import transaction

from ...definition.workflow import StageNode, Workflow
from ...logging import job_fields
from ...models import Status, WorkflowJob, WorkflowRun, WorkflowStage
from .. import events as ev
from ..connections import retry_on_disconnect
from ..faults import fault_point
from ..handlers.run_claim_pending import start_claimed_run
from ..limits import check_job, claim_next_allowed_run, job_gate
from ..locking import LOCKED, claim_next_pending_run, lock_run, try_lock_run
from ..outbox import append_events, caused_by, caused_by_unless_marked, new_causation_id
from ..store import load_outputs, run_error, stages_of, update_run, update_stage, write_log
from . import Delivery
from .records import start_stage
from .transition import advance

if TYPE_CHECKING:
    from ..dispatch import Kernel

logger = logging.getLogger("django_workflows.worker")


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
    busy_tries = 0
    began = time.time_ns()
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
        if found is _BUSY:
            busy_tries += 1
            if busy_tries > BUSY_RETRIES:
                return None  # still locked: its holder's commit wakes or leases it
            time.sleep(BUSY_RETRY_SECONDS)  # an outcome transaction commits in milliseconds
            continue
        if found is None:
            return None
        fault_point("lease.after_commit")
        found.lease_began_ns = began
        return found


#: :func:`_lease_transaction` committed a settlement instead of a delivery: lease again.
_AGAIN: Any = object()
#: :func:`lease_within` found no job to lease, but passed over a ready job because another
#: transaction held its run (an outcome of that run in flight): look again shortly. Two
#: workers could otherwise both miss the job - the one committing an outcome skips the job
#: row the other has locked while it finds the run locked - and leave it for the tick.
_BUSY: Any = object()
#: How often :func:`lease` looks again after :data:`_BUSY`, and how long it waits before each.
BUSY_RETRIES = 20
BUSY_RETRY_SECONDS = 0.01


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
        delivery = lease_within(kernel, worker_id, queues)
        if delivery is not None and delivery is not _AGAIN and delivery is not _BUSY:
            fault_point("lease.before_commit")
    return delivery


@dataclass(frozen=True)
class HeldRun:
    """A run the caller's transaction holds locked and leaves RUNNING, with its stage records
    as this transaction sees them and the outputs it knows of them (an outcome whose
    transition waits for a sibling stage: :mod:`.outcome`). :func:`lease_within` leases a job
    of this run without reading the run, its records or those outputs again (issue 19: three
    statements fewer when the worker's next delivery is a sibling of the stage it finished).
    """

    run: WorkflowRun
    records: list[WorkflowStage]
    outputs: dict[str, Any]


def lease_within(
    kernel: Kernel,
    worker_id: str,
    queues: frozenset[str] | None = None,
    held: HeldRun | None = None,
    events_out: list[dict[str, Any]] | None = None,
) -> Delivery | None:
    """The body of transaction 1 in the caller's transaction: lease the next ready job of
    ``queues`` (or claim a PENDING run and lease its first job) to ``worker_id`` and start
    its stage, appending its events with a causation of their own. ``None``: no work;
    :data:`_AGAIN`: something was settled instead (see :func:`_lease_transaction`);
    :data:`_BUSY`: no work leased, but a ready job was passed over because its run was locked.

    Also called by an outcome transaction that did not continue its own run
    (:mod:`.outcome`, issue 19): the worker's next delivery is leased in the commit of its
    last outcome, one transaction fewer. Runs are locked without waiting
    (:func:`..locking.try_lock_run`), so holding the outcome's run lock cannot deadlock.
    ``held``: the outcome's run (:class:`HeldRun`); a job of it is leased with what the
    outcome holds of it. ``events_out``: the events are added to this list, marked with their
    causation, instead of appended here; the caller appends them with its own in one
    statement per run (an outcome and the sibling stage it leased: one sequence bump, issue 19).
    """
    events: list[dict[str, Any]] = []
    locked: dict[int, WorkflowRun | None] = {}
    passed_over: list[int] = []

    def run_is_free(job: WorkflowJob, locked: dict[int, Any] = locked) -> bool:
        if held is not None and job.workflow_run_id == held.run.pk:
            locked[job.pk] = held.run  # this transaction holds its lock already
            return True
        run = try_lock_run(job.workflow_run_id)
        if run is LOCKED:  # never wait for a run while holding a job (deadlocks)
            passed_over.append(job.pk)
            return False
        locked[job.pk] = run  # type: ignore[assignment]
        return True

    versions = kernel.registry.runnable_versions()  # issue 12 item 3: same statement
    job = kernel.queue.lease_next(
        worker_id,
        accept=run_is_free,
        queues=queues,
        versions=versions,
        gate=job_gate(kernel.registry, kernel.transport),  # None without limits (issue 18)
    )
    run: WorkflowRun | None
    records: list[WorkflowStage] | None = None
    outputs: dict[str, Any] | None = None
    begun: WorkflowStage | None = None
    if job is not None:
        run = locked[job.pk]
        if held is not None and run is held.run:
            records, outputs = held.records, held.outputs
    else:
        now = kernel.clock.now()  # the claim statement starts the run (issue 19)
        run = claim_next_allowed_run(
            kernel.registry, versions, kernel.transport, claim=claim_next_pending_run, start_at=now
        )
        if run is None:
            return _BUSY if passed_over else None
        started = start_claimed_run(
            kernel, run, worker_id, events, reserve_for=worker_id, serves=queues, now=now
        )
        if started is None or not started.jobs or started.jobs[0].worker_id != worker_id:
            _append_or_hand_over(kernel, events, events_out)
            return _AGAIN
        job, records, begun = started.jobs[0], started.records, started.started
    delivery = begin(kernel, job, run, events, records=records, outputs=outputs, started=begun)
    _append_or_hand_over(kernel, events, events_out)
    return _AGAIN if delivery is None else delivery


def _append_or_hand_over(
    kernel: Kernel, events: list[dict[str, Any]], events_out: list[dict[str, Any]] | None
) -> None:
    """Append a lease's ``events`` with a causation of their own, or add them so marked to
    ``events_out`` for the caller to append (:func:`lease_within`)."""
    if events_out is None:
        append_events(events, new_causation_id(), kernel.clock.now())
    else:
        events_out += caused_by_unless_marked(events, new_causation_id())


def begin(
    kernel: Kernel,
    job: WorkflowJob,
    run: WorkflowRun | None,
    events: list[dict[str, Any]],
    *,
    records: list[WorkflowStage] | None = None,
    outputs: dict[str, Any] | None = None,
    started: WorkflowStage | None = None,
) -> Delivery | None:
    """Start the stage of a job leased in the current transaction, whose run the caller has
    locked (``None``: the run is gone): the RUNNING guard, then phase 1 (record RUNNING,
    ``stage:started`` appended to ``events``). ``records``/``outputs``: what the caller
    already holds of the run (saves reading it again). ``started``: the job's stage record
    when the caller inserted it RUNNING in this transaction (:func:`..handlers.base.open_stages`):
    it is not written again, and the delivery starts at its ``started_at``.

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
        return _not_executed(
            kernel, job, f"Workflow run {job.workflow_run_id} is {status}, not RUNNING; job"
        )
    if records is None:
        records = stages_of(run.pk)
    record = next((r for r in records if r.stage_id == node.stage.id), None)
    if started is not None and started is not record:
        started = None  # not this job's record: start it as usual
    now = kernel.clock.now() if started is None else started.started_at
    assert now is not None
    if job.item_index is not None:  # a map item (issue 18 item 3)
        return _begin_item(kernel, job, workflow, node, run, record, records, outputs, now)
    if record is not None and record.status == Status.COMPLETED:
        # K-JE-5: the stage already completed (an earlier delivery committed its outcome).
        kernel.queue.complete(job.pk, attempt=job.attempt)
        events += advance(kernel, workflow, run, records, now).events
        return None
    known = outputs or {}
    earlier_outputs = earlier_outputs_of(kernel, node, records, known)
    resume_state = record.suspended_state if record is not None else None
    if started is None:
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


def _begin_item(
    kernel: Kernel,
    job: WorkflowJob,
    workflow: Workflow,
    node: Any,
    run: WorkflowRun,
    record: WorkflowStage | None,
    records: list[WorkflowStage],
    outputs: dict[str, Any] | None,
    now: Any,
) -> Delivery | None:
    """:func:`begin` for a map item's job: the map stage's record was marked RUNNING when its
    items were created, so it is not started again (no ``stage:started`` per item); an item of
    a record that is no longer RUNNING (the stage failed, a rerun) is failed unexecuted.
    """
    if record is None or record.status != Status.RUNNING:
        state = record.status if record is not None else "gone"
        return _not_executed(
            kernel, job, f"Map stage {job.stage_id!r} is {state}; item {job.item_index}"
        )
    known = outputs or {}
    return Delivery(
        job=job,
        workflow=workflow,
        node=node,
        run=run,
        record=record,
        records=records,
        outputs=earlier_outputs_of(kernel, node, records, known),
        resume_state=None,
        started_at=now,
    )


def _not_executed(kernel: Kernel, job: WorkflowJob, what: str) -> None:
    """Fail a leased job whose body must not run (its run or map stage moved on), counting
    the delivery; ``what`` names it ("... job", "... item 3"). Returns ``None`` (no delivery)."""
    kernel.queue.fail(
        job.pk, f"{what} not executed", attempt=job.attempt, max_attempts=job.max_attempts
    )


def earlier_outputs_of(
    kernel: Kernel,
    node: StageNode,
    records: list[WorkflowStage],
    known: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """``{stage_id: raw output}`` of the COMPLETED records of groups before ``node``'s: what
    its body sees of earlier stages. ``known``: outputs the caller already holds (not read
    again); the others are read in one blob lookup (none when every one is known).
    """
    known = known or {}
    earlier = [
        r
        for r in records
        if r.execution_group < node.execution_group and r.status == Status.COMPLETED
    ]
    missing = [r for r in earlier if r.stage_id not in known]
    loaded = load_outputs(kernel.blobs, missing) if missing else {}
    return {r.stage_id: known.get(r.stage_id, loaded.get(r.stage_id)) for r in earlier}


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
    logger.error(message, extra=job_fields(job))
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
    logger.warning(
        "Stage %s job %s attempt %s: leased to this worker by a commit whose acknowledgement "
        "was lost; delivering it",
        node.stage.id,
        job.pk,
        job.attempt,
        extra=job_fields(job, record.generation),
    )
    return Delivery(
        job=job,
        workflow=workflow,
        node=node,
        run=run,  # type: ignore[arg-type]
        record=record,
        records=records,
        outputs=earlier_outputs_of(kernel, node, records),
        resume_state=None,
        started_at=record.started_at or kernel.clock.now(),
    )


def lease_job(
    kernel: Kernel, job_id: int, worker_id: str, *, attempt: int | None = None
) -> tuple[Delivery | None, WorkflowJob | None]:
    """Transaction 1 for one given job (the entry of ``job.execute`` and
    :func:`..hosting.execute_job`): lock its run, lease the job, then :func:`begin` - the same
    guards as :func:`lease` (RUNNING guard, K-JE-5, definition mismatch, deliveries used up).

    A PENDING job is leased to ``worker_id`` (RUNNING, ``attempt + 1``, lease stamped by the
    lease clock). A RUNNING job is taken as the caller's own lease (it dequeued it) when
    ``attempt`` is ``None`` or equals the job's attempt (the token). A PENDING job held by a
    shared limit (:mod:`..limits`) is not leased (it stays PENDING for a later lease). The run
    is locked before
    the job, the order a cancel takes, so the two never deadlock.

    Returns ``(delivery, job)``: ``delivery`` is ``None`` when the job was settled instead of
    started (see :func:`begin`) or could not be leased (gone, in another status, another
    token, or given up because its deliveries were used up); ``job`` is the job row as leased
    (``None``: not leased).

    Raises:
        django.db.OperationalError: the database stayed unreachable for ``RECONNECT_SECONDS``.
    """

    def one_try() -> tuple[Delivery | None, WorkflowJob | None]:
        with transaction.atomic():
            run_id = (
                WorkflowJob.objects.filter(pk=job_id)
                .values_list("workflow_run_id", flat=True)
                .first()
            )
            if run_id is None:
                return None, None
            run = lock_run(run_id)
            job = WorkflowJob.objects.select_for_update().filter(pk=job_id).first()
            if job is None:
                return None, None
            if job.status == Status.RUNNING:
                if attempt is not None and job.attempt != attempt:
                    return None, None
            elif job.status != Status.PENDING:
                return None, None
            elif job.attempt >= job.max_attempts:
                kernel.queue.give_up(job)
                return None, None
            elif check_job(kernel.registry.get(job.workflow_id), job.queue) is not None:
                return None, None  # held by a shared limit (issue 18): left PENDING
            elif not kernel.queue.lease(job, worker_id):
                return None, None
            events: list[dict[str, Any]] = []
            delivery = begin(kernel, job, run, events)
            append_events(events, new_causation_id(), kernel.clock.now())
        return delivery, job

    began = time.time_ns()
    found = retry_on_disconnect(one_try, what=f"lease of job {job_id}")
    if found[0] is not None:
        fault_point("lease.after_commit")
        found[0].lease_began_ns = began
    return found
