"""The schedules admin (issue 12): the list with next fire times and the last run, the schedule
page with its next times, and pause / resume / trigger now / backfill as confirmation pages
with a History record, messages and their own permissions."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from django.contrib.admin.models import LogEntry
from django.contrib.auth.models import Permission
from django.contrib.messages import get_messages
from django.test import Client
from django.urls import reverse

from django_workflows import define_schedule
from django_workflows.definition.registry import registry
from django_workflows.kernel.runtime import get_kernel
from django_workflows.kernel.schedules import sync_schedules
from django_workflows.models import WorkflowAnnotation, WorkflowRun, WorkflowSchedule
from tests.workflows import two_stage

pytestmark = pytest.mark.django_db(transaction=True)

NAME = "admin:hourly"  # a name that needs quoting in admin URLs


@pytest.fixture(autouse=True)
def _schedule() -> Iterator[None]:
    workflow = two_stage("admin-nightly")
    registry.register(workflow)
    registry.register_schedule(
        define_schedule(NAME, workflow, cron="0 * * * *", tz="Europe/Berlin", input={"value": 1})
    )
    sync_schedules(get_kernel())  # as a worker does when it starts (the admin only reads)
    yield
    registry.unregister_schedule(NAME)
    registry.unregister("admin-nightly")


def staff(django_user_model: Any, name: str, *codenames: str) -> Client:
    user = django_user_model.objects.create_user(name, password="pw", is_staff=True)
    perms = Permission.objects.filter(
        content_type__app_label="django_workflows", codename__in=codenames
    )
    user.user_permissions.add(*perms)
    client = Client()
    client.force_login(user)
    return client


def url(name: str, *args: Any) -> str:
    from django.contrib.admin.utils import quote

    return reverse(f"admin:django_workflows_workflowschedule_{name}", args=[quote(a) for a in args])


def texts(response: Any) -> list[str]:
    return [str(m) for m in get_messages(response.wsgi_request)]


ALL = (
    "view_workflowschedule",
    "pause_workflowschedule",
    "trigger_workflowschedule",
    "backfill_workflowschedule",
    "view_workflowrun",
)


def test_list_shows_next_fire_and_last_run(django_user_model: Any) -> None:
    client = staff(django_user_model, "ops", *ALL)
    page = client.get(url("changelist"))
    assert page.status_code == 200
    html = page.content.decode()
    assert NAME in html and "<code>0 * * * *</code></span><br>Europe/Berlin" in html
    assert "active" in html
    detail = client.get(url("change", NAME)).content.decode()
    assert "next scheduled times" in detail.lower() and detail.count("<li>") >= 5
    for label in ("Pause", "Trigger now", "Backfill"):
        assert f">{label}</a>" in detail


def test_pause_resume_trigger_backfill_with_history(django_user_model: Any) -> None:
    client = staff(django_user_model, "ops", *ALL)
    client.get(url("changelist"))
    confirm = client.get(url("pause", NAME))
    assert confirm.status_code == 200 and b"Pause this schedule?" in confirm.content
    done = client.post(url("pause", NAME), {"confirm": "yes", "reason": "deploy"})
    assert done.status_code == 302
    assert texts(done)[-1] == f"Paused schedule {NAME}: it fires no more until resumed."
    row = WorkflowSchedule.objects.get()
    assert row.paused and row.pause_reason == "deploy"
    assert ">Resume</a>" in client.get(url("change", NAME)).content.decode()
    client.post(url("resume", NAME), {"confirm": "yes"})
    assert not WorkflowSchedule.objects.get().paused
    started = client.post(url("trigger", NAME), {"confirm": "yes"})
    assert texts(started)[-1].startswith("Started run ")
    run = WorkflowRun.objects.get()
    assert WorkflowAnnotation.objects.get(run=run, key="trigger.reason").value == (
        "triggered now by ops"
    )
    bad = client.post(url("backfill", NAME), {"confirm": "yes", "start": "x", "end": "y"})
    assert bad.status_code == 200 and b"is not an ISO-8601 date-time" in bad.content
    reversed_range = client.post(
        url("backfill", NAME),
        {"confirm": "yes", "start": "2025-01-02T00:00Z", "end": "2025-01-01T00:00Z"},
    )
    assert reversed_range.status_code == 200 and b"is before start" in reversed_range.content
    filled = client.post(
        url("backfill", NAME),
        {"confirm": "yes", "start": "2025-01-01T00:00Z", "end": "2025-01-01T01:00Z"},
    )
    assert texts(filled)[-1] == "2 scheduled time(s): started 2 run(s), 0 had a run already."
    assert WorkflowRun.objects.count() == 3
    history = list(
        LogEntry.objects.filter(object_id=NAME)
        .order_by("id")
        .values_list("change_message", flat=True)
    )
    assert history[0] == "Paused the schedule. Reason: deploy"
    assert history[1] == "Resumed the schedule."
    assert history[2].startswith("Triggered the schedule now: run ")
    assert history[3].startswith("Backfilled 2025-01-01T00:00:00+00:00 to ")


@pytest.mark.parametrize(
    ("op", "perm"),
    [
        ("pause", "pause_workflowschedule"),
        ("resume", "pause_workflowschedule"),
        ("trigger", "trigger_workflowschedule"),
        ("backfill", "backfill_workflowschedule"),
    ],
)
def test_each_operation_needs_its_permission(django_user_model: Any, op: str, perm: str) -> None:
    viewer = staff(django_user_model, "viewer", *(p for p in ALL if p != perm))
    viewer.get(url("changelist"))
    assert viewer.get(url(op, NAME)).status_code == 403
    assert viewer.post(url(op, NAME), {"confirm": "yes"}).status_code == 403
    link = {"pause": "Pause", "resume": "Pause", "trigger": "Trigger now", "backfill": "Backfill"}
    assert f">{link[op]}</a>" not in viewer.get(url("change", NAME)).content.decode()
    allowed = staff(django_user_model, "allowed", "view_workflowschedule", perm)
    assert allowed.get(url(op, NAME)).status_code == 200
    assert WorkflowRun.objects.count() == 0


@pytest.mark.parametrize(
    ("start", "end", "message"),
    [
        ("9999-12-31T23:59Z", "9999-12-31T23:59:59Z", "is outside the years 1900-9000"),
        ("0001-01-01T00:00Z", "2025-01-01T00:00Z", "is outside the years 1900-9000"),
        ("2025-01-02T00:00Z", "2025-01-01T00:00Z", "is before start"),
    ],
)
def test_backfill_out_of_range_is_a_form_error(
    django_user_model: Any, start: str, end: str, message: str
) -> None:
    client = staff(django_user_model, "ops", *ALL)
    page = client.post(url("backfill", NAME), {"confirm": "yes", "start": start, "end": end})
    assert page.status_code == 200
    assert message in page.content.decode()
    assert WorkflowRun.objects.count() == 0


def test_triggering_an_orphaned_schedule_says_it_is_orphaned(django_user_model: Any) -> None:
    client = staff(django_user_model, "ops", *ALL)
    registry.unregister_schedule(NAME)
    sync_schedules(get_kernel())  # the next tick orphans it
    page = client.post(url("trigger", NAME), {"confirm": "yes"})
    assert any("is orphaned (its definition is gone from code)" in t for t in texts(page))
    assert WorkflowRun.objects.count() == 0


def test_showing_the_schedule_pages_syncs_nothing(django_user_model: Any) -> None:
    """A definition without a row is not written by a GET of the list (no admin GET writes):
    rows come from the workers and ``workflows_schedule``."""
    registry.register_schedule(
        define_schedule("admin:fresh", "admin-nightly", every=60, input={"value": 1})
    )
    try:
        client = staff(django_user_model, "ops", *ALL)
        assert client.get(url("changelist")).status_code == 200
        assert not WorkflowSchedule.objects.filter(pk="admin:fresh").exists()
    finally:
        registry.unregister_schedule("admin:fresh")
