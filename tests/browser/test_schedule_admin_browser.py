"""The schedules admin in a real browser (issue 12): the list with next fire times and the
last run link, the schedule page and a pause through its confirmation page. A screenshot of the
list goes to ``$DW_SCREENSHOT_DIR`` (default: the test's temporary directory) as
``schedules.png``. Skipped without the ``playwright`` package or a ``chromium`` binary.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from django.urls import reverse

from django_workflows import define_schedule
from django_workflows.definition.registry import registry
from django_workflows.kernel.schedules import fire_due_schedules
from django_workflows.models import WorkflowSchedule
from django_workflows.schedules import pause_schedule
from django_workflows.testing import FakeClock, make_kernel
from tests.workflows import two_stage

pytestmark = pytest.mark.django_db(transaction=True)  # Chromium and page: conftest.py


@pytest.fixture
def world(django_user_model: Any) -> Iterator[None]:
    os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"] = "true"
    workflow = two_stage("report-eu")
    schedules = [
        define_schedule(
            "nightly-report",
            workflow,
            cron="30 2 * * *",
            tz="Europe/Berlin",
            input={"value": 1},
            description="EU report at 02:30 Berlin time",
        ),
        define_schedule(
            "every-15-min", workflow, every=900, input={"value": 2}, jitter=60, overlap="buffer_one"
        ),
        define_schedule(
            "weekly-digest",
            workflow,
            cron="0 8 * * mon",
            tz="America/New_York",
            input={"value": 3},
            catchup="skip",
        ),
    ]
    registry.register(workflow)
    for schedule in schedules:
        registry.register_schedule(schedule)
    now = datetime.now(UTC).replace(microsecond=0)
    kernel = make_kernel(workflow, clock=FakeClock(now - timedelta(minutes=20)))
    for schedule in schedules:
        kernel.registry.register_schedule(schedule)
    fire_due_schedules(kernel)
    kernel.clock.set(now)
    fire_due_schedules(kernel)  # every-15-min fired at least once: a last run to link
    pause_schedule("weekly-digest", "holiday season", kernel=kernel)
    django_user_model.objects.create_superuser("admin", "admin@example.com", "s3cret-pw")
    yield
    for schedule in schedules:
        registry.unregister_schedule(schedule.name)
    registry.unregister("report-eu")
    os.environ.pop("DJANGO_ALLOW_ASYNC_UNSAFE", None)


def test_schedules_list_and_pause_in_chromium(
    live_server: Any, log_in: Any, world: None, page: Any, tmp_path: Path
) -> None:
    shots = Path(os.environ.get("DW_SCREENSHOT_DIR") or tmp_path)
    shots.mkdir(parents=True, exist_ok=True)
    base = live_server.url
    page.set_viewport_size({"width": 1440, "height": 700})
    log_in()
    page.goto(base + reverse("admin:django_workflows_workflowschedule_changelist"))
    table = page.locator("#result_list")
    assert table.locator("tbody tr").count() == 3
    text = table.inner_text()
    assert "cron 30 2 * * *" in text and "Europe/Berlin" in text and "paused" in text
    assert table.locator("tbody tr a[href*='/workflowrun/']").count() >= 1  # last run link
    page.evaluate("() => document.querySelector('#nav-sidebar')?.remove()")
    page.screenshot(path=str(shots / "schedules.png"))
    page.click("text=nightly-report")
    page.click("a.dw-pause-link")
    page.fill("textarea[name=reason]", "migrating the warehouse")
    page.click("input[type=submit][value='Yes, pause']")
    assert "Paused schedule nightly-report" in page.locator("ul.messagelist").inner_text()
    row = WorkflowSchedule.objects.get(name="nightly-report")
    assert row.paused and row.pause_reason == "migrating the warehouse"
