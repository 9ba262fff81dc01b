"""Every route of the HTTP API with its status codes (both databases)."""

from __future__ import annotations

import time
import uuid
from typing import Any

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from django_workflows.models import OutboxEvent, WorkflowAnnotation, WorkflowRun, WorkflowStage

from .conftest import API, drive, row_counts

# The kernel's worker path manages its own connections: real transactions, as in the admin tests.
pytestmark = pytest.mark.django_db(transaction=True)


def create(api: Any, workflow_id: str = "api-two-stage", **body: Any) -> Any:
    payload = {"workflow_id": workflow_id, "input": {"value": 1}, **body}
    return api.post(f"{API}runs/", payload, format="json")


def completed_run(api: Any) -> str:
    run_id = create(api).json()["id"]
    assert drive(run_id).status == "COMPLETED"
    return run_id


def waiting_approval(api: Any, workflow_id: str = "api-approval") -> str:
    run_id = create(api, workflow_id).json()["id"]
    drive(run_id)
    stage = WorkflowStage.objects.get(run_id=run_id, stage_id="review")
    assert stage.status == "SUSPENDED"
    return run_id


# --- definitions ----------------------------------------------------------------------------------


def test_definitions_list_and_detail(api: Any) -> None:
    response = api.get(f"{API}definitions/")
    assert response.status_code == 200
    by_id = {d["workflow_id"]: d for d in response.json()}
    two = by_id["api-two-stage"]
    assert two["name"] == "API demo"
    assert two["input_schema"]["properties"]["value"]["type"] == "integer"
    groups = two["execution_groups"]
    assert [g["execution_group"] for g in groups] == [1, 2]
    assert groups[0]["stages"][0]["stage_id"] == "first"
    assert groups[0]["stages"][0]["mode"] == "sync"
    review = by_id["api-approval"]["execution_groups"][1]["stages"][0]
    assert review["mode"] == "async-batch"
    assert "poll_interval_seconds" in review["config_schema"]["properties"]

    detail = api.get(f"{API}definitions/api-two-stage/")
    assert detail.status_code == 200 and detail.json() == two
    missing = api.get(f"{API}definitions/nope/")
    assert missing.status_code == 404 and missing.json()["code"] == "not_found"


# --- create ---------------------------------------------------------------------------------------


def test_create_run_201_with_location(api: Any) -> None:
    response = create(
        api,
        config={"first": {}},
        priority=7,
        annotations=[{"attributes": {"trigger.source": "api"}, "actor": {"kind": "svc"}}],
    )
    assert response.status_code == 201, response.json()
    body = response.json()
    assert response["Location"] == body["url"]
    assert body["url"].endswith(f"{API}runs/{body['id']}/")
    assert body["status"] == "PENDING" and body["priority"] == 7
    assert body["waiting"][0]["reason"] == "claim"
    run = WorkflowRun.objects.get(pk=body["id"])
    assert run.input == {"value": 1}
    assert WorkflowAnnotation.objects.get(run=run).key == "trigger.source"


def test_create_idempotency_replay_and_reuse(api: Any) -> None:
    headers = {"HTTP_IDEMPOTENCY_KEY": "order-42"}
    first = api.post(
        f"{API}runs/",
        {"workflow_id": "api-two-stage", "input": {"value": 1}},
        format="json",
        **headers,
    )
    assert first.status_code == 201
    counts = row_counts()
    again = api.post(
        f"{API}runs/",
        {"workflow_id": "api-two-stage", "input": {"value": 1}},
        format="json",
        **headers,
    )
    assert again.status_code == 200 and again.json()["id"] == first.json()["id"]
    other = api.post(
        f"{API}runs/",
        {"workflow_id": "api-two-stage", "input": {"value": 2}},
        format="json",
        **headers,
    )
    assert other.status_code == 409
    assert other.json()["code"] == "idempotency_key_reused"
    assert "order-42" in other.json()["message"]
    assert row_counts() == counts


def test_create_idempotency_in_progress_409(api: Any) -> None:
    from django_workflows.kernel import idempotency
    from django_workflows.kernel.runtime import get_kernel

    idempotency.acquire("busy", "run.create", now=get_kernel().now(), stale_after_seconds=600)
    response = api.post(
        f"{API}runs/",
        {"workflow_id": "api-two-stage", "input": {"value": 1}},
        format="json",
        HTTP_IDEMPOTENCY_KEY="busy",
    )
    assert response.status_code == 409 and response.json()["code"] == "idempotency_in_progress"


@pytest.mark.parametrize(
    ("body", "code", "field"),
    [
        ({"workflow_id": "nope", "input": {}}, "unknown_workflow", "workflow_id"),
        ({"workflow_id": "api-two-stage", "input": {"value": "x"}}, "invalid_input", "input.value"),
        ({"workflow_id": "api-two-stage", "input": {}}, "invalid_input", "input.value"),
        (
            {
                "workflow_id": "api-approval",
                "input": {"value": 1},
                "config": {"review": {"poll_interval_seconds": -1}},
            },
            "invalid_config",
            "config.review.poll_interval_seconds",
        ),
        (
            {"workflow_id": "api-two-stage", "input": {"value": 1}, "config": {"zzz": {}}},
            "invalid_config",
            "config",
        ),
        (
            {"workflow_id": "api-two-stage", "input": {"value": 1}, "priority": "high"},
            "invalid",
            "priority",
        ),
        ({"workflow_id": 5, "input": {}}, "invalid", "workflow_id"),
        ({"input": {}}, "invalid", "workflow_id"),
        ({"workflow_id": "api-two-stage", "input": [1]}, "invalid", "input"),
        (
            {
                "workflow_id": "api-two-stage",
                "input": {"value": 1},
                "annotations": [{"attributes": {"nodots": 1}}],
            },
            "invalid",
            "annotations[0]",
        ),
    ],
)
def test_create_400s(api: Any, body: dict, code: str, field: str) -> None:
    counts = row_counts()
    response = api.post(f"{API}runs/", body, format="json")
    assert response.status_code == 400, response.json()
    data = response.json()
    assert data["code"] == code
    assert any(k.startswith(field) for k in data["errors"]), data
    assert row_counts() == counts


def test_bad_idempotency_key_header(api: Any) -> None:
    response = api.post(
        f"{API}runs/",
        {"workflow_id": "api-two-stage", "input": {"value": 1}},
        format="json",
        HTTP_IDEMPOTENCY_KEY="x" * 300,
    )
    assert response.status_code == 400 and "Idempotency-Key" in response.json()["errors"]


# --- list -----------------------------------------------------------------------------------------


def test_list_newest_first_cursor_pages_and_filters(api: Any) -> None:
    ids = [create(api, priority=i).json()["id"] for i in range(5)]
    failed = create(api, "api-fails").json()["id"]
    drive(failed)
    page = api.get(f"{API}runs/", {"page_size": 2})
    assert page.status_code == 200
    body = page.json()
    assert [r["id"] for r in body["results"]] == [failed, ids[4]]
    assert body["previous"] is None
    seen = [r["id"] for r in body["results"]]
    while body["next"]:
        body = api.get(body["next"]).json()
        seen += [r["id"] for r in body["results"]]
    assert seen == [failed, *reversed(ids)]
    back = api.get(body["previous"]).json() if body["previous"] else None
    assert back is not None and [r["id"] for r in back["results"]] == [ids[3], ids[2]]

    assert [r["id"] for r in api.get(f"{API}runs/", {"status": "FAILED"}).json()["results"]] == [
        failed
    ]
    both = api.get(f"{API}runs/?status=FAILED&status=COMPLETED").json()["results"]
    assert len(both) == 6
    assert api.get(f"{API}runs/", {"workflow_id": "api-fails"}).json()["results"][0]["id"] == failed
    assert api.get(f"{API}runs/", {"status": "NOPE"}).status_code == 400
    assert api.get(f"{API}runs/", {"cursor": "garbage"}).json()["code"] == "invalid"
    assert api.get(f"{API}runs/", {"page_size": 0}).status_code == 400
    assert api.get(f"{API}runs/", {"value": "1"}).status_code == 400

    run = WorkflowRun.objects.get(pk=ids[0])
    after = api.get(f"{API}runs/", {"created_after": run.created_at.isoformat()}).json()
    assert ids[0] in [r["id"] for r in after["results"]]
    before = api.get(f"{API}runs/", {"created_before": run.created_at.isoformat()}).json()
    assert ids[0] not in [r["id"] for r in before["results"]]


def test_list_annotation_filter(api: Any) -> None:
    tagged = create(api, annotations=[{"attributes": {"acme.team": "blue", "acme.n": 5}}])
    create(api, annotations=[{"attributes": {"acme.team": "red"}}])
    tagged_id = tagged.json()["id"]

    def ids(**params: Any) -> list[str]:
        return [r["id"] for r in api.get(f"{API}runs/", params).json()["results"]]

    assert ids(key="acme.team", value="blue") == [tagged_id]
    assert ids(key="acme.n", value="5") == [tagged_id]
    assert ids(key="acme.n", value='"5"') == []
    assert len(ids(key="acme.team")) == 2


def test_list_issues_no_count(api: Any) -> None:
    create(api)
    with CaptureQueriesContext(connection) as queries:
        assert api.get(f"{API}runs/").status_code == 200
    assert not any("COUNT(" in q["sql"].upper() for q in queries.captured_queries)


# --- detail ---------------------------------------------------------------------------------------


def test_detail_with_stages_and_404s(api: Any) -> None:
    run_id = create(api).json()["id"]
    drive(run_id)
    response = api.get(f"{API}runs/{run_id}/")
    assert response.status_code == 200
    body = response.json()
    assert body["status"] == "COMPLETED" and body["output"] == {"value": 12}
    first = body["stages"][0]
    assert first["stage_id"] == "first" and first["execution_group"] == 1
    assert first["status"] == "COMPLETED" and first["generation"] == 0
    assert first["progress"] == 100  # a completed stage reports 100
    assert isinstance(first["duration_ms"], int)
    assert first["started_at"].endswith("Z")
    assert body["waiting"] == []
    assert "version" not in body  # the row counter is not part of the API (issue 17 §3)
    assert body["links"]["admin"].endswith(f"/admin/django_workflows/workflowrun/{run_id}/change/")

    unknown = api.get(f"{API}runs/{uuid.uuid4()}/")
    assert unknown.status_code == 404 and unknown.json()["code"] == "not_found"
    malformed = api.get(f"{API}runs/not-a-uuid/")
    assert malformed.status_code == 404 and malformed.json()["code"] == "not_found"
    nowhere = api.get(f"{API}no/such/route/")
    assert nowhere.status_code == 404 and nowhere.json()["code"] == "not_found"


def test_detail_failed_run_error_and_waiting_approval(api: Any) -> None:
    failed = create(api, "api-fails").json()["id"]
    drive(failed)
    body = api.get(f"{API}runs/{failed}/").json()
    assert body["status"] == "FAILED" and "boom" in body["error"]
    assert "boom" in body["stages"][0]["error"]

    waiting = waiting_approval(api)
    body = api.get(f"{API}runs/{waiting}/").json()
    assert body["waiting"][0]["reason"] == "approval"
    assert body["waiting"][0]["stage_id"] == "review"


# --- cancel ---------------------------------------------------------------------------------------


def test_cancel(api: Any) -> None:
    run_id = create(api).json()["id"]
    response = api.post(
        f"{API}runs/{run_id}/cancel/", {"reason": "no longer needed"}, format="json"
    )
    assert response.status_code == 200 and response.json() == {
        "cancelled": True,
        "status": "CANCELLED",
    }
    event = OutboxEvent.objects.filter(workflow_run_id=run_id).order_by("-sequence").first()
    assert event.event_type == "workflow:cancelled"
    again = api.post(f"{API}runs/{run_id}/cancel/", {}, format="json")
    assert again.status_code == 200 and again.json()["cancelled"] is False
    empty_body = api.post(f"{API}runs/{completed_run(api)}/cancel/")
    assert empty_body.status_code == 200 and empty_body.json()["cancelled"] is False
    assert api.post(f"{API}runs/{uuid.uuid4()}/cancel/", {}, format="json").status_code == 404
    bad = api.post(f"{API}runs/{run_id}/cancel/", {"reason": 5}, format="json")
    assert bad.status_code == 400 and "reason" in bad.json()["errors"]


# --- rerun ----------------------------------------------------------------------------------------


def test_rerun(api: Any) -> None:
    run_id = completed_run(api)
    response = api.post(f"{API}runs/{run_id}/rerun/", {"from_stage_id": "second"}, format="json")
    assert response.status_code == 200, response.json()
    assert response.json()["deleted_stages"] == ["second"]
    assert response.json()["replayed"] is False
    assert WorkflowRun.objects.get(pk=run_id).status == "RUNNING"
    conflict = api.post(f"{API}runs/{run_id}/rerun/", {"from_stage_id": "second"}, format="json")
    assert conflict.status_code == 409 and conflict.json()["code"] == "run_state"
    assert "RUNNING" in conflict.json()["message"]
    drive(run_id)
    unknown = api.post(f"{API}runs/{run_id}/rerun/", {"from_stage_id": "zzz"}, format="json")
    assert unknown.status_code == 400 and unknown.json()["code"] == "unknown_stage"
    assert "from_stage_id" in unknown.json()["errors"]
    missing = api.post(f"{API}runs/{uuid.uuid4()}/rerun/", {"from_stage_id": "a"}, format="json")
    assert missing.status_code == 404
    assert api.post(f"{API}runs/{run_id}/rerun/", {}, format="json").status_code == 400


def test_rerun_idempotency_key(api: Any) -> None:
    run_id = completed_run(api)
    body = {"from_stage_id": "second", "idempotency_key": "fix-1"}
    assert api.post(f"{API}runs/{run_id}/rerun/", body, format="json").status_code == 200
    replay = api.post(f"{API}runs/{run_id}/rerun/", body, format="json")
    assert replay.status_code == 200 and replay.json()["replayed"] is True
    other = completed_run(api)
    reused = api.post(f"{API}runs/{other}/rerun/", body, format="json")
    assert reused.status_code == 409 and reused.json()["code"] == "idempotency_key_reused"
    assert "fix-1" in reused.json()["message"]


# --- approve / reject -----------------------------------------------------------------------------


def test_approve_records_the_user_and_resumes(api: Any) -> None:
    run_id = waiting_approval(api)
    response = api.post(f"{API}runs/{run_id}/approve/", {"comment": "ship it"}, format="json")
    assert response.status_code == 200, response.json()
    assert response.json()["decided_by"] == "alice" and response.json()["recorded"] is True
    same = api.post(f"{API}runs/{run_id}/approve/", {}, format="json")
    assert same.status_code == 200 and same.json()["recorded"] is False
    opposite = api.post(f"{API}runs/{run_id}/reject/", {"reason": "no"}, format="json")
    assert opposite.status_code == 409 and opposite.json()["code"] == "approval_conflict"
    time.sleep(0.02)
    run = drive(run_id)
    assert run.status == "COMPLETED"
    assert run.output["approved"] is True and run.output["decided_by"] == "alice"
    done = api.post(f"{API}runs/{run_id}/approve/", {}, format="json")
    assert done.status_code == 409 and done.json()["code"] == "no_approval_waiting"


def test_reject_and_no_approval_waiting(api: Any) -> None:
    run_id = waiting_approval(api)
    response = api.post(f"{API}runs/{run_id}/reject/", {"reason": "numbers off"}, format="json")
    assert response.status_code == 200 and response.json()["outcome"] == "rejected"
    pending = create(api).json()["id"]
    nothing = api.post(f"{API}runs/{pending}/approve/", {}, format="json")
    assert nothing.status_code == 409 and nothing.json()["code"] == "no_approval_waiting"
    assert api.post(f"{API}runs/{uuid.uuid4()}/reject/", {}, format="json").status_code == 404


def test_not_an_allowed_approver_403(api: Any) -> None:
    run_id = waiting_approval(api, "api-approval-restricted")
    response = api.post(f"{API}runs/{run_id}/approve/", {}, format="json")
    assert response.status_code == 403 and response.json()["code"] == "not_allowed_approver"


# --- annotations ----------------------------------------------------------------------------------


def test_annotations_attach_and_list(api: Any) -> None:
    run_id = completed_run(api)
    response = api.post(
        f"{API}runs/{run_id}/annotations/",
        {
            "attributes": {"acme.csat": 5, "acme.note": "good"},
            "idempotency_key": "csat",
            "emit_event": True,
        },
        format="json",
    )
    assert response.status_code == 201 and response.json() == {"created": 2, "duplicates": 0}
    again = api.post(
        f"{API}runs/{run_id}/annotations/",
        {"attributes": {"acme.csat": 5}, "idempotency_key": "csat"},
        format="json",
    )
    assert again.status_code == 200 and again.json() == {"created": 0, "duplicates": 1}
    stage = api.post(
        f"{API}runs/{run_id}/annotations/",
        {
            "attributes": {"acme.reviewed": True},
            "scope": "stage",
            "scope_id": "first",
            "actor": {"kind": "bot", "id": "r2"},
        },
        format="json",
    )
    assert stage.status_code == 201

    rows = api.get(f"{API}runs/{run_id}/annotations/").json()["results"]
    by_key = {r["key"]: r for r in rows}
    assert by_key["acme.csat"]["actor_id"] == "alice" and by_key["acme.csat"]["value"] == 5
    assert by_key["acme.reviewed"]["actor_id"] == "r2"
    assert by_key["acme.reviewed"]["scope_id"] == "first"

    def keys(**params: Any) -> list[str]:
        response = api.get(f"{API}runs/{run_id}/annotations/", params)
        assert response.status_code == 200, response.json()
        return [r["key"] for r in response.json()["results"]]

    assert keys(key="acme.note") == ["acme.note"]
    assert sorted(keys(key_prefix="acme.")) == ["acme.csat", "acme.note", "acme.reviewed"]
    assert keys(scope="stage", scope_id="first") == ["acme.reviewed"]
    assert "acme.reviewed" not in keys(no_scope_id="true")
    assert keys(actor_id="r2") == ["acme.reviewed"]
    assert keys(actor_kind="bot") == ["acme.reviewed"]
    assert "acme.csat" in keys(generation=0)
    assert keys(generation=1) == []
    created = by_key["acme.csat"]["created_at"]
    assert "acme.csat" in keys(since=created, until=created)
    assert len(keys(limit=1)) == 1
    assert api.get(f"{API}runs/{run_id}/annotations/", {"limit": 0}).status_code == 400
    assert api.get(f"{API}runs/{run_id}/annotations/", {"generation": "x"}).status_code == 400
    assert api.get(f"{API}runs/{uuid.uuid4()}/annotations/").status_code == 404


def test_annotations_bad_input(api: Any) -> None:
    run_id = completed_run(api)
    counts = row_counts()
    bad_key = api.post(
        f"{API}runs/{run_id}/annotations/", {"attributes": {"nodots": 1}}, format="json"
    )
    assert bad_key.status_code == 400 and bad_key.json()["code"] == "invalid"
    unknown_stage = api.post(
        f"{API}runs/{run_id}/annotations/",
        {"attributes": {"acme.x": 1}, "scope": "stage", "scope_id": "nope"},
        format="json",
    )
    assert unknown_stage.status_code == 400 and unknown_stage.json()["code"] == "unknown_stage"
    missing = api.post(
        f"{API}runs/{uuid.uuid4()}/annotations/", {"attributes": {"a.b": 1}}, format="json"
    )
    assert missing.status_code == 404
    assert row_counts() == counts


# --- events and logs ------------------------------------------------------------------------------


def test_events_in_sequence_and_after(api: Any) -> None:
    run_id = completed_run(api)
    response = api.get(f"{API}runs/{run_id}/events/")
    assert response.status_code == 200
    body = response.json()
    sequences = [e["sequence"] for e in body["results"]]
    assert sequences == list(range(1, len(sequences) + 1))
    assert body["results"][0]["event_type"] == "workflow:created"
    assert body["results"][-1]["event_type"] == "workflow:completed"
    assert body["run_status"] == "COMPLETED" and body["next_after"] == sequences[-1]
    later = api.get(f"{API}runs/{run_id}/events/", {"after": 2, "limit": 2}).json()
    assert [e["sequence"] for e in later["results"]] == [3, 4]
    started = time.monotonic()
    empty = api.get(f"{API}runs/{run_id}/events/", {"after": sequences[-1], "wait": 0.3}).json()
    assert empty["results"] == [] and empty["next_after"] == sequences[-1]
    assert time.monotonic() - started >= 0.3
    assert api.get(f"{API}runs/{run_id}/events/", {"wait": 31}).status_code == 400
    assert api.get(f"{API}runs/{run_id}/events/", {"wait": "nan"}).status_code == 400
    assert api.get(f"{API}runs/{run_id}/events/", {"after": -1}).status_code == 400
    assert api.get(f"{API}runs/{uuid.uuid4()}/events/").status_code == 404


def test_logs(api: Any) -> None:
    run_id = completed_run(api)
    response = api.get(f"{API}runs/{run_id}/logs/")
    assert response.status_code == 200
    rows = response.json()["results"]
    mine = [r for r in rows if r["message"] == "adding one"]
    assert mine and mine[0]["stage_id"] == "first" and mine[0]["level"] == "INFO"
    assert mine[0]["metadata"] == {"value": 1}
    after = api.get(f"{API}runs/{run_id}/logs/", {"after": rows[-1]["id"]}).json()
    assert after["results"] == [] and after["next_after"] == rows[-1]["id"]
    assert api.get(f"{API}runs/{run_id}/logs/", {"level": "LOUD"}).status_code == 400
    assert api.get(f"{API}runs/{uuid.uuid4()}/logs/").status_code == 404


# --- schema, docs, generic errors -----------------------------------------------------------------


def test_schema_and_docs(api: Any, client: Any) -> None:
    from drf_spectacular.validation import validate_schema

    response = client.get(f"{API}schema/")
    assert response.status_code == 200
    schema = response.json()
    validate_schema(schema)
    assert f"{API}runs/{{run_id}}/events/" in schema["paths"]
    assert all(p.startswith(API) for p in schema["paths"])
    assert client.get(f"{API}schema/?format=yaml").status_code == 200
    docs = client.get(f"{API}docs/")
    assert docs.status_code == 200 and b"swagger" in docs.content.lower()


def test_errors_are_json(api: Any) -> None:
    not_json = api.post(f"{API}runs/", "workflow_id=x", content_type="text/plain")
    assert not_json.status_code == 415 and not_json.json()["code"] == "unsupported_media_type"
    broken = api.post(f"{API}runs/", "{not json", content_type="application/json")
    assert broken.status_code == 400 and broken.json()["code"] == "parse_error"
    array = api.post(f"{API}runs/", [1, 2], format="json")
    assert array.status_code == 400 and array.json()["code"] == "invalid"
    method = api.delete(f"{API}runs/")
    assert method.status_code == 405 and method.json()["code"] == "method_not_allowed"
    assert method["Content-Type"] == "application/json"
