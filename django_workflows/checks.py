"""System checks (``django_workflows.E001``...): settings mistakes caught at start-up."""

from __future__ import annotations

import math
from typing import Any

from django.conf import settings
from django.core.checks import Error, Info, Warning, register
from django.utils.module_loading import import_string

from .conf import DEFAULTS, workflow_settings
from .definition.stage import seconds_error


@register()
def check_settings(app_configs: Any = None, **kwargs: Any) -> list[Any]:
    messages: list[Any] = []
    user = getattr(settings, "DJANGO_WORKFLOWS", None) or {}
    unknown = sorted(set(user) - set(DEFAULTS))
    if unknown:
        messages.append(
            Error(
                f"Unknown DJANGO_WORKFLOWS settings: {', '.join(unknown)}",
                hint=f"Known settings: {', '.join(sorted(DEFAULTS))}",
                id="django_workflows.E001",
            )
        )
    for name in (
        "MAX_ATTEMPTS",
        "STALE_LEASE_SECONDS",
        "HEARTBEAT_INTERVAL_SECONDS",
        "TICK_INTERVAL_SECONDS",
        "JOBS_PER_WAKEUP",
        "SUPERVISOR_INTERVAL_SECONDS",
        "TICKER_LEASE_SECONDS",
        "STOP_GRACE_SECONDS",
        "STAGE_TIMEOUT_GRACE_SECONDS",
    ):
        value = getattr(workflow_settings, name)
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not math.isfinite(value)
            or value <= 0
        ):
            messages.append(
                Error(
                    f"DJANGO_WORKFLOWS['{name}'] must be a positive, finite number, got {value!r}",
                    id="django_workflows.E002",
                )
            )
    for name in ("DEFAULT_STAGE_TIMEOUT_SECONDS", "DEFAULT_QUEUE_TIMEOUT_SECONDS"):
        problem = seconds_error(getattr(workflow_settings, name))
        if problem:
            messages.append(
                Error(f"DJANGO_WORKFLOWS['{name}'] {problem}", id="django_workflows.E002")
            )
    if (
        isinstance(workflow_settings.HEARTBEAT_INTERVAL_SECONDS, int | float)
        and isinstance(workflow_settings.STALE_LEASE_SECONDS, int | float)
        and workflow_settings.HEARTBEAT_INTERVAL_SECONDS >= workflow_settings.STALE_LEASE_SECONDS
    ):
        messages.append(
            Error(
                "DJANGO_WORKFLOWS['HEARTBEAT_INTERVAL_SECONDS'] must be below STALE_LEASE_SECONDS, "
                "or running stages lose their lease",
                id="django_workflows.E003",
            )
        )
    try:
        import_string(workflow_settings.TRANSPORT)
    except ImportError as exc:
        messages.append(
            Error(
                f"DJANGO_WORKFLOWS['TRANSPORT'] cannot be imported: {exc}",
                id="django_workflows.E004",
            )
        )
    for path in workflow_settings.PLUGINS:
        try:
            import_string(path)
        except ImportError as exc:
            messages.append(
                Error(
                    f"DJANGO_WORKFLOWS['PLUGINS'] entry {path!r}: {exc}", id="django_workflows.E005"
                )
            )
    q = getattr(settings, "Q_CLUSTER", None) or {}
    if q and "django_q" in settings.INSTALLED_APPS:
        timeout, retry = q.get("timeout"), q.get("retry", 60)
        if timeout is None:
            messages.append(
                Warning(
                    "Q_CLUSTER['timeout'] is not set: django-q2 then never stops a task, but "
                    f"delivers any task still running after Q_CLUSTER['retry'] ({retry} s) a "
                    "second time; set timeout above your longest stage and retry above timeout",
                    id="django_workflows.W001",
                )
            )
        elif retry is not None and retry <= timeout:
            messages.append(
                Warning(
                    "Q_CLUSTER['retry'] should be larger than Q_CLUSTER['timeout'], or django-q2 "
                    "delivers long tasks twice",
                    id="django_workflows.W001",
                )
            )
    messages += check_routing()
    messages += check_queue_limits()
    messages += check_wakeups()
    messages += check_retention()
    messages += check_stage_timeouts()
    messages += check_health_settings()
    for alias, db in settings.DATABASES.items():
        if db.get("ENGINE", "").endswith("sqlite3"):
            mode = (db.get("OPTIONS") or {}).get("transaction_mode")
            if mode != "IMMEDIATE":
                messages.append(
                    Warning(
                        f"DATABASES['{alias}'] is SQLite without "
                        "OPTIONS={'transaction_mode': 'IMMEDIATE'}: concurrent workers will hit "
                        "'database is locked'",
                        id="django_workflows.W002",
                    )
                )
        elif "postgresql" in db.get("ENGINE", ""):
            messages += check_session_bounds(alias, db)
    return messages


def check_health_settings() -> list[Any]:
    """``django_workflows.E040``: a health setting of the wrong kind (issue 20):
    ``HEALTH_MAX_OUTBOX_LAG_SECONDS`` / ``HEALTH_MAX_DEAD_LETTERS`` ``None`` or a number of
    0 or more (dead letters: an integer), ``HEALTH_DB_TIMEOUT_SECONDS`` and
    ``HEALTH_TIMEOUT_SECONDS`` positive numbers,
    ``HEALTH_FINISHED_WINDOW_SECONDS`` 0 or more, ``HEALTH_TOKEN`` ``None`` or a non-empty
    string."""

    def number(value: Any, *, integer: bool = False) -> bool:
        kinds = int if integer else int | float
        return (
            not isinstance(value, bool)
            and isinstance(value, kinds)
            and math.isfinite(value)
            and value >= 0
        )

    problems = []
    lag = workflow_settings.HEALTH_MAX_OUTBOX_LAG_SECONDS
    if lag is not None and not number(lag):
        problems.append(("HEALTH_MAX_OUTBOX_LAG_SECONDS", "None or a number of 0 or more", lag))
    dead = workflow_settings.HEALTH_MAX_DEAD_LETTERS
    if dead is not None and not number(dead, integer=True):
        problems.append(("HEALTH_MAX_DEAD_LETTERS", "None or an integer of 0 or more", dead))
    timeout = workflow_settings.HEALTH_DB_TIMEOUT_SECONDS
    if not number(timeout) or timeout == 0:
        problems.append(("HEALTH_DB_TIMEOUT_SECONDS", "a positive number", timeout))
    total = workflow_settings.HEALTH_TIMEOUT_SECONDS
    if not number(total) or total == 0:
        problems.append(("HEALTH_TIMEOUT_SECONDS", "a positive number", total))
    window = workflow_settings.HEALTH_FINISHED_WINDOW_SECONDS
    if not number(window):
        problems.append(("HEALTH_FINISHED_WINDOW_SECONDS", "a number of 0 or more", window))
    token = workflow_settings.HEALTH_TOKEN
    if token is not None and not (isinstance(token, str) and token):
        problems.append(("HEALTH_TOKEN", "None or a non-empty string", "<hidden>"))
    return [
        Error(f"DJANGO_WORKFLOWS['{name}'] must be {want}, got {got!r}", id="django_workflows.E040")
        for name, want, got in problems
    ]


#: What :func:`check_session_bounds` looks for in a PostgreSQL database's ``OPTIONS``.
SESSION_BOUNDS = (
    "idle_in_transaction_session_timeout",
    "tcp_user_timeout",
    "keepalives",
)


def check_session_bounds(alias: str, db: dict[str, Any]) -> list[Any]:
    """``W012`` (issue 17): a PostgreSQL database whose ``OPTIONS`` do not bound its sessions.

    A host that vanishes inside a transaction (power loss, a network partition) leaves its
    session "idle in transaction", holding run and job row locks, until PostgreSQL's TCP
    notices - minutes to hours. ``idle_in_transaction_session_timeout`` (in ``OPTIONS
    ["options"]``, or set for the role or server) ends it; the libpq ``keepalives`` and
    ``tcp_user_timeout`` options make the workers notice a dead server or link. Only the
    settings are read (no query): a bound set with ``ALTER ROLE ... SET`` is not seen, silence
    the warning then (``SILENCED_SYSTEM_CHECKS``). Returns the warnings (a list).
    """
    options = db.get("OPTIONS") or {}
    server = str(options.get("options") or "")
    missing = [name for name in SESSION_BOUNDS[:1] if name not in server]
    missing += [name for name in SESSION_BOUNDS[1:] if name not in options]
    if not missing:
        return []
    return [
        Warning(
            f"DATABASES['{alias}'] (PostgreSQL) does not bound its sessions: "
            f"{', '.join(missing)} missing from OPTIONS. A host lost inside a transaction "
            "then keeps its row locks until PostgreSQL's TCP notices, and maintenance waits",
            hint="See docs/howto/several-hosts.md, 'Bound every database session', for the "
            "OPTIONS to use (or silence this if the role or server sets them)",
            id="django_workflows.W012",
        )
    ]


def queue_limits_error(value: Any) -> str | None:
    """Why ``value`` is not a valid ``QUEUE_LIMITS`` setting (``{queue: positive int}``), or
    ``None``."""
    if not isinstance(value, dict):
        return f"must be a dict of queue name to a positive integer, got {value!r}"
    for queue, limit in value.items():
        if not isinstance(queue, str) or not queue:
            return f"has a queue name that is not a non-empty string: {queue!r}"
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            return f"[{queue!r}] must be a positive integer, got {limit!r}"
    return None


def check_queue_limits() -> list[Any]:
    """``DJANGO_WORKFLOWS['QUEUE_LIMITS']`` (issue 18 item 6): E030 naming the bad entry."""
    problem = queue_limits_error(workflow_settings.QUEUE_LIMITS)
    if problem is None:
        return []
    return [
        Error(
            f"DJANGO_WORKFLOWS['QUEUE_LIMITS'] {problem}",
            hint='e.g. "QUEUE_LIMITS": {"gpu": 2} (at most 2 RUNNING jobs of queue "gpu")',
            id="django_workflows.E030",
        )
    ]


def check_retention() -> list[Any]:
    """``RETENTION``, ``RETENTION_BATCH_SIZE``, ``RETENTION_INTERVAL_SECONDS`` (issue 20):
    E033 naming the bad field."""
    from .retention import settings_error

    problem = settings_error()
    if problem is None:
        return []
    return [
        Error(
            f"DJANGO_WORKFLOWS: {problem}",
            hint='e.g. "RETENTION": {"DEFAULT_DAYS": {"COMPLETED": 30, "FAILED": 90}} '
            "(see docs/howto/retention.md)",
            id="django_workflows.E033",
        )
    ]


def check_wakeups() -> list[Any]:
    """Wake-ups on ``NOTIFY`` (issue 19): E031 for ``WAKE_WITH_NOTIFY`` other than ``"auto"``,
    ``True`` or ``False``, or ``True`` on a database that is not PostgreSQL; E032 for a negative
    ``WORKER_LINGER_SECONDS`` or ``WORK_TASK_SECONDS``."""
    from django.db import connection

    messages: list[Any] = []
    value = workflow_settings.WAKE_WITH_NOTIFY
    if value not in ("auto", True, False):
        messages.append(
            Error(
                "DJANGO_WORKFLOWS['WAKE_WITH_NOTIFY'] must be 'auto', True or False, "
                f"not {value!r}",
                id="django_workflows.E031",
            )
        )
    elif value is True and connection.vendor != "postgresql":
        messages.append(
            Error(
                "DJANGO_WORKFLOWS['WAKE_WITH_NOTIFY'] is True but the default database is "
                f"{connection.vendor}, not PostgreSQL (LISTEN/NOTIFY needs PostgreSQL)",
                hint="use 'auto' (NOTIFY on PostgreSQL only) or False",
                id="django_workflows.E031",
            )
        )
    for name in ("WORKER_LINGER_SECONDS", "WORK_TASK_SECONDS"):
        seconds = getattr(workflow_settings, name)
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or seconds < 0:
            messages.append(
                Error(
                    f"DJANGO_WORKFLOWS[{name!r}] must be a number of seconds >= 0, not {seconds!r}",
                    id="django_workflows.E032",
                )
            )
    return messages


def check_routing() -> list[Any]:
    """Stage routing (issue 8 item 5): ``E007`` for a malformed ``QUEUES``; ``W010`` for a
    stage queue that ``QUEUES`` does not map (no worker ever leases its jobs); ``W011`` for a
    queue mapped onto a django-q2 cluster that ``Q_CLUSTER`` does not define (neither its
    ``name`` nor a key of ``ALT_CLUSTERS``: ``Q_CLUSTER_NAME=<cluster> qcluster`` cannot start).
    """
    from django.core.exceptions import ImproperlyConfigured

    from .kernel import routing

    try:
        mapping = routing.queue_clusters()
    except ImproperlyConfigured as exc:
        return [Error(str(exc), id="django_workflows.E007")]
    messages: list[Any] = []
    used = routing.stage_queues()
    for queue, stages in sorted(used.items()):
        if queue not in mapping:
            messages.append(
                Warning(
                    f"Stage queue {queue!r} (stages {', '.join(stages)}) is not mapped onto a "
                    "django-q2 cluster: no worker will run these stages",
                    hint=f"Add it to DJANGO_WORKFLOWS['QUEUES'], e.g. {{{queue!r}: {queue!r}}}, "
                    f"and start that cluster: Q_CLUSTER_NAME={queue} python manage.py qcluster",
                    id="django_workflows.W010",
                )
            )
    if "django_q" in settings.INSTALLED_APPS:
        clusters = routing.configured_clusters()
        for queue, cluster in sorted(mapping.items()):
            if cluster not in clusters:
                messages.append(
                    Warning(
                        f"Queue {queue!r} is mapped onto django-q2 cluster {cluster!r}, which "
                        f"Q_CLUSTER does not define (clusters: {', '.join(sorted(clusters))})",
                        hint=f"Add Q_CLUSTER['ALT_CLUSTERS'] = {{{cluster!r}: {{...}}}} and "
                        f"start it with Q_CLUSTER_NAME={cluster} python manage.py qcluster",
                        id="django_workflows.W011",
                    )
                )
    return messages


def cluster_timeout_seconds(cluster: str) -> float | None:
    """django-q2's ``timeout`` of ``cluster`` (seconds): its ``Q_CLUSTER['ALT_CLUSTERS']``
    entry's, else ``Q_CLUSTER['timeout']``; ``None`` when unset (django-q2 never stops a task).
    """
    q = getattr(settings, "Q_CLUSTER", None) or {}
    alt = q.get("ALT_CLUSTERS") if isinstance(q.get("ALT_CLUSTERS"), dict) else {}
    own = alt.get(cluster) if isinstance(alt.get(cluster), dict) else {}
    value = own.get("timeout", q.get("timeout"))
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def check_stage_timeouts() -> list[Any]:
    """Stage timeouts (issue 12 item 2): ``W003`` for a stage whose ``timeout_seconds`` (or
    ``DEFAULT_STAGE_TIMEOUT_SECONDS``) plus ``STAGE_TIMEOUT_GRACE_SECONDS`` (plus, with NOTIFY
    wake-ups, :func:`.kernel.wakeup.work_task_seconds`: a lingering task may start a stage
    that late in its life; issue 19) is not below the
    django-q2 ``timeout`` of the cluster serving its queue (``Q_CLUSTER['timeout']``, or the
    cluster's ``ALT_CLUSTERS`` entry): django-q2 would kill the worker before the stage
    timeout, and the failure would name django-q2's timeout instead of the stage's.
    """
    if "django_q" not in settings.INSTALLED_APPS or not getattr(settings, "Q_CLUSTER", None):
        return []
    from django.core.exceptions import ImproperlyConfigured

    from .definition.registry import registry
    from .kernel import routing, timeouts, wakeup

    try:
        grace = timeouts.grace_seconds()
        mapping = routing.queue_clusters()
        # With NOTIFY a work task may start a stage up to WORK_TASK_SECONDS into its life.
        lead = wakeup.work_task_seconds() if wakeup.notify_enabled() else 0.0
    except (ImproperlyConfigured, TypeError, ValueError):
        return []  # reported by E002 / E007 / E031
    too_long: dict[str, list[str]] = {}
    limits: dict[str, float] = {}
    for workflow in registry:
        for stage in workflow.stages:
            seconds = timeouts.stage_timeout_seconds(stage)
            cluster = mapping.get(stage.queue)
            if seconds is None or cluster is None:
                continue
            limit = cluster_timeout_seconds(cluster)
            if limit is not None and seconds + grace + lead >= limit:
                too_long.setdefault(cluster, []).append(f"{workflow.id}/{stage.id} ({seconds:g} s)")
                limits[cluster] = limit
    return [
        Warning(
            f"Stages {', '.join(stages)} have a timeout_seconds that, with "
            f"STAGE_TIMEOUT_GRACE_SECONDS={grace:g}"
            + (f" and a work task's {lead:g} s of leasing (WORK_TASK_SECONDS)" if lead else "")
            + ", is not below django-q2 cluster "
            f"{cluster!r}'s timeout ({limits[cluster]:g} s): django-q2 kills the worker first "
            "and the stage fails with django-q2's timeout instead of its own",
            hint="Raise Q_CLUSTER['timeout'] (and 'retry' above it) for that cluster above the "
            "longest stage timeout plus the grace, or lower the stage's timeout_seconds",
            id="django_workflows.W003",
        )
        for cluster, stages in sorted(too_long.items())
    ]


@register()
def check_definition_versions(app_configs: Any = None, **kwargs: Any) -> list[Any]:
    """``W004`` (issue 12 item 3): in-flight (PENDING or RUNNING) runs whose definition version
    no loaded definition runs (neither its ``version`` nor one of its ``takes_over``) and no
    live worker advertises either (the worker presence table, ``workflow_worker_versions``):
    orphaned runs, which never finish unless a worker with their version comes back.

    ``I004`` (issue 17): such runs whose version a live worker does run - a side-by-side deploy
    done right (the old workers finish the old runs) - are reported as information naming
    the workers (and so their hosts), not warned about.

    ``W005``: in-flight runs whose version a loaded definition claims to run (same
    ``version`` or ``takes_over``) but whose stored structure has stages the loaded
    definition lacks (a reused explicit version, a wrong ``takes_over``): they fail with
    ``DefinitionMismatch`` when they reach such a stage.

    One ``GROUP BY`` query, one query of the presence rows when some in-flight version is not
    loaded, and at most one query of the stored structures; nothing when the tables do not
    exist yet (before ``migrate``) or the database cannot be reached.
    """
    from django.db import DatabaseError, transaction

    from .definition.registry import registry
    from .kernel import versions
    from .kernel.runtime import get_kernel

    try:
        with transaction.atomic():  # a savepoint: a missing table must not break the caller's
            in_flight = versions.in_flight_versions()
            unrunnable = versions.unrunnable(registry, in_flight)
            live = versions.live_workers(lease_clock=get_kernel().lease_clock) if unrunnable else {}
            mismatched = versions.mismatched_structures(registry, in_flight)
    except (DatabaseError, RuntimeError):  # RuntimeError: database access blocked (tests)
        return []
    messages: list[Any] = []
    for workflow_id, version, runs in unrunnable:
        workflow = registry.get(workflow_id)
        loaded = (
            f"the loaded definition runs {', '.join(workflow.runs_versions)}"
            if workflow is not None
            else "the workflow is not registered here"
        )
        workers = live.get((workflow_id, version))
        if workers:
            messages.append(
                Info(
                    f"{runs} in-flight run(s) of workflow {workflow_id!r} need definition "
                    f"version {version!r}, which no loaded definition provides ({loaded}); "
                    f"live {versions.describe_workers(workers)} "
                    f"{'runs' if len(workers) == 1 else 'run'} it",
                    hint="A side-by-side deploy: stop those workers once workflows_list shows "
                    "no in-flight runs of that version",
                    id="django_workflows.I004",
                )
            )
            continue
        messages.append(
            Warning(
                f"{runs} in-flight run(s) of workflow {workflow_id!r} need definition version "
                f"{version!r}, which no loaded definition provides ({loaded}) and no live "
                f"worker runs: they wait for a worker with version {version}",
                hint=(
                    "Start (or keep) workers with that version until those runs finish, or declare "
                    f"define_workflow(id={workflow_id!r}, ..., takes_over=[{version!r}]) if "
                    "this definition can execute them"
                ),
                id="django_workflows.W004",
            )
        )
    for workflow_id, version, runs, missing in mismatched:
        workflow = registry.get(workflow_id)
        loaded = workflow.version if workflow is not None else "?"
        messages.append(
            Warning(
                f"{runs} in-flight run(s) of workflow {workflow_id!r} were started by definition "
                f"version {version!r}, which the loaded definition (version {loaded!r}) claims "
                f"to run, but it lacks their stage(s) {', '.join(missing)}: those runs fail "
                "(DefinitionMismatch) if they reach them",
                hint=(
                    "A changed definition needs a new version: do not reuse an explicit "
                    "version=, and declare takes_over only for versions whose stages this "
                    "definition has"
                ),
                id="django_workflows.W005",
            )
        )
    return messages
