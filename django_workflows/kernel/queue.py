"""The job queue on the ``workflow_jobs`` table (SPEC §1.13, DM-40..49).

The table is the truth: leases, delivery counts, back-off and cancellation live here. After a
transaction that enqueued jobs commits, the transport wakes workers (a hint, not a promise).
Job state changes check the job's current status, so a CANCELLED job stays CANCELLED
(Part I item 9, EC-36).

Re-delivery is bounded (Part I item 3, EC-21): a job whose next delivery would exceed
``max_attempts`` - found by :meth:`JobQueue.dequeue` or by ``lease.reapStale`` - is never
leased or released again. The queue hands it to its ``on_exhausted`` hook (the kernel's
:func:`~django_workflows.kernel.redelivery.give_up_job`), which fails the job, its stage record
and, through ``run.transition``, the run; without a hook only the job row is failed.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from django.db import transaction
from django.db.models import F

from ..conf import workflow_settings
from ..models import Status, WorkflowJob
from ..ports import Clock, JobTransport
from .locking import claim_next_job, lock_exhausted_stale_jobs

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
    """A job to enqueue (DM-40)."""

    workflow_run_id: uuid.UUID
    workflow_id: str
    stage_id: str
    priority: int = 5
    payload: dict[str, Any] = field(default_factory=dict)
    next_poll_at: datetime | None = None


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
        self.transport = transport
        self.on_exhausted = on_exhausted

    def enqueue(self, specs: list[JobSpec]) -> list[int]:
        """Insert PENDING jobs (one statement) and wake workers after commit. Returns ids."""
        if not specs:
            return []
        now = self.clock.now()
        max_attempts = int(workflow_settings.MAX_ATTEMPTS)
        jobs = WorkflowJob.objects.bulk_create(
            [
                WorkflowJob(
                    created_at=now,
                    updated_at=now,
                    workflow_run_id=s.workflow_run_id,
                    workflow_id=s.workflow_id,
                    stage_id=s.stage_id,
                    priority=s.priority,
                    payload=s.payload,
                    max_attempts=max_attempts,
                    next_poll_at=s.next_poll_at,
                )
                for s in specs
            ]
        )
        count = len(jobs)
        transaction.on_commit(lambda: self.transport.wake_workers(count))
        return [job.pk for job in jobs]

    def dequeue(self, worker_id: str) -> WorkflowJob | None:
        """Lease the next ready job: RUNNING, ``attempt + 1``, lease stamped (DM-41, SM-20).

        A ready job whose delivery count has reached ``max_attempts`` is not leased: it is given
        up (:meth:`give_up`) and the next ready job is considered (Part I item 3, EC-21).
        Database errors propagate (they are not an empty queue).
        """
        now = self.clock.now()
        with transaction.atomic():
            seen: list[int] = []
            while True:
                job = claim_next_job(now, exclude=seen)
                if job is None:
                    return None
                if job.attempt < job.max_attempts:
                    break
                seen.append(job.pk)
                self.give_up(job)
            job.status = Status.RUNNING
            job.worker_id = worker_id
            job.locked_at = job.started_at = job.updated_at = now
            job.attempt += 1
            job.save(
                update_fields=[
                    "status",
                    "worker_id",
                    "locked_at",
                    "started_at",
                    "updated_at",
                    "attempt",
                ]
            )
        return job

    def complete(self, job_id: int, *, from_status: str = Status.RUNNING) -> bool:
        """RUNNING (or ``from_status``) -> COMPLETED (DM-42, SM-21/26)."""
        now = self.clock.now()
        return bool(
            WorkflowJob.objects.filter(pk=job_id, status=from_status).update(
                status=Status.COMPLETED,
                completed_at=now,
                updated_at=now,
                worker_id=None,
                locked_at=None,
            )
        )

    def suspend(self, job_id: int, next_poll_at: datetime | None) -> bool:
        """RUNNING -> SUSPENDED, lease cleared (DM-43, SM-22)."""
        now = self.clock.now()
        if next_poll_at is None:
            next_poll_at = now + timedelta(
                seconds=float(workflow_settings.SUSPEND_FALLBACK_SECONDS)
            )
        return bool(
            WorkflowJob.objects.filter(pk=job_id, status=Status.RUNNING).update(
                status=Status.SUSPENDED,
                next_poll_at=next_poll_at,
                updated_at=now,
                worker_id=None,
                locked_at=None,
            )
        )

    def fail(self, job_id: int, error: str, *, should_retry: bool = False) -> str | None:
        """Fail a RUNNING job (DM-44, SM-23/24).

        With ``should_retry`` and deliveries left the job goes back to PENDING after an
        exponential back-off of ``RETRY_BACKOFF_BASE_SECONDS * 2**(attempt-1)`` seconds
        (capped by ``RETRY_BACKOFF_MAX_SECONDS``); otherwise it is FAILED.

        Returns:
            The new status, or ``None`` if the job was no longer RUNNING.
        """
        now = self.clock.now()
        job = WorkflowJob.objects.filter(pk=job_id).only("attempt", "max_attempts").first()
        if job is None:
            return None
        if should_retry and job.attempt < job.max_attempts:
            delay = min(
                float(workflow_settings.RETRY_BACKOFF_BASE_SECONDS) * 2 ** max(job.attempt - 1, 0),
                float(workflow_settings.RETRY_BACKOFF_MAX_SECONDS),
            )
            updated = WorkflowJob.objects.filter(pk=job_id, status=Status.RUNNING).update(
                status=Status.PENDING,
                last_error=error,
                worker_id=None,
                locked_at=None,
                next_poll_at=now + timedelta(seconds=delay),
                updated_at=now,
            )
            return Status.PENDING if updated else None
        updated = WorkflowJob.objects.filter(pk=job_id, status=Status.RUNNING).update(
            status=Status.FAILED,
            last_error=error,
            completed_at=now,
            updated_at=now,
            worker_id=None,
            locked_at=None,
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

    def touch(self, job_id: int) -> bool:
        """Heartbeat: refresh the lease of a RUNNING job; a no-op otherwise (DM-46)."""
        now = self.clock.now()
        return bool(
            WorkflowJob.objects.filter(pk=job_id, status=Status.RUNNING).update(
                locked_at=now, updated_at=now
            )
        )

    def release_stale(self, threshold_seconds: float) -> int:
        """RUNNING jobs whose lease is older than the threshold go back to PENDING (DM-45).

        Only jobs with deliveries left (``attempt < max_attempts``) are released; the others
        are for :meth:`give_up_stale` (Part I item 3). Returns the number released.
        """
        now = self.clock.now()
        cutoff = now - timedelta(seconds=threshold_seconds)
        return WorkflowJob.objects.filter(
            status=Status.RUNNING, locked_at__lt=cutoff, attempt__lt=F("max_attempts")
        ).update(status=Status.PENDING, worker_id=None, locked_at=None, updated_at=now)

    def give_up_stale(self, threshold_seconds: float) -> int:
        """Give up RUNNING jobs whose lease is older than the threshold and whose deliveries are
        used up (``attempt >= max_attempts``) instead of releasing them (Part I item 3, EC-21).
        Must run inside a transaction. Returns the number given up.
        """
        cutoff = self.clock.now() - timedelta(seconds=threshold_seconds)
        return sum(1 for job in lock_exhausted_stale_jobs(cutoff) if self.give_up(job))

    def cancel_by_run(self, run_id: uuid.UUID) -> int:
        """PENDING and SUSPENDED jobs of the run -> CANCELLED (DM-47). RUNNING ones are left."""
        now = self.clock.now()
        return WorkflowJob.objects.filter(
            workflow_run_id=run_id, status__in=[Status.PENDING, Status.SUSPENDED]
        ).update(status=Status.CANCELLED, completed_at=now, updated_at=now)

    def jobs_by_run(self, run_id: uuid.UUID) -> list[WorkflowJob]:
        """Every job of the run, any status (DM-48)."""
        return list(WorkflowJob.objects.filter(workflow_run_id=run_id).order_by("id"))
