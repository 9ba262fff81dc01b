"""Definition versions (issue 12 item 3): stored structures, advertised worker versions, and
the in-flight runs that need a version no worker has.

* A run records the version of the definition it started with (``WorkflowRun.
  definition_version``: ``define_workflow(version=...)`` or the fingerprint); its jobs carry
  it (``WorkflowJob.definition_version``). ``""`` means unversioned: any definition runs it.
* The structure of each version is stored once (``WorkflowDefinitionVersion``) by
  :func:`ensure_stored` when a run of a version not yet stored is created (right after its
  transaction commits): a process remembers which versions it stored, so the common case
  costs no statement.
* Workers lease only jobs and PENDING runs of versions their registry runs (the lease
  statement's own condition, :func:`.locking.versions_clause`).
* Each worker process advertises the versions it runs (:func:`announce`, one row in
  ``workflow_worker_versions`` refreshed with its queue presence, expiring like it);
  :func:`live_versions` reads them, so a job no live worker can run is explained as
  "waiting for a worker with version X" (:func:`describe_missing_version`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from datetime import datetime
from typing import TYPE_CHECKING, Any

from django.db import DatabaseError, transaction

from ..models import Status, WorkflowDefinitionVersion, WorkflowRun, WorkflowWorkerVersions

if TYPE_CHECKING:
    from ..definition.registry import WorkflowRegistry
    from ..definition.workflow import Workflow
    from .leases import LeaseClock

logger = logging.getLogger("django_workflows.worker")

#: ``(workflow_id, version)`` pairs this process knows to be stored (committed).
_stored: set[tuple[str, str]] = set()

#: Run statuses whose runs still need a definition to make progress.
IN_FLIGHT = (Status.PENDING, Status.RUNNING)


def ensure_stored(workflow: Workflow, now: datetime) -> None:
    """Store ``workflow``'s structure for its version unless this process already did.

    Once the surrounding transaction commits, the first run of a version in a process costs
    one ``INSERT ... ON CONFLICT DO NOTHING`` (another process may have stored it first), run
    after the commit: inside the run's transaction the new row's unique key would make every
    concurrent first run of that version wait for this transaction. The version is remembered
    once stored; a failed or rolled-back insert is tried again with the next run. Until then
    the admin shows the registered definition's stages for runs of its own version.
    """
    key = (workflow.id, workflow.version)
    if key in _stored:
        return
    structure, takes_over = workflow.structure(), list(workflow.takes_over)

    def store() -> None:
        try:
            WorkflowDefinitionVersion.objects.bulk_create(
                [
                    WorkflowDefinitionVersion(
                        workflow_id=key[0],
                        version=key[1],
                        structure=structure,
                        takes_over=takes_over,
                        first_seen_at=now,
                    )
                ],
                ignore_conflicts=True,
            )
        except DatabaseError:  # the run committed: never fail its caller over the structure
            logger.warning("Could not store version %s of workflow %s", key[1], key[0])
            return
        _stored.add(key)

    transaction.on_commit(store)


def forget_stored(**_: Any) -> None:
    """Forget which versions this process stored (after the tables were flushed: tests)."""
    _stored.clear()


def stored_structure(workflow_id: str, version: str) -> dict[str, Any] | None:
    """The stored structure of ``version`` of ``workflow_id`` (one query), or ``None``."""
    row = (
        WorkflowDefinitionVersion.objects.filter(workflow_id=workflow_id, version=version)
        .values_list("structure", flat=True)
        .first()
    )
    return row if isinstance(row, dict) else None


def versions_q(versions: Iterable[tuple[str, str]], prefix: str = "") -> Any:
    """The ORM form of :func:`.locking.versions_clause` on the run fields behind ``prefix``
    (``"run__"`` from a stage record): unversioned, of a workflow not in ``versions``, or of
    one of the ``(workflow_id, version)`` pairs. No pairs: no condition.
    """
    from django.db.models import Q

    pairs = list(versions)
    if not pairs:
        return Q()
    allowed = Q(**{f"{prefix}definition_version": ""}) | ~Q(
        **{f"{prefix}workflow_id__in": sorted({w for w, _ in pairs})}
    )
    for workflow_id, version in pairs:
        allowed |= Q(
            **{f"{prefix}workflow_id": workflow_id, f"{prefix}definition_version": version}
        )
    return allowed


def deploy_lease_name(base: str, registry: WorkflowRegistry) -> str:
    """The name of a singleton maintenance lease (the ``ticker`` and ``maintenance-tick``
    leases) for the processes running ``registry``'s definitions: ``base`` for an empty
    registry, else ``base@`` and 12 hex digits of the SHA-1 of its runnable versions.

    Processes of one deploy share the name, so they still tick one at a time; processes of
    another deploy (other definition versions) tick on their own lease, because only they can
    claim and poll their versions' runs and stages. The steps every tick shares (reaping
    stale leases and stuck runs, the outbox flush under its own lease) are safe to run from
    two ticks at once: each locks the rows it changes.
    """
    import hashlib
    import json

    pairs = registry.runnable_versions()
    if not pairs:
        return base
    digest = hashlib.sha1(json.dumps(pairs).encode()).hexdigest()[:12]
    return f"{base}@{digest}"


def runnable_map(registry: WorkflowRegistry) -> dict[str, list[str]]:
    """``{workflow_id: [version, ...]}``: what ``registry``'s definitions run."""
    found: dict[str, list[str]] = {}
    for workflow_id, version in registry.runnable_versions():
        found.setdefault(workflow_id, []).append(version)
    return found


# --- Advertised versions ----------------------------------------------------------------------


def announce(
    worker_id: str, registry: WorkflowRegistry, lease_clock: LeaseClock, ttl_seconds: float
) -> None:
    """Write or refresh ``worker_id``'s advertised versions (one ``UPDATE``; an ``INSERT`` the
    first time) until ``now + ttl_seconds`` in lease time, and drop expired rows.
    """
    versions = runnable_map(registry)
    expires = lease_clock.offset(ttl_seconds)
    updated = WorkflowWorkerVersions.objects.filter(worker_id=worker_id).update(
        versions=versions, expires_at=expires
    )
    if not updated:
        WorkflowWorkerVersions.objects.bulk_create(
            [WorkflowWorkerVersions(worker_id=worker_id, versions=versions, expires_at=expires)],
            ignore_conflicts=True,
        )
    WorkflowWorkerVersions.objects.filter(expires_at__lte=lease_clock.now()).delete()


def withdraw(worker_id: str) -> None:
    """Remove ``worker_id``'s advertised versions (a worker that stops cleanly)."""
    WorkflowWorkerVersions.objects.filter(worker_id=worker_id).delete()


def live_versions(*, lease_clock: LeaseClock) -> dict[str, set[str]]:
    """``{workflow_id: {version, ...}}`` that at least one live worker runs (one query).

    ``lease_clock``: the kernel's (``kernel.lease_clock``; the default kernel's is
    ``django_workflows.kernel.runtime.get_kernel().lease_clock``) - passed by the caller so
    this module does not import :mod:`.runtime` (an import circle).
    """
    found: dict[str, set[str]] = {}
    for versions in WorkflowWorkerVersions.objects.filter(
        expires_at__gt=lease_clock.now()
    ).values_list("versions", flat=True):
        if isinstance(versions, dict):
            for workflow_id, listed in versions.items():
                found.setdefault(str(workflow_id), set()).update(str(v) for v in listed or ())
    return found


def live_workers(*, lease_clock: LeaseClock) -> dict[tuple[str, str], list[str]]:
    """``{(workflow_id, version): [worker_id, ...]}``: which live worker processes advertise
    each version (ids sorted; a worker id names its host, ``worker-<host>-<pid>-<hex>``).
    One query on ``workflow_worker_versions``; expired rows do not count. Tells a correct
    side-by-side deploy (old runs run by a live old worker) from orphaned runs (the system
    check ``django_workflows.W004``, ``workflows_list``). ``lease_clock`` as for
    :func:`live_versions`.
    """
    found: dict[tuple[str, str], list[str]] = {}
    rows = WorkflowWorkerVersions.objects.filter(expires_at__gt=lease_clock.now()).values_list(
        "worker_id", "versions"
    )
    for worker_id, versions in rows:
        if isinstance(versions, dict):
            for workflow_id, listed in versions.items():
                for version in listed or ():
                    found.setdefault((str(workflow_id), str(version)), []).append(worker_id)
    return {key: sorted(ids) for key, ids in found.items()}


def describe_workers(worker_ids: Iterable[str], most: int = 3) -> str:
    """``"worker worker-a-1-x"``, ``"workers worker-a-1-x, worker-b-2-y"``, ``"workers w1,
    w2, w3 and 2 more"``: at most ``most`` ids named."""
    ids = list(worker_ids)
    if len(ids) == 1:
        return f"worker {ids[0]}"
    named = ", ".join(ids[:most])
    more = f" and {len(ids) - most} more" if len(ids) > most else ""
    return f"workers {named}{more}"


def describe_missing_version(version: str) -> str:
    """``"waiting for a worker with version 3"``."""
    return f"waiting for a worker with version {version}"


# --- In-flight runs ---------------------------------------------------------------------------


def in_flight_versions() -> dict[tuple[str, str], int]:
    """``{(workflow_id, definition_version): runs}`` of PENDING and RUNNING runs (one
    ``GROUP BY`` query; ``""`` for unversioned runs).
    """
    from django.db.models import Count

    rows = (
        WorkflowRun.objects.filter(status__in=IN_FLIGHT)
        .order_by()
        .values_list("workflow_id", "definition_version")
        .annotate(n=Count("id"))
    )
    return {(wf, version): n for wf, version, n in rows}


def unrunnable(
    registry: WorkflowRegistry, in_flight: dict[tuple[str, str], int]
) -> list[tuple[str, str, int]]:
    """``[(workflow_id, version, runs)]`` (sorted) of in-flight versioned runs whose version no
    definition of ``registry`` runs (for the system check ``django_workflows.W004``).
    """
    runnable = set(registry.runnable_versions())
    return sorted(
        (wf, version, n)
        for (wf, version), n in in_flight.items()
        if version and (wf, version) not in runnable
    )


def mismatched_structures(
    registry: WorkflowRegistry, in_flight: dict[tuple[str, str], int]
) -> list[tuple[str, str, int, tuple[str, ...]]]:
    """``[(workflow_id, version, runs, missing stage ids)]`` (sorted) of in-flight runs whose
    version a loaded definition claims to run (its ``version`` or a ``takes_over``) although
    the structure stored for that version (``WorkflowDefinitionVersion.structure``) has
    stages the loaded definition lacks: a reused explicit version or a wrong ``takes_over``;
    such runs fail with ``DefinitionMismatch`` when they reach a missing stage (for the system
    check ``django_workflows.W005``). One query; none when no in-flight version is runnable.
    """
    from django.db.models import Q

    from ..models import WorkflowDefinitionVersion

    runnable = set(registry.runnable_versions())
    claimed = [(wf, v) for (wf, v) in in_flight if v and (wf, v) in runnable]
    if not claimed:
        return []
    where = Q()
    for wf, v in claimed:
        where |= Q(workflow_id=wf, version=v)
    found = []
    rows = WorkflowDefinitionVersion.objects.filter(where).values_list(
        "workflow_id", "version", "structure"
    )
    for wf, v, structure in rows:
        workflow = registry.get(wf)
        if workflow is None:
            continue
        stored = [
            stage.get("id")
            for group in (structure or {}).get("groups", [])
            for stage in group
            if isinstance(stage, dict)
        ]
        loaded = set(workflow.stage_ids)
        missing = tuple(sid for sid in stored if sid not in loaded)
        if missing:
            found.append((wf, v, in_flight[(wf, v)], missing))
    return sorted(found)


def waiting_for_version(run: WorkflowRun, *, lease_clock: LeaseClock) -> str | None:
    """The definition version ``run`` waits for a worker with, or ``None``: the run is
    versioned, PENDING or with a ready PENDING job or a SUSPENDED one (its completion checks
    run on a worker of its version), workers advertise versions, and none runs
    the run's version (at most two queries; none for an unversioned or terminal run). For the
    CLI (``workflows_status``); the admin and the API use
    :func:`django_workflows.runs.waiting_reasons`. ``lease_clock`` as for
    :func:`live_versions`.
    """
    from django.db.models import Q

    from ..models import WorkflowJob

    version = run.definition_version
    if not version or run.status not in IN_FLIGHT:
        return None
    if run.status == Status.RUNNING and not (
        WorkflowJob.objects.filter(
            Q(next_poll_at__isnull=True)
            | Q(next_poll_at__lte=lease_clock.now())
            | Q(status=Status.SUSPENDED),
            workflow_run_id=run.pk,
            status__in=[Status.PENDING, Status.SUSPENDED],
        ).exists()
    ):
        return None
    live = live_versions(lease_clock=lease_clock)
    if not live or version in live.get(run.workflow_id, ()):
        return None
    return version
