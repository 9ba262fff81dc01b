"""The ``DJANGO_WORKFLOWS`` settings dict: defaults, lazy reads, reset on ``setting_changed``.

Every knob lives in one dict in the project's settings::

    DJANGO_WORKFLOWS = {
        "STALE_LEASE_SECONDS": 300,
        "TICK_INTERVAL_SECONDS": 1.0,
    }

Read a value with ``workflow_settings.STALE_LEASE_SECONDS``. Values are read lazily, so
``override_settings(DJANGO_WORKFLOWS=...)`` works in tests. Units are part of every name.
"""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.core.signals import setting_changed
from django.dispatch import receiver

DEFAULTS: dict[str, Any] = {
    # Observability (issue 20, docs/howto/observability.md)
    # OpenTelemetry spans and metrics when opentelemetry-api is installed and a provider is
    # configured; False turns them off (JSON log fields do not depend on it).
    "TELEMETRY": True,
    # Jobs (SPEC §7.1, DM-40..49)
    # Delivery attempts per job before it is failed for good (DM-40, Part I item 3).
    "MAX_ATTEMPTS": 3,
    # A RUNNING job whose lease is older than this is released for re-delivery (DM-45, H-10).
    "STALE_LEASE_SECONDS": 300,
    # How often a worker refreshes the lease of the job it executes (H-2).
    "HEARTBEAT_INTERVAL_SECONDS": 60.0,
    # Base of the retry back-off: attempt n waits BASE * 2**(n-1) seconds (DM-44).
    "RETRY_BACKOFF_BASE_SECONDS": 2.0,
    # Upper bound of one retry back-off wait.
    "RETRY_BACKOFF_MAX_SECONDS": 300.0,
    # Where a suspended stage is next polled when it names no time (SM-22, K-JE-16).
    "SUSPEND_FALLBACK_SECONDS": 60.0,
    # How long (seconds) the stage path and the heartbeat keep reconnecting and retrying a
    # transaction whose database connection died (terminated, idle timeout, database restart),
    # counted from the first failure; back-off 0.05 s doubling to 2 s (kernel/connections.py).
    # Default 60: long enough to survive a database restart. 0: one immediate retry only.
    "RECONNECT_SECONDS": 60.0,
    # Stage timeouts (issue 12 item 2; kernel/timeouts.py). The longest one delivery of a
    # stage may run (seconds) when the stage names no timeout_seconds; None = no limit. Past
    # it ctx.is_cancelled() turns true and the delivery fails with StageTimeout (retried per
    # the stage's retry policy); a body still running STAGE_TIMEOUT_GRACE_SECONDS later has
    # its timeout committed for it and its worker process recycled (django-q2 workers).
    "DEFAULT_STAGE_TIMEOUT_SECONDS": None,
    # How long (seconds) a timed-out stage body may take to notice ctx.is_cancelled() and
    # return before the watchdog commits the timeout and recycles the worker process. Keep
    # Q_CLUSTER['timeout'] above every stage timeout + this (system check W003).
    "STAGE_TIMEOUT_GRACE_SECONDS": 5.0,
    # The longest a ready job may wait for a worker of its queue (seconds) when its stage
    # names no queue_timeout_seconds; None = wait forever. Past it the maintenance tick
    # fails the stage and the run: "no worker of queue 'gpu' picked up the job within 60 s".
    "DEFAULT_QUEUE_TIMEOUT_SECONDS": None,
    # Maintenance tick (SPEC §7.3)
    "MAX_CLAIMS_PER_TICK": 10,
    "MAX_SUSPENDED_CHECKS_PER_TICK": 10,
    "MAX_OUTBOX_FLUSH_PER_TICK": 100,
    # Runs with no activity for this long are reaped; None = max(3 * stale lease, 300) (H-10).
    "STUCK_THRESHOLD_SECONDS": None,
    # Idempotency keys left "in progress" longer than this may be reclaimed (K-1, K-12).
    # None disables reclaiming.
    "IDEMPOTENCY_STALE_SECONDS": 600.0,
    # Outbox delivery attempts before an event is dead-lettered (EV-5).
    "OUTBOX_MAX_RETRIES": 3,
    # Plugins: dotted paths to objects made with ``define_plugin`` (EV-30).
    "PLUGINS": [],
    # Worker transport (django-q2)
    # Ready jobs one wake-up task drains before it returns (without NOTIFY), or per lease loop
    # of a lingering task (with it; kernel/wakeup.py).
    "JOBS_PER_WAKEUP": 10,
    # How wake-ups reach idle workers: "auto" (default: LISTEN/NOTIFY on PostgreSQL, django-q2
    # tasks elsewhere), True (PostgreSQL only; check E031) or False (django-q2 tasks through
    # the broker). With NOTIFY a wake-up rides the commit of the transaction that made the
    # work (no broker row), each worker process keeps one more connection, its listener, and
    # an idle process wakes itself through its own cluster's task queue (issue 19).
    "WAKE_WITH_NOTIFY": "auto",
    # With NOTIFY: how long (seconds) a django-q2 work task that found nothing to do waits for
    # a notification before it returns and frees its django-q2 worker. 0: return at once.
    # Lower it if the same django-q2 cluster also runs other tasks of yours.
    "WORKER_LINGER_SECONDS": 30.0,
    # With NOTIFY: how long (seconds) one work task keeps leasing while work is ready before
    # it hands on to a new task (at most half of Q_CLUSTER['timeout']).
    "WORK_TASK_SECONDS": 120.0,
    # The worker process holding the ticker lease runs maintenance ticks this often while a
    # run is PENDING or RUNNING (kernel/supervisor.py).
    "TICK_INTERVAL_SECONDS": 1.0,
    # How often each worker process's supervisor thread looks whether runs are live while
    # nobody holds the ticker lease (one query); a dead ticker is replaced within
    # TICKER_LEASE_SECONDS + this. Idle cost: one query per worker process per interval (3 s:
    # an idle 2-worker cluster polls the broker once a second and needs <= 2 statements/s in
    # all, issue 19).
    "SUPERVISOR_INTERVAL_SECONDS": 3.0,
    # Whether worker processes run the maintenance ticker in their supervisor thread. False:
    # they never tick (run ``workflows_tick --loop`` or ``workflows_worker`` elsewhere); the
    # graceful stop works either way.
    "SUPERVISOR_TICKS": True,
    # TTL of the ticker and maintenance-tick leases (at most STALE_LEASE_SECONDS), refreshed
    # every third of it by the holder; a holder that died stops blocking after this long.
    "TICKER_LEASE_SECONDS": 10.0,
    # Graceful stop: after the cluster's SIGTERM, a stage still executing this many seconds
    # later is released (back to PENDING for another worker, ctx.is_cancelled() true, its
    # late result discarded) and its worker process exits. Keep it below the orchestrator's
    # kill deadline (Kubernetes: terminationGracePeriodSeconds, 30 s by default).
    "STOP_GRACE_SECONDS": 20.0,
    # No longer used (the ticker runs in each worker process's supervisor thread, not as a
    # long django-q2 task); kept so that settings naming it stay valid.
    "TICKER_RUN_SECONDS": 50.0,
    # Install the django-q2 schedule for the ticker after ``migrate`` (post_migrate).
    "INSTALL_SCHEDULE": True,
    # Name of the django-q2 cluster that serves the "default" queue (and gets the claim and
    # ticker wake-ups); None = Q_CLUSTER["name"], django-q2's default cluster.
    "Q_CLUSTER_NAME": None,
    # Stage routing (issue 8 item 5): {queue: django-q2 cluster name} for stages that name a
    # queue (@stage(..., queue="gpu")), e.g. {"gpu": "gpu"}. Workers of a cluster lease only
    # the jobs of its queues; "default" maps to Q_CLUSTER_NAME unless named here. A stage
    # queue mapped nowhere is reported by system check django_workflows.W010.
    "QUEUES": {},
    # Shared limits (issue 18 item 6, docs/limits.md): {queue: N} - at most N jobs of that
    # queue RUNNING at once across the cluster (every host, every workflow), e.g. {"gpu": 2}.
    # Enforced by the database when a job is leased; a queue not named here is unlimited.
    # A bad value is reported by system check django_workflows.E030.
    "QUEUE_LIMITS": {},
    # Module that each installed app may define with its workflows (autodiscovery).
    "AUTODISCOVER_MODULE": "workflows",
    # The transport used to wake workers: "django_q" or "inline" (tests: nothing is sent).
    "TRANSPORT": "django_workflows.transport.django_q.DjangoQTransport",
    # Dotted path of a zero-argument callable returning the kernel's Clock (None: the system
    # clock). Leases never depend on it: they are stamped and judged with the database's clock.
    "CLOCK": None,
    # Retention (issue 20, docs/howto/retention.md; django_workflows/retention.py): None keeps
    # every run forever (deleting is opt-in). A dict {"DEFAULT_DAYS": {status: days},
    # "WORKFLOW_DAYS": {workflow_id: {status: days}}, "DJANGO_Q_TASK_DAYS": days,
    # "IDEMPOTENCY_KEY_DAYS": days}: a COMPLETED/FAILED/CANCELLED run is deleted (with its
    # stages, jobs, logs, annotations, signals, events and blobs) that many days after its
    # completed_at; None or a status not named: kept forever. Checked by system check E033.
    "RETENTION": None,
    # How often (seconds) the worker processes' supervisor prunes on RETENTION (one process of
    # all hosts at a time, under the "retention" maintenance lease; one batch per cycle, again
    # after SUPERVISOR_INTERVAL_SECONDS while a full batch was found).
    "RETENTION_INTERVAL_SECONDS": 3600.0,
    # Runs deleted per transaction by workflows_prune and the supervisor (each batch locks
    # only its own run rows, with SKIP LOCKED on PostgreSQL).
    "RETENTION_BATCH_SIZE": 500,
    # HTTP API (django_workflows.api, mounted with include("django_workflows.api.urls")).
    # Dotted paths of DRF authentication classes; None: REST_FRAMEWORK's
    # DEFAULT_AUTHENTICATION_CLASSES (DRF's default is session + basic authentication).
    "API_AUTHENTICATION_CLASSES": None,
    # Dotted paths of DRF permission classes of every run/definition endpoint. The default
    # needs an authenticated user with the model permission each view names in
    # ``required_permissions`` (view_*, add_workflowrun, cancel_/rerun_/approve_/annotate_*).
    "API_PERMISSION_CLASSES": ["django_workflows.api.permissions.WorkflowModelPermissions"],
    # Permission classes of the schema and docs pages (default: anyone may read the contract).
    "API_SCHEMA_PERMISSION_CLASSES": ["rest_framework.permissions.AllowAny"],
    # Dotted paths of DRF throttle classes; the default throttles by API_THROTTLE_RATES.
    "API_THROTTLE_CLASSES": ["django_workflows.api.throttling.WorkflowsRateThrottle"],
    # Rates per scope ("read", "write", "events"; DRF syntax such as "100/min"); None or a
    # missing scope: not throttled. Clients are told apart by user id (else by IP address).
    "API_THROTTLE_RATES": {"read": None, "write": None, "events": None},
    # Request bodies larger than this many bytes are refused with 413 before parsing.
    "API_MAX_BODY_BYTES": 2 * 1024 * 1024,
    # Deepest nesting of arrays/objects accepted in a JSON request body (deeper: 400).
    "API_MAX_JSON_DEPTH": 64,
    # Runs per page of GET runs/ (clients may ask for up to API_MAX_PAGE_SIZE).
    "API_PAGE_SIZE": 50,
    "API_MAX_PAGE_SIZE": 500,
    # Longest long poll of GET runs/{id}/events/?wait= (seconds), and how often it looks.
    "API_LONG_POLL_MAX_SECONDS": 30.0,
    "API_LONG_POLL_INTERVAL_SECONDS": 0.15,
    # Health and metrics (issue 20; django_workflows.health, docs/howto/health-and-metrics.md).
    # workflows_health and the readiness view fail the "outbox" check when the oldest
    # deliverable undelivered outbox event is older than this (seconds); None: not checked.
    "HEALTH_MAX_OUTBOX_LAG_SECONDS": 300.0,
    # ... and the "dead_letters" check when more dead letters than this wait for an operator
    # (0: any dead letter fails it); None: not checked.
    "HEALTH_MAX_DEAD_LETTERS": 0,
    # The readiness view's bounds on the database (seconds): connecting (PostgreSQL
    # connect_timeout, whole seconds, at least 1) and each statement (statement_timeout).
    "HEALTH_DB_TIMEOUT_SECONDS": 2.0,
    # The total time (seconds) one readiness probe, metrics scrape or workflows_health run
    # may spend on the database: the probe's connect and SELECT 1 and every read after it.
    # When it runs out the "database" check fails as timed out (readiness 503, the command
    # exit 1, metrics workflows_up 0 and workflows_scrape_timed_out 1).
    "HEALTH_TIMEOUT_SECONDS": 4.0,
    # Bearer token of the metrics view and of the readiness view's numbers: requests must
    # send "Authorization: Bearer <token>" (or be a staff user's session). None: the metrics
    # view is open to whoever can reach its URL, and readiness shows only check names and ok.
    "HEALTH_TOKEN": None,
    # The window (seconds) of the metrics' "runs finished recently per workflow and status"
    # gauge (workflows_runs_finished_window); 0: not computed.
    "HEALTH_FINISHED_WINDOW_SECONDS": 60.0,
}


class WorkflowSettings:
    """Attribute access to ``DJANGO_WORKFLOWS`` merged over :data:`DEFAULTS`.

    Raises:
        AttributeError: for a name that is not a known setting.
    """

    def __init__(self) -> None:
        self._cache: dict[str, Any] = {}

    @property
    def user_settings(self) -> dict[str, Any]:
        return dict(getattr(settings, "DJANGO_WORKFLOWS", None) or {})

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") or name not in DEFAULTS:
            raise AttributeError(f"Unknown DJANGO_WORKFLOWS setting {name!r}")
        if name not in self._cache:
            self._cache[name] = self.user_settings.get(name, DEFAULTS[name])
        return self._cache[name]

    @property
    def stuck_threshold_seconds(self) -> float:
        """The stuck-run threshold in seconds: the setting, or max(3 x stale lease, 300) (H-10)."""
        value = self.STUCK_THRESHOLD_SECONDS
        if value is None:
            return max(3 * float(self.STALE_LEASE_SECONDS), 300.0)
        return float(value)

    def reload(self) -> None:
        self._cache.clear()


workflow_settings = WorkflowSettings()


@receiver(setting_changed)
def _reload_settings(*, setting: str, **kwargs: Any) -> None:
    # The default kernel, built from these settings, is reset by its own receiver
    # (:mod:`django_workflows.kernel.runtime`): this module imports nothing of the kernel.
    if setting == "DJANGO_WORKFLOWS":
        workflow_settings.reload()
