"""One delivery of a job, from lease to commit: the path every stage takes (SPEC §4.6, §7.2).

A worker runs this story in a loop (:func:`work`, here); each step is a module of
:mod:`.stage_path`:

1. **Lease** (:mod:`.stage_path.lease`; one transaction, only when the worker holds no job yet):
   lock the next ready job (``SKIP LOCKED``; highest priority, then oldest run first), or else claim
   a PENDING run (locked and made RUNNING in one statement unless its key must be checked first)
   and insert its first job already leased to this worker; stamp the lease with the
   database's clock (:mod:`.leases`); lock the run and check it is RUNNING (the RUNNING guard); mark
   the stage record RUNNING and append ``stage:started``. Once committed, the job belongs to this
   delivery, identified by its token: the job id and the ``attempt`` it was leased with.
2. **Execute** (:mod:`.stage_path.execute`; no transaction): run the stage body
   (:func:`.stage_path.records.run_stage`) while the heartbeat (:mod:`.heartbeat`) refreshes the
   lease, fenced by the token (a heartbeat that finds the token gone tells the stage, through
   ``ctx.is_cancelled()``, that its result will be discarded). A stage with a timeout
   (:mod:`.timeouts`) is watched by the same heartbeat thread: past the deadline
   ``ctx.is_cancelled()`` turns true and the outcome becomes a ``StageTimeout`` failure; a body
   still running after the grace has that failure committed for it through step 3 (fenced) and its
   worker process recycled.
3. **Outcome** (:mod:`.stage_path.outcome`; one transaction): lock the run (RUNNING guard), write
   the outcome (:func:`.stage_path.records.write_outcome`: stage record, output blob, annotations,
   logs, events) and settle the job *fenced by the token* (``UPDATE ... WHERE id = ? AND status =
   RUNNING AND attempt = ?``; a completed stage's record and output blob ride in that statement,
   :func:`.rows.update`'s ``carrying``; a blob store outside the database is written only once
   the fence held), transition the run
   (:func:`.stage_path.transition.advance`: the next group's stage records and jobs; the first new
   job is leased to this worker at once, its stage marked RUNNING), and append every event with
   gap-free sequences. Either all of it commits or none of it: a stage can no longer be COMPLETED
   without its transition. The delivery's events, from ``stage:started`` to its outcome's, carry
   one causation id (SPEC K-5, K-JE-2); the next stage leased in the same commit is a delivery of
   its own.

   A delivery whose lease was taken over (paused past its lease, a skewed clock, a lost connection)
   matches no row: the transaction rolls back and the result is discarded like a ghost - no record,
   output or event changes, only a WARN log line. A rerun takes back the jobs of the old generation
   still out, a live lease included (``run.rerunFrom``), so a late outcome of the old generation is
   discarded the same way. A run that left RUNNING (cancelled) makes the result a ghost: only the
   job is failed, without retry. An outcome that does not continue its run leases the worker's next
   delivery in the same commit instead (:func:`.stage_path.lease.lease_within`: any ready job or
   PENDING run, its run locked without waiting), so a worker spends one transaction per stage.
4. If step 3 leased a delivery, go to 2 with it; if it looked and found no work, stop;
   otherwise go to 1.

Transactions 1 and 3 (and each heartbeat) that hit a dead database connection - terminated,
closed by ``idle_session_timeout`` while the stage ran, or refused during a database restart -
are run again on a new connection (:func:`.connections.retry_on_disconnect`, for up to
``RECONNECT_SECONDS``). That is safe because a rolled-back lease leased nothing and the outcome
is fenced by the token; a retried outcome that finds the job already settled at its own
attempt by this very outcome (its COMMIT reached the database, the acknowledgement did not) is
reported committed, not discarded, and a job that a lost commit leased to this worker is
taken back (:func:`.stage_path.lease._adopt_orphan`). A connection kill so costs one retried
write, not a delivery.

So a trivial stage costs one transaction, whether it continues its run or not. Crash windows:
before a lease commits nothing happened; after it the job is RUNNING and its lease expires, so
``lease.reapStale`` releases it for another delivery (bounded by ``max_attempts``); before
the outcome commits nothing of the outcome happened; after it everything did. The fault
points of :mod:`.faults` sit at each of these boundaries.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .. import telemetry
from .connections import retry_on_disconnect
from .heartbeat import Heartbeat, in_flight
from .stage_path import Delivery, Outcome
from .stage_path.execute import execute, is_task_timeout, task_timeout_message
from .stage_path.lease import begin, lease, mismatch_message
from .stage_path.outcome import commit_outcome

if TYPE_CHECKING:
    from .dispatch import Kernel
    from .supervisor import StopSignal

__all__ = [
    "Delivery",
    "Heartbeat",
    "Outcome",
    "WorkResult",
    "begin",
    "commit_outcome",
    "deliver",
    "execute",
    "in_flight",
    "is_task_timeout",
    "lease",
    "mismatch_message",
    "task_timeout_message",
    "work",
]


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
    with telemetry.delivering(delivery) as seen:  # log fields; spans and metrics if enabled
        with seen.step("execute"):
            outcome, services = execute(kernel, delivery)
        with seen.step("outcome"):
            stopped = outcome.stopped  # django-q2's timeout: nothing continues after it
            reserve_for = worker_id if stopped is None else None
            result = commit_outcome(kernel, delivery, outcome, services, reserve_for, stop, queues)
        seen.ended(result)
    if stopped is not None:
        raise stopped
    return result


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
        if current is None and result.no_work:
            break  # the outcome's transaction looked for the next delivery: there is none
    return out
