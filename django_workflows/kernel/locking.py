"""Row locks of runs, jobs and schedules (ARCHITECTURE §3): the run lock of the RUNNING guard,
the job lease and claim statements, the give-up scan, the schedule locks.

Not the only place that locks rows: :func:`.delivery._adopt_orphan` (taking back a job a lost
commit leased to this worker) and :mod:`.timeouts` (failing overrun jobs) lock jobs with
``select_for_update(skip_locked=True)`` themselves; the raw statements here lock through
:func:`.rows.select` (``lock="update"`` / ``"skip"``).

On PostgreSQL these are real row locks (``FOR UPDATE``, ``SKIP LOCKED`` for claims). On SQLite
Django ignores ``select_for_update``; there the ``IMMEDIATE`` transaction mode takes the database
write lock at ``BEGIN``, which serialises writers just as strictly.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from datetime import datetime
from typing import Any

from django.db import transaction
from django.db.models import F, Q
from django.db.models.functions import Now

from ..models import Status, WorkflowJob, WorkflowRun
from . import rows
from .errors import InvalidCommandError, RunNotRunningError

#: ``((workflow_id, definition_version), ...)``: the definition versions a worker runs
#: (:meth:`~django_workflows.definition.registry.WorkflowRegistry.runnable_versions`).
VersionPairs = tuple[tuple[str, str], ...]


def versions_clause(versions: VersionPairs | None) -> tuple[str, list[Any], int]:
    """The version condition of the lease and claim statements (issue 12 item 3) and its
    parameters: a row passes when it is unversioned (``definition_version = ''``), or its
    workflow is none of ``versions``' workflows (this process does not have it: the lease
    goes on as before, K-CP-2 fails such a run), or its ``(workflow_id,
    definition_version)`` is one of ``versions``. So a worker leaves a row only when it has
    the workflow but not a definition that runs the row's version.

    ``versions=None`` or ``()``: no condition (``n = -1`` / ``0``). Row values
    (``(a, b) IN (VALUES ...)``) work on PostgreSQL and SQLite (>= 3.15).
    """
    if not versions:
        return "", [], -1 if versions is None else 0
    ids = sorted({workflow_id for workflow_id, _ in versions})
    values = ", ".join(["(%s, %s)"] * len(versions))
    params: list[Any] = [*ids, *(item for pair in versions for item in pair)]
    return (
        f" AND (definition_version = '' OR workflow_id NOT IN ({', '.join(['%s'] * len(ids))})"
        f" OR (workflow_id, definition_version) IN (VALUES {values}))",
        params,
        len(versions) * 1000 + len(ids),
    )


def parse_run_id(value: Any, field: str = "workflow_run_id") -> uuid.UUID:
    """``value`` as a UUID. Raises :class:`InvalidCommandError` naming ``field``."""
    if isinstance(value, uuid.UUID):
        return value
    try:
        return uuid.UUID(str(value))
    except (TypeError, ValueError):
        raise InvalidCommandError(
            f"{field}: {value!r} is not a valid run id (expected a UUID)", field=field
        ) from None


def lock_run(run_id: uuid.UUID) -> WorkflowRun | None:
    """Lock and return the run row, or ``None`` if it does not exist. Needs a transaction."""
    found = rows.select(
        WorkflowRun, "lock_run", "id = %s", [rows.prep(WorkflowRun, "id", run_id)], lock="update"
    )
    return found[0] if found else None


class _RunRowLocked(Exception):
    """:func:`require_running` with ``wait=False``: another transaction holds the run row
    (a kernel-internal signal, never raised to callers of the package)."""


def require_running(run_id: uuid.UUID, *, wait: bool = True) -> WorkflowRun:
    """The RUNNING guard (Part I item 1, K-JE-15, K-PS-5).

    Locks the run row and returns it if it is RUNNING; a cancel that committed first is seen
    here, and a cancel that comes later waits for this transaction. Must run inside
    ``transaction.atomic()``. ``wait=False`` (maintenance, issue 17): do not wait for a
    transaction that holds the row (it may be a vanished host's), raise :class:`_RunRowLocked`.

    Raises:
        RunNotRunningError: the run is not RUNNING (status ``DELETED`` when it vanished).
        _RunRowLocked: ``wait=False`` and another transaction holds the row.
    """
    assert transaction.get_connection().in_atomic_block, "require_running needs a transaction"
    found = lock_run(run_id) if wait else try_lock_run(run_id)
    if found is LOCKED:
        raise _RunRowLocked(run_id)
    run = found if isinstance(found, WorkflowRun) else None
    if run is None:
        raise RunNotRunningError(run_id, "DELETED")
    if run.status != Status.RUNNING:
        raise RunNotRunningError(run_id, run.status)
    return run


def claim_next_pending_run(
    versions: VersionPairs | None = None,
    exclude_keys: Iterable[tuple[str, str]] = (),
    key_limits: dict[str, int] | None = None,
    start_at: datetime | None = None,
) -> WorkflowRun | None:
    """Lock the PENDING run with the highest priority, oldest first (DM-33); skip locked rows.
    ``versions``: skip runs of these workflows whose definition version is none of these
    (:func:`versions_clause`; issue 12 item 3); ``None``: any.

    ``start_at``: also make the run RUNNING, started (and updated) at that time with its
    ``version`` bumped, in the same statement (:func:`.rows.update_first`; issue 19: one
    statement per claimed run fewer); the run is returned so. For a claimer that takes the
    run whatever its key (no per-key limit to check under its lock, :mod:`.limits`).

    Per-key limits (:mod:`.limits`, issue 18 item 6): ``key_limits`` (``{workflow_id:
    max_running_per_key}``) passes over keyed runs of those workflows whose key already has
    that many RUNNING runs, in the same statement (one indexed count per candidate, so held
    keys cost no statement each); ``exclude_keys``: ``(workflow_id, concurrency_key)`` pairs
    to pass over as well (held by a lock this transaction could not take).
    """
    in_versions, params, nv = versions_clause(versions)
    keys = list(exclude_keys)
    not_keys = "".join(" AND NOT (workflow_id = %s AND concurrency_key = %s)" for _ in keys)
    params += [item for pair in keys for item in pair]
    room, nl = "", 0
    if key_limits:
        limited = sorted(key_limits.items())
        nl = len(limited)
        table = rows._q(WorkflowRun._meta.db_table)
        cases = " ".join("WHEN %s THEN %s" for _ in limited)
        room = (
            f" AND (concurrency_key IS NULL OR workflow_id NOT IN ({', '.join(['%s'] * nl)})"
            f" OR (SELECT COUNT(*) FROM {table} held WHERE held.workflow_id = {table}.workflow_id"
            f" AND held.concurrency_key = {table}.concurrency_key AND held.status = %s)"
            f" < CASE workflow_id {cases} END)"
        )
        params += [w for w, _ in limited] + [Status.RUNNING.value]
        params += [item for pair in limited for item in pair]
    key = f"claim_next_pending_run:{nv}" + (f":k{len(keys)}" if keys else "")
    key += f":l{nl}" if nl else ""
    where = f"status = %s{in_versions}{not_keys}{room}"
    order_by = "priority DESC, created_at ASC, id ASC"
    if start_at is not None:
        return rows.update_first(
            WorkflowRun,
            key,
            where,
            [Status.PENDING.value, *params],
            order_by=order_by,
            values={"status": Status.RUNNING.value, "started_at": start_at, "updated_at": start_at},
            bump_version=True,
        )
    found = rows.select(
        WorkflowRun,
        key,
        where,
        [Status.PENDING.value, *params],
        order_by=order_by,
        limit=1,
        lock="skip",
    )
    return found[0] if found else None


def claim_next_job(
    now: Any,
    exclude: Iterable[int] = (),
    queues: Iterable[str] | None = None,
    versions: VersionPairs | None = None,
    exclude_workflows: Iterable[str] = (),
    exclude_queues: Iterable[str] = (),
) -> WorkflowJob | None:
    """Lock the ready PENDING job with the highest priority, oldest run first (DM-41), so a
    run that has started finishes before newer runs start.

    ``exclude_workflows`` / ``exclude_queues``: workflows and queues whose jobs are held by a
    shared limit in this lease (:mod:`.limits`, issue 18 item 6); passed over.

    ``now``: lease time (a datetime or the database's ``Now()``). ``exclude``: job ids this
    transaction already looked at (and still holds locks on). ``queues``: only jobs of these
    queues (issue 8 item 5; the claim index leads with status and queue); ``None``: any.
    ``versions``: skip jobs of these workflows whose definition version is none of these
    (:func:`versions_clause`; issue 12 item 3); ``None``: any.
    """
    exclude = list(exclude)
    queue_list = sorted(queues) if queues is not None else None
    if queue_list is not None and not queue_list:
        return None
    held_workflows, held_queues = sorted(exclude_workflows), sorted(exclude_queues)
    if hasattr(now, "resolve_expression") and not isinstance(now, Now):
        return _claim_next_job_orm(  # another expression
            now, exclude, queue_list, versions, held_workflows, held_queues
        )
    params: list[Any] = [Status.PENDING.value]
    in_queues = ""
    if queue_list is not None:
        in_queues = (
            " AND queue = %s"
            if len(queue_list) == 1
            else f" AND queue IN ({', '.join(['%s'] * len(queue_list))})"
        )
        params += queue_list
    if isinstance(now, Now):
        ready = rows.now_sql()
    else:
        ready = "%s"
        params.append(rows.prep(WorkflowJob, "next_poll_at", now))
    not_in, ids = rows.ids_clause("id", exclude)
    in_versions, version_params, nv = versions_clause(versions)
    nq = -1 if queue_list is None else len(queue_list)
    held, held_params, key = "", [], ""
    if held_workflows or held_queues:
        not_workflows, held_params = rows.ids_clause("workflow_id", held_workflows)
        not_queues, queue_params = rows.ids_clause("queue", held_queues)
        held, held_params = not_workflows + not_queues, held_params + queue_params
        key = f":h{len(held_workflows)}:{len(held_queues)}"
    found = rows.select(
        WorkflowJob,
        f"claim_next_job:{ready != '%s'}:{len(ids)}:{nq}:{nv}{key}",
        f"status = %s{in_queues} AND (next_poll_at IS NULL OR next_poll_at <= {ready})"
        f"{in_versions}{not_in}{held}",
        params + version_params + ids + held_params,
        order_by="priority DESC, run_created_at ASC, id ASC",
        limit=1,
        lock="skip",
    )
    return found[0] if found else None


def _claim_next_job_orm(
    now: Any,
    exclude: list[int],
    queues: list[str] | None,
    versions: VersionPairs | None,
    held_workflows: list[str],
    held_queues: list[str],
) -> WorkflowJob | None:
    qs = WorkflowJob.objects.select_for_update(skip_locked=True).filter(
        Q(next_poll_at__isnull=True) | Q(next_poll_at__lte=now), status=Status.PENDING
    )
    if held_workflows:
        qs = qs.exclude(workflow_id__in=held_workflows)
    if held_queues:
        qs = qs.exclude(queue__in=held_queues)
    if queues is not None:
        qs = qs.filter(queue__in=queues)
    if exclude:
        qs = qs.exclude(pk__in=exclude)
    if versions:
        allowed = Q(definition_version="") | ~Q(workflow_id__in={w for w, _ in versions})
        for workflow_id, version in versions:
            allowed |= Q(workflow_id=workflow_id, definition_version=version)
        qs = qs.filter(allowed)
    return qs.order_by("-priority", "run_created_at", "id").first()


def lock_exhausted_stale_jobs(cutoff: Any) -> list[WorkflowJob]:
    """Lock RUNNING jobs whose lease is older than ``cutoff`` and whose next delivery would
    exceed ``max_attempts`` (Part I item 3); rows locked elsewhere are skipped.
    """
    return list(
        WorkflowJob.objects.select_for_update(skip_locked=True)
        .filter(status=Status.RUNNING, locked_at__lt=cutoff, attempt__gte=F("max_attempts"))
        .order_by("id")
    )


def lock_releasable_stale_jobs(cutoff: Any) -> list[int]:
    """Lock RUNNING jobs whose lease is older than ``cutoff`` and that have deliveries left
    (``attempt < max_attempts``); returns their ids. Rows locked elsewhere are skipped (a
    vanished host's open transaction must not block the maintenance tick, issue 17). Needs a
    transaction.
    """
    return list(
        WorkflowJob.objects.select_for_update(skip_locked=True)
        .filter(status=Status.RUNNING, locked_at__lt=cutoff, attempt__lt=F("max_attempts"))
        .order_by("id")
        .values_list("pk", flat=True)
    )


#: :func:`try_lock_run` result when another transaction holds the run row.
LOCKED = object()


def try_lock_run(run_id: uuid.UUID) -> WorkflowRun | object | None:
    """Lock the run row without waiting (Part I item 3).

    Callers that already hold job row locks use this instead of :func:`lock_run`: waiting for
    the run while holding a job could deadlock with ``run.cancel`` (run, then jobs).

    Returns:
        The locked run, ``None`` when it does not exist, or :data:`LOCKED` when another
        transaction holds it (try again later).
    """
    found = rows.select(
        WorkflowRun, "try_lock_run", "id = %s", [rows.prep(WorkflowRun, "id", run_id)], lock="skip"
    )
    run = found[0] if found else None
    if run is None and WorkflowRun.objects.filter(pk=run_id).exists():
        return LOCKED
    return run


def lock_due_schedule(name: str, now: Any) -> Any:
    """Lock and return the ``WorkflowSchedule`` row ``name`` if it is unpaused and has a firing
    due at ``now`` (``next_fire_at <= now`` or a buffered firing), else ``None``. On
    PostgreSQL ``FOR UPDATE SKIP LOCKED``: a row another tick is firing is skipped, and after
    that tick commits the due condition is judged on the advanced row. Needs a transaction.
    """
    from django.db import connection

    from ..models import WorkflowSchedule

    assert transaction.get_connection().in_atomic_block, "lock_due_schedule needs a transaction"
    rows_ = WorkflowSchedule.objects.filter(pk=name, paused=False).filter(
        Q(next_fire_at__lte=now) | Q(buffered_at__isnull=False)
    )
    if connection.features.has_select_for_update_skip_locked:
        rows_ = rows_.select_for_update(skip_locked=True)
    return rows_.first()


def lock_schedule(name: str) -> Any:
    """Lock and return the ``WorkflowSchedule`` row ``name`` (waiting for a tick that fires
    it), or ``None``. Needs a transaction.
    """
    from ..models import WorkflowSchedule

    assert transaction.get_connection().in_atomic_block, "lock_schedule needs a transaction"
    return WorkflowSchedule.objects.select_for_update().filter(pk=name).first()
