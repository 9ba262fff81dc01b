"""``manage.py workflows_schedule list|next|pause|resume|trigger|backfill`` (issue 12)."""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from typing import Any

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError

from django_workflows import define_schedule, registry
from django_workflows.models import WorkflowAnnotation, WorkflowRun, WorkflowSchedule
from tests.workflows import two_stage

pytestmark = pytest.mark.django_db(transaction=True)


def run(*args: Any) -> str:
    out = io.StringIO()
    call_command("workflows_schedule", *args, stdout=out, stderr=io.StringIO())
    return out.getvalue()


@pytest.fixture(autouse=True)
def _registered() -> Iterator[None]:
    workflow = two_stage("cmd-nightly")
    registry.register(workflow)
    registry.register_schedule(
        define_schedule(
            "cmd-hourly", workflow, cron="0 * * * *", tz="Europe/Berlin", input={"value": 1}
        )
    )
    yield
    registry.unregister_schedule("cmd-hourly")
    registry.unregister("cmd-nightly")


def test_list_syncs_and_shows_the_schedule() -> None:
    text = run("list")
    assert "cmd-hourly  cmd-nightly  cron 0 * * * * (Europe/Berlin)  active" in text
    (doc,) = json.loads(run("list", "--json"))
    assert doc["name"] == "cmd-hourly" and doc["paused"] is False
    assert doc["next_fire_at"].endswith(":00:00+00:00")
    # never fired: null, not "-"
    assert doc["last_fired_at"] is None and doc["last_scheduled_at"] is None
    assert doc["last_run_id"] is None


def test_next_lists_up_to_the_cap() -> None:
    assert len(run("next", "cmd-hourly", "--count", "1000").splitlines()) == 1000


def test_next_pause_resume_trigger_backfill() -> None:
    lines = run("next", "cmd-hourly", "--count", "3").splitlines()
    assert len(lines) == 3 and all("Europe/Berlin" in line for line in lines)
    assert run("pause", "cmd-hourly", "--reason", "deploy").strip() == "paused cmd-hourly"
    assert run("pause", "cmd-hourly").strip() == "already paused"
    assert WorkflowSchedule.objects.get().pause_reason == "deploy"
    assert "paused" in run("list")
    assert run("resume", "cmd-hourly").startswith("resumed cmd-hourly; next fire at ")
    out = run("trigger", "cmd-hourly")
    assert out.startswith("started run ")
    run_id = out.split()[-1]
    assert WorkflowAnnotation.objects.get(run_id=run_id, key="trigger.source").value == "schedule"
    text = run(
        "backfill",
        "cmd-hourly",
        "--start",
        "2025-01-01T00:00:00+00:00",
        "--end",
        "2025-01-01T02:00:00Z",
    )
    assert text.strip() == "3 scheduled times: started 3 runs, 0 existed"
    assert WorkflowRun.objects.count() == 4


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("pause", "ghost"), "Schedule 'ghost' not found"),
        (("next", "cmd-hourly", "--count", "0"), "--count: must be > 0"),
        (("next", "cmd-hourly", "--count", "100000"), "--count: at most 1000"),
        (
            ("backfill", "cmd-hourly", "--start", "yesterday", "--end", "2025-01-01T00:00Z"),
            "--start: 'yesterday' is not an ISO-8601 date-time",
        ),
        (
            ("backfill", "cmd-hourly", "--start", "2025-01-01T00:00", "--end", "2025-01-01T00:00Z"),
            "--start: '2025-01-01T00:00' has no UTC offset",
        ),
        (
            (
                "backfill",
                "cmd-hourly",
                "--start",
                "2025-01-02T00:00Z",
                "--end",
                "2025-01-01T00:00Z",
            ),
            "end: 2025-01-01T00:00:00+00:00 is before start",
        ),
        (
            (
                "backfill",
                "cmd-hourly",
                "--start",
                "9999-12-31T23:59Z",
                "--end",
                "9999-12-31T23:59:59Z",
            ),
            "start: 9999-12-31T23:59:00+00:00 is outside the years 1900-9000",
        ),
        (
            (
                "backfill",
                "cmd-hourly",
                "--start",
                "0001-01-01T00:00Z",
                "--end",
                "2025-01-01T00:00Z",
            ),
            "start: 0001-01-01T00:00:00+00:00 is outside the years 1900-9000",
        ),
        (
            (
                "backfill",
                "cmd-hourly",
                "--start",
                "2025-01-01T00:00Z",
                "--end",
                "9001-01-01T00:00Z",
            ),
            "end: 9001-01-01T00:00:00+00:00 is outside the years 1900-9000",
        ),
    ],
)
def test_bad_arguments_name_the_field(args: tuple[str, ...], message: str) -> None:
    with pytest.raises(CommandError) as info:
        run(*args)
    assert message in str(info.value)
    assert WorkflowRun.objects.count() == 0


def test_operating_an_orphaned_schedule_says_it_is_orphaned() -> None:
    run("list")
    registry.unregister_schedule("cmd-hourly")
    for args, verb in [
        (("trigger", "cmd-hourly"), "triggered"),
        (("resume", "cmd-hourly"), "resumed"),
        (
            (
                "backfill",
                "cmd-hourly",
                "--start",
                "2025-01-01T00:00Z",
                "--end",
                "2025-01-01T01:00Z",
            ),
            "backfilled",
        ),
    ]:
        with pytest.raises(CommandError) as info:
            run(*args)
        assert str(info.value) == (
            "Schedule 'cmd-hourly' is orphaned (its definition is gone from code); it "
            f"cannot be {verb} until a deploy defines it again (pausing it is still "
            "possible: workflows_schedule pause cmd-hourly)"
        )
    assert WorkflowRun.objects.count() == 0
