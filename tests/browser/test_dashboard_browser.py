"""The admin dashboard (issue 20 item 5) in a real browser: Playwright drives Debian's Chromium
(``executable_path=shutil.which("chromium")``) against a live server with a week of runs of
three workflows (bulk rows with stage records and open jobs).

Logs in, opens the dashboard from the app list, checks the charts render (inline SVG with
``<title>``s, bars of every status, the queue chart, the tables), switches the window and the
workflow, shows a bad parameter's message, and follows a "most failing stages" link to the
filtered run list. Screenshots ``dashboard_*.png`` go to ``$DW_SCREENSHOT_DIR`` (default: the
test's temporary directory); ``DW_SCREENSHOT_DIR=docs/screenshots`` regenerates the docs'.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from django.urls import reverse
from django.utils import timezone

from django_workflows.models import Status, WorkflowJob, WorkflowRun, WorkflowStage

pytestmark = pytest.mark.django_db(transaction=True)  # Chromium and page: conftest.py

#: (workflow, [(stage, typical ms)], runs per hour at the peak, failure rate).
LAYOUT = [
    ("invoice-sync", [("fetch", 800), ("transform", 2500), ("post", 1200)], 14, 0.04),
    ("doc-pipeline", [("ocr", 9000), ("language", 400), ("publish", 300)], 8, 0.10),
    ("nightly-report", [("query", 40000), ("render", 6000)], 2, 0.02),
]


def _seed() -> None:
    """A week of finished runs (more by day than by night), their stage records, a failing
    stage per FAILED run, and open jobs on two queues."""
    now = timezone.now()
    runs, stages, n = [], [], 0
    for hours_ago in range(24 * 7):
        hour = now - timedelta(hours=hours_ago)
        daytime = 8 <= timezone.localtime(hour).hour <= 19
        for wf, layout, peak, failure_rate in LAYOUT:
            count = peak if daytime else max(1, peak // 4)
            for k in range(count + (hours_ago * 7 + k_offset(wf)) % 3):
                n += 1
                done = hour - timedelta(minutes=(k * 53 + hours_ago * 11) % 60)
                roll = (n * 37) % 100
                status = (
                    Status.FAILED
                    if roll < failure_rate * 100
                    else Status.CANCELLED
                    if roll == 99
                    else Status.COMPLETED
                )
                failed_at = layout[n % len(layout)][0] if status == Status.FAILED else None
                run = WorkflowRun(
                    id=uuid.uuid4(),
                    created_at=done - timedelta(minutes=2),
                    updated_at=done,
                    workflow_id=wf,
                    workflow_name=wf,
                    workflow_type="demo",
                    status=status,
                    started_at=done - timedelta(minutes=2),
                    completed_at=done,
                    error={"stage_id": failed_at, "message": "upstream 503"} if failed_at else None,
                )
                runs.append(run)
                for number, (stage_id, ms) in enumerate(layout, start=1):
                    failed = stage_id == failed_at
                    spread = ms * (0.5 + ((n * 7919 + number * 104729) % 1000) / 700)
                    stages.append(
                        WorkflowStage(
                            created_at=run.created_at,
                            updated_at=done,
                            run=run,
                            stage_id=stage_id,
                            stage_name=stage_id,
                            stage_number=number,
                            execution_group=number,
                            status=Status.FAILED if failed else Status.COMPLETED,
                            started_at=run.created_at,
                            completed_at=done,
                            duration_ms=int(spread),
                        )
                    )
                    if failed:
                        break
    WorkflowRun.objects.bulk_create(runs, batch_size=500)
    WorkflowStage.objects.bulk_create(stages, batch_size=500)
    jobs = []
    for i in range(40):
        queue = "batch" if i % 3 == 0 else "default"
        status = Status.RUNNING if i % 4 == 0 else Status.PENDING
        jobs.append(
            WorkflowJob(
                created_at=now - timedelta(seconds=30 + i * 9),
                updated_at=now,
                workflow_run_id=uuid.uuid4(),
                workflow_id="invoice-sync",
                stage_id="fetch",
                status=status,
                queue=queue,
                next_poll_at=now + timedelta(minutes=5) if i % 7 == 1 else None,
            )
        )
    WorkflowJob.objects.bulk_create(jobs)


def k_offset(wf: str) -> int:
    return sum(map(ord, wf)) % 3


@pytest.fixture
def world(django_user_model: Any) -> Iterator[None]:
    from django.core.cache import cache

    os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"] = "true"  # Playwright's event loop in this thread
    cache.clear()  # the dashboard caches closed buckets
    _seed()
    django_user_model.objects.create_superuser("admin", "admin@example.com", "s3cret-pw")
    yield
    os.environ.pop("DJANGO_ALLOW_ASYNC_UNSAFE", None)


def test_dashboard_in_chromium(
    live_server: Any, log_in: Any, world: None, page: Any, tmp_path: Path
) -> None:
    base = live_server.url
    shots = Path(os.environ.get("DW_SCREENSHOT_DIR") or tmp_path)
    shots.mkdir(parents=True, exist_ok=True)
    log_in()

    # from the app list to the dashboard (default window: 24 hours)
    page.click("a[href$='/admin/django_workflows/dashboard/']")
    assert page.locator(".dw-window.dw-current").inner_text() == "24h"
    total = page.locator("svg#dw-chart-total")
    assert total.is_visible()
    assert "Runs finished per bucket, all workflows" in (
        total.locator("title").first.text_content() or ""
    )
    assert total.locator("rect.dw-bar-completed").count() >= 20
    assert total.locator("rect.dw-bar-failed").count() >= 1
    assert page.locator("#dw-per-workflow svg.dw-chart").count() == 3
    bar_title = total.locator("rect.dw-bar-completed title").first.text_content() or ""
    assert " to " in bar_title and bar_title.endswith("COMPLETED")
    assert page.locator("svg#dw-queue-chart rect.dw-bar").count() >= 4
    queues = page.locator("#dw-queue-table").inner_text()
    assert "batch" in queues and "default" in queues
    assert (
        page.locator("#dw-slowest-table tbody tr")
        .first.inner_text()
        .startswith("nightly-report\tquery")
    )
    assert page.locator("#dw-failing-table tbody tr").count() >= 3
    assert page.locator("#dw-percentile-table tbody tr").count() == 8
    box = total.bounding_box()
    assert box and box["width"] > 600 and box["height"] >= 150
    page.screenshot(path=str(shots / "dashboard_24h.png"), full_page=True)
    page.locator("#dw-throughput").screenshot(path=str(shots / "dashboard_throughput.png"))

    # a week, then one workflow
    page.click(".dw-window[data-window='7d']")
    page.wait_for_url("**window=7d**")
    assert page.locator(".dw-window.dw-current").inner_text() == "7d"
    assert page.locator("svg#dw-chart-total rect.dw-bar-completed").count() == 28
    page.screenshot(path=str(shots / "dashboard_7d.png"), full_page=True)
    page.select_option("#dw-workflow", "doc-pipeline")
    page.click("#dw-controls input[type=submit]")
    page.wait_for_url("**workflow=doc-pipeline**")
    assert page.locator(".dw-window.dw-current").inner_text() == "7d"
    assert page.locator("#dw-per-workflow").count() == 0
    assert set(page.locator("#dw-percentile-table tbody td:first-child").all_inner_texts()) == {
        "doc-pipeline"
    }
    page.locator("#dw-slowest").screenshot(path=str(shots / "dashboard_stages.png"))

    # a bad parameter: a message, not an error page
    page.goto(base + reverse("admin:django_workflows_dashboard_changelist") + "?window=foo")
    assert "Unknown window 'foo'" in page.locator(".dw-param-error").inner_text()
    assert page.locator(".dw-window.dw-current").inner_text() == "24h"

    # a most-failing stage's link: the failed runs of that stage in the window
    row = page.locator("#dw-failing-table tbody tr").first
    workflow, stage, failed = row.locator("td").all_inner_texts()[:3]
    row.locator("a.dw-runs-link").click()
    page.wait_for_url("**failed_stage=**")
    listed = page.locator("#result_list tbody tr")
    assert listed.count() == min(int(failed), 50)
    assert all(
        workflow == t for t in page.locator("#result_list td.field-workflow_id").all_inner_texts()
    )
    assert f"stage {stage}: upstream 503" in page.locator("#result_list").inner_text()
    assert page.locator("#changelist-filter").inner_text().count(stage) >= 1
