"""Retention: delete old finished runs on a policy (issue 20 part 1, ``docs/howto/retention.md``).

The policy is ``DJANGO_WORKFLOWS["RETENTION"]`` (default ``None``: keep everything)::

    "RETENTION": {
        # days a terminal run is kept after its completed_at, per status (None: forever;
        # a status not named: forever)
        "DEFAULT_DAYS": {"COMPLETED": 30, "FAILED": 90, "CANCELLED": 30},
        # per workflow id, over DEFAULT_DAYS status by status
        "WORKFLOW_DAYS": {"nightly-etl": {"COMPLETED": 7}, "audit": {"COMPLETED": None}},
        # django-q2's task results (Success/Failure rows) older than this (None: keep)
        "DJANGO_Q_TASK_DAYS": 7,
        # idempotency keys older than this (None: keep)
        "IDEMPOTENCY_KEY_DAYS": None,
    }

A run is **prunable** when it is terminal (COMPLETED, FAILED or CANCELLED), its
``completed_at`` is older than its status's age, every outbox event of it is published (or
skipped by an operator), no child run of it is live, and it is not the child of a live run.
Pruning a run deletes, in one short transaction per batch, its logs, annotations, signals,
stages, jobs, outbox events, blobs (``run_id`` rows of the database blob store) and the run
row. The run rows are locked first (PostgreSQL: ``FOR UPDATE SKIP LOCKED``: a run another
transaction holds - a rerun, a cancel, an outcome - is skipped, never waited for), then the
parent and the children of each locked run (``FOR SHARE SKIP LOCKED``: a run whose relative
another transaction holds - a child's rerun about to make it RUNNING - is skipped too), and
every condition is read again after the locks, so a run that a rerun made RUNNING again, that
got a new event, or whose parent or child a rerun made live again, is never deleted.

Nothing is remembered between calls: a new call finds what is still prunable, so an
interrupted prune (Ctrl-C between batches, a crash) continues where it stopped.

Entry points: :func:`prune` (the ``workflows_prune`` command and the supervisor's
:class:`RetentionDuty` call it), :func:`policy` / :func:`parse_policy`.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from django.apps import apps
from django.db import connection, transaction
from django.db.models import Exists, OuterRef, Q, QuerySet

from .conf import workflow_settings
from .models import (
    IdempotencyKey,
    OutboxEvent,
    WorkflowAnnotation,
    WorkflowBlob,
    WorkflowJob,
    WorkflowLog,
    WorkflowRun,
    WorkflowSignal,
    WorkflowStage,
)

if TYPE_CHECKING:
    from .kernel.dispatch import Kernel

logger = logging.getLogger("django_workflows.retention")

#: The statuses a policy may name, in report order.
STATUSES: tuple[str, ...] = ("COMPLETED", "FAILED", "CANCELLED")
#: The keys of the ``RETENTION`` dict.
KEYS: tuple[str, ...] = (
    "DEFAULT_DAYS",
    "WORKFLOW_DAYS",
    "DJANGO_Q_TASK_DAYS",
    "IDEMPOTENCY_KEY_DAYS",
)
#: The name of the maintenance lease that keeps two processes from pruning at once.
RETENTION_LEASE = "retention"


#: The longest age a policy may name (days, about 1,000 years): ``now - timedelta(days=...)``
#: must stay a date; use ``None`` to keep runs forever.
MAX_DAYS = 365_000


class RetentionPolicyError(ValueError):
    """A malformed ``RETENTION`` setting; the message names the bad field."""


def _days(value: Any, where: str) -> float | None:
    if value is None:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value < 0
        or value > MAX_DAYS
    ):
        raise RetentionPolicyError(
            f"RETENTION{where} must be a number of days from 0 to {MAX_DAYS} or None (keep "
            f"forever), got {value!r}"
        )
    return float(value)


def _statuses(value: Any, where: str) -> dict[str, float | None]:
    if not isinstance(value, dict):
        raise RetentionPolicyError(
            f"RETENTION{where} must be a dict of status to days, e.g. "
            f'{{"COMPLETED": 30, "FAILED": 90}}, got {value!r}'
        )
    out: dict[str, float | None] = {}
    for status, days in value.items():
        if status not in STATUSES:
            raise RetentionPolicyError(
                f"RETENTION{where} names {status!r}, not a terminal status "
                f"(one of {', '.join(STATUSES)})"
            )
        out[status] = _days(days, f"{where}[{status!r}]")
    return out


@dataclass(frozen=True)
class Rule:
    """One status's age for one workflow (``workflow_id``) or for every workflow not named
    in ``excluded`` (``workflow_id`` ``None``: the default rule). ``days`` > 0 or 0."""

    status: str
    days: float
    workflow_id: str | None = None
    excluded: frozenset[str] = frozenset()

    def cutoff(self, now: datetime) -> datetime:
        return now - timedelta(days=self.days)

    def runs(self, now: datetime) -> QuerySet[WorkflowRun]:
        """The terminal runs this rule has aged out at ``now`` (before the safety filters)."""
        qs = WorkflowRun.objects.filter(status=self.status, completed_at__lt=self.cutoff(now))
        if self.workflow_id is not None:
            return qs.filter(workflow_id=self.workflow_id)
        if self.excluded:
            qs = qs.exclude(workflow_id__in=sorted(self.excluded))
        return qs


@dataclass(frozen=True)
class RetentionPolicy:
    """The parsed ``RETENTION`` setting (:func:`parse_policy`); ages in days."""

    default_days: dict[str, float | None] = field(default_factory=dict)
    workflow_days: dict[str, dict[str, float | None]] = field(default_factory=dict)
    django_q_task_days: float | None = None
    idempotency_key_days: float | None = None

    def days_for(self, workflow_id: str, status: str) -> float | None:
        """How many days a ``status`` run of ``workflow_id`` is kept (``None``: forever)."""
        own = self.workflow_days.get(workflow_id, {})
        if status in own:
            return own[status]
        return self.default_days.get(status)

    def rules(self, workflow_id: str | None = None) -> list[Rule]:
        """The rules to apply (only ``workflow_id``'s when given), statuses in
        :data:`STATUSES` order, a workflow's own rules before the default one."""
        out: list[Rule] = []
        for status in STATUSES:
            if workflow_id is not None:
                days = self.days_for(workflow_id, status)
                if days is not None:
                    out.append(Rule(status, days, workflow_id))
                continue
            named = frozenset(w for w, own in self.workflow_days.items() if status in own)
            for wf in sorted(named):
                days = self.workflow_days[wf][status]
                if days is not None:
                    out.append(Rule(status, days, wf))
            default = self.default_days.get(status)
            if default is not None:
                out.append(Rule(status, default, None, named))
        return out


def parse_policy(value: Any) -> RetentionPolicy | None:
    """``RETENTION`` as a :class:`RetentionPolicy` (``None`` stays ``None``: keep everything).

    Raises:
        RetentionPolicyError: naming the bad key or value.
    """
    if value is None:
        return None
    if not isinstance(value, dict):
        raise RetentionPolicyError(
            f"RETENTION must be None or a dict with keys {', '.join(KEYS)}, got {value!r}"
        )
    unknown = sorted(str(k) for k in value if k not in KEYS)
    if unknown:
        raise RetentionPolicyError(
            f"RETENTION has unknown keys {', '.join(unknown)} (known: {', '.join(KEYS)})"
        )
    workflows = value.get("WORKFLOW_DAYS") or {}
    if not isinstance(workflows, dict):
        raise RetentionPolicyError(
            f"RETENTION['WORKFLOW_DAYS'] must be a dict of workflow id to a dict of status to "
            f"days, got {workflows!r}"
        )
    for wf in workflows:
        if not isinstance(wf, str) or not wf:
            raise RetentionPolicyError(
                f"RETENTION['WORKFLOW_DAYS'] has a workflow id that is not a non-empty "
                f"string: {wf!r}"
            )
    return RetentionPolicy(
        default_days=_statuses(value.get("DEFAULT_DAYS") or {}, "['DEFAULT_DAYS']"),
        workflow_days={
            wf: _statuses(own, f"['WORKFLOW_DAYS'][{wf!r}]") for wf, own in workflows.items()
        },
        django_q_task_days=_days(value.get("DJANGO_Q_TASK_DAYS"), "['DJANGO_Q_TASK_DAYS']"),
        idempotency_key_days=_days(value.get("IDEMPOTENCY_KEY_DAYS"), "['IDEMPOTENCY_KEY_DAYS']"),
    )


def policy() -> RetentionPolicy | None:
    """The configured policy (:func:`parse_policy` of ``DJANGO_WORKFLOWS["RETENTION"]``)."""
    return parse_policy(workflow_settings.RETENTION)


def settings_error() -> str | None:
    """Why the retention settings are invalid (``RETENTION``, ``RETENTION_BATCH_SIZE``,
    ``RETENTION_INTERVAL_SECONDS``), or ``None`` (system check E033)."""
    try:
        policy()
    except RetentionPolicyError as exc:
        return str(exc)
    size = workflow_settings.RETENTION_BATCH_SIZE
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        return f"RETENTION_BATCH_SIZE must be a positive integer, got {size!r}"
    interval = workflow_settings.RETENTION_INTERVAL_SECONDS
    if (
        isinstance(interval, bool)
        or not isinstance(interval, int | float)
        or not math.isfinite(interval)
        or interval <= 0
    ):
        return f"RETENTION_INTERVAL_SECONDS must be a positive number, got {interval!r}"
    return None


# --- what keeps a run ------------------------------------------------------------------------


def _undelivered() -> Exists:
    """An outbox event of the run that is not published (waiting, or a dead letter)."""
    return Exists(
        OutboxEvent.objects.filter(workflow_run_id=OuterRef("pk"), published_at__isnull=True)
    )


#: The run statuses that are not terminal. Named (``status IN (...)``), not negated: the live
#: runs are then read from an index that leads with ``status`` (``wf_run_status_created_idx``)
#: instead of a scan of every finished run.
LIVE_RUN_STATUSES: tuple[str, ...] = ("PENDING", "RUNNING", "SUSPENDED")


def _family_exists() -> Q:
    """A live child of the run, or a live parent."""
    child = WorkflowRun.objects.filter(parent_run_id=OuterRef("pk"), status__in=LIVE_RUN_STATUSES)
    parent = WorkflowRun.objects.filter(pk=OuterRef("parent_run_id"), status__in=LIVE_RUN_STATUSES)
    return Q(Exists(child)) | Q(Exists(parent))


def prunable(qs: QuerySet[WorkflowRun]) -> QuerySet[WorkflowRun]:
    """``qs`` without the runs something keeps: an undelivered (or dead-lettered) event, a
    live child, a live parent."""
    return qs.exclude(_undelivered()).exclude(_family_exists())


# --- the report ------------------------------------------------------------------------------


@dataclass
class PruneReport:
    """What one :func:`prune` did (or, with ``dry_run``, would do).

    ``runs``: ``{workflow_id: {status: n}}`` pruned (or prunable); ``kept``: aged-out runs
    kept, ``{"undelivered": n, "live_family": n}`` (dry run: counted; otherwise the ones met
    in this call) and ``"referenced"`` (held by another app's ``PROTECT`` / ``RESTRICT`` /
    ``DO_NOTHING`` relation, counted when a batch meets them); ``rows``: rows deleted per
    table (dry run: none); ``django_q_tasks`` / ``idempotency_keys``: rows deleted (dry run:
    that would be); ``batches``: transactions committed; ``skipped_locked``: candidate runs
    skipped because another transaction held the run, its parent or one of its children;
    ``seconds``: wall time; ``complete``: nothing prunable was left when it stopped (false
    after ``max_runs``, a stop request, or ``max_batches``).
    """

    dry_run: bool = False
    runs: dict[str, dict[str, int]] = field(default_factory=dict)
    kept: dict[str, int] = field(default_factory=lambda: {"undelivered": 0, "live_family": 0})
    rows: dict[str, int] = field(default_factory=dict)
    django_q_tasks: int = 0
    idempotency_keys: int = 0
    batches: int = 0
    skipped_locked: int = 0
    seconds: float = 0.0
    complete: bool = True

    @property
    def runs_total(self) -> int:
        return sum(n for per in self.runs.values() for n in per.values())

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["runs_total"] = self.runs_total
        out["runs_per_second"] = (
            round(self.runs_total / self.seconds, 1) if self.seconds > 0 else None
        )
        return out

    def _add_run(self, workflow_id: str, status: str, n: int = 1) -> None:
        per = self.runs.setdefault(workflow_id, {})
        per[status] = per.get(status, 0) + n


#: ``(table label, model, run column)`` deleted per batch, dependents first.
DEPENDENTS: tuple[tuple[str, Any, str], ...] = (
    ("logs", WorkflowLog, "run_id"),
    ("annotations", WorkflowAnnotation, "run_id"),
    ("signals", WorkflowSignal, "run_id"),
    ("stages", WorkflowStage, "run_id"),
    ("jobs", WorkflowJob, "workflow_run_id"),
    ("outbox_events", OutboxEvent, "workflow_run_id"),
    ("blobs", WorkflowBlob, "run_id"),
)


def _raw_delete(qs: QuerySet[Any]) -> int:
    """One ``DELETE ... WHERE`` of ``qs`` (no cascade collection, no signals: the dependents
    are deleted explicitly, in :data:`DEPENDENTS` order)."""
    return int(qs._raw_delete(qs.db))  # type: ignore[attr-defined]


def other_relations() -> list[Any]:
    """Relations of other apps' models to :class:`WorkflowRun` (a ``ForeignKey``,
    ``OneToOneField`` or ``ManyToManyField`` of the project's own models): the raw deletes of
    :data:`DEPENDENTS` would leave their rows pointing at nothing, which PostgreSQL refuses
    at commit - every batch would fail for good."""
    engine = {model for _, model, _ in DEPENDENTS}
    return [
        rel
        for rel in WorkflowRun._meta.related_objects
        if rel.related_model not in engine
        and rel.related_model._meta.app_label != "django_workflows"
    ]


def _settle_other_relations(ids: list[Any], report: PruneReport) -> list[Any]:
    """Apply the ``on_delete`` of :func:`other_relations` to the runs ``ids`` about to be
    deleted, as Django's ``delete()`` would: ``CASCADE`` deletes the referencing rows (through
    the ORM, so their own relations and signals are honoured), ``SET_NULL`` / ``SET_DEFAULT``
    update them, a many-to-many loses its links; a run referenced through ``PROTECT``,
    ``RESTRICT`` or ``DO_NOTHING`` is kept (counted in ``report.kept["referenced"]``).
    Returns the ids still to delete. No statement when no other app refers to runs."""
    from django.db.models import deletion

    relations = other_relations()
    if not relations:
        return ids
    remaining = list(ids)
    acting = []
    for rel in relations:  # first which runs must stay, then act for the others only
        if rel.many_to_many or rel.on_delete in (
            deletion.CASCADE,
            deletion.SET_NULL,
            deletion.SET_DEFAULT,
        ):
            acting.append(rel)
            continue
        # PROTECT, RESTRICT, DO_NOTHING, SET(...): a referenced run stays
        referencing = rel.related_model._base_manager.filter(**{f"{rel.field.name}__in": remaining})
        held = set(referencing.values_list(rel.field.attname, flat=True))
        if held:
            report.kept["referenced"] = report.kept.get("referenced", 0) + len(held)
            remaining = [pk for pk in remaining if pk not in held]
    if not remaining:
        return []
    for rel in acting:
        if rel.many_to_many:
            through = rel.through
            column = next(
                f.name
                for f in through._meta.fields
                if getattr(f, "related_model", None) is WorkflowRun
            )
            through._base_manager.filter(**{f"{column}__in": remaining}).delete()
            continue
        name = rel.field.name
        referencing = rel.related_model._base_manager.filter(**{f"{name}__in": remaining})
        if rel.on_delete is deletion.CASCADE:
            referencing.delete()
        elif rel.on_delete is deletion.SET_NULL:
            referencing.update(**{name: None})
        else:
            referencing.update(**{name: rel.field.get_default()})
    return remaining


def _lock(ids: list[Any], rule: Rule, now: datetime) -> list[Any]:
    qs = rule.runs(now).filter(pk__in=ids)
    if connection.features.has_select_for_update_skip_locked:
        qs = qs.select_for_update(skip_locked=True, of=("self",))
    return list(qs.order_by().values_list("pk", flat=True))


def _lock_family(ids: list[Any]) -> list[Any]:
    """Share-lock the parent and the children of the runs ``ids`` (whose own rows this
    transaction already holds) and return the ids whose every relative could be locked: on
    PostgreSQL ``FOR SHARE SKIP LOCKED``, so a relative another transaction holds (a rerun of
    a child, which locks only the child's row, about to make it RUNNING) keeps its family
    out of this batch instead of being read as it was before that transaction commits; and
    until this batch commits no relative's status can change (a rerun of it waits, then
    finds the deleted run gone, as after any earlier prune). Never waits.

    SQLite has one writer at a time: the batch's transaction already excludes a rerun, so
    ``ids`` is returned as is (no statement)."""
    if not ids or not connection.features.has_select_for_update_skip_locked:
        return ids
    relatives: dict[Any, set[Any]] = {pk: set() for pk in ids}
    rows = WorkflowRun.objects.filter(Q(parent_run_id__in=ids) | Q(pk__in=ids)).order_by()
    for pk, parent in rows.values_list("pk", "parent_run_id"):
        if parent in relatives and pk not in relatives:  # a child of a locked run
            relatives[parent].add(pk)
        if pk in relatives and parent is not None:  # a locked run's parent
            relatives[pk].add(parent)
    wanted = set().union(*relatives.values()) - set(ids)
    if not wanted:
        return ids
    present = WorkflowRun.objects.filter(pk__in=wanted).order_by().values_list("pk", flat=True)
    sql, params = present.query.sql_with_params()
    with connection.cursor() as cursor:
        cursor.execute(f"{sql} FOR SHARE SKIP LOCKED", params)
        held = {row[0] for row in cursor.fetchall()}
    # A relative that exists but could not be locked; one that is gone keeps nothing.
    blocked = set(present.exclude(pk__in=held)) if len(held) < len(wanted) else set()
    return [pk for pk in ids if not relatives[pk] & blocked]


def _delete_batch(
    ids: list[Any], rule: Rule, now: datetime, report: PruneReport, blobs: Any = None
) -> list[tuple[Any, str]]:
    """Lock, re-check and delete one batch of candidate runs; returns the deleted
    ``(id, workflow_id)`` pairs.

    ``blobs``: the kernel's blob store; if it has ``delete_run_blobs(runs)`` (``runs``: a list
    of ``(run id, workflow_type)``; keys live under ``workflow-v2/{workflow_type}/{run id}/``,
    :func:`.blobs.stage_prefix`), it is called after the batch committed.
    """
    with transaction.atomic():
        locked = _lock_family(_lock(ids, rule, now))
        report.skipped_locked += len(ids) - len(locked)
        if not locked:
            return []
        # A statement after the locks: its snapshot sees every commit that came before (an
        # event appended, a child started, a rerun of the run or of a relative), and
        # nothing can change these rows or their relatives until this transaction ends.
        rows = list(
            prunable(rule.runs(now).filter(pk__in=locked))
            .order_by()
            .values_list("pk", "workflow_id", "workflow_type")
        )
        if not rows:
            return []
        keep = _settle_other_relations([pk for pk, _, _ in rows], report)
        if not keep:
            return []
        rows = [row for row in rows if row[0] in set(keep)]
        for label, model, column in DEPENDENTS:
            n = _raw_delete(model.objects.filter(**{f"{column}__in": keep}))
            report.rows[label] = report.rows.get(label, 0) + n
        n = _raw_delete(WorkflowRun.objects.filter(pk__in=keep))
        report.rows["runs"] = report.rows.get("runs", 0) + n
    report.batches += 1
    hook = getattr(blobs, "delete_run_blobs", None)
    if hook is not None:
        # A blob store that keeps content outside the database (its own rows, if any, went
        # with the batch): told after the commit, so a rolled-back batch loses no content;
        # a crash in between leaves unreferenced content behind, never a run without it.
        hook([(pk, workflow_type) for pk, _, workflow_type in rows])
    return [(pk, wf) for pk, wf, _ in rows]


def _count_by(qs: QuerySet[WorkflowRun]) -> dict[str, int]:
    from django.db.models import Count

    return {
        row["workflow_id"]: row["n"]
        for row in qs.order_by().values("workflow_id").annotate(n=Count("pk"))
    }


def _django_q_task_model() -> Any | None:
    if not apps.is_installed("django_q"):
        return None
    from django_q.models import Task

    return Task


def _delete_aged(
    qs: QuerySet[Any],
    *,
    dry_run: bool,
    batch_size: int,
    stop: threading.Event | None,
    max_batches: int | None = None,
) -> tuple[int, bool]:
    """Delete ``qs``'s rows in batches of primary keys; ``(deleted, complete)``."""
    if dry_run:
        return qs.count(), True
    total = 0
    batches = 0
    while True:
        if (stop is not None and stop.is_set()) or (
            max_batches is not None and batches >= max_batches
        ):
            return total, False
        batches += 1
        pks = list(qs.order_by("pk").values_list("pk", flat=True)[:batch_size])
        if not pks:
            return total, True
        with transaction.atomic():
            total += _raw_delete(qs.model.objects.filter(pk__in=pks))
        if len(pks) < batch_size:
            return total, True


def count_prunable(pol: RetentionPolicy, now: datetime, *, workflow_id: str | None = None) -> int:
    """How many runs are prunable now (one ``COUNT`` per rule)."""
    return sum(prunable(rule.runs(now)).count() for rule in pol.rules(workflow_id))


def prune(
    *,
    kernel: Kernel | None = None,
    pol: RetentionPolicy | None = None,
    dry_run: bool = False,
    batch_size: int | None = None,
    workflow_id: str | None = None,
    max_runs: int | None = None,
    max_batches: int | None = None,
    stop: threading.Event | None = None,
    progress: Callable[[PruneReport], None] | None = None,
    pause_seconds: float = 0.0,
    now: datetime | None = None,
    include_side_tables: bool = True,
) -> PruneReport:
    """Delete (``dry_run``: count) what the retention policy has aged out.

    Args:
        kernel: whose clock says "now" and whose blob store is told about deleted runs
            (default: :func:`~django_workflows.kernel.runtime.get_kernel`).
        pol: the policy (default: :func:`policy`; ``None`` there: nothing is pruned).
        dry_run: count per workflow and status what would be deleted and what is kept, and
            delete nothing.
        batch_size: runs per transaction (default ``RETENTION_BATCH_SIZE``).
        workflow_id: prune only this workflow's runs (its own ages, else the default ones);
            django-q2 rows and idempotency keys are then left alone.
        max_runs: stop after about this many runs (whole batches; at least one batch).
        max_batches: stop after this many run batches (the supervisor's bounded cycle).
        stop: checked between batches; once set, the prune returns (``complete`` false).
        progress: called after each batch with the report so far.
        pause_seconds: wait this long after each run batch (a gentler prune beside busy
            workers; ``stop`` ends the wait at once).
        now: the moment ages are measured from (default: the kernel's clock).
        include_side_tables: also prune django-q2 task rows and idempotency keys by age.

    Returns:
        a :class:`PruneReport`.

    Raises:
        RetentionPolicyError: the setting is malformed.
    """
    t0 = time.perf_counter()
    if kernel is None:
        from .kernel.runtime import get_kernel

        kernel = get_kernel()
    pol = pol if pol is not None else policy()
    report = PruneReport(dry_run=dry_run)
    if pol is None:
        return report
    now = now or kernel.clock.now()
    size = int(batch_size or workflow_settings.RETENTION_BATCH_SIZE)
    rules = pol.rules(workflow_id)
    for rule in rules:
        aged = rule.runs(now)
        if dry_run:
            for wf, n in _count_by(prunable(aged)).items():
                report._add_run(wf, rule.status, n)
            report.kept["undelivered"] += aged.filter(_undelivered()).count()
            report.kept["live_family"] += (
                aged.exclude(_undelivered()).filter(_family_exists()).count()
            )
            continue
        # Keyset walk over (completed_at, id): a run skipped (locked, or kept after the
        # lock) is never looked at again by this call, so the walk always ends.
        after: tuple[datetime, Any] | None = None
        while True:
            if stop is not None and stop.is_set():
                report.complete = False
                break
            qs = prunable(aged)
            if after is not None:
                qs = qs.filter(
                    Q(completed_at__gt=after[0]) | Q(completed_at=after[0], pk__gt=after[1])
                )
            page = list(qs.order_by("completed_at", "pk").values_list("pk", "completed_at")[:size])
            if not page:
                break
            if (max_runs is not None and report.runs_total >= max_runs) or (
                max_batches is not None and report.batches >= max_batches
            ):
                report.complete = False  # more is waiting
                break
            after = (page[-1][1], page[-1][0])
            deleted = _delete_batch([pk for pk, _ in page], rule, now, report, kernel.blobs)
            for _pk, wf in deleted:
                report._add_run(wf, rule.status)
            if progress is not None:
                progress(report)
            if len(page) < size:
                break
            if pause_seconds > 0:
                if stop is not None:
                    stop.wait(pause_seconds)
                else:
                    time.sleep(pause_seconds)
        if not report.complete:
            break
    if not dry_run and report.complete:
        # What the walk did not take: aged-out runs kept by an event or a live relative.
        for rule in rules:
            aged = rule.runs(now)
            report.kept["undelivered"] += aged.filter(_undelivered()).count()
            report.kept["live_family"] += (
                aged.exclude(_undelivered()).filter(_family_exists()).count()
            )
    if include_side_tables and workflow_id is None and report.complete:
        for days, attr, model, column in (
            (pol.django_q_task_days, "django_q_tasks", _django_q_task_model(), "stopped"),
            (pol.idempotency_key_days, "idempotency_keys", IdempotencyKey, "created_at"),
        ):
            if days is None or model is None:
                continue
            cutoff = now - timedelta(days=days)
            n, done = _delete_aged(
                model.objects.filter(**{f"{column}__lt": cutoff}),
                dry_run=dry_run,
                batch_size=size,
                stop=stop,
                max_batches=max_batches,
            )
            setattr(report, attr, n)
            report.complete = report.complete and done
            if progress is not None:
                progress(report)
    report.seconds = round(time.perf_counter() - t0, 3)
    return report


# --- the engine's own schedule ---------------------------------------------------------------


class RetentionDuty:
    """Supervisor duty (:mod:`.kernel.supervisor`): prune on the policy from the worker
    processes themselves, one process of all hosts at a time.

    Every ``RETENTION_INTERVAL_SECONDS`` (and while the last cycle still found a full batch,
    every ``SUPERVISOR_INTERVAL_SECONDS``, so a backlog drains without a long transaction
    ever), a process that takes the ``retention`` maintenance lease prunes at most one batch
    of ``RETENTION_BATCH_SIZE`` runs, then gives the lease up. Does nothing (one look per
    ``MAX_SLEEP_SECONDS``, no query) while ``RETENTION`` is ``None`` or
    ``SUPERVISOR_TICKS`` is false.

    A cycle runs in a thread of its own (``background``, the default), so a batch never
    delays the ticker duty that shares the supervisor thread; the duty starts no new cycle
    while one is running.

    Args:
        kernel: a callable returning the kernel (read lazily: settings may change).
        owner: this process's lease owner name.
        background: run each cycle in a new thread (``False``: in the caller's, tests).
    """

    name = "retention"

    def __init__(
        self, kernel: Callable[[], Kernel], owner: str, *, background: bool = True
    ) -> None:
        self._kernel = kernel
        self.owner = owner
        self.background = background
        self.stopped = False
        self._due = 0.0
        self.cycles = 0
        self.pruned = 0
        self.last: PruneReport | None = None
        self._thread: threading.Thread | None = None
        self._more = False

    def poke(self) -> None:
        self._due = 0.0

    def stop(self) -> None:
        self.stopped = True

    def join(self, timeout: float | None = None) -> None:
        """Wait for a cycle running in the background (tests, a stopping process)."""
        if self._thread is not None:
            self._thread.join(timeout)

    def run(self, now: float) -> float:
        from .kernel.supervisor import MAX_SLEEP_SECONDS

        if self.stopped or not workflow_settings.SUPERVISOR_TICKS:
            return MAX_SLEEP_SECONDS
        if workflow_settings.RETENTION is None:
            return MAX_SLEEP_SECONDS
        if self._thread is not None:
            if self._thread.is_alive():
                return 1.0
            self._thread = None
            if self._more:  # the cycle found a full batch: more is waiting
                self._due = min(
                    self._due, now + float(workflow_settings.SUPERVISOR_INTERVAL_SECONDS)
                )
        if now < self._due:
            return self._due - now
        interval = float(workflow_settings.RETENTION_INTERVAL_SECONDS)
        self._due = now + interval
        if settings_error() is not None:
            return interval  # reported by system check E033
        if self.background:
            self._thread = threading.Thread(target=self._cycle, name="retention", daemon=True)
            self._thread.start()
            return 1.0
        self._cycle()
        if self._more:
            self._due = now + float(workflow_settings.SUPERVISOR_INTERVAL_SECONDS)
        return max(0.0, self._due - now)

    def _cycle(self) -> None:
        """One cycle: take the lease, prune one batch, give the lease up."""
        from .kernel import leases

        self._more = False
        try:
            kernel = self._kernel()
            ttl = leases.ticker_lease_seconds()
            if not leases.acquire_lease(kernel.lease_clock, RETENTION_LEASE, self.owner, ttl):
                return
            try:
                with leases.LeaseKeeper(
                    kernel, RETENTION_LEASE, self.owner, ttl, leases.lease_heartbeat_seconds(ttl)
                ):
                    report = prune(kernel=kernel, max_batches=1)
            finally:
                leases.release_lease(RETENTION_LEASE, self.owner)
            self.cycles += 1
            self.pruned += report.runs_total
            self.last = report
            self._more = not report.complete
            if report.runs_total:
                logger.info("Retention pruned %d runs", report.runs_total)
        except Exception:
            if not self.background:
                raise
            logger.exception("Retention cycle failed; retrying at the next interval")
        finally:
            if self.background:
                connection.close()  # this thread's own connection
