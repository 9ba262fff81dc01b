"""``GET|POST runs/{id}/signals/`` (issue 18 item 4): send (201 stored, 200 duplicate by body
key or Idempotency-Key header), errors by field, 404, 409 run_terminal, list, and a waiting
stage completing with the payload sent over the API."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from pydantic import BaseModel

from django_workflows import cancel_run, define_workflow, start_run, wait_for_signal
from django_workflows.definition.registry import registry
from django_workflows.models import WorkflowSignal

from .conftest import API, drive

pytestmark = pytest.mark.django_db


class Go(BaseModel):
    ok: bool


@pytest.fixture(autouse=True)
def signal_workflow() -> Iterator[None]:
    wf = (
        define_workflow(id="api-signal")
        .pipe(wait_for_signal(id="go", payload=Go, poll_interval_seconds=3600))
        .build()
    )
    registry.register(wf)
    yield
    registry.unregister(wf.id)


def _url(run_id: str) -> str:
    return f"{API}runs/{run_id}/signals/"


def test_a_signal_sent_over_the_api_completes_the_waiting_stage(api: Any) -> None:
    run_id = start_run("api-signal")
    drive(run_id)
    response = api.post(_url(run_id), {"name": "go", "payload": {"ok": True}}, format="json")
    assert response.status_code == 201, response.json()
    body = response.json()
    assert (body["stored"], body["woke"], body["name"]) == (True, True, "go")
    run = drive(run_id)
    assert run.status == "COMPLETED"
    listed = api.get(_url(run_id)).json()["results"]
    assert [(s["name"], s["payload"], s["actor"], s["consumed_stage_id"]) for s in listed] == [
        ("go", {"ok": True}, "user:alice", "go")
    ]
    assert listed[0]["consumed_at"] is not None


def test_keys_by_body_or_header_make_duplicates(api: Any) -> None:
    run_id = start_run("api-signal")
    first = api.post(_url(run_id), {"name": "go", "key": "k"}, format="json")
    again = api.post(_url(run_id), {"name": "go"}, format="json", HTTP_IDEMPOTENCY_KEY="k")
    assert (first.status_code, again.status_code) == (201, 200)
    assert again.json()["stored"] is False
    assert again.json()["signal_id"] == first.json()["signal_id"]
    clash = api.post(
        _url(run_id), {"name": "go", "key": "a"}, format="json", HTTP_IDEMPOTENCY_KEY="b"
    )
    assert clash.status_code == 400 and "key" in clash.json()["errors"]
    assert WorkflowSignal.objects.filter(run_id=run_id).count() == 1


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"name": "bad name"}, "name"),
        ({}, "name"),
        ({"name": "go", "payload": "x" * 70000}, "payload"),
        ({"name": "go", "actor": 3}, "actor"),
    ],
)
def test_bad_bodies_are_400_naming_the_field(api: Any, body: dict[str, Any], field: str) -> None:
    run_id = start_run("api-signal")
    response = api.post(_url(run_id), body, format="json")
    assert response.status_code == 400, response.json()
    assert field in response.json()["errors"], response.json()
    assert not WorkflowSignal.objects.exists()


def test_unknown_and_terminal_runs(api: Any) -> None:
    assert api.post(_url(str(uuid.uuid4())), {"name": "go"}, format="json").status_code == 404
    assert api.get(_url("not-a-run")).status_code == 404
    run_id = start_run("api-signal")
    cancel_run(run_id)
    response = api.post(_url(run_id), {"name": "go"}, format="json")
    assert response.status_code == 409
    assert response.json()["code"] == "run_terminal"
    assert "finished run takes no signals" in response.json()["message"]
