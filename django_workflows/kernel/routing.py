"""Stage routing: which worker pool (queue) runs a stage, and which pools have live workers
(issue 8 item 5; SPEC K-32's routing executor in this engine's terms).

A stage names its queue (``@stage(..., queue="gpu")``; default ``"default"``); each of its jobs
carries it (``WorkflowJob.queue``). The ``QUEUES`` setting maps queues onto named django-q2
clusters (``{"gpu": "gpu"}``); ``"default"`` maps onto the default cluster
(:func:`default_cluster`) unless ``QUEUES`` names it. A worker process serves the queues whose
cluster is its own (:func:`queues_served_by`) and leases only their jobs; wake-ups for a ready
job go to its queue's cluster (:func:`cluster_of`).

Presence: a worker announces the queues it serves (:func:`announce`), a row per queue in the
named-leases table (``worker:<queue>:<digest of the worker id>``) that expires after
:func:`presence_ttl_seconds`; :func:`live_queues` reads the unexpired ones. A PENDING ready job
whose queue has no live worker is *waiting for a worker*
(:func:`waiting_for_worker` / :func:`waiting_reason`), shown by ``workflows_status`` and the API.
"""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from django.conf import settings
from django.db.models import Q

from ..conf import workflow_settings
from ..definition.stage import DEFAULT_QUEUE as DEFAULT_QUEUE
from ..models import MaintenanceLease, Status, WorkflowJob
from .leases import LeaseClock, acquire_lease

if TYPE_CHECKING:
    from ..definition.registry import WorkflowRegistry

#: Prefix of the presence rows in ``workflow_maintenance_leases``.
PRESENCE_PREFIX = "worker:"


def default_cluster() -> str:
    """The django-q2 cluster of the ``"default"`` queue: the ``Q_CLUSTER_NAME`` setting, else
    django-q2's own default cluster as the settings define it (``Q_CLUSTER["cluster_name"]``,
    else ``Q_CLUSTER["name"]``, else ``"default"``; not the ``Q_CLUSTER_NAME`` environment
    variable, which selects the cluster of one process).
    """
    name = workflow_settings.Q_CLUSTER_NAME
    if name:
        return str(name)
    q = getattr(settings, "Q_CLUSTER", None) or {}
    return str(q.get("cluster_name") or q.get("name") or "default")


def queue_clusters() -> dict[str, str]:
    """``{queue: django-q2 cluster name}``: the ``QUEUES`` setting plus ``"default"``.

    Raises:
        ImproperlyConfigured: ``QUEUES`` is not a dict of non-empty strings.
    """
    from django.core.exceptions import ImproperlyConfigured

    raw = workflow_settings.QUEUES or {}
    if not isinstance(raw, dict) or not all(
        isinstance(k, str) and k and isinstance(v, str) and v for k, v in raw.items()
    ):
        raise ImproperlyConfigured(
            f"DJANGO_WORKFLOWS['QUEUES'] must map queue names to django-q2 cluster names "
            f"(non-empty strings), got {raw!r}"
        )
    mapping = {DEFAULT_QUEUE: default_cluster()}
    mapping.update(raw)
    return mapping


def cluster_of(queue: str) -> str | None:
    """The django-q2 cluster that serves ``queue``, or ``None`` for a queue that ``QUEUES``
    does not map (nobody serves it; system check ``django_workflows.W010``).
    """
    return queue_clusters().get(queue)


def queues_served_by(cluster: str) -> frozenset[str]:
    """The queues whose jobs the workers of django-q2 cluster ``cluster`` lease."""
    return frozenset(q for q, c in queue_clusters().items() if c == cluster)


def stage_queues(workflows: Iterable[Any] | None = None) -> dict[str, list[str]]:
    """``{queue: ["workflow_id/stage_id", ...]}`` of the stages of ``workflows`` (default:
    every registered workflow).
    """
    if workflows is None:
        from ..definition.registry import registry

        workflows = list(registry)
    found: dict[str, list[str]] = {}
    for workflow in workflows:
        for stage in workflow.stages:
            found.setdefault(stage.queue, []).append(f"{workflow.id}/{stage.id}")
    return found


def configured_clusters() -> set[str]:
    """The django-q2 cluster names this project defines: ``Q_CLUSTER["name"]`` (or
    ``"default"``) and the keys of ``Q_CLUSTER["ALT_CLUSTERS"]``.
    """
    q = getattr(settings, "Q_CLUSTER", None) or {}
    names = {str(q.get("name") or "default")}
    if q.get("cluster_name"):
        names.add(str(q["cluster_name"]))
    alt = q.get("ALT_CLUSTERS")
    if isinstance(alt, dict):
        names.update(str(k) for k in alt)
    return names


# --- Presence ---------------------------------------------------------------------------------


def presence_interval_seconds() -> float:
    """How often a worker process refreshes its presence: ``HEARTBEAT_INTERVAL_SECONDS``."""
    return float(workflow_settings.HEARTBEAT_INTERVAL_SECONDS)


def presence_ttl_seconds() -> float:
    """How long a presence row lives without a refresh: three presence intervals."""
    return 3 * presence_interval_seconds()


def _presence_name(queue: str, worker_id: str) -> str:
    digest = hashlib.sha1(worker_id.encode()).hexdigest()[:16]
    return f"{PRESENCE_PREFIX}{queue}:{digest}"


def announce(
    worker_id: str,
    queues: Iterable[str],
    *,
    lease_clock: LeaseClock | None = None,
    registry: WorkflowRegistry | None = None,
) -> None:
    """Write or refresh ``worker_id``'s presence for each queue (lease time: the database's
    clock) and drop presence rows of those queues that expired; also advertise the definition
    versions it runs (``registry``, default the kernel's: :func:`.versions.announce`, issue
    12 item 3). Safe from any thread (it uses that thread's connection; the caller closes it
    when the thread idles).
    """
    from . import versions as definition_versions

    if lease_clock is None or registry is None:
        from .runtime import get_kernel

        kernel = get_kernel()
        lease_clock = lease_clock or kernel.lease_clock
        registry = registry if registry is not None else kernel.registry
    ttl = presence_ttl_seconds()
    definition_versions.announce(worker_id, registry, lease_clock, ttl)
    queues = sorted(set(queues))
    for queue in queues:
        acquire_lease(lease_clock, _presence_name(queue, worker_id), worker_id, ttl)
    if queues:
        expired = Q()
        for queue in queues:
            expired |= Q(name__startswith=f"{PRESENCE_PREFIX}{queue}:")
        MaintenanceLease.objects.filter(expired, expires_at__lte=lease_clock.now()).delete()


def withdraw(worker_id: str, queues: Iterable[str]) -> None:
    """Remove ``worker_id``'s presence rows (a worker that stops cleanly)."""
    from .versions import withdraw as withdraw_versions

    names = [_presence_name(q, worker_id) for q in queues]
    MaintenanceLease.objects.filter(name__in=names, owner=worker_id).delete()
    withdraw_versions(worker_id)


def live_queues(*, lease_clock: LeaseClock | None = None) -> set[str]:
    """The queues that have at least one worker whose presence has not expired."""
    if lease_clock is None:
        from .runtime import get_kernel

        lease_clock = get_kernel().lease_clock
    names = MaintenanceLease.objects.filter(
        name__startswith=PRESENCE_PREFIX, expires_at__gt=lease_clock.now()
    ).values_list("name", flat=True)
    return {name[len(PRESENCE_PREFIX) :].rsplit(":", 1)[0] for name in names}


def waiting_for_worker(
    run_id: uuid.UUID | str, *, lease_clock: LeaseClock | None = None
) -> list[str]:
    """The queues (sorted) of the run's ready PENDING jobs that no live worker serves.

    A ready job is PENDING with no retry back-off left (``next_poll_at`` unset or past).
    Returns ``[]`` when every ready job's queue has a live worker (or nothing is ready).
    """
    if lease_clock is None:
        from .runtime import get_kernel

        lease_clock = get_kernel().lease_clock
    queues = set(
        WorkflowJob.objects.filter(
            Q(next_poll_at__isnull=True) | Q(next_poll_at__lte=lease_clock.now()),
            workflow_run_id=run_id,
            status=Status.PENDING,
        ).values_list("queue", flat=True)
    )
    if not queues:
        return []
    return sorted(queues - live_queues(lease_clock=lease_clock))


def describe_waiting(queues: list[str]) -> str | None:
    """``"waiting for a gpu worker"`` (several: ``"waiting for a gpu, ocr worker"``), or
    ``None`` for no queue.
    """
    if not queues:
        return None
    return f"waiting for a {', '.join(queues)} worker"


def waiting_reason(run_id: Any, *, lease_clock: LeaseClock | None = None) -> str | None:
    """Why the run's ready work is not running, e.g. ``"waiting for a gpu worker"``, or
    ``None`` (see :func:`waiting_for_worker`). For the CLI, the API and the admin.
    """
    return describe_waiting(waiting_for_worker(run_id, lease_clock=lease_clock))
