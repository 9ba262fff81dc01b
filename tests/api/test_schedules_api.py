"""The schedules routes of the HTTP API (issue 12): list, retrieve, pause, resume, trigger,
backfill; their permissions and errors; the OpenAPI schema documents them."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from django_workflows import define_schedule
from django_workflows.definition.registry import registry
from django_workflows.models import WorkflowAnnotation, WorkflowRun, WorkflowSchedule

from .conftest import API, make_user, token_client

pytestmark = pytest.mark.django_db

SCHEDULE_PERMS = (
    "view_workflowschedule",
    "pause_workflowschedule",
    "trigger_workflowschedule",
    "backfill_workflowschedule",
)
ROUTES = [
    ("get", "schedules/", None, "view_workflowschedule"),
    ("get", "schedules/api-hourly/", None, "view_workflowschedule"),
    ("post", "schedules/api-hourly/pause/", {}, "pause_workflowschedule"),
    ("post", "schedules/api-hourly/resume/", {}, "pause_workflowschedule"),
    ("post", "schedules/api-hourly/trigger/", {}, "trigger_workflowschedule"),
    (
        "post",
        "schedules/api-hourly/backfill/",
        {"start": "2025-01-01T00:00:00Z", "end": "2025-01-01T01:00:00Z"},
        "backfill_workflowschedule",
    ),
]


@pytest.fixture(autouse=True)
def schedule(workflows: list[Any]) -> Iterator[None]:
    registry.register_schedule(
        define_schedule("api-hourly", "api-two-stage", cron="0 * * * *", input={"value": 1})
    )
    yield
    registry.unregister_schedule("api-hourly")


@pytest.fixture
def sched_api() -> Any:
    return token_client(make_user("op", *SCHEDULE_PERMS))


def call(client: Any, method: str, path: str, body: Any) -> Any:
    if method == "get":
        return client.get(API + path)
    return client.post(API + path, body, format="json")


def test_list_and_detail(sched_api: Any) -> None:
    response = sched_api.get(f"{API}schedules/")
    assert response.status_code == 200
    (doc,) = response.json()
    assert doc["name"] == "api-hourly" and doc["spec"] == "cron 0 * * * * (UTC)"
    assert doc["next_fire_at"].endswith(":00:00Z") and doc["paused"] is False
    assert doc["url"].endswith("/schedules/api-hourly/")
    detail = sched_api.get(f"{API}schedules/api-hourly/").json()
    assert len(detail["upcoming"]) == 5
    missing = sched_api.get(f"{API}schedules/ghost/")
    assert missing.status_code == 404 and missing.json()["code"] == "not_found"


def test_pause_resume_trigger_backfill(sched_api: Any) -> None:
    sched_api.get(f"{API}schedules/")  # sync
    paused = sched_api.post(f"{API}schedules/api-hourly/pause/", {"reason": "x"}, format="json")
    assert paused.json() == {**paused.json(), "paused": True, "changed": True}
    assert WorkflowSchedule.objects.get().pause_reason == "x"
    again = sched_api.post(f"{API}schedules/api-hourly/pause/", {}, format="json").json()
    assert again["changed"] is False
    resumed = sched_api.post(f"{API}schedules/api-hourly/resume/", {}, format="json").json()
    assert resumed["paused"] is False and resumed["changed"] is True
    trigger = sched_api.post(f"{API}schedules/api-hourly/trigger/", {}, format="json")
    assert trigger.status_code == 201
    run_id = trigger.json()["workflow_run_id"]
    reason = WorkflowAnnotation.objects.get(run_id=run_id, key="trigger.reason").value
    assert reason == "triggered now by api:op"
    body = {"start": "2025-01-01T00:00:00Z", "end": "2025-01-01T02:00:00+00:00"}
    backfill = sched_api.post(f"{API}schedules/api-hourly/backfill/", body, format="json")
    assert backfill.status_code == 200
    assert len(backfill.json()["run_ids"]) == 3 and backfill.json()["existing"] == 0
    replay = sched_api.post(f"{API}schedules/api-hourly/backfill/", body, format="json").json()
    assert replay["run_ids"] == [] and replay["existing"] == 3
    assert WorkflowRun.objects.count() == 4
    detail = sched_api.get(f"{API}schedules/api-hourly/").json()
    assert detail["last_run_id"] == run_id and detail["last_run"].endswith(f"/runs/{run_id}/")


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"start": "2025-01-01T00:00:00", "end": "2025-01-01T01:00:00Z"}, "start"),
        ({"start": "2025-01-01T00:00:00Z", "end": "soon"}, "end"),
        ({"start": "2025-01-02T00:00:00Z", "end": "2025-01-01T00:00:00Z"}, "end"),
        ({"start": "2020-01-01T00:00:00Z", "end": "2025-01-01T00:00:00Z"}, "end"),
        ({"start": "2025-01-01T00:00:00Z"}, "end"),
        ({"start": "2025-01-01T00:00:00Z", "end": "2025-01-01T00:00:00Z", "x": 1}, "x"),
    ],
)
def test_backfill_errors_name_the_field(sched_api: Any, body: dict, field: str) -> None:
    sched_api.get(f"{API}schedules/")
    response = sched_api.post(f"{API}schedules/api-hourly/backfill/", body, format="json")
    assert response.status_code == 400, response.json()
    assert field in response.json()["errors"]
    assert WorkflowRun.objects.count() == 0


def test_a_kernel_field_error_is_not_prefixed_twice(sched_api: Any) -> None:
    sched_api.get(f"{API}schedules/")
    body = {"start": "2025-01-02T00:00:00Z", "end": "2025-01-01T00:00:00Z"}
    response = sched_api.post(f"{API}schedules/api-hourly/backfill/", body, format="json")
    assert response.status_code == 400
    doc = response.json()
    assert doc["errors"]["end"] == [
        "2025-01-01T00:00:00+00:00 is before start 2025-01-02T00:00:00+00:00"
    ], doc
    assert "end: end:" not in response.content.decode()


@pytest.mark.parametrize(
    ("action", "body", "verb"),
    [
        ("resume", {}, "resumed"),
        ("trigger", {}, "triggered"),
        (
            "backfill",
            {"start": "2025-01-01T00:00:00Z", "end": "2025-01-01T01:00:00Z"},
            "backfilled",
        ),
    ],
)
def test_operating_an_orphaned_schedule_is_409(
    sched_api: Any, action: str, body: Any, verb: str
) -> None:
    sched_api.get(f"{API}schedules/")
    registry.unregister_schedule("api-hourly")
    sched_api.get(f"{API}schedules/")  # sync orphans it
    response = sched_api.post(f"{API}schedules/api-hourly/{action}/", body, format="json")
    assert response.status_code == 409 and response.json()["code"] == "schedule_orphaned"
    assert (
        f"is orphaned (its definition is gone from code); it cannot be {verb}"
        in (response.json()["message"])
    )
    assert WorkflowRun.objects.count() == 0


@pytest.mark.parametrize(("method", "path", "body", "perm"), ROUTES)
def test_each_route_needs_its_permission(method: str, path: str, body: Any, perm: str) -> None:
    token_client(make_user("syncer", *SCHEDULE_PERMS)).get(f"{API}schedules/")
    assert call(token_client(None), method, path, body).status_code == 401
    others = [p for p in SCHEDULE_PERMS if p != perm]
    denied = call(token_client(make_user("other", *others)), method, path, body)
    assert denied.status_code == 403 and perm in denied.json()["message"]
    allowed = call(token_client(make_user("exact", perm)), method, path, body)
    assert allowed.status_code in (200, 201)


def test_schema_documents_the_schedule_routes(client: Any) -> None:
    paths = client.get(f"{API}schema/").json()["paths"]
    for route in ("schedules/", "schedules/{name}/", "schedules/{name}/backfill/"):
        assert f"{API}{route}" in paths
    assert "409" in paths[f"{API}schedules/{{name}}/trigger/"]["post"]["responses"]
