"""The admin dashboard (issue 20 item 5) on a known set of rows: buckets per workflow and status,
queue depth, duration percentiles (PostgreSQL ``percentile_cont`` and the Python interpolation
agree), the slowest and most failing stages and their links, the sample bound, bad parameters
and an empty database. Runs on SQLite and PostgreSQL.
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta
from typing import Any
from urllib.parse import urlencode

import pytest
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.urls import reverse
from django.utils import timezone

from django_workflows.admin import dashboard
from django_workflows.admin.dashboard import build_dashboard, make_window, percentile
from django_workflows.models import Status, WorkflowJob, WorkflowRun, WorkflowStage

pytestmark = pytest.mark.django_db

URL = "admin:django_workflows_dashboard_changelist"


@pytest.fixture(autouse=True)
def _fresh_cache() -> None:
    """The page caches closed buckets: each test starts without them."""
    from django.core.cache import cache

    cache.clear()


def run_row(
    workflow_id: str,
    status: str,
    completed_at: datetime | None,
    *,
    failed_stage: str | None = None,
    stages: dict[str, int] | None = None,
) -> WorkflowRun:
    """A run finished at ``completed_at`` with COMPLETED stages of the given durations (ms)."""
    created = (completed_at or timezone.now()) - timedelta(minutes=1)
    run = WorkflowRun.objects.create(
        created_at=created,
        updated_at=completed_at or created,
        workflow_id=workflow_id,
        workflow_name=workflow_id,
        workflow_type="test",
        status=status,
        started_at=created,
        completed_at=completed_at,
        error=(
            {"stage_id": failed_stage, "message": "boom", "error_type": "ValueError"}
            if status == Status.FAILED
            else None
        ),
    )
    for number, (stage_id, ms) in enumerate((stages or {}).items(), start=1):
        WorkflowStage.objects.create(
            created_at=created,
            updated_at=created,
            run=run,
            stage_id=stage_id,
            stage_name=stage_id,
            stage_number=number,
            execution_group=number,
            status=Status.COMPLETED,
            started_at=created,
            completed_at=created + timedelta(milliseconds=ms),
            duration_ms=ms,
        )
    if status == Status.FAILED and failed_stage:
        WorkflowStage.objects.create(
            created_at=created,
            updated_at=created,
            run=run,
            stage_id=failed_stage,
            stage_name=failed_stage,
            stage_number=99,
            execution_group=99,
            status=Status.FAILED,
            started_at=created,
            completed_at=created,
            duration_ms=5,  # not a COMPLETED record: never in the percentiles
        )
    return run


def job_row(queue: str, status: str, *, next_poll_at: datetime | None = None, age_s: int = 0):
    now = timezone.now()
    return WorkflowJob.objects.create(
        created_at=now - timedelta(seconds=age_s),
        updated_at=now,
        workflow_run_id=uuid.uuid4(),
        workflow_id="dash-a",
        stage_id="charge",
        status=status,
        queue=queue,
        next_poll_at=next_poll_at,
    )


@pytest.fixture
def known(db: Any) -> dict[str, Any]:
    """dash-a: 5 COMPLETED (charge 100..500 ms, ship 1000..5000 ms), 1 FAILED at charge, 1
    CANCELLED; dash-b: 3 FAILED (2 at fetch, 1 at parse), 1 COMPLETED (fetch 50 ms); 1 dash-a
    run finished 3 days ago; 1 RUNNING run (not finished); open jobs on two queues."""
    now = timezone.now()
    recent = now - timedelta(minutes=10)
    earlier = now - timedelta(hours=5)
    for i, ms in enumerate((100, 200, 300, 400, 500)):
        at = recent if i < 3 else earlier
        run_row("dash-a", Status.COMPLETED, at, stages={"charge": ms, "ship": 1000 * (i + 1)})
    run_row("dash-a", Status.FAILED, recent, failed_stage="charge")
    run_row("dash-a", Status.CANCELLED, earlier)
    run_row("dash-b", Status.FAILED, recent, failed_stage="fetch")
    run_row("dash-b", Status.FAILED, earlier, failed_stage="fetch")
    run_row("dash-b", Status.FAILED, earlier, failed_stage="parse")
    run_row("dash-b", Status.COMPLETED, recent, stages={"fetch": 50})
    run_row("dash-a", Status.COMPLETED, now - timedelta(days=3), stages={"charge": 9000})
    run_row("dash-a", Status.RUNNING, None)
    job_row("default", Status.PENDING, age_s=120)  # ready for 2 minutes
    job_row("default", Status.PENDING, next_poll_at=now - timedelta(seconds=30), age_s=600)
    job_row("default", Status.PENDING, next_poll_at=now + timedelta(hours=1))  # back-off
    job_row("default", Status.RUNNING)
    job_row("batch", Status.RUNNING)
    job_row("batch", Status.SUSPENDED)
    job_row("batch", Status.COMPLETED)  # not open: not counted
    return {"now": now, "recent": recent, "earlier": earlier}


def _bucket(window: Any, at: datetime) -> int:
    return int((at - window.start).total_seconds() // window.step)


def test_windows_are_aligned_to_their_buckets() -> None:
    now = datetime(2026, 12, 3, 10, 17, 5, tzinfo=UTC)
    w = make_window("24h", now)
    assert w.end == datetime(2026, 12, 3, 11, 0, tzinfo=UTC)
    assert w.start == w.end - timedelta(days=1) and w.buckets == 24 and w.step == 3600
    assert [make_window(k, now).buckets for k in ("1h", "7d", "30d")] == [12, 28, 30]
    assert make_window("30d", now).end == datetime(2026, 12, 4, tzinfo=UTC)


def test_percentile_interpolates_like_percentile_cont() -> None:
    values = [100, 200, 300, 400, 500]
    assert percentile(values, 0.5) == 300
    assert percentile(values, 0.95) == pytest.approx(480)
    assert percentile(values, 0.99) == pytest.approx(496)
    assert percentile([7], 0.99) == 7


def test_numbers_match_the_known_runs(known: dict[str, Any]) -> None:
    data = build_dashboard("24h", None, now=known["now"])
    w = data.window
    by = {s.workflow_id: s for s in data.series}
    assert [s.workflow_id for s in data.series] == ["dash-a", "dash-b"]  # most runs first
    a, b = by["dash-a"], by["dash-b"]
    r, e = _bucket(w, known["recent"]), _bucket(w, known["earlier"])
    assert r != e
    assert a.counts[Status.COMPLETED][r] == 3 and a.counts[Status.COMPLETED][e] == 2
    assert a.counts[Status.FAILED][r] == 1 and a.counts[Status.CANCELLED][e] == 1
    assert a.total == 7  # the run of 3 days ago and the RUNNING one are not in the window
    assert b.status_totals == [1, 3, 0] and b.failed == 3
    assert data.total.total == 11 and data.total.counts[Status.FAILED][e] == 2
    # nothing outside the two buckets
    assert sum(data.total.counts[s][i] for s in dashboard.FINISHED for i in (r, e)) == 11

    stats = {(s.workflow_id, s.stage_id): s for s in data.stages}
    assert set(stats) == {("dash-a", "charge"), ("dash-a", "ship"), ("dash-b", "fetch")}
    charge = stats[("dash-a", "charge")]
    assert (charge.count, charge.p50, charge.max) == (5, 300, 500)
    assert charge.p95 == pytest.approx(480) and charge.p99 == pytest.approx(496)
    ship = stats[("dash-a", "ship")]
    assert ship.p50 == 3000 and ship.p95 == pytest.approx(4800)
    assert data.sample_exact and data.sampled_runs == 11

    assert [(s.workflow_id, s.stage_id) for s in data.slowest] == [
        ("dash-a", "ship"),
        ("dash-a", "charge"),
        ("dash-b", "fetch"),
    ]
    assert [(f.workflow_id, f.stage_id, f.failed) for f in data.failing] == [
        ("dash-b", "fetch", 2),
        ("dash-a", "charge", 1),
        ("dash-b", "parse", 1),
    ]
    assert data.failing[0].share == pytest.approx(2 / 4)
    assert data.failing[1].share == pytest.approx(1 / 7)

    queues = {q.queue: q for q in data.queues}
    d, bq = queues["default"], queues["batch"]
    assert (d.ready, d.delayed, d.running, d.suspended) == (2, 1, 1, 0)
    assert 110 <= d.oldest_ready_s <= 300  # ready since its creation 2 minutes ago
    assert (bq.ready, bq.running, bq.suspended, bq.oldest_ready_s) == (0, 1, 1, None)
    assert data.pending_runs == 0


def test_the_wider_window_and_the_workflow_filter(known: dict[str, Any]) -> None:
    week = build_dashboard("7d", None, now=known["now"])
    assert week.total.total == 12  # the run of 3 days ago too
    charge = next(s for s in week.stages if s.stage_id == "charge")
    assert charge.count == 6 and charge.max == 9000
    only_b = build_dashboard("24h", "dash-b", now=known["now"])
    assert [s.workflow_id for s in only_b.series] == ["dash-b"]
    assert [f.stage_id for f in only_b.failing] == ["fetch", "parse"]
    assert {s.workflow_id for s in only_b.stages} == {"dash-b"}
    hour = build_dashboard("1h", None, now=known["now"])
    assert hour.total.total == 6  # the runs of 10 minutes ago


def test_the_sample_bounds_the_percentiles(known: dict[str, Any], monkeypatch: Any) -> None:
    monkeypatch.setattr(dashboard, "SAMPLE_RUNS", 4)  # 11 runs in two buckets (6 and 5)
    data = build_dashboard("24h", None, now=known["now"])
    assert not data.sample_exact and data.sampled_runs == 4  # 2 + 2 of 6 + 5
    assert sum(s.count for s in data.stages) <= 4 * 2  # two stages per sampled run at most
    assert data.total.total == 11  # the throughput is still exact


def test_sample_sizes_follow_the_runs_of_each_bucket() -> None:
    assert dashboard.sample_sizes([3, 0, 2], 10) == [3, 0, 2]  # everything: exact
    assert dashboard.sample_sizes([900, 0, 100], 10) == [9, 0, 1]
    sizes = dashboard.sample_sizes([5, 5, 5], 4)  # largest remainders, the earliest first
    assert sizes == [2, 1, 1] and sum(sizes) == 4
    sizes = dashboard.sample_sizes([1000] + [1] * 29, 1000)
    assert sum(sizes) == 1000 and sizes[0] >= 970  # a quiet bucket is not worth 1/30th


def test_sampled_percentiles_weigh_each_bucket_by_its_runs(monkeypatch: Any) -> None:
    """A busy hour of fast stages and a quiet hour of slow ones: the sample takes runs in
    proportion, so the median is the busy hour's. (Sampling each bucket equally - the old
    behaviour - gave the quiet hour half the weight: a median of 5.5 s.)"""
    now = datetime(2026, 12, 3, 10, 30, tzinfo=UTC)
    busy, quiet = now - timedelta(hours=3), now - timedelta(hours=6)
    for i in range(18):
        run_row("dash-w", Status.COMPLETED, busy - timedelta(seconds=i), stages={"s": 1000})
    for i in range(2):
        run_row("dash-w", Status.COMPLETED, quiet - timedelta(seconds=i), stages={"s": 10_000})
    monkeypatch.setattr(dashboard, "SAMPLE_RUNS", 10)
    data = build_dashboard("24h", None, now=now)
    (stat,) = data.stages
    assert stat.p50 == 1000  # equal weights: one run of each bucket, a median of 5.5 s
    assert not data.sample_exact and data.sampled_runs == 10  # 9 of the busy hour, 1 quiet
    assert stat.count == 10 and stat.max == 10_000
    assert stat.p95 == pytest.approx(5950)  # 9 x 1 s and 1 x 10 s: 1000 + 0.55 * 9000


def test_the_page_shows_the_numbers(admin_client: Client, known: dict[str, Any]) -> None:
    with CaptureQueriesContext(connection) as queries:
        response = admin_client.get(reverse(URL))
    assert response.status_code == 200
    html = response.content.decode()
    assert html.count('<svg class="dw-chart"') == 4  # all workflows, dash-a, dash-b, queues
    assert "<title" in html and "11 runs finished, 4 failed." in html
    assert 'id="dw-chart-total"' in html and "COMPLETED</title>" in html
    assert 'class="dw-window dw-current" data-window="24h"' in html
    data = response.context["dw"]
    failing = data.failing
    span = "finished=" + data.window.finished_range()
    assert failing[0].url.endswith(f"?workflow_id=dash-b&status=FAILED&{span}&failed_stage=fetch")
    assert failing[0].url in html.replace("&amp;", "&")
    # the session and user, then five reads of the dashboard and the workflow list's none
    reads = [q["sql"] for q in queries.captured_queries if "django_session" not in q["sql"]]
    assert len(reads) <= 8, reads
    assert not any(
        q["sql"].lstrip().upper().startswith(("INSERT", "UPDATE", "DELETE"))
        for q in queries.captured_queries
        if "django_session" not in q["sql"]
    )


def test_the_links_lead_to_the_filtered_run_list(
    admin_client: Client, known: dict[str, Any]
) -> None:
    data = build_dashboard("24h", None, now=known["now"])
    response = admin_client.get(data.failing[0].url)
    assert response.status_code == 200
    runs = list(response.context["cl"].result_list)
    assert len(runs) == 2 and {r.workflow_id for r in runs} == {"dash-b"}
    assert all(r.error["stage_id"] == "fetch" for r in runs)
    listed = admin_client.get(
        reverse("admin:django_workflows_workflowrun_changelist") + "?finished=1h"
    )
    assert listed.context["cl"].result_count == 6
    changelist = admin_client.get(reverse("admin:django_workflows_workflowrun_changelist"))
    assert reverse(URL) in changelist.content.decode()
    index = admin_client.get(reverse("admin:index")).content.decode()
    assert reverse(URL) in index  # an entry in the app list


def test_the_links_cover_the_buckets_they_count(admin_client: Client) -> None:
    """The run list behind a link holds exactly the runs the row counts: the window's buckets
    (aligned to the hour, so the first starts less than 24 hours ago) - not the runs of the
    last 24 hours from now, which takes in runs finished before the first bucket."""
    now = timezone.now()
    window = make_window("24h", now)
    before = window.start - timedelta(milliseconds=1)  # not in the window, in the last 24 h
    assert before > now - timedelta(hours=24)
    run_row("dash-l", Status.FAILED, window.start + timedelta(seconds=1), failed_stage="charge")
    run_row("dash-l", Status.FAILED, now - timedelta(minutes=1), failed_stage="charge")
    run_row("dash-l", Status.FAILED, before, failed_stage="charge")
    response = admin_client.get(reverse(URL))
    data = response.context["dw"]
    assert data.window.start == window.start
    (failing,) = data.failing
    assert failing.failed == 2
    start, end = (b.strftime("%Y-%m-%dT%H:%M:%SZ") for b in (window.start, window.end))
    assert f"finished={start}/{end}" in failing.url
    listed = admin_client.get(failing.url).context["cl"]
    assert listed.result_count == 2  # "the last 24 hours" listed 3
    runs = admin_client.get(response.context["dw_runs_url"]).context["cl"]
    assert runs.result_count == 2
    # each bucket of the table links to its own runs
    html = response.content.decode().replace("&amp;", "&")
    bucket = window.finished_range(0)
    assert f"finished={bucket}" in html
    one = admin_client.get(
        reverse("admin:django_workflows_workflowrun_changelist")
        + "?"
        + urlencode({"finished": bucket})
    )
    assert one.context["cl"].result_count == 1
    assert f"{timezone.localtime(window.start):%Y-%m-%d %H:%M} to" in one.content.decode()


@pytest.mark.parametrize(
    "value", ["2026-12-03T11:00:00Z", "2026-12-03T11:00:00Z/2026-12-02T11:00:00Z", "x/y"]
)
def test_a_bad_finished_range_is_an_error(admin_client: Client, value: str) -> None:
    response = admin_client.get(
        reverse("admin:django_workflows_workflowrun_changelist")
        + "?"
        + urlencode({"finished": value})
    )
    assert response.status_code == 302 and response["Location"].endswith("?e=1")


def test_the_page_reuses_closed_buckets_and_counts_the_open_one(
    admin_client: Client, known: dict[str, Any]
) -> None:
    assert admin_client.get(reverse(URL)).context["dw"].total.total == 11
    run_row("dash-a", Status.COMPLETED, known["now"] - timedelta(hours=3))  # a closed bucket
    run_row("dash-a", Status.FAILED, known["now"], failed_stage="ship")  # the open bucket
    again = admin_client.get(reverse(URL)).context["dw"]
    assert again.total.total == 12  # the open bucket is read live, the closed ones cached
    assert ("dash-a", "ship", 1) in [(f.workflow_id, f.stage_id, f.failed) for f in again.failing]
    live = build_dashboard("24h", None)  # in code: nothing cached
    assert live.total.total == 13


@pytest.mark.parametrize(
    ("query", "message"),
    [
        ("?window=foo", "Unknown window &#x27;foo&#x27;: choose one of 1h, 24h, 7d, 30d."),
        ("?workflow=nope", "Unknown workflow &#x27;nope&#x27;: it is not registered"),
        ("?workflow=" + "x" * 300, "The workflow id is not valid"),
        ("?window=7d&workflow=%00", "The workflow id is not valid"),
    ],
)
def test_bad_parameters_say_why(
    admin_client: Client, known: dict[str, Any], query: str, message: str
) -> None:
    response = admin_client.get(reverse(URL) + query)
    assert response.status_code == 200
    html = response.content.decode()
    assert message in html and 'class="errornote dw-param-error"' in html
    assert response.context["dw"].total.total == 11 if "7d" not in query else 12


def test_an_empty_database(admin_client: Client) -> None:
    response = admin_client.get(reverse(URL) + "?window=30d")
    assert response.status_code == 200
    html = response.content.decode()
    assert "0 runs finished, 0 failed." in html
    assert "No open jobs." in html and "No run failed in this window." in html
    assert "No completed stage in this window." in html
    assert 'id="dw-chart-total"' in html  # an empty chart, not an error


def test_view_permission_of_runs_is_needed(django_user_model: Any) -> None:
    from django.contrib.auth.models import Permission

    user = django_user_model.objects.create_user("viewer", password="pw", is_staff=True)
    client = Client()
    client.force_login(user)
    assert client.get(reverse(URL)).status_code == 403
    user.user_permissions.add(Permission.objects.get(codename="view_workflowrun"))
    client.force_login(django_user_model.objects.get(pk=user.pk))
    assert client.get(reverse(URL)).status_code == 200
