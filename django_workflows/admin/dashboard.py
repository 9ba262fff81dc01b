"""The admin dashboard (issue 20 item 5): throughput and failures per workflow over time, queue
depth, stage duration percentiles, the slowest and the most failing stages - computed by a few
bounded queries and drawn server side as inline SVG with a table under each chart (no
JavaScript, no external CSS).

``/admin/django_workflows/dashboard/?window=24h&workflow=<id>`` (``window``: ``1h``, ``24h``
(default), ``7d``, ``30d``; ``workflow``: optional). Viewing it needs the view permission of
runs. What each panel reads (eight statements at most whatever the number of runs; the page
reuses the counts of closed buckets and the percentiles for :data:`CLOSED_CACHE_SECONDS`):

* **Throughput and failures**: runs *finished* (``completed_at``) in the window, counted per
  workflow, status and time bucket (:data:`WINDOWS`: 5 min, 1 h, 6 h, 1 day) in SQL - on
  PostgreSQL an index-only scan of ``wf_run_completed_idx`` (``completed_at`` INCLUDE
  ``workflow_id``, ``status``). Buckets are aligned to the bucket width (UTC); the last one is
  the bucket in progress.
* **Queue depth** (now, not windowed): jobs per queue - ready (PENDING and due), delayed
  (PENDING with a future ``next_poll_at``: retry back-off or not-before), running, suspended -
  and the age of the oldest ready job (since its ``next_poll_at``, or its creation); plus the
  PENDING runs no worker has claimed yet (counted up to :data:`MAX_PENDING_COUNT`).
* **Stage durations**: p50 / p95 / p99 and max of ``duration_ms`` of the COMPLETED stage
  records of runs finished in the window, per workflow and stage (PostgreSQL:
  ``percentile_cont``; SQLite: the same linear interpolation in Python). Exact when the window
  holds at most :data:`SAMPLE_RUNS` runs; otherwise computed from a sample of that many runs
  taken from each bucket in proportion to the runs it holds (the latest runs of each bucket;
  :func:`sample_sizes`), so every sampled run stands for as many runs, and marked so.
* **Slowest stages**: the stage rows above ordered by p95 (then max), the first
  :data:`TOP_STAGES`.
* **Most failing stages**: FAILED runs finished in the window per workflow and failed stage
  (``error["stage_id"]``, the stage that failed the run; exact, through the partial index
  ``wf_run_failed_completed_idx``), with the share of the workflow's finished runs, the first
  :data:`TOP_STAGES`; each links to the run list filtered by workflow, status, stage and the
  window's buckets (``?finished=<start>/<end>``, :func:`~.run_list.finished_range`: the runs
  the row counts, not "the last 24 hours" from now).

Bad parameters (an unknown window, a workflow id that is too long or has no runs and is not
registered) show a message on the page and fall back to the defaults; nothing here writes.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any
from urllib.parse import urlencode

from django.contrib import admin
from django.db import connection
from django.db.models import Count, F, Min, Q
from django.db.models.fields.json import KeyTextTransform
from django.db.models.functions import Coalesce
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse
from django.urls import reverse
from django.utils import timezone
from django.utils.html import escape, format_html, format_html_join
from django.utils.safestring import SafeString, mark_safe

from ..definition.registry import registry
from ..models import Dashboard, Status, WorkflowJob, WorkflowRun, WorkflowStage
from .display import STATUS_COLOURS, format_duration_ms
from .run_list import finished_range

#: ``window`` parameter -> (length, bucket width in seconds, label).
WINDOWS: dict[str, tuple[timedelta, int, str]] = {
    "1h": (timedelta(hours=1), 300, "last hour (5-minute buckets)"),
    "24h": (timedelta(days=1), 3600, "last 24 hours (hourly buckets)"),
    "7d": (timedelta(days=7), 6 * 3600, "last 7 days (6-hour buckets)"),
    "30d": (timedelta(days=30), 86400, "last 30 days (daily buckets)"),
}
DEFAULT_WINDOW = "24h"
#: Runs whose stages the duration percentiles read at most (spread over the buckets).
SAMPLE_RUNS = 1000
#: How long the admin page reuses the counts of a window's closed buckets and its duration
#: percentiles (seconds, Django's default cache); the bucket in progress is always counted
#: live. Runs deleted, pruned or rerun show in closed buckets within this time.
CLOSED_CACHE_SECONDS = 300
#: (workflow, failed stage) groups read per statement at most.
MAX_FAILED_GROUPS = 1000
#: Rows of the slowest / most failing stage tables.
TOP_STAGES = 10
#: Workflows drawn as their own throughput chart (the busiest; the rest are in the totals).
MAX_WORKFLOW_CHARTS = 8
#: Rows of the percentile table at most.
MAX_PERCENTILE_ROWS = 100
#: PENDING runs counted at most (an index range with a LIMIT).
MAX_PENDING_COUNT = 10_000
#: Longest workflow id accepted (the column's length).
MAX_WORKFLOW_ID = 200

#: The statuses a finished run has, in stacking order (bottom first).
FINISHED = (Status.COMPLETED, Status.FAILED, Status.CANCELLED)


@dataclass
class Window:
    """The time window: ``start`` .. ``end`` (UTC, ``end`` exclusive, both on bucket
    boundaries), ``step`` seconds per bucket, ``starts`` the start of each bucket."""

    key: str
    label: str
    start: datetime
    end: datetime
    step: int
    starts: list[datetime]
    _labels: list[str] | None = field(default=None, repr=False, compare=False)

    @property
    def buckets(self) -> int:
        return len(self.starts)

    def labels(self) -> list[str]:
        """The (HTML-escaped) label of each bucket boundary: ``buckets + 1`` of them, the last
        the window's end (see :func:`_bucket_label`); computed once per window."""
        if self._labels is None:
            edges = [*self.starts, self.end]
            self._labels = [escape(_bucket_label(self, at)) for at in edges]
        return self._labels

    def finished_range(self, index: int | None = None) -> str:
        """The run list's ``?finished=`` value of the runs this window counts (``index``: of
        bucket ``index`` only): from its first bucket's start to its end, the same boundaries
        as the counts (see :func:`~.run_list.finished_range`)."""
        if index is None:
            return finished_range(self.start, self.end)
        start = self.starts[index]
        return finished_range(start, start + timedelta(seconds=self.step))


def make_window(key: str, now: datetime) -> Window:
    """The window ``key`` (a key of :data:`WINDOWS`) ending with the bucket that holds ``now``."""
    length, step, label = WINDOWS[key]
    epoch = int(now.timestamp())
    end_epoch = (epoch // step + 1) * step
    count = int(length.total_seconds()) // step
    start_epoch = end_epoch - count * step
    starts = [datetime.fromtimestamp(start_epoch + i * step, UTC) for i in range(count)]
    return Window(
        key,
        label,
        datetime.fromtimestamp(start_epoch, UTC),
        datetime.fromtimestamp(end_epoch, UTC),
        step,
        starts,
    )


@dataclass
class Series:
    """Finished runs per bucket of one workflow (or of all): ``counts[status][bucket]``."""

    workflow_id: str
    counts: dict[str, list[int]]

    @property
    def total(self) -> int:
        return sum(sum(v) for v in self.counts.values())

    def status_total(self, status: str) -> int:
        return sum(self.counts.get(status, []))

    @property
    def status_totals(self) -> list[int]:
        """Runs per status of :data:`FINISHED`, in that order."""
        return [self.status_total(s) for s in FINISHED]

    @property
    def failed(self) -> int:
        return self.status_total(Status.FAILED)


def duration_text(name: str, *, scale: float = 1.0) -> property:
    """A read-only property: the attribute ``name`` (a number, times ``scale`` to make it
    milliseconds) as :func:`~.display.format_duration_ms` text (``"1.5 s"``), ``"-"`` when it is
    ``None``. The ``*_text`` attributes the page shows."""

    def text(self: Any) -> str:
        value = getattr(self, name)
        return "-" if value is None else format_duration_ms(value * scale)

    return property(text, doc=f"``{name}`` as text (``format_duration_ms``; ``-`` if None).")


@dataclass
class QueueRow:
    """Jobs of one queue now: ``ready`` (PENDING and due), ``delayed`` (PENDING, due later),
    ``running``, ``suspended``; ``oldest_ready_s`` seconds since the oldest ready job became
    ready (``None`` without one)."""

    queue: str
    ready: int = 0
    delayed: int = 0
    running: int = 0
    suspended: int = 0
    oldest_ready_s: float | None = None

    oldest_text = duration_text("oldest_ready_s", scale=1000)


@dataclass
class StageStats:
    """Durations (ms) of one stage of one workflow: ``count`` COMPLETED records read."""

    workflow_id: str
    stage_id: str
    count: int
    p50: float
    p95: float
    p99: float
    max: float
    url: str = ""
    svg: Any = ""

    p50_text = duration_text("p50")
    p95_text = duration_text("p95")
    p99_text = duration_text("p99")
    max_text = duration_text("max")


@dataclass
class FailingStage:
    """FAILED runs of ``workflow_id`` that ``stage_id`` failed (``""``: no stage), ``share`` of
    the workflow's runs finished in the window (0..1)."""

    workflow_id: str
    stage_id: str
    failed: int
    share: float
    url: str = ""
    svg: Any = ""

    @property
    def share_text(self) -> str:
        """``4.2 %`` (one decimal below 10 %)."""
        pct = self.share * 100
        return f"{pct:.1f} %" if pct < 10 else f"{pct:.0f} %"


@dataclass
class DashboardData:
    """Everything the page shows (see the module docstring)."""

    window: Window
    workflow: str | None
    series: list[Series]
    total: Series
    queues: list[QueueRow]
    pending_runs: int
    pending_capped: bool
    stages: list[StageStats]
    slowest: list[StageStats]
    failing: list[FailingStage]
    sampled_runs: int
    sample_exact: bool
    errors: list[str] = field(default_factory=list)


# --- queries ----------------------------------------------------------------------------------


def _epoch_sql(column: str) -> str:
    if connection.vendor == "postgresql":
        return f"EXTRACT(EPOCH FROM {column})"
    if connection.vendor == "sqlite":
        return f"CAST(strftime('%%s', {column}) AS INTEGER)"
    return f"UNIX_TIMESTAMP({column})"  # MySQL / MariaDB


def _bucket_rows(
    window: Window, workflow: str | None, lo: datetime, hi: datetime
) -> list[tuple[str, str, int, int]]:
    """``(workflow_id, status, bucket index, runs)`` of the runs finished in ``[lo, hi)`` (one
    ``GROUP BY``; on PostgreSQL an index-only scan of ``wf_run_completed_idx``)."""
    table = WorkflowRun._meta.db_table
    if connection.vendor == "postgresql":
        # date_bin (PostgreSQL 14+): the bucket's start, timestamp arithmetic on int8 - a
        # third cheaper per row than date_part's numeric epoch, the most of this statement
        bucket = "date_bin(%s, completed_at, %s)"
        params: list[Any] = [timedelta(seconds=window.step), window.start]
    else:
        bucket = f"FLOOR(({_epoch_sql('completed_at')} - %s) / %s)"
        params = [int(window.start.timestamp()), window.step]
    where = "completed_at >= %s AND completed_at < %s"
    params += [lo, hi]
    if workflow:
        where += " AND workflow_id = %s"
        params.append(workflow)
    sql = (
        f"SELECT workflow_id, status, {bucket} AS b, COUNT(*) FROM {table} "
        f"WHERE {where} GROUP BY workflow_id, status, b"
    )
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        rows = cursor.fetchall()
    if connection.vendor == "postgresql":
        first, step = window.start.timestamp(), window.step
        return [(wf, st, int((b.timestamp() - first) // step), int(n)) for wf, st, b, n in rows]
    return [(wf, st, int(b), int(n)) for wf, st, b, n in rows]


def _closed(key: str, compute: Any, cached: bool) -> Any:
    """``compute()``, or its value cached for :data:`CLOSED_CACHE_SECONDS` under ``key`` when
    ``cached`` (the default cache)."""
    if not cached:
        return compute()
    from django.core.cache import cache

    full = f"django_workflows:dashboard:{key}"
    value = cache.get(full)
    if value is None:
        value = compute()
        cache.set(full, value, CLOSED_CACHE_SECONDS)
    return value


def _key(window: Window, workflow: str | None, what: str) -> str:
    import hashlib

    wf = hashlib.sha1((workflow or "").encode()).hexdigest()[:16]
    return f"{what}:{window.key}:{int(window.start.timestamp())}:{wf}"


def throughput(
    window: Window, workflow: str | None, *, cached: bool = False
) -> tuple[list[Series], Series]:
    """Finished runs per workflow, status and bucket; the series ordered by total runs (most
    first), and the sum over all workflows. Two ``GROUP BY`` statements: the closed buckets
    (cached when ``cached``, see :data:`CLOSED_CACHE_SECONDS`) and the bucket in progress."""
    open_start = window.starts[-1]
    rows = _closed(
        _key(window, workflow, "throughput"),
        lambda: _bucket_rows(window, workflow, window.start, open_start),
        cached,
    ) + _bucket_rows(window, workflow, open_start, window.end)
    per: dict[str, dict[str, list[int]]] = {}
    total: dict[str, list[int]] = {s: [0] * window.buckets for s in FINISHED}
    for wf, status, index, n in rows:
        if status not in total or not 0 <= index < window.buckets:
            continue
        counts = per.setdefault(wf, {s: [0] * window.buckets for s in FINISHED})
        counts[status][index] += n
        total[status][index] += n
    series = [Series(wf, counts) for wf, counts in per.items()]
    series.sort(key=lambda s: (-s.total, s.workflow_id))
    return series, Series("all workflows", total)


def queue_depth(now: datetime) -> tuple[list[QueueRow], int, bool]:
    """Open jobs per queue (one statement on the job status index) and the PENDING runs not
    claimed yet (counted up to :data:`MAX_PENDING_COUNT`): ``(rows, pending, capped)``."""
    due = Q(next_poll_at__isnull=True) | Q(next_poll_at__lte=now)
    ready = Q(status=Status.PENDING) & due
    rows = (
        WorkflowJob.objects.filter(status__in=[Status.PENDING, Status.RUNNING, Status.SUSPENDED])
        .values("queue")
        .annotate(
            ready=Count("id", filter=ready),
            delayed=Count("id", filter=Q(status=Status.PENDING) & ~due),
            running=Count("id", filter=Q(status=Status.RUNNING)),
            suspended=Count("id", filter=Q(status=Status.SUSPENDED)),
            oldest=Min(Coalesce("next_poll_at", "created_at"), filter=ready),
        )
        .order_by("queue")
    )
    out = []
    for row in rows:
        oldest = row["oldest"]
        age = None if oldest is None else max(0.0, (now - oldest).total_seconds())
        out.append(
            QueueRow(
                row["queue"], row["ready"], row["delayed"], row["running"], row["suspended"], age
            )
        )
    pending = (
        WorkflowRun.objects.filter(status=Status.PENDING)
        .order_by()
        .values("pk")[: MAX_PENDING_COUNT + 1]
        .count()
    )
    return out, min(pending, MAX_PENDING_COUNT), pending > MAX_PENDING_COUNT


def sample_sizes(finished: list[int], size: int | None = None) -> list[int]:
    """Runs to sample from each bucket: ``finished[i]`` runs finished in bucket ``i``, ``size``
    runs in all (default :data:`SAMPLE_RUNS`). Every run when they are at most ``size``; else
    proportional to the bucket's runs (largest remainders, so the sizes add up to ``size``
    exactly), so that each sampled run stands for the same number of runs and a busy bucket
    weighs in the percentiles as much as its runs do. A list as long as ``finished``."""
    size = SAMPLE_RUNS if size is None else size
    total = sum(finished)
    if total <= size:
        return list(finished)
    shares = [n * size / total for n in finished]
    sizes = [math.floor(x) for x in shares]
    by_remainder = sorted(range(len(finished)), key=lambda i: (sizes[i] - shares[i], i))
    for i in by_remainder[: size - sum(sizes)]:
        sizes[i] += 1
    return sizes


def _sample_sql(window: Window, workflow: str | None, sizes: list[int]) -> tuple[str, list]:
    """The ``(id, workflow_id)`` of the sampled runs: the latest ``sizes[i]`` runs of each
    bucket ``i`` (:func:`sample_sizes`; one ``UNION ALL`` of index range scans with a ``LIMIT``
    each, the buckets with nothing to sample left out)."""
    table = WorkflowRun._meta.db_table
    extra = " AND workflow_id = %s" if workflow else ""
    parts, params = [], []
    for i, start in enumerate(window.starts):
        if not sizes[i]:
            continue
        end = start + timedelta(seconds=window.step)
        parts.append(
            f"SELECT * FROM (SELECT id, workflow_id FROM {table} WHERE completed_at >= %s "
            f"AND completed_at < %s{extra} ORDER BY completed_at DESC LIMIT {int(sizes[i])})"
            f" AS s{i}"
        )
        params += [start, end] + ([workflow] if workflow else [])
    return " UNION ALL ".join(parts), params


def percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) of sorted ``values`` by linear interpolation between the
    closest ranks - what PostgreSQL's ``percentile_cont`` computes. ``values`` must not be
    empty."""
    pos = (len(values) - 1) * q
    lo = math.floor(pos)
    hi = math.ceil(pos)
    return float(values[lo]) + (float(values[hi]) - float(values[lo])) * (pos - lo)


def stage_durations(
    window: Window, workflow: str | None, finished: list[int]
) -> tuple[list[StageStats], int, bool]:
    """Duration percentiles per workflow and stage (see the module docstring):
    ``(stats ordered by workflow and stage, sampled runs, exact)``."""
    exact = sum(finished) <= SAMPLE_RUNS
    sizes = sample_sizes(finished)
    sampled = sum(sizes)
    if not sampled:
        return [], 0, True
    if exact:
        # one range scan of the window (a run finishing meanwhile may join the open bucket)
        sample = (
            f"SELECT id, workflow_id FROM {WorkflowRun._meta.db_table} WHERE completed_at >= %s "
            f"AND completed_at < %s{' AND workflow_id = %s' if workflow else ''}"
        )
        params: list[Any] = [window.start, window.end] + ([workflow] if workflow else [])
    else:
        sample, params = _sample_sql(window, workflow, sizes)
    stages = WorkflowStage._meta.db_table
    base = (
        f"FROM ({sample}) AS smp JOIN {stages} st ON st.run_id = smp.id "
        "WHERE st.status = %s AND st.duration_ms IS NOT NULL"
    )
    params = [*params, Status.COMPLETED]
    out: list[StageStats] = []
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute(
                "SELECT smp.workflow_id, st.stage_id, COUNT(*), "
                "percentile_cont(0.5) WITHIN GROUP (ORDER BY st.duration_ms), "
                "percentile_cont(0.95) WITHIN GROUP (ORDER BY st.duration_ms), "
                "percentile_cont(0.99) WITHIN GROUP (ORDER BY st.duration_ms), "
                f"MAX(st.duration_ms) {base} GROUP BY smp.workflow_id, st.stage_id",
                params,
            )
            for wf, stage_id, n, p50, p95, p99, top in cursor.fetchall():
                out.append(
                    StageStats(wf, stage_id, int(n), float(p50), float(p95), float(p99), top)
                )
        else:
            cursor.execute(f"SELECT smp.workflow_id, st.stage_id, st.duration_ms {base}", params)
            groups: dict[tuple[str, str], list[int]] = defaultdict(list)
            for wf, stage_id, ms in cursor.fetchall():
                groups[(wf, stage_id)].append(int(ms))
            for (wf, stage_id), values in groups.items():
                values.sort()
                out.append(
                    StageStats(
                        wf,
                        stage_id,
                        len(values),
                        percentile(values, 0.5),
                        percentile(values, 0.95),
                        percentile(values, 0.99),
                        float(values[-1]),
                    )
                )
    for row in out:
        row.max = float(row.max)
    out.sort(key=lambda s: (s.workflow_id, s.stage_id))
    return out, sampled, exact


def _failed_groups(workflow: str | None, lo: datetime, hi: datetime) -> list[tuple[str, str, int]]:
    """``(workflow_id, failed stage or "", runs)`` of the FAILED runs finished in ``[lo, hi)``
    (the partial index ``wf_run_failed_completed_idx``), at most :data:`MAX_FAILED_GROUPS`."""
    qs = WorkflowRun.objects.filter(status=Status.FAILED, completed_at__gte=lo, completed_at__lt=hi)
    if workflow:
        qs = qs.filter(workflow_id=workflow)
    rows = (
        qs.annotate(failed_stage=KeyTextTransform("stage_id", "error"))
        .values("workflow_id", "failed_stage")
        .annotate(n=Count("id"))
        .order_by("-n", "workflow_id", F("failed_stage").asc(nulls_first=True))[:MAX_FAILED_GROUPS]
    )
    return [(r["workflow_id"], r["failed_stage"] or "", int(r["n"])) for r in rows]


def failing_stages(
    window: Window,
    workflow: str | None,
    finished_per_workflow: dict[str, int],
    *,
    cached: bool = False,
) -> list[FailingStage]:
    """FAILED runs of the window per workflow and failed stage, most first (ties by workflow,
    stage), at most :data:`TOP_STAGES`; the closed buckets cached when ``cached``."""
    open_start = window.starts[-1]
    counts: dict[tuple[str, str], int] = defaultdict(int)
    closed = _closed(
        _key(window, workflow, "failing"),
        lambda: _failed_groups(workflow, window.start, open_start),
        cached,
    )
    for wf, stage_id, n in closed + _failed_groups(workflow, open_start, window.end):
        counts[(wf, stage_id)] += n
    ordered = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0][0], kv[0][1]))
    out = []
    for (wf, stage_id), n in ordered[:TOP_STAGES]:
        total = finished_per_workflow.get(wf, 0)
        out.append(FailingStage(wf, stage_id, n, n / total if total else 0.0))
    return out


def run_list_url(**params: str) -> str:
    """The admin run list filtered by ``params`` (its filter parameters; ``:`` and ``/`` are
    left as they are, so a ``finished`` range reads as one)."""
    base = reverse("admin:django_workflows_workflowrun_changelist")
    return f"{base}?{urlencode(params, safe=':/')}" if params else base


def build_dashboard(
    window_key: str, workflow: str | None, now: datetime | None = None, *, cached: bool = False
) -> Any:
    """The data of the page for ``window_key`` (a key of :data:`WINDOWS`) and ``workflow``
    (``None``: all workflows); ``now`` defaults to the current time. Eight statements at most:
    throughput and failures (closed buckets, bucket in progress), the queues (two), the
    duration sample. ``cached`` (the admin page): the closed buckets' counts and the duration
    percentiles come from the default cache when computed less than
    :data:`CLOSED_CACHE_SECONDS` ago (the bucket in progress and the queues are always read);
    ``False`` (default): everything is read now."""
    now = now or timezone.now()
    window = make_window(window_key, now)
    series, total = throughput(window, workflow, cached=cached)
    queues, pending, capped = queue_depth(now)
    finished = [sum(total.counts[s][i] for s in FINISHED) for i in range(window.buckets)]
    stats, sampled, exact = _closed(
        _key(window, workflow, "durations"),
        lambda: stage_durations(window, workflow, finished),
        cached,
    )
    per_workflow = {s.workflow_id: s.total for s in series}
    failing = failing_stages(window, workflow, per_workflow, cached=cached)
    most = max((f.failed for f in failing), default=0)
    span = window.finished_range()
    for item in failing:
        item.svg = format_html(
            '<svg class="dw-range" role="img" viewBox="0 0 160 14" width="160" height="14">'
            "<title>{} / {}: {} failed runs, {} of its runs</title>"
            '<rect x="0" y="3" width="{}" height="8" fill="#dc3545"/></svg>',
            item.workflow_id,
            item.stage_id or "(no stage)",
            item.failed,
            item.share_text,
            round(max(160 * item.failed / most, 1), 1),
        )
        params = {"workflow_id": item.workflow_id, "status": Status.FAILED, "finished": span}
        if item.stage_id:
            params["failed_stage"] = item.stage_id
        item.url = run_list_url(**params)
    for row in stats:
        row.url = run_list_url(workflow_id=row.workflow_id, finished=span)
    slowest = sorted(stats, key=lambda s: (-s.p95, -s.max, s.workflow_id, s.stage_id))
    if stats:
        low = min(s.p50 for s in stats) / 2
        high = max(s.max for s in stats)
        for row in stats:
            row.svg = duration_svg(row, low, high)
    return DashboardData(
        window=window,
        workflow=workflow,
        series=series,
        total=total,
        queues=queues,
        pending_runs=pending,
        pending_capped=capped,
        stages=stats[:MAX_PERCENTILE_ROWS],
        slowest=slowest[:TOP_STAGES],
        failing=failing,
        sampled_runs=sampled,
        sample_exact=exact,
    )


# --- drawing ----------------------------------------------------------------------------------

#: Bar colours per status (the badges' colours).
BAR_COLOURS = {s: STATUS_COLOURS[s][0] for s in FINISHED}


def _bucket_label(window: Window, start: datetime) -> str:
    local = timezone.localtime(start)
    if window.step >= 86400:
        return local.strftime("%m-%d")
    if window.step >= 3600 * 6:
        return local.strftime("%m-%d %H:%M")
    return local.strftime("%H:%M")


def _nice_max(value: int) -> int:
    if value <= 5:
        return 5
    magnitude = 10 ** int(math.log10(value))
    for m in (1, 2, 2.5, 5, 10):
        if value <= m * magnitude:
            return int(m * magnitude)
    return value


def throughput_svg(
    series: Series, window: Window, *, chart_id: str, width: int = 480, height: int = 150
) -> Any:
    """A stacked bar chart of ``series`` (COMPLETED at the bottom, then FAILED, CANCELLED): an
    ``<svg role="img">`` with a ``<title>`` naming the chart and one ``<title>`` per bar
    segment (``"14:00 to 15:00: 120 COMPLETED"``). ``width`` x ``height`` is the ``viewBox``:
    the chart scales to its box, text with it."""
    left, bottom, top = 34, 18, 8
    plot_w, plot_h = width - left - 6, height - bottom - top
    sums = [sum(series.counts[s][i] for s in FINISHED) for i in range(window.buckets)]
    y_max = _nice_max(max(sums, default=0))
    slot = plot_w / max(window.buckets, 1)
    bar_w = max(slot * 0.8, 1.0)
    title = f"Runs finished per bucket, {series.workflow_id}, {window.label}: {series.total} runs"
    parts: list[SafeString] = [
        format_html(
            '<svg class="dw-chart" id="{}" role="img" aria-labelledby="{}-title" '
            'viewBox="0 0 {} {}" width="100%"><title id="{}-title">{}</title>',
            chart_id,
            chart_id,
            width,
            height,
            chart_id,
            title,
        )
    ]
    for frac in (0, 0.5, 1):
        y = top + plot_h * (1 - frac)
        parts.append(
            format_html(
                '<line x1="{}" x2="{}" y1="{}" y2="{}" class="dw-grid"/>'
                '<text x="{}" y="{}" class="dw-axis" text-anchor="end">{}</text>',
                left,
                width - 6,
                f"{y:.1f}",
                f"{y:.1f}",
                left - 4,
                f"{y + 3:.1f}",
                int(y_max * frac),
            )
        )
    every = max(1, math.ceil(window.buckets / (width // 80)))
    labels = window.labels()
    for i in range(window.buckets):
        x = left + i * slot + (slot - bar_w) / 2
        y = top + plot_h
        label_from, label_to = labels[i], labels[i + 1]
        for status in FINISHED:
            n = series.counts[status][i]
            if not n:
                continue
            h = plot_h * n / y_max
            y -= h
            # numbers, the fixed colours and statuses, escaped labels: no format_html per bar
            # (a 30-day page draws ~400 bars; escaping each argument was most of its drawing)
            parts.append(
                mark_safe(
                    f'<rect x="{x:.1f}" y="{y:.1f}" width="{bar_w:.1f}" height="{max(h, 0.5):.1f}"'
                    f' fill="{BAR_COLOURS[status]}" class="dw-bar dw-bar-{status.lower()}">'
                    f"<title>{label_from} to {label_to}: {int(n)} {status}</title></rect>"
                )
            )
        centre = left + i * slot + slot / 2
        room = len(label_from) * 3.2  # half the label's width at the axis font size
        if i % every == 0 and centre + room <= width:  # a label that would be cut is left out
            parts.append(
                format_html(
                    '<text x="{}" y="{}" class="dw-axis" text-anchor="middle">{}</text>',
                    f"{centre:.1f}",
                    height - 5,
                    label_from,
                )
            )
    parts.append(mark_safe("</svg>"))
    return mark_safe("".join(parts))


def queue_svg(queues: list[QueueRow], *, chart_id: str = "dw-queue-chart") -> Any:
    """Horizontal stacked bars, one per queue (ready, delayed, running, suspended), each
    segment with its ``<title>``."""
    kinds = (
        ("ready", "#0d6efd"),
        ("running", "#198754"),
        ("delayed", "#b7791f"),
        ("suspended", "#adb5bd"),
    )
    row_h, left, width = 24, 140, 960
    height = row_h * max(len(queues), 1) + 8
    top = max((sum(getattr(q, k) for k, _ in kinds) for q in queues), default=0)
    x_max = _nice_max(top)
    plot_w = width - left - 60
    parts = [
        format_html(
            '<svg class="dw-chart" id="{}" role="img" aria-labelledby="{}-title" '
            'viewBox="0 0 {} {}" width="100%"><title id="{}-title">{}</title>',
            chart_id,
            chart_id,
            width,
            height,
            chart_id,
            "Jobs per queue now: ready, running, delayed, suspended",
        )
    ]
    for r, q in enumerate(queues):
        y = 4 + r * row_h
        parts.append(
            format_html(
                '<text x="{}" y="{}" class="dw-axis dw-queue-label" text-anchor="end">{}</text>',
                left - 6,
                y + 15,
                q.queue,
            )
        )
        x = float(left)
        for kind, colour in kinds:
            n = getattr(q, kind)
            if not n:
                continue
            w = plot_w * n / x_max
            parts.append(
                format_html(
                    '<rect x="{}" y="{}" width="{}" height="{}" fill="{}" class="dw-bar">'
                    "<title>{}: {} {}</title></rect>",
                    f"{x:.1f}",
                    y + 2,
                    f"{max(w, 1):.1f}",
                    row_h - 6,
                    colour,
                    q.queue,
                    n,
                    kind,
                )
            )
            x += w
        total = sum(getattr(q, k) for k, _ in kinds)
        parts.append(
            format_html(
                '<text x="{}" y="{}" class="dw-axis">{}</text>', f"{x + 4:.1f}", y + 15, total
            )
        )
    parts.append(mark_safe("</svg>"))
    return mark_safe("".join(parts))


def duration_svg(stat: StageStats, low: float, high: float) -> Any:
    """One row's durations on a log scale from ``low`` to ``high`` ms (shared by the table):
    a bar from 0 to p50, a lighter one from p50 to p95, a thin one to p99, a tick at max."""
    width, height = 240, 14
    lo, hi = math.log10(max(low, 1.0)), math.log10(max(high, low * 10, 10.0))

    def x(ms: float) -> float:
        value = (math.log10(max(ms, 1.0)) - lo) / (hi - lo)
        return round(min(max(value, 0.0), 1.0) * (width - 2) + 1, 1)

    text = (
        f"{stat.workflow_id} / {stat.stage_id}: p50 {stat.p50_text}, p95 {stat.p95_text}, "
        f"p99 {stat.p99_text}, max {stat.max_text} ({stat.count} records)"
    )
    return format_html(
        '<svg class="dw-range" role="img" viewBox="0 0 {} {}" width="{}" height="{}">'
        "<title>{}</title>"
        '<rect x="1" y="3" width="{}" height="8" fill="#0d6efd"/>'
        '<rect x="{}" y="3" width="{}" height="8" fill="#6ea8fe"/>'
        '<rect x="{}" y="6" width="{}" height="2" fill="#9ec5fe"/>'
        '<rect x="{}" y="1" width="1.5" height="12" fill="#6c757d"/></svg>',
        width,
        height,
        width,
        height,
        text,
        max(x(stat.p50) - 1, 1),
        x(stat.p50),
        max(x(stat.p95) - x(stat.p50), 0.5),
        x(stat.p95),
        max(x(stat.p99) - x(stat.p95), 0.5),
        min(x(stat.max), width - 1.5),
    )


def legend(items: list[tuple[str, str]]) -> Any:
    """Colour keys: ``[(label, colour)]``."""
    return format_html_join(
        " ",
        '<span class="dw-key"><span class="dw-key-swatch" style="background:{}"></span> {}</span>',
        ((colour, label) for label, colour in items),
    )


# --- the admin page ---------------------------------------------------------------------------


def parse_params(request: HttpRequest) -> tuple[str, str | None, list[str]]:
    """``(window, workflow, errors)`` from ``?window=`` / ``?workflow=``: an unknown window falls
    back to :data:`DEFAULT_WINDOW`, an unusable workflow id to all workflows, each with a
    message saying why."""
    errors = []
    window = request.GET.get("window", DEFAULT_WINDOW) or DEFAULT_WINDOW
    if window not in WINDOWS:
        errors.append(
            f"Unknown window {window[:40]!r}: choose one of {', '.join(WINDOWS)}. "
            f"Showing the {WINDOWS[DEFAULT_WINDOW][2]}."
        )
        window = DEFAULT_WINDOW
    workflow = (request.GET.get("workflow") or "").strip() or None
    if workflow is not None:
        if len(workflow) > MAX_WORKFLOW_ID or not workflow.isprintable():
            errors.append(
                f"The workflow id is not valid (at most {MAX_WORKFLOW_ID} printable "
                "characters). Showing all workflows."
            )
            workflow = None
        elif (
            workflow not in registry
            # in the order of wf_run_workflow_created_idx: an index probe, never a table scan
            and not WorkflowRun.objects.filter(workflow_id=workflow)
            .order_by("workflow_id", "created_at", "id")
            .values("pk")[:1]
        ):
            errors.append(
                f"Unknown workflow {workflow!r}: it is not registered and has no runs. "
                "Showing all workflows."
            )
            workflow = None
    return window, workflow, errors


@admin.register(Dashboard)
class DashboardAdmin(admin.ModelAdmin):
    """The dashboard as the changelist of the :class:`~django_workflows.models.Dashboard`
    proxy: an entry in the app list, view permission of runs required, nothing to add, change
    or delete."""

    def has_view_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        user = request.user
        return bool(
            user.is_active
            and user.is_staff
            and (
                user.has_perm("django_workflows.view_workflowrun")
                or user.has_perm("django_workflows.change_workflowrun")
            )
        )

    def has_module_permission(self, request: HttpRequest) -> bool:
        return self.has_view_permission(request)

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def get_urls(self) -> list[Any]:
        from django.shortcuts import redirect
        from django.urls import path

        prefix = f"{self.opts.app_label}_{self.opts.model_name}"

        def to_run(view: str) -> Any:
            # The proxy's objects are runs: its change / history URLs show the run's pages.
            def redirect_view(request: HttpRequest, object_id: str) -> HttpResponse:
                return redirect(f"admin:django_workflows_workflowrun_{view}", object_id)

            return self.admin_site.admin_view(redirect_view)

        return [
            path("", self.admin_site.admin_view(self.changelist_view), name=f"{prefix}_changelist"),
            path("<path:object_id>/history/", to_run("history"), name=f"{prefix}_history"),
            path("<path:object_id>/change/", to_run("change"), name=f"{prefix}_change"),
        ]

    def changelist_view(self, request: HttpRequest, extra_context: Any = None) -> HttpResponse:
        """The dashboard page (GET; see the module docstring)."""
        from django.core.exceptions import PermissionDenied

        if not self.has_view_permission(request):
            raise PermissionDenied
        window_key, workflow, errors = parse_params(request)
        data = build_dashboard(window_key, workflow, cached=True)
        data.errors = errors
        charts = [
            (
                data.total,
                throughput_svg(
                    data.total, data.window, chart_id="dw-chart-total", width=960, height=200
                ),
            )
        ]
        if not workflow:
            for i, s in enumerate(data.series[:MAX_WORKFLOW_CHARTS]):
                charts.append((s, throughput_svg(s, data.window, chart_id=f"dw-chart-wf-{i}")))
        rows = []
        only = {"workflow_id": workflow} if workflow else {}
        labels = data.window.labels()
        for i in range(data.window.buckets):
            counts = [data.total.counts[s][i] for s in FINISHED]
            if sum(counts):
                url = run_list_url(finished=data.window.finished_range(i), **only)
                rows.append((labels[i], counts, sum(counts), url))
        windows = []
        for key, (_length, _step, label) in WINDOWS.items():
            query = {"window": key, **({"workflow": workflow} if workflow else {})}
            windows.append((key, label, "?" + urlencode(query), key == window_key))
        workflows = sorted({wf.id for wf in registry} | {s.workflow_id for s in data.series})
        context = {
            **self.admin_site.each_context(request),
            "opts": self.opts,
            "title": "Dashboard",
            "subtitle": None,
            "dw": data,
            "dw_charts": charts,
            "dw_bucket_rows": rows,
            "dw_statuses": FINISHED,
            "dw_windows": windows,
            "dw_workflows": workflows[:500],
            "dw_status_legend": legend([(s, BAR_COLOURS[s]) for s in FINISHED]),
            "dw_queue_svg": queue_svg(data.queues) if data.queues else None,
            "dw_queue_legend": legend(
                [
                    ("ready", "#0d6efd"),
                    ("running", "#198754"),
                    ("delayed", "#b7791f"),
                    ("suspended", "#adb5bd"),
                ]
            ),
            "dw_runs_url": run_list_url(
                finished=data.window.finished_range(),
                **({"workflow_id": workflow} if workflow else {}),
            ),
            **(extra_context or {}),
        }
        return TemplateResponse(request, "admin/django_workflows/dashboard.html", context)


__all__ = [
    "DEFAULT_WINDOW",
    "SAMPLE_RUNS",
    "WINDOWS",
    "DashboardAdmin",
    "DashboardData",
    "FailingStage",
    "QueueRow",
    "Series",
    "StageStats",
    "Window",
    "build_dashboard",
    "failing_stages",
    "make_window",
    "percentile",
    "queue_depth",
    "stage_durations",
    "throughput",
]
