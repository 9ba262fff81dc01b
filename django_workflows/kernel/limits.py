"""Shared limits (issue 18 item 6, docs/limits.md): at most N RUNNING stages per workflow
(``define_workflow(max_running_stages=N)``), per queue (``QUEUE_LIMITS``) and at most N
RUNNING runs per concurrency key (``define_workflow(concurrency_key=..., max_running_per_key=N)``),
across every worker on every host.

How the database enforces them. A limit is checked when a job is leased (:func:`job_gate`,
used by :meth:`.JobQueue.lease_next`, :func:`.handlers.base.enqueue_stage_jobs` for the next
stage leased in an outcome transaction, and :func:`.stage_path.lease.lease_job`) and when a
PENDING run is claimed (:func:`claim_next_allowed_run`). The check takes the limit's lock and
then counts the live rows it limits (RUNNING jobs of the workflow / of the queue, RUNNING runs
of the key) in the same transaction; the lease or claim commits with the lock held, so the next
checker of that limit counts it. Nothing is counted in a separate counter, so the count heals by
itself when a lease expires, a worker crashes or a job is reaped.

The lock: on PostgreSQL a transaction-level advisory lock per limit
(``pg_try_advisory_xact_lock``), only ever *tried*: a transaction never waits for a limit
(so limits add no deadlock). A limit whose lock another transaction holds (it is leasing under
that limit right now) counts as held for this lease, and one worker of the job's queue is woken
after commit to look again. On SQLite the ``IMMEDIATE`` transaction already serialises writers.

A held job or run is passed over, not waited for: the lease leaves out that workflow, queue or
key and takes the next eligible job (no starvation of other work); within one key the oldest
PENDING run is claimed first. Workflows and queues without limits cost nothing: no lock and no
count is taken for them, and the plain stage path's statements are unchanged.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

from django.db import connection, transaction

from ..conf import workflow_settings
from ..models import Status, WorkflowJob, WorkflowRun
from .locking import VersionPairs

if TYPE_CHECKING:
    from ..definition.registry import WorkflowRegistry
    from ..definition.workflow import Workflow
    from ..ports import JobTransport


@dataclass(frozen=True)
class Held:
    """Why a job or run may not start now: the limit (``kind``: ``"max_running_stages"``,
    ``"queue"`` or ``"max_running_per_key"``), its ``scope`` (the workflow id, the queue name
    or the key), its ``limit`` and the ``running`` count seen (``None``: another transaction
    held the limit's lock at that moment).
    """

    kind: str
    scope: str
    limit: int
    running: int | None


def queue_limits() -> dict[str, int]:
    """The ``QUEUE_LIMITS`` setting (``{queue: N}``; ``{}`` when unset or malformed: system
    check E030 reports a malformed one)."""
    value = workflow_settings.QUEUE_LIMITS
    return value if isinstance(value, dict) else {}


def any_job_limits(registry: WorkflowRegistry) -> bool:
    """Whether any job-level limit exists (a queue limit, or a registered workflow with
    ``max_running_stages``): without one, leases take no limit step at all."""
    if queue_limits():
        return True
    return any(w.limits is not None and w.limits.max_running_stages for w in registry)


def _lock_key(name: str) -> int:
    """A signed 64-bit advisory lock key for the limit ``name`` (stable across processes)."""
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big", signed=True)


def try_lock(name: str) -> bool:
    """Try to take the limit ``name``'s lock for the rest of the current transaction. Never
    waits. ``True`` on SQLite (the ``IMMEDIATE`` transaction holds the write lock)."""
    if connection.vendor != "postgresql":
        return True
    assert transaction.get_connection().in_atomic_block, "limit locks need a transaction"
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_try_advisory_xact_lock(%s)", [_lock_key(name)])
        return bool(cursor.fetchone()[0])


def running_jobs(*, workflow_id: str | None = None, queue: str | None = None) -> int:
    """RUNNING jobs of the workflow (or of the queue), every worker's."""
    qs = WorkflowJob.objects.filter(status=Status.RUNNING)
    if workflow_id is not None:
        qs = qs.filter(workflow_id=workflow_id)
    if queue is not None:
        qs = qs.filter(queue=queue)
    return qs.count()


def running_runs(workflow_id: str, key: str) -> int:
    """RUNNING runs of the workflow with the concurrency key ``key``."""
    return WorkflowRun.objects.filter(
        workflow_id=workflow_id, concurrency_key=key, status=Status.RUNNING
    ).count()


def _wake_later(transport: JobTransport | None, queue: str) -> None:
    if transport is not None:
        transaction.on_commit(lambda: transport.wake_workers(1, queue=queue))


def check_job(
    workflow: Workflow | None,
    queue: str,
    *,
    transport: JobTransport | None = None,
) -> Held | None:
    """In the current transaction, whether one more job of ``workflow`` on ``queue`` may
    become RUNNING: ``None`` (yes; the limits' locks are now held until commit, so lease it in
    this transaction) or the :class:`Held` limit. Free (no statement) when neither the
    workflow nor the queue is limited. ``transport``: woken after commit for ``queue`` when a
    limit's lock was busy (someone else is leasing under it right now).
    """
    max_stages = workflow.limits.max_running_stages if workflow and workflow.limits else None
    if max_stages:
        assert workflow is not None
        if not try_lock(f"workflow:{workflow.id}"):
            _wake_later(transport, queue)
            return Held("max_running_stages", workflow.id, max_stages, None)
        running = running_jobs(workflow_id=workflow.id)
        if running >= max_stages:
            return Held("max_running_stages", workflow.id, max_stages, running)
    queue_limit = queue_limits().get(queue)
    if queue_limit:
        if not try_lock(f"queue:{queue}"):
            _wake_later(transport, queue)
            return Held("queue", queue, queue_limit, None)
        running = running_jobs(queue=queue)
        if running >= queue_limit:
            return Held("queue", queue, queue_limit, running)
    return None


#: ``gate(job) -> Held | None`` (see :func:`job_gate`).
JobGate = Callable[[WorkflowJob], Held | None]


def job_gate(registry: WorkflowRegistry, transport: JobTransport | None = None) -> JobGate | None:
    """The limit check of a lease (:meth:`.JobQueue.lease_next`), or ``None`` when no
    job-level limit exists (the lease then takes no limit step)."""
    if not any_job_limits(registry):
        return None

    def gate(job: WorkflowJob) -> Held | None:
        return check_job(registry.get(job.workflow_id), job.queue, transport=transport)

    return gate


def concurrency_key_of(workflow: Workflow, parsed_input: Any) -> str | None:
    """The concurrency key of a new run of ``workflow`` (``None``: no key). ``parsed_input``:
    the validated input model.

    Raises:
        ValueError: the workflow's ``concurrency_key`` raised, or returned something that is
            not a string (or ``None``), or a key longer than 200 characters; the message says
            which.
    """
    from ..definition.workflow import MAX_CONCURRENCY_KEY_LENGTH

    if workflow.limits is None or workflow.limits.concurrency_key is None:
        return None
    try:
        key = workflow.limits.concurrency_key(parsed_input)
    except Exception as exc:
        raise ValueError(f"concurrency_key raised {type(exc).__name__}: {exc}") from exc
    if key is None:
        return None
    if isinstance(key, int | float) and not isinstance(key, bool):
        key = str(key)
    if not isinstance(key, str):
        raise ValueError(f"concurrency_key must return a string or None, got {key!r}")
    if not key or len(key) > MAX_CONCURRENCY_KEY_LENGTH:
        raise ValueError(
            f"concurrency_key must return 1 to {MAX_CONCURRENCY_KEY_LENGTH} characters, "
            f"got {len(key)}"
        )
    return key


def check_run(
    workflow: Workflow | None,
    key: str | None,
    transport: JobTransport | None = None,
    run: WorkflowRun | None = None,
) -> Held | None:
    """In the current transaction, whether one more run of ``workflow`` with concurrency key
    ``key`` may become RUNNING (``None``: yes, its lock is held until commit).

    ``run``: the claimed candidate; it is refused while an older PENDING run of its key (same
    definition version, claim order: priority, then age) waits - that one's row is locked by
    another claimer right now (``SKIP LOCKED`` passed it over) - so runs of one key start in
    order even under concurrent claims; the claimer is woken after commit to try again.
    """
    if key is None or workflow is None or workflow.limits is None:
        return None
    per_key = workflow.limits.max_running_per_key
    if not per_key:
        return None
    if not try_lock(f"key:{workflow.id}:{key}"):
        if transport is not None:
            transaction.on_commit(transport.wake_claimer)
        return Held("max_running_per_key", key, per_key, None)
    running = running_runs(workflow.id, key)
    if running >= per_key:
        return Held("max_running_per_key", key, per_key, running)
    if run is not None and _older_pending(run):
        if transport is not None:
            transaction.on_commit(transport.wake_claimer)
        return Held("max_running_per_key", key, per_key, running)
    return None


def _older_pending(run: WorkflowRun) -> bool:
    """Whether a PENDING run of ``run``'s workflow, key and definition version comes before
    it in claim order (priority descending, then ``created_at``, then id)."""
    from django.db.models import Q

    before = (
        Q(priority__gt=run.priority)
        | Q(priority=run.priority, created_at__lt=run.created_at)
        | Q(priority=run.priority, created_at=run.created_at, pk__lt=run.pk)
    )
    return (
        WorkflowRun.objects.filter(
            before,
            workflow_id=run.workflow_id,
            concurrency_key=run.concurrency_key,
            definition_version=run.definition_version,
            status=Status.PENDING,
        )
        .exclude(pk=run.pk)
        .exists()
    )


def key_limits(registry: WorkflowRegistry) -> dict[str, int]:
    """``{workflow_id: max_running_per_key}`` of the registered keyed workflows."""
    return {
        w.id: w.limits.max_running_per_key
        for w in registry
        if w.limits is not None and w.limits.concurrency_key and w.limits.max_running_per_key
    }


def claim_next_allowed_run(
    registry: WorkflowRegistry,
    versions: VersionPairs | None,
    transport: JobTransport | None = None,
    claim: Callable[..., WorkflowRun | None] | None = None,
    start_at: datetime | None = None,
) -> WorkflowRun | None:
    """:func:`.locking.claim_next_pending_run`, passing over runs whose key is held by its
    ``max_running_per_key`` (the next run of another key, or unkeyed, is claimed instead;
    within one key the oldest first). Full keys are left out by the claim statement itself;
    the candidate's key is then checked under its lock (:func:`check_run`), and a key whose
    lock is busy is left out of the next try. Without a keyed workflow registered: exactly
    ``claim(versions)``. ``claim``: the claim statement (default
    :func:`.locking.claim_next_pending_run`; callers pass the name they import, so a test
    that replaces it there still sees its replacement called).

    ``start_at``: without a keyed workflow registered, the claim statement also makes the run
    RUNNING at that time (``claim(versions, start_at=...)``; issue 19); the run returned says
    which happened (``status``). With keyed workflows the run is returned PENDING, locked:
    its key is checked under its lock first.
    """
    from .locking import claim_next_pending_run

    claim = claim or claim_next_pending_run
    limits = key_limits(registry)
    if not limits:
        return claim(versions) if start_at is None else claim(versions, start_at=start_at)
    held: list[tuple[str, str]] = []
    while True:  # full keys are passed over in the statement; this loops on lock contention
        run = claim(versions, exclude_keys=held, key_limits=limits)
        if run is None or run.concurrency_key is None:
            return run
        workflow = registry.get(run.workflow_id)
        if check_run(workflow, run.concurrency_key, transport, run=run) is None:
            return run
        held.append((run.workflow_id, run.concurrency_key))


def wake_freed(kernel_transport: JobTransport, workflow: Workflow | None, queue: str) -> None:
    """After a limited job's outcome commits (a slot freed), wake one worker of each queue that
    may hold a job waiting for that slot: the job's queue if it is limited, every queue of the
    workflow's stages if the workflow is. Nothing for unlimited jobs."""
    queues: set[str] = set()
    if queue in queue_limits():
        queues.add(queue)
    if workflow is not None and workflow.limits is not None:
        if workflow.limits.max_running_stages:
            queues |= {node.stage.queue for node in workflow.nodes}
    for name in sorted(queues):
        transaction.on_commit(lambda q=name: kernel_transport.wake_workers(1, queue=q))  # type: ignore[misc]


def wake_claimer_if_keyed(transport: JobTransport, workflow: Workflow | None, run: Any) -> None:
    """After a keyed run leaves RUNNING (its key slot freed), ask for a claim after commit."""
    if (
        workflow is not None
        and workflow.limits is not None
        and workflow.limits.concurrency_key is not None
        and getattr(run, "concurrency_key", None) is not None
    ):
        transaction.on_commit(transport.wake_claimer)


def holder_of(workflow_id: str, key: str, exclude: Any = None) -> WorkflowRun | None:
    """The oldest RUNNING run of the workflow with ``key`` (for waiting reasons)."""
    qs = WorkflowRun.objects.filter(
        workflow_id=workflow_id, concurrency_key=key, status=Status.RUNNING
    )
    if exclude is not None:
        qs = qs.exclude(pk=exclude)
    return qs.order_by("started_at", "id").first()


def describe_run_hold(run: WorkflowRun, workflow: Workflow | None) -> str | None:
    """Why a PENDING keyed run waits (for waiting reasons; feature-only queries): ``"held by
    the limit max_running_per_key=1 for key 'cust-7' (run <id> holds it)"``, or ``None``
    when its key has a free slot (or it has no key)."""
    key = run.concurrency_key
    if key is None or workflow is None or workflow.limits is None:
        return None
    per_key = workflow.limits.max_running_per_key
    if not per_key:
        return None
    running = running_runs(workflow.id, key)
    if running < per_key:
        return None
    holder = holder_of(workflow.id, key)
    who = f"run {holder.pk} holds it" if running == 1 and holder else f"{running} runs hold it"
    return f"held by the limit max_running_per_key={per_key} for key {key!r} ({who})"


def describe_job_hold(job: WorkflowJob, workflow: Workflow | None) -> str | None:
    """Why a ready PENDING job waits although it is queued (for waiting reasons): ``"held by
    the limit max_running_stages=2 of workflow 'x' (2 stages running)"`` or ``"held by the
    limit QUEUE_LIMITS['gpu']=1 (1 stage running)"``; ``None`` when no limit is full."""
    max_stages = workflow.limits.max_running_stages if workflow and workflow.limits else None
    if max_stages and workflow is not None:
        running = running_jobs(workflow_id=workflow.id)
        if running >= max_stages:
            return (
                f"held by the limit max_running_stages={max_stages} of workflow "
                f"{workflow.id!r} ({running} {'stage' if running == 1 else 'stages'} running)"
            )
    queue_limit = queue_limits().get(job.queue)
    if queue_limit:
        running = running_jobs(queue=job.queue)
        if running >= queue_limit:
            return (
                f"held by the limit QUEUE_LIMITS[{job.queue!r}]={queue_limit} "
                f"({running} {'stage' if running == 1 else 'stages'} running)"
            )
    return None


__all__ = [
    "Held",
    "JobGate",
    "check_job",
    "check_run",
    "claim_next_allowed_run",
    "concurrency_key_of",
    "describe_job_hold",
    "describe_run_hold",
    "job_gate",
    "queue_limits",
]
