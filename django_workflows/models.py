"""Database tables of the engine (SPEC §1).

The kernel owns every status column: code outside ``django_workflows.kernel`` reads these
models but changes state only by dispatching a command. Engine timestamps (``created_at``,
``updated_at``, leases, poll times) are written from the kernel's clock, never ``auto_now``
(Part I item 12). Durations are 64-bit milliseconds (``*_ms``, Part I item 13); JSON columns use
Django's JSON encoder so datetimes, decimals and UUIDs round-trip as ISO strings.
"""

from __future__ import annotations

import uuid
from typing import Any

from django.core.serializers.json import DjangoJSONEncoder
from django.db import models


class Status(models.TextChoices):
    """The one status enum shared by runs, stages and jobs (DM-1).

    ``SKIPPED`` is a stage status only: a conditional stage whose ``when=`` was false or
    whose branch was not chosen (issue 18, ``docs/conditions.md``); it counts as done. The
    engine never writes ``SKIPPED`` or ``SUSPENDED`` on a run (SM-8).
    """

    PENDING = "PENDING"
    RUNNING = "RUNNING"
    SUSPENDED = "SUSPENDED"
    COMPLETED = "COMPLETED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"
    SKIPPED = "SKIPPED"
    #: A map item's job waiting for a free slot of its stage's ``max_concurrency`` (jobs only;
    #: issue 18 item 3): never leased; an item's outcome promotes the next one to PENDING.
    HELD = "HELD"


TERMINAL_RUN_STATUSES = frozenset({Status.COMPLETED, Status.FAILED, Status.CANCELLED})
ACTIVE_STAGE_STATUSES = frozenset({Status.PENDING, Status.RUNNING, Status.SUSPENDED})


class LogLevel(models.TextChoices):
    DEBUG = "DEBUG"
    INFO = "INFO"
    WARN = "WARN"
    ERROR = "ERROR"


def _json(**kwargs: object) -> models.JSONField:
    return models.JSONField(encoder=DjangoJSONEncoder, **kwargs)  # type: ignore[arg-type]


class WorkflowRun(models.Model):
    """One execution of a registered workflow (SPEC §1.2).

    ``version`` is bumped by every update (DM-5); ``run.transition`` and the poller use it as an
    optimistic claim. ``duration_ms`` is measured from ``started_at`` (Part I item 14).
    """

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    created_at = models.DateTimeField()
    updated_at = models.DateTimeField()
    version = models.PositiveIntegerField(default=1)
    workflow_id = models.CharField(max_length=200)
    workflow_name = models.CharField(max_length=200)
    workflow_type = models.CharField(max_length=200)
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.PENDING)
    started_at = models.DateTimeField(null=True, blank=True)
    completed_at = models.DateTimeField(null=True, blank=True)
    duration_ms = models.BigIntegerField(null=True, blank=True)
    input = _json(default=dict, blank=True)
    output = _json(null=True, blank=True)
    config = _json(default=dict, blank=True)
    total_cost = models.FloatField(default=0)
    total_tokens = models.BigIntegerField(default=0)
    priority = models.IntegerField(default=5)
    metadata = _json(null=True, blank=True)
    #: Why a FAILED run failed, written in the UPDATE that sets it FAILED (``None`` otherwise;
    #: a CANCELLED run keeps its reason in ``output["error"]``): ``{"stage_id", "message",
    #: "error_type", "generation", "delivery"}`` - the failed stage (``None`` when no stage
    #: caused it), its ``error_message``, the kind of failure (an exception class name,
    #: ``StageFailed``'s ``error_type``, ``DeliveriesExhausted``, ``StuckRunReaped``,
    #: ``WorkflowNotFound``, ...), the stage's rerun generation and the job delivery it failed
    #: on (``None`` when unknown). The stage's traceback is in its ``metrics["traceback"]``.
    error = _json(null=True, blank=True)
    #: The sequence of the run's latest outbox event (EV-3): appenders bump it under the run's
    #: row lock, so sequences are gap-free without a ``MAX()`` per append.
    event_sequence = models.PositiveBigIntegerField(default=0)
    #: The version of the definition the run started with (issue 12 item 3): the workflow's
    #: explicit ``version`` or its fingerprint; ``""`` (runs created before versions existed):
    #: unversioned, any definition of the workflow may execute it. Also the database default,
    #: so rows inserted by code that predates the column (a rolling deploy) are unversioned.
    definition_version = models.CharField(max_length=64, default="", db_default="", blank=True)
    #: The run whose stage started this run (issue 18 item 5, child workflows), or ``None`` for
    #: a top-level run. A plain UUID, not a foreign key: purging a parent never blocks on, or
    #: cascades into, its children.
    parent_run_id = models.UUIDField(null=True, blank=True)
    #: The id of the parent's stage that started this run (``None`` without a parent).
    parent_stage_id = models.CharField(max_length=200, null=True, blank=True)
    #: The rerun generation of that parent stage when it started this run.
    parent_generation = models.IntegerField(null=True, blank=True)
    #: The run's concurrency key (issue 18 item 6, docs/limits.md): its workflow's
    #: ``concurrency_key(input)``, computed once when the run is created; at most
    #: ``max_running_per_key`` runs of the workflow with one key are RUNNING at once. ``None``:
    #: the run is not limited by key.
    concurrency_key = models.CharField(max_length=200, null=True, blank=True)
    #: The W3C trace context of the span that created the run (issue 20 item 3,
    #: :mod:`django_workflows.telemetry`): ``{"traceparent": str, "tracestate"?: str}``, or
    #: ``None`` (tracing off or not configured when the run was created). Stage, signal and
    #: outbox-delivery spans of the run are its children.
    trace_context = _json(null=True, blank=True)

    class Meta:
        db_table = "workflow_runs"
        ordering = ["-created_at"]
        # Every index is paid for on each INSERT and each UPDATE that cannot stay HOT (a status
        # change): issue 19 dropped ``(workflow_id)``, served by the composite indexes that
        # start with it (0018).
        indexes = [
            # The stuck-run reaper's RUNNING runs not updated since T (and the ticker's "runs
            # live?"). A prefix of the composite indexes below, yet kept: without it and the
            # stage records' ``(status)`` the reaper's plan became a parallel sequential scan
            # of the runs, 28 ms against 1.9 ms at 100,000 finished runs
            # (``python -m bench.scale --quick``).
            models.Index(fields=["status"], name="wf_run_status_idx"),
            # The claim's order, id included (issue 19): with the tie-breaker out of the
            # index, a prepared claim's generic plan, planned while the table was small,
            # sorted every PENDING run for each claim (4-7 ms at 3,000 pending).
            models.Index(
                fields=["status", "-priority", "created_at", "id"], name="wf_run_claim_id_idx"
            ),
            # The HTTP API's run list: keyset pagination newest first, (created_at, id)
            # descending, alone or after a status filter (no sort, no COUNT).
            models.Index(fields=["created_at", "id"], name="wf_run_created_id_idx"),
            models.Index(fields=["status", "created_at", "id"], name="wf_run_status_created_idx"),
            # The admin's workflow filter, newest first (0007).
            models.Index(
                fields=["workflow_id", "created_at", "id"], name="wf_run_workflow_created_idx"
            ),
            # A parent's children (cancel cascade, run page, ``?parent=``), newest first.
            # Partial (0020): only child runs are written to it.
            models.Index(
                fields=["parent_run_id", "created_at"],
                condition=models.Q(parent_run_id__isnull=False),
                name="wf_run_child_idx",
            ),
            # Retention (issue 20): the aged-out runs of one status, oldest first, a batch at
            # a time (keyset on completed_at, id; ``completed_at < cutoff`` implies the
            # condition). Partial (0019): a run is written to it once, when it finishes.
            models.Index(
                fields=["status", "completed_at", "id"],
                condition=models.Q(completed_at__isnull=False),
                name="wf_run_finished_status_idx",
            ),
            # The per-key limit's count of RUNNING runs of one key (issue 18 item 6).
            # Partial (0020): only keyed runs are written to it.
            models.Index(
                fields=["workflow_id", "concurrency_key", "status"],
                condition=models.Q(concurrency_key__isnull=False),
                name="wf_run_keyed_idx",
            ),
            # Runs finished in a time window, per workflow and status (issue 20: the health
            # metrics' window and the admin dashboard's throughput panel, both from the index
            # alone): partial, so PENDING/RUNNING rows and their updates never touch it.
            models.Index(
                fields=["completed_at", "workflow_id", "status"],
                name="wf_run_completed_idx",
                condition=models.Q(completed_at__isnull=False),
            ),
            # The FAILED runs of a window (the dashboard's failures; partial: failed runs only).
            models.Index(
                fields=["completed_at"],
                condition=models.Q(status="FAILED"),
                name="wf_run_failed_completed_idx",
            ),
        ]
        # Operator permissions shared by the HTTP API and the admin.
        permissions = [
            ("cancel_workflowrun", "Can cancel workflow runs"),
            ("rerun_workflowrun", "Can rerun workflow runs from a stage"),
            ("approve_workflowrun", "Can approve or reject a waiting approval stage"),
            ("annotate_workflowrun", "Can attach annotations to workflow runs"),
        ]

    def __str__(self) -> str:
        return f"{self.workflow_id} run {self.id} ({self.status})"

    @property
    def is_terminal(self) -> bool:
        return self.status in TERMINAL_RUN_STATUSES


class Dashboard(WorkflowRun):
    """The admin dashboard (issue 20 item 5, :mod:`django_workflows.admin.dashboard`): a proxy
    of :class:`WorkflowRun` with no table of its own, so the dashboard has an entry in the
    admin's app list and a URL (``/admin/django_workflows/dashboard/``). Viewing it needs the
    view permission of runs."""

    class Meta:
        proxy = True
        verbose_name = "dashboard"
        verbose_name_plural = "dashboard"
        default_permissions = ()


class WorkflowStage(models.Model):
    """The execution record of one stage within one run (SPEC §1.3).

    ``generation`` is the rerun generation (SM-30's ``attempt``), not a retry counter.
    ``output_data`` holds a blob-store reference ``{"_artifactKey": ...}`` (DM-51).
    ``progress``/``progress_message`` are written live while the stage runs (Part I item 14).
    """

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    created_at = models.DateTimeField()
    updated_at = models.DateTimeField()
    version = models.PositiveIntegerField(default=1)
    #: No index of its own: ``wf_stage_run_stage_uniq`` (run, stage_id) serves lookups by run.
    run = models.ForeignKey(
        WorkflowRun, on_delete=models.CASCADE, related_name="stages", db_index=False
    )
    stage_id = models.CharField(max_length=200)
    stage_name = models.CharField(max_length=200)
    stage_number = models.PositiveIntegerField()
    execution_group = models.PositiveIntegerField()
    generation = models.PositiveIntegerField(default=0)
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.PENDING)
    started_at = models.DateTimeField(null=True, blank=True)
    completed_at = models.DateTimeField(null=True, blank=True)
    duration_ms = models.BigIntegerField(null=True, blank=True)
    input_data = _json(null=True, blank=True)
    output_data = _json(null=True, blank=True)
    config = _json(null=True, blank=True)
    suspended_state = _json(null=True, blank=True)
    resume_data = _json(null=True, blank=True)
    next_poll_at = models.DateTimeField(null=True, blank=True)
    poll_interval_ms = models.BigIntegerField(null=True, blank=True)
    max_wait_until = models.DateTimeField(null=True, blank=True)
    metrics = _json(null=True, blank=True)
    embedding_info = _json(null=True, blank=True)
    error_message = models.TextField(null=True, blank=True)
    progress = models.FloatField(null=True, blank=True)
    progress_message = models.TextField(blank=True, default="")
    #: Why a SKIPPED stage did not run (issue 18: its ``when=`` was false, or another branch
    #: was chosen); ``""`` for every other status.
    skip_reason = models.TextField(blank=True, default="", db_default="")
    #: A map stage's items (issue 18 item 3): how many ``over`` returned, and how many have
    #: completed / failed for good; ``None`` on a plain stage. Updated in each item's outcome
    #: transaction; ``progress`` is settled / total.
    items_total = models.PositiveIntegerField(null=True, blank=True)
    items_completed = models.PositiveIntegerField(null=True, blank=True)
    items_failed = models.PositiveIntegerField(null=True, blank=True)

    class Meta:
        db_table = "workflow_stages"
        ordering = ["execution_group", "stage_number"]
        constraints = [
            models.UniqueConstraint(fields=["run", "stage_id"], name="wf_stage_run_stage_uniq"),
        ]
        # ``run``'s own foreign-key index was a leading prefix of the unique constraint:
        # dropped (issue 19, 0018; see WorkflowRun).
        indexes = [
            # The stuck-run reaper's "a SUSPENDED stage of this run still waits" (next_poll_at
            # or max_wait_until ahead). Kept: without it the reaper's plan turned into a
            # sequential scan of the runs (see WorkflowRun).
            models.Index(fields=["status"], name="wf_stage_status_idx"),
            # Only a suspended (polled) stage has a ``next_poll_at``: both indexes on it hold
            # those records alone, and every query of them compares ``next_poll_at`` (which
            # implies the condition), so a plain stage is never written to them (0021).
            models.Index(
                fields=["next_poll_at"],
                condition=models.Q(next_poll_at__isnull=False),
                name="wf_stage_polled_idx",
            ),
            # stage.pollSuspended: due SUSPENDED stages in next_poll_at order; the LIMIT stops
            # the index walk, however many stages are suspended (0007).
            models.Index(
                fields=["status", "next_poll_at"],
                condition=models.Q(next_poll_at__isnull=False),
                name="wf_stage_due_poll_idx",
            ),
            # run.reapStuck's "no stage of this run changed since T": one probe per RUNNING
            # candidate, not a scan of every stage of every finished run (issue 19: 380 ms at
            # 1M finished runs with a parallel Seq Scan of 3.3M stages, plus JIT).
            models.Index(fields=["run", "updated_at"], name="wf_stage_run_updated_idx"),
            # The health snapshot's stage durations of the last window (issue 20 item 2):
            # an index range on the newest finished stages, not a scan of every stage.
            models.Index(
                fields=["completed_at"],
                name="wf_stage_completed_idx",
                condition=models.Q(completed_at__isnull=False),
            ),
        ]

    def __str__(self) -> str:
        return f"{self.stage_id} ({self.status})"

    @property
    def items(self) -> dict[str, int] | None:
        """A map stage's item counts ``{"total", "completed", "failed"}``; ``None`` for a
        plain stage (or a map stage whose items are not created yet)."""
        if self.items_total is None:
            return None
        return {
            "total": self.items_total,
            "completed": self.items_completed or 0,
            "failed": self.items_failed or 0,
        }

    def items_in_flight(self, limit: int = 5) -> list[dict[str, Any]]:
        """A map stage's items being executed now, lowest index first (at most ``limit``):
        ``[{"index", "progress", "message"}]`` (``progress`` 0-100 or ``None`` before the
        item's first ``ctx.progress``). One query; ``[]`` at once for a plain stage or a map
        stage whose items have all settled."""
        counts = self.items
        if counts is None or counts["completed"] + counts["failed"] >= counts["total"]:
            return []
        rows = (
            WorkflowJob.objects.filter(
                workflow_run_id=self.run_id,
                stage_id=self.stage_id,
                status=Status.RUNNING,
                item_index__isnull=False,
            )
            .order_by("item_index")
            .values_list("item_index", "progress", "progress_message")[:limit]
        )
        return [{"index": i, "progress": p, "message": m or ""} for i, p, m in rows]

    @property
    def items_summary(self) -> str:
        """``"items 7/10 completed, 1 failed"`` for a map stage; ``""`` otherwise."""
        counts = self.items
        if counts is None:
            return ""
        return f"items {counts['completed']}/{counts['total']} completed, {counts['failed']} failed"


class WorkflowJob(models.Model):
    """One queued unit of work: execute one stage of one run (SPEC §1.7).

    ``attempt`` counts deliveries (SM-31) and is the delivery's fencing token: a delivery's
    outcome commits only while the job is RUNNING with the attempt it was leased with.
    ``worker_id``/``locked_at`` form the lease that heartbeats refresh; ``locked_at`` and
    ``next_poll_at`` (the not-before time of a retry back-off) are written with the database's
    clock. ``run_created_at`` copies the run's creation time so ready jobs are served oldest
    run first (a started run finishes before newer runs start). ``queue`` is the worker pool of
    the job's stage: a worker leases only jobs of the queues it serves (``wf_job_queue_claim_idx``
    leads with status and queue). There is deliberately no foreign key to the run (DM-11).
    """

    id = models.BigAutoField(primary_key=True)
    created_at = models.DateTimeField()
    updated_at = models.DateTimeField()
    workflow_run_id = models.UUIDField()
    workflow_id = models.CharField(max_length=200)
    stage_id = models.CharField(max_length=200)
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.PENDING)
    priority = models.IntegerField(default=5)
    attempt = models.PositiveIntegerField(default=0)
    max_attempts = models.PositiveIntegerField(default=3)
    worker_id = models.CharField(max_length=200, null=True, blank=True)
    locked_at = models.DateTimeField(null=True, blank=True)
    started_at = models.DateTimeField(null=True, blank=True)
    completed_at = models.DateTimeField(null=True, blank=True)
    next_poll_at = models.DateTimeField(null=True, blank=True)
    payload = _json(default=dict, blank=True)
    last_error = models.TextField(null=True, blank=True)
    run_created_at = models.DateTimeField(null=True, blank=True)
    #: The worker pool whose workers may lease the job: its stage's ``queue`` (issue 8 item 5).
    queue = models.CharField(max_length=40, default="default")
    #: The run's ``definition_version``: a worker leases the job only if one of its definitions
    #: runs that version (its own or a ``takes_over``); ``""``: any worker (also the database
    #: default, for rows inserted by code that predates the column).
    definition_version = models.CharField(max_length=64, default="", db_default="", blank=True)
    #: A map item's 0-based index in its stage's item list (issue 18 item 3; the item itself
    #: is ``payload["item"]``); ``None`` for a plain stage's job.
    item_index = models.PositiveIntegerField(null=True, blank=True)
    #: A completed map item's output (JSON), written in the fenced UPDATE that completes it.
    item_output = _json(null=True, blank=True)
    #: A map item's live progress (0-100) and message, from ``ctx.progress`` in its body
    #: (issue 18 item 3: each item reports its own; the map stage's record shows settled /
    #: total). ``None`` for a plain stage's job, whose progress is on its stage record.
    progress = models.FloatField(null=True, blank=True)
    progress_message = models.TextField(null=True, blank=True)

    class Meta:
        db_table = "workflow_jobs"
        ordering = ["-priority", "created_at", "id"]
        # ``(status, priority)`` was a leading prefix of the claim's index: dropped (issue 19).
        indexes = [
            # Leases of any queue (workflows_worker, tests) walk this one in order ...
            models.Index(
                fields=["status", "-priority", "run_created_at", "id"], name="wf_job_claim_idx"
            ),
            # ... and a worker of one queue (a django-q2 cluster) this one (stage routing).
            models.Index(
                fields=["status", "queue", "-priority", "run_created_at", "id"],
                name="wf_job_queue_claim_idx",
            ),
            # Jobs in a retry back-off or suspended (map items) only: the others have no
            # ``next_poll_at`` and are never written to it (0021).
            models.Index(
                fields=["next_poll_at"],
                condition=models.Q(next_poll_at__isnull=False),
                name="wf_job_polled_idx",
            ),
            models.Index(fields=["workflow_run_id"], name="wf_job_run_idx"),
            # Map items: the next HELD item of a run (one per item outcome) and the fan-in's
            # read of the outputs in item order.
            models.Index(
                fields=["workflow_run_id", "stage_id", "status", "item_index"],
                name="wf_job_run_item_idx",
                condition=models.Q(item_index__isnull=False),
            ),
            # The health snapshot's redeliveries of the jobs finished in the last window
            # (issue 20 item 2): an index range on the newest finished jobs.
            models.Index(
                fields=["completed_at"],
                name="wf_job_completed_idx",
                condition=models.Q(completed_at__isnull=False),
            ),
        ]

    def __str__(self) -> str:
        return f"job {self.id} {self.stage_id} ({self.status})"


class WorkflowLog(models.Model):
    """An append-only log line written by a stage or the kernel (SPEC §1.4)."""

    id = models.BigAutoField(primary_key=True)
    created_at = models.DateTimeField()
    run = models.ForeignKey(
        WorkflowRun, on_delete=models.CASCADE, null=True, blank=True, related_name="logs"
    )
    stage = models.ForeignKey(
        WorkflowStage, on_delete=models.CASCADE, null=True, blank=True, related_name="logs"
    )
    level = models.CharField(max_length=8, choices=LogLevel.choices)
    message = models.TextField()
    metadata = _json(null=True, blank=True)

    class Meta:
        db_table = "workflow_logs"
        ordering = ["created_at", "id"]

    def __str__(self) -> str:
        return f"[{self.level}] {self.message[:60]}"


class WorkflowAnnotation(models.Model):
    """A typed, queryable fact about a run or stage (SPEC §1.6, §6).

    Ordered by ``created_at`` then ``id``; the auto-increment id is the tie-breaker (AN-24).
    """

    id = models.BigAutoField(primary_key=True)
    created_at = models.DateTimeField()
    #: No index of its own: the indexes below and the dedupe constraint all lead with ``run``.
    run = models.ForeignKey(
        WorkflowRun, on_delete=models.CASCADE, related_name="annotations", db_index=False
    )
    stage_record = models.ForeignKey(
        WorkflowStage,
        on_delete=models.SET_NULL,
        null=True,
        blank=True,
        related_name="annotations",
    )
    #: The rerun generation of the stage it belongs to (AN-12; SPEC's ``attempt``).
    generation = models.PositiveIntegerField(default=0)
    scope = models.CharField(max_length=64, default="run")
    scope_id = models.CharField(max_length=200, null=True, blank=True)
    actor_kind = models.CharField(max_length=64, null=True, blank=True)
    actor_id = models.CharField(max_length=200, null=True, blank=True)
    actor_version = models.CharField(max_length=64, null=True, blank=True)
    key = models.CharField(max_length=200)
    value = _json()
    payload = _json(null=True, blank=True)
    idempotency_key = models.CharField(max_length=200, null=True, blank=True)

    class Meta:
        db_table = "workflow_annotations"
        ordering = ["created_at", "id"]
        constraints = [
            models.UniqueConstraint(
                fields=["run", "key", "idempotency_key"], name="wf_annotation_dedupe_uniq"
            ),
        ]
        # One index per filter of annotations.list (AN-9, DM-16), each ending in the list order
        # (created_at, id) where that lets a LIMIT stop early. The key index uses
        # varchar_pattern_ops on PostgreSQL so a key-prefix filter (LIKE 'ns.%') can use it
        # under any collation; it still serves exact keys (other databases ignore opclasses).
        indexes = [
            models.Index(
                fields=["run", "key", "created_at", "id"],
                name="wf_ann_run_key_idx",
                opclasses=["uuid_ops", "varchar_pattern_ops", "timestamptz_ops", "int8_ops"],
            ),
            models.Index(fields=["run", "created_at", "id"], name="wf_ann_run_created_idx"),
            models.Index(
                fields=["run", "scope", "scope_id", "created_at"], name="wf_ann_run_scope_idx"
            ),
            models.Index(fields=["run", "actor_id", "created_at"], name="wf_ann_run_actor_idx"),
            models.Index(
                fields=["run", "actor_kind", "created_at"], name="wf_ann_run_actor_kind_idx"
            ),
            models.Index(
                fields=["run", "generation", "created_at"], name="wf_ann_run_generation_idx"
            ),
        ]

    def __str__(self) -> str:
        value = repr(self.value)
        return f"{self.key}={value if len(value) <= 60 else value[:59] + '…'}"


class OutboxEvent(models.Model):
    """An event written in the same transaction as the state change that produced it (§5.2).

    ``sequence`` is 1, 2, 3, ... per run, gap-free (DM-20). No foreign key to the run (DM-11).
    A dead letter (``dlq_at`` set, ``published_at`` empty) blocks the later events of its run
    until it is replayed or skipped by an operator; a skipped row keeps ``dlq_at`` and gets
    ``published_at`` = ``skipped_at`` and the operator's ``skip_note`` (Part I item 16).
    ``last_error`` is the error of the latest failed delivery (cleared by a replay, kept on a
    skip).
    """

    id = models.BigAutoField(primary_key=True)
    created_at = models.DateTimeField()
    workflow_run_id = models.UUIDField()
    sequence = models.PositiveIntegerField()
    event_type = models.CharField(max_length=64)
    payload = _json()
    causation_id = models.CharField(max_length=200)
    occurred_at = models.DateTimeField()
    published_at = models.DateTimeField(null=True, blank=True)
    retry_count = models.PositiveIntegerField(default=0)
    dlq_at = models.DateTimeField(null=True, blank=True)
    skipped_at = models.DateTimeField(null=True, blank=True)
    skip_note = models.TextField(blank=True, default="")
    last_error = models.TextField(null=True, blank=True)

    class Meta:
        db_table = "outbox_events"
        ordering = ["workflow_run_id", "sequence"]
        constraints = [
            models.UniqueConstraint(
                fields=["workflow_run_id", "sequence"], name="wf_outbox_run_seq_uniq"
            ),
        ]
        # No query reads events by ``published_at`` range (the backlog and the dead letters
        # have their partial indexes): its index, updated by every flush, was dropped (issue 19).
        indexes = [
            # outbox.flush: unpublished, not dead-lettered rows in (run, sequence) order - a
            # partial index that holds only the backlog, so the flush's LIMIT stops early (0007).
            models.Index(
                fields=["workflow_run_id", "sequence"],
                name="wf_outbox_unpublished_idx",
                condition=models.Q(published_at__isnull=True, dlq_at__isnull=True),
            ),
            # Dead letters (the flush's "blocked runs" and the admin's dead-letter counts).
            models.Index(
                fields=["workflow_run_id", "sequence"],
                name="wf_outbox_dead_letter_idx",
                condition=models.Q(published_at__isnull=True, dlq_at__isnull=False),
            ),
        ]
        # Operator permissions shared by the HTTP API and the admin.
        permissions = [
            ("replay_outboxevent", "Can replay dead-lettered outbox events"),
            ("skip_outboxevent", "Can skip a dead-lettered outbox event"),
        ]

    def __str__(self) -> str:
        return f"{self.event_type} #{self.sequence}"


class IdempotencyKey(models.Model):
    """A command idempotency key, scoped by command type (SPEC §1.9, K-10..14)."""

    class State(models.TextChoices):
        IN_PROGRESS = "in_progress"
        COMPLETED = "completed"

    id = models.BigAutoField(primary_key=True)
    created_at = models.DateTimeField()
    key = models.CharField(max_length=255)
    command_type = models.CharField(max_length=64)
    state = models.CharField(max_length=16, choices=State.choices, default=State.IN_PROGRESS)
    result = _json(null=True, blank=True)

    class Meta:
        db_table = "idempotency_keys"
        constraints = [
            models.UniqueConstraint(fields=["key", "command_type"], name="wf_idem_key_type_uniq"),
        ]

    def __str__(self) -> str:
        return f"{self.command_type}:{self.key} ({self.state})"


class WorkflowBlob(models.Model):
    """A JSON blob of the database blob store: stage outputs, artifacts, ``ctx.storage`` (DM-50).

    ``run_id``/``stage_id`` record who wrote it, so a rerun can delete what the deleted stages
    stored (Part I item 8).
    """

    key = models.CharField(max_length=512, primary_key=True)
    created_at = models.DateTimeField()
    run_id = models.UUIDField(null=True, blank=True)
    stage_id = models.CharField(max_length=200, null=True, blank=True)
    data = _json(null=True)

    class Meta:
        db_table = "workflow_blobs"
        indexes = [models.Index(fields=["run_id", "stage_id"], name="wf_blob_run_stage_idx")]

    def __str__(self) -> str:
        return self.key


class MaintenanceLease(models.Model):
    """A named lease that keeps maintenance ticks from overlapping (Part I item 18)."""

    name = models.CharField(max_length=64, primary_key=True)
    owner = models.CharField(max_length=200)
    expires_at = models.DateTimeField()

    class Meta:
        db_table = "workflow_maintenance_leases"

    def __str__(self) -> str:
        return f"{self.name} held by {self.owner}"


class WorkflowSchedule(models.Model):
    """A schedule that starts runs of a workflow at cron times or fixed intervals (issue 12).

    Rows are synced from the code definitions (:func:`django_workflows.define_schedule`) by
    the maintenance tick: definition fields are overwritten from code, the operator state
    (``paused``) and the firing state are kept. A row whose definition disappeared is kept,
    ``orphaned`` and paused, never deleted.

    ``next_scheduled_at`` is the next scheduled time (the one in the firing's idempotency key
    ``schedule:<name>:<iso time>``); ``next_fire_at`` is that time plus its deterministic
    jitter: the tick fires the schedule once ``next_fire_at <= now``. ``buffered_at`` holds the
    one firing an ``overlap="buffer_one"`` schedule keeps while its previous run is live.
    """

    name = models.CharField(primary_key=True, max_length=180)
    created_at = models.DateTimeField()
    updated_at = models.DateTimeField()
    workflow_id = models.CharField(max_length=200)
    description = models.TextField(blank=True, default="")
    cron = models.CharField(max_length=200, blank=True, default="")
    every_seconds = models.FloatField(null=True, blank=True)
    tz = models.CharField(max_length=64, default="UTC")
    input = _json(default=dict, blank=True)
    config = _json(default=dict, blank=True)
    priority = models.IntegerField(default=5)
    overlap = models.CharField(max_length=20, default="skip")
    catchup = models.CharField(max_length=20, default="run_once")
    catchup_window_seconds = models.FloatField(default=86400.0)
    jitter_seconds = models.FloatField(default=0.0)
    repeated_times = models.CharField(max_length=8, default="once")
    anchor = models.DateTimeField()
    #: sha256 of the code definition last synced (a changed definition is re-synced).
    definition_hash = models.CharField(max_length=64, blank=True, default="")
    paused = models.BooleanField(default=False)
    #: Why it is paused: an operator's note, or ``orphaned`` (its definition disappeared).
    pause_reason = models.CharField(max_length=500, blank=True, default="")
    orphaned = models.BooleanField(default=False)
    next_scheduled_at = models.DateTimeField(null=True, blank=True)
    next_fire_at = models.DateTimeField(null=True, blank=True)
    buffered_at = models.DateTimeField(null=True, blank=True)
    last_scheduled_at = models.DateTimeField(null=True, blank=True)
    last_fired_at = models.DateTimeField(null=True, blank=True)
    last_run_id = models.UUIDField(null=True, blank=True)
    fired_count = models.PositiveBigIntegerField(default=0)
    skipped_count = models.PositiveBigIntegerField(default=0)
    #: The last firing error (a run that could not be created), or ``""``.
    last_error = models.TextField(blank=True, default="")

    class Meta:
        db_table = "workflow_schedules"
        ordering = ["name"]
        indexes = [
            # The tick's due scan and the ticker's EXISTS: unpaused, next_fire_at <= now.
            models.Index(fields=["paused", "next_fire_at"], name="wf_schedule_due_idx"),
        ]
        permissions = [
            ("pause_workflowschedule", "Can pause and resume workflow schedules"),
            ("trigger_workflowschedule", "Can trigger a workflow schedule now"),
            ("backfill_workflowschedule", "Can backfill a workflow schedule over a time range"),
        ]

    def __str__(self) -> str:
        return f"schedule {self.name} ({self.workflow_id})"

    @property
    def spec_text(self) -> str:
        """``"cron 0 * * * * (Europe/Berlin)"`` or ``"every 900s"``."""
        if self.cron:
            return f"cron {self.cron} ({self.tz})"
        seconds = self.every_seconds or 0
        return f"every {int(seconds) if seconds == int(seconds) else seconds}s"


class WorkflowDefinitionVersion(models.Model):
    """The structure of one version of a workflow definition, stored once (issue 12 item 3)
    when the first run of that version is created: the admin shows each run's own stage list
    from it, not today's definition.

    ``structure``: :meth:`~django_workflows.definition.workflow.Workflow.structure`
    (``{"name", "groups": [[{"id", "name", "kind", "queue"}, ...], ...]}``);
    ``takes_over``: the older versions that definition declared it can take over.
    """

    id = models.BigAutoField(primary_key=True)
    workflow_id = models.CharField(max_length=200)
    version = models.CharField(max_length=64)
    structure = _json(default=dict)
    takes_over = _json(default=list, blank=True)
    first_seen_at = models.DateTimeField()

    class Meta:
        db_table = "workflow_definition_versions"
        constraints = [
            models.UniqueConstraint(
                fields=["workflow_id", "version"], name="wf_definition_version_uniq"
            )
        ]

    def __str__(self) -> str:
        return f"{self.workflow_id} version {self.version}"


class WorkflowWorkerVersions(models.Model):
    """The definition versions a live worker process can run (issue 12 item 3): one row per
    worker, refreshed with its queue presence (:func:`django_workflows.kernel.routing.announce`)
    and expiring like it. ``versions``: ``{workflow_id: [version, ...]}`` (own version and
    ``takes_over``). Read to explain "waiting for a worker with version X".
    """

    worker_id = models.CharField(max_length=200, primary_key=True)
    versions = _json(default=dict)
    expires_at = models.DateTimeField()

    class Meta:
        db_table = "workflow_worker_versions"

    def __str__(self) -> str:
        return f"versions of worker {self.worker_id}"


class WorkflowSignal(models.Model):
    """A named message sent to a run from outside (issue 18 item 4, ``send_signal``).

    Stored durably when sent (buffered: it may arrive before a stage waits for it) and
    consumed at most once, by the first ``wait_for_signal`` stage of the run that waits for
    its ``name`` (oldest unconsumed first): ``consumed_at`` is set by a fenced update
    (``... WHERE consumed_at IS NULL``) in the poll transaction that completes that stage.
    ``idempotency_key`` is unique per run when given: a repeated send with the same key is a
    duplicate and stores nothing.
    """

    id = models.BigAutoField(primary_key=True)
    created_at = models.DateTimeField()
    run = models.ForeignKey(WorkflowRun, on_delete=models.CASCADE, related_name="signals")
    name = models.CharField(max_length=200)
    payload = _json(null=True, blank=True)
    idempotency_key = models.CharField(max_length=255, null=True, blank=True)
    actor = models.CharField(max_length=200, null=True, blank=True)
    consumed_at = models.DateTimeField(null=True, blank=True)
    consumed_by = models.ForeignKey(
        WorkflowStage,
        on_delete=models.SET_NULL,
        null=True,
        blank=True,
        related_name="consumed_signals",
    )
    #: ``stage_id`` of the stage record that consumed it (kept if that record is deleted).
    consumed_stage_id = models.CharField(max_length=200, null=True, blank=True)
    #: The rerun generation of the consuming stage record.
    consumed_generation = models.PositiveIntegerField(null=True, blank=True)

    class Meta:
        db_table = "workflow_signals"
        ordering = ["created_at", "id"]
        constraints = [
            models.UniqueConstraint(
                fields=["run", "idempotency_key"], name="wf_signal_run_key_uniq"
            ),
        ]
        indexes = [
            # The poll's "oldest unconsumed signal of this name for this run".
            models.Index(fields=["run", "name", "consumed_at", "id"], name="wf_signal_wait_idx"),
        ]

    def __str__(self) -> str:
        state = "consumed" if self.consumed_at else "pending"
        return f"signal {self.name!r} of run {self.run_id} ({state})"
