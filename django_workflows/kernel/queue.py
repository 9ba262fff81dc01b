"""The job queue on the ``workflow_jobs`` table (SPEC §1.13, DM-40..49).

The table is the truth: leases, delivery counts, back-off and cancellation live here. After a
transaction that enqueued jobs commits, the transport wakes workers (a hint, not a promise).
Job state changes check the job's current status, so a CANCELLED job stays CANCELLED
(Part I item 9, EC-36). A delivery's own changes (heartbeat, complete, fail, suspend) can also
be fenced by its token, the ``attempt`` it was leased with: a delivery whose lease was taken
over changes nothing. Lease times (``locked_at``) and retry not-before times (``next_poll_at``)
are written and compared in lease time, the database's clock (:mod:`.leases`), so hosts whose
clocks disagree still agree on who owns a job.

Re-delivery is bounded (Part I item 3, EC-21): a job whose next delivery would exceed
``max_attempts`` - found by :meth:`JobQueue.dequeue` or by ``lease.reapStale`` - is never
leased or released again. The queue hands it to its ``on_exhausted`` hook (the kernel's
:func:`~django_workflows.kernel.redelivery.give_up_job`), which fails the job, its stage record
and, through ``run.transition``, the run; without a hook only the job row is failed.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from django.db import DatabaseError, transaction
from django.db.models import F

from ..conf import workflow_settings
from ..definition.stage import DEFAULT_QUEUE, RetryPolicy
from ..models import Status, WorkflowJob
from ..ports import Clock, JobTransport
from . import rows, wakeup
from .leases import LeaseClock
from .locking import (
    VersionPairs,
    claim_next_job,
    lock_exhausted_stale_jobs,
    lock_releasable_stale_jobs,
)

#: ``on_exhausted(job, message) -> bool``: settle a job whose deliveries are used up; ``False``
#: means "not now" (its run is locked by another transaction) and leaves the job as it is.
ExhaustedHook = Callable[[WorkflowJob, str], bool]


def exhausted_message(job: WorkflowJob) -> str:
    """The error recorded for a job given up after ``max_attempts`` deliveries (Part I item 3)."""
    message = (
        f"Job {job.pk} of stage {job.stage_id!r} was delivered {job.attempt} times without "
        "finishing (worker crash or infrastructure error); giving up after "
        f"max_attempts={job.max_attempts}"
    )
    if job.last_error:
        message += f". Last error: {job.last_error}"
    return message


@dataclass(frozen=True)
class JobSpec:
    """A job to enqueue (DM-40). ``queue``: its stage's worker pool (issue 8 item 5).
    ``max_attempts``: its delivery limit, the stage's ``retry.max_attempts`` (``None``: the
    ``MAX_ATTEMPTS`` setting). ``definition_version``: its run's (issue 12 item 3; ``""``: any
    worker).
    """

    workflow_run_id: uuid.UUID
    workflow_id: str
    stage_id: str
    priority: int = 5
    payload: dict[str, Any] = field(default_factory=dict)
    next_poll_at: datetime | None = None
    run_created_at: datetime | None = None
    queue: str = DEFAULT_QUEUE
    max_attempts: int | None = None
    definition_version: str = ""


class JobQueue:
    """Queue operations bound to a clock and a transport.

    Args:
        on_exhausted: called (inside the queue's transaction, with the job row locked) for a
            job whose next delivery would exceed ``max_attempts``; see :data:`ExhaustedHook`.
    """

    def __init__(
        self, clock: Clock, transport: JobTransport, on_exhausted: ExhaustedHook | None = None
    ) -> None:
        self.clock = clock
        self.lease_clock = LeaseClock(clock)
        self.transport = transport
        self.on_exhausted = on_exhausted

    def enqueue(self, specs: list[JobSpec], *, reserve_for: str | None = None) -> list[int]:
        """Insert PENDING jobs (one statement) and wake workers after commit. Returns ids; see
        :meth:`enqueue_jobs`.
        """
        return [job.pk for job in self.enqueue_jobs(specs, reserve_for=reserve_for)]

    def enqueue_jobs(
        self, specs: list[JobSpec], *, reserve_for: str | None = None
    ) -> list[WorkflowJob]:
        """Insert PENDING jobs (one statement) and wake workers after commit; returns the rows.

        ``reserve_for``: a worker id; the first job is inserted already leased to that worker
        (RUNNING, attempt 1, lease stamped), so a worker that advanced a run continues with
        its next stage without a round trip through the queue (the caller puts a job of a
        queue that worker serves first). Only the other jobs wake workers, each through its
        queue's cluster (``transport.wake_workers(n, queue=...)``).
        """
        if not specs:
            return []
        now = self.clock.now()
        max_attempts = int(workflow_settings.MAX_ATTEMPTS)
        jobs = [
            rows.new(
                WorkflowJob,
                created_at=now,
                updated_at=now,
                workflow_run_id=s.workflow_run_id,
                workflow_id=s.workflow_id,
                stage_id=s.stage_id,
                priority=s.priority,
                payload=s.payload,
                max_attempts=s.max_attempts or max_attempts,
                next_poll_at=s.next_poll_at,
                run_created_at=s.run_created_at or now,
                queue=s.queue,
                definition_version=s.definition_version,
            )
            for s in specs
        ]
        if reserve_for is not None:
            first = jobs[0]
            first.status = Status.RUNNING
            first.worker_id = reserve_for
            first.locked_at = self.lease_clock.now()
            first.started_at = now
            first.attempt = 1
        rows.insert(jobs)
        waiting: dict[str, int] = {}
        for job in jobs[1:] if reserve_for is not None else jobs:
            waiting[job.queue] = waiting.get(job.queue, 0) + 1
        for queue, count in waiting.items():
            wakeup.wake_workers_at_commit(self.transport, count, queue)
        return jobs

    def dequeue(
        self,
        worker_id: str,
        *,
        queues: frozenset[str] | None = None,
        versions: VersionPairs | None = None,
    ) -> WorkflowJob | None:
        """Lease the next ready job: RUNNING, ``attempt + 1``, lease stamped (DM-41, SM-20).

        A ready job whose delivery count has reached ``max_attempts`` is not leased: it is given
        up (:meth:`give_up`) and the next ready job is considered (Part I item 3, EC-21).
        Database errors propagate (they are not an empty queue). ``queues``, ``versions``: see
        :meth:`lease_next`.
        """
        with transaction.atomic():
            return self.lease_next(worker_id, queues=queues, versions=versions)

    def lease_next(
        self,
        worker_id: str,
        *,
        accept: Callable[[WorkflowJob], bool] | None = None,
        queues: frozenset[str] | None = None,
        versions: VersionPairs | None = None,
        gate: Callable[[WorkflowJob], Any] | None = None,
    ) -> WorkflowJob | None:
        """:meth:`dequeue` inside the caller's transaction (the caller commits the lease).

        Ready jobs are served by priority, then oldest run first, so a started run finishes
        before newer runs start (depth-first within a priority). ``accept(job)``: asked
        before a job is leased; a job it refuses is passed over. ``queues``: lease only jobs
        of these queues (the worker's pools); ``None``: any queue. ``versions``: the worker's
        definitions (:meth:`.WorkflowRegistry.runnable_versions`; issue 12 item 3): a job of
        one of their workflows is leased only if it is unversioned or its
        ``definition_version`` is one of theirs, in the same statement; ``None``: any.
        ``gate(job)``: the shared limits (:func:`.limits.job_gate`, issue 18 item 6), asked
        before ``accept``; a :class:`.limits.Held` answer passes over every job of that
        workflow (``max_running_stages``) or queue (``QUEUE_LIMITS``) for the rest of this
        lease, in the claim statement itself (so held work costs one statement, not one per
        job); ``None``: no limits.
        """
        now = self.clock.now()
        seen: list[int] = []
        held_workflows: set[str] = set()
        held_queues: set[str] = set()
        while True:
            job = claim_next_job(
                self.lease_clock.now(),
                exclude=seen,
                queues=queues,
                versions=versions,
                exclude_workflows=held_workflows,
                exclude_queues=held_queues,
            )
            if job is None:
                return None
            seen.append(job.pk)
            if job.attempt >= job.max_attempts:
                self.give_up(job)
                continue
            held = gate(job) if gate is not None else None
            if held is not None:
                if held.kind == "queue":
                    held_queues.add(job.queue)
                else:
                    held_workflows.add(job.workflow_id)
                seen.pop()  # excluded by its workflow or queue from now on
            elif accept is None or accept(job):
                break
        if not self.lease(job, worker_id, now=now):  # as Model.save(update_fields=...) would
            raise DatabaseError("Save with update_fields did not affect any rows.")
        return job

    def lease(self, job: WorkflowJob, worker_id: str, *, now: datetime | None = None) -> bool:
        """Lease ``job`` (read by the caller, PENDING at ``job.attempt``) to ``worker_id`` in
        the caller's transaction: RUNNING, ``attempt + 1``, the lease stamped by the lease
        clock (DM-41, SM-20). Fenced: ``False`` (nothing changed) if the job is no longer
        PENDING at that attempt. ``job`` is updated in place on success.
        """
        now = self.clock.now() if now is None else now
        values = {
            "status": Status.RUNNING,
            "worker_id": worker_id,
            "locked_at": self.lease_clock.now(),
            "started_at": now,
            "updated_at": now,
            "attempt": job.attempt + 1,
        }
        if not self._fenced_update(job.pk, Status.PENDING, job.attempt, values):
            return False
        for name, value in values.items():
            setattr(job, name, value)
        return True

    @staticmethod
    def _fenced_update(
        job_id: int,
        from_status: str,
        attempt: int | None,
        values: dict[str, Any],
        carrying: Sequence[rows.Write] = (),
    ) -> int:
        """Update the job only while it is in ``from_status`` (and at ``attempt``, if given).
        ``carrying``: writes sent in the same statement (:func:`.rows.update`)."""
        where: dict[str, Any] = {"status": from_status}
        if attempt is not None:
            where["attempt"] = attempt
        return rows.update(WorkflowJob, job_id, values, where=where, carrying=carrying)

    def complete(
        self,
        job_id: int,
        *,
        from_status: str = Status.RUNNING,
        attempt: int | None = None,
        extra: dict[str, Any] | None = None,
        carrying: Sequence[rows.Write] = (),
    ) -> bool:
        """RUNNING (or ``from_status``) -> COMPLETED (DM-42, SM-21/26); with ``attempt`` only
        if the job is still at that delivery (fencing). ``extra``: more columns set in the
        same UPDATE (a map item's ``item_output``). ``carrying``: writes sent with the UPDATE
        whether or not the fence holds (:func:`.rows.update`; the stage path's outcome rolls
        back when it does not): the stage's record and output (issue 19).
        """
        now = self.clock.now()
        return bool(
            self._fenced_update(
                job_id,
                from_status,
                attempt,
                dict(
                    status=Status.COMPLETED,
                    completed_at=now,
                    updated_at=now,
                    worker_id=None,
                    locked_at=None,
                    **(extra or {}),
                ),
                carrying,
            )
        )

    def suspend(
        self,
        job_id: int,
        next_poll_at: datetime | None,
        *,
        attempt: int | None = None,
        extra: dict[str, Any] | None = None,
    ) -> bool:
        """RUNNING -> SUSPENDED, lease cleared (DM-43, SM-22); fenced by ``attempt``.
        ``extra``: more columns set in the same UPDATE (a map item's ``payload``)."""
        now = self.clock.now()
        if next_poll_at is None:
            next_poll_at = now + timedelta(
                seconds=float(workflow_settings.SUSPEND_FALLBACK_SECONDS)
            )
        return bool(
            self._fenced_update(
                job_id,
                Status.RUNNING,
                attempt,
                dict(
                    status=Status.SUSPENDED,
                    next_poll_at=next_poll_at,
                    updated_at=now,
                    worker_id=None,
                    locked_at=None,
                    **(extra or {}),
                ),
            )
        )

    def retry_delay_seconds(self, attempt: int, policy: RetryPolicy | None = None) -> float:
        """Back-off before delivery ``attempt + 1``: ``RETRY_BACKOFF_BASE_SECONDS *
        2**(attempt-1)``, capped by ``RETRY_BACKOFF_MAX_SECONDS`` (DM-44); a stage's
        ``policy`` (its ``retry=``) replaces either setting it names.
        """
        base = float(workflow_settings.RETRY_BACKOFF_BASE_SECONDS)
        cap = float(workflow_settings.RETRY_BACKOFF_MAX_SECONDS)
        if policy is not None:
            return policy.delay_seconds(attempt, base, cap)
        return min(base * 2 ** max(attempt - 1, 0), cap)

    def fail(
        self,
        job_id: int,
        error: str,
        *,
        should_retry: bool = False,
        attempt: int | None = None,
        max_attempts: int | None = None,
        policy: RetryPolicy | None = None,
    ) -> str | None:
        """Fail a RUNNING job (DM-44, SM-23/24); fenced by ``attempt`` when given.

        With ``should_retry`` and deliveries left the job goes back to PENDING after
        :meth:`retry_delay_seconds` (in lease time; ``policy``: the stage's ``retry=``);
        otherwise it is FAILED. ``attempt`` and ``max_attempts``, when the caller knows them,
        save reading the job.

        Returns:
            The new status, or ``None`` if the job was no longer RUNNING (at ``attempt``).
        """
        now = self.clock.now()
        if attempt is None or max_attempts is None:
            job = WorkflowJob.objects.filter(pk=job_id).only("attempt", "max_attempts").first()
            if job is None:
                return None
            current, limit = job.attempt, job.max_attempts
        else:
            current, limit = attempt, max_attempts
        if should_retry and current < limit:
            updated = self._fenced_update(
                job_id,
                Status.RUNNING,
                attempt,
                dict(
                    status=Status.PENDING,
                    last_error=error,
                    worker_id=None,
                    locked_at=None,
                    next_poll_at=self.lease_clock.offset(self.retry_delay_seconds(current, policy)),
                    updated_at=now,
                ),
            )
            return Status.PENDING if updated else None
        updated = self._fenced_update(
            job_id,
            Status.RUNNING,
            attempt,
            dict(
                status=Status.FAILED,
                last_error=error,
                completed_at=now,
                updated_at=now,
                worker_id=None,
                locked_at=None,
            ),
        )
        return Status.FAILED if updated else None

    def give_up(self, job: WorkflowJob) -> bool:
        """Settle a locked job whose deliveries are used up (Part I item 3).

        Calls the ``on_exhausted`` hook with :func:`exhausted_message`; without a hook the job
        is FAILED here. Returns ``False`` when the hook deferred (the job is left unchanged).
        """
        message = exhausted_message(job)
        if self.on_exhausted is not None:
            return self.on_exhausted(job, message)
        return self.settle(job, Status.FAILED, error=message)

    def settle(
        self,
        job: WorkflowJob,
        status: str,
        *,
        error: str | None = None,
        next_poll_at: datetime | None = None,
    ) -> bool:
        """Move ``job`` from the status it was read with to ``status`` (COMPLETED, FAILED or
        SUSPENDED), clearing its lease. ``error`` becomes ``last_error``; ``next_poll_at`` is
        kept for SUSPENDED. Returns whether the row changed (EC-36: never from another status).
        """
        now = self.clock.now()
        fields: dict[str, Any] = dict(status=status, updated_at=now, worker_id=None, locked_at=None)
        if status == Status.SUSPENDED:
            fields["next_poll_at"] = next_poll_at
        else:
            fields["completed_at"] = now
        if error is not None:
            fields["last_error"] = error
        return bool(WorkflowJob.objects.filter(pk=job.pk, status=job.status).update(**fields))

    def touch(self, job_id: int, *, attempt: int | None = None) -> bool:
        """Heartbeat: refresh the lease of a RUNNING job; a no-op otherwise (DM-46). With
        ``attempt``, only while the job is still at that delivery: ``False`` tells a worker
        that its lease was taken over.
        """
        return bool(
            self._fenced_update(
                job_id,
                Status.RUNNING,
                attempt,
                {"locked_at": self.lease_clock.now(), "updated_at": self.clock.now()},
            )
        )

    def release(self, job_id: int, *, attempt: int) -> bool:
        """Give a RUNNING job back to the queue at once (a stopping worker past its grace
        period, issue 8 item 3): PENDING, lease cleared, fenced by ``attempt``. The released
        delivery does not count against ``max_attempts`` (it is raised by one), and its late
        result matches no fence (the job is no longer RUNNING at ``attempt``). ``False`` if
        the delivery no longer owns the job (its outcome committed first, or it was reaped).
        """
        return bool(
            WorkflowJob.objects.filter(pk=job_id, status=Status.RUNNING, attempt=attempt).update(
                status=Status.PENDING,
                worker_id=None,
                locked_at=None,
                next_poll_at=None,
                max_attempts=F("max_attempts") + 1,
                updated_at=self.clock.now(),
            )
        )

    def release_stale(self, threshold_seconds: float) -> int:
        """RUNNING jobs whose lease is older than the threshold go back to PENDING (DM-45).

        Only jobs with deliveries left (``attempt < max_attempts``) are released; the others
        are for :meth:`give_up_stale` (Part I item 3). Rows another transaction holds are
        skipped (``SKIP LOCKED``, issue 17): a host that vanished inside a transaction never
        blocks the tick; its jobs are released by a later tick, once PostgreSQL ended its
        session (``idle_in_transaction_session_timeout``, TCP keepalives). Returns the number
        released.
        """
        now = self.clock.now()
        cutoff = self.lease_clock.offset(-threshold_seconds)
        with transaction.atomic():
            ids = lock_releasable_stale_jobs(cutoff)
            if not ids:
                return 0
            # Re-checked: the rows are locked, so only a concurrent release could differ.
            return WorkflowJob.objects.filter(
                pk__in=ids, status=Status.RUNNING, locked_at__lt=cutoff
            ).update(status=Status.PENDING, worker_id=None, locked_at=None, updated_at=now)

    def give_up_stale(self, threshold_seconds: float) -> int:
        """Give up RUNNING jobs whose lease is older than the threshold and whose deliveries are
        used up (``attempt >= max_attempts``) instead of releasing them (Part I item 3, EC-21).
        Must run inside a transaction. Returns the number given up.
        """
        cutoff = self.lease_clock.offset(-threshold_seconds)
        return sum(1 for job in lock_exhausted_stale_jobs(cutoff) if self.give_up(job))

    def cancel_by_run(self, run_id: uuid.UUID, *, running: bool = False) -> int:
        """PENDING, SUSPENDED and HELD (map items) jobs of the run -> CANCELLED (DM-47).
        RUNNING ones are left,
        unless ``running``: then they are taken back too (a rerun, issue 17: a delivery of the
        old generation, however live its lease, no longer owns its job, so its outcome matches
        no fence and its heartbeat reports the lease lost). Returns the count.
        """
        now = self.clock.now()
        statuses = [Status.PENDING, Status.SUSPENDED, Status.HELD]
        statuses += [Status.RUNNING] if running else []
        return WorkflowJob.objects.filter(workflow_run_id=run_id, status__in=statuses).update(
            status=Status.CANCELLED, completed_at=now, updated_at=now
        )

    def jobs_by_run(self, run_id: uuid.UUID) -> list[WorkflowJob]:
        """Every job of the run, any status (DM-48)."""
        return list(WorkflowJob.objects.filter(workflow_run_id=run_id).order_by("id"))
