"""``dead-letters/``: list, replay and skip dead-lettered outbox events over the API - the
same kernel commands as the admin (plugin.replayDLQ, outbox.skipDeadLetter), idempotent,
with the outbox permissions (issue 17 §4)."""

from __future__ import annotations

from typing import Any

import pytest
from django.utils import timezone

from django_workflows import start_run
from django_workflows.models import OutboxEvent

from .conftest import API

pytestmark = pytest.mark.django_db

PERMS = ("view_outboxevent", "replay_outboxevent", "skip_outboxevent")


@pytest.fixture
def dead() -> OutboxEvent:
    """A run's first event, dead-lettered after 3 failed deliveries; its later events wait."""
    run_id = start_run("api-two-stage", {"value": 1})
    rows = OutboxEvent.objects.filter(workflow_run_id=run_id).order_by("sequence")
    first = rows.first()
    assert first is not None
    OutboxEvent.objects.filter(pk=first.pk).update(
        dlq_at=timezone.now(), retry_count=3, last_error="plugin said no"
    )
    first.refresh_from_db()
    return first


def test_list_shows_dead_letters_only(client_with: Any, dead: OutboxEvent) -> None:
    client = client_with(*PERMS)
    body = client.get(f"{API}dead-letters/").json()
    assert [row["id"] for row in body["results"]] == [dead.pk]
    row = body["results"][0]
    assert row["state"] == "dead_letter" and row["retry_count"] == 3
    assert row["last_error"] == "plugin said no" and row["workflow_run_id"] == str(
        dead.workflow_run_id
    )
    assert body["next_after"] == dead.pk
    assert client.get(f"{API}dead-letters/", {"after": dead.pk}).json()["results"] == []


def test_replay_rearms_the_event_and_is_idempotent(client_with: Any, dead: OutboxEvent) -> None:
    client = client_with(*PERMS)
    first = client.post(f"{API}dead-letters/{dead.pk}/replay/", format="json")
    assert first.status_code == 200, first.content
    assert first.json() == {"event_id": dead.pk, "replayed": True, "state": "pending"}
    dead.refresh_from_db()
    assert dead.dlq_at is None and dead.retry_count == 0 and dead.last_error is None
    again = client.post(f"{API}dead-letters/{dead.pk}/replay/", format="json")
    assert again.status_code == 200
    assert again.json() == {"event_id": dead.pk, "replayed": False, "state": "pending"}
    assert client.get(f"{API}dead-letters/").json()["results"] == []


def test_skip_marks_it_skipped_with_the_note_and_is_idempotent(
    client_with: Any, dead: OutboxEvent
) -> None:
    client = client_with(*PERMS)
    later = OutboxEvent.objects.filter(
        workflow_run_id=dead.workflow_run_id, sequence__gt=dead.sequence
    ).count()
    response = client.post(
        f"{API}dead-letters/{dead.pk}/skip/", {"note": "bad payload"}, format="json"
    )
    assert response.status_code == 200, response.content
    body = response.json()
    assert body["changed"] is True and body["note"] == "bad payload"
    assert body["unblocked"] == later and body["event_type"] == dead.event_type
    dead.refresh_from_db()
    assert dead.skipped_at is not None and dead.published_at == dead.skipped_at
    again = client.post(f"{API}dead-letters/{dead.pk}/skip/", {"note": "again"}, format="json")
    assert again.status_code == 200 and again.json()["changed"] is False
    assert again.json()["note"] == "bad payload"  # the first skip's note stays
    replay = client.post(f"{API}dead-letters/{dead.pk}/replay/", format="json")
    assert replay.status_code == 409 and replay.json()["code"] == "not_a_dead_letter"


def test_skip_of_an_event_that_is_no_dead_letter_is_a_409(
    client_with: Any, dead: OutboxEvent
) -> None:
    client = client_with(*PERMS)
    other = start_run("api-two-stage", {"value": 2})
    pending = OutboxEvent.objects.filter(workflow_run_id=other).first()
    assert pending is not None
    response = client.post(f"{API}dead-letters/{pending.pk}/skip/", {"note": "x"}, format="json")
    assert response.status_code == 409 and response.json()["code"] == "not_a_dead_letter"
    pending.refresh_from_db()
    assert pending.skipped_at is None and pending.published_at is None


@pytest.mark.parametrize("event_id", ["0", "-1", "abc", "1e3", "9" * 30, "a%00b", "%C2%B2"])
def test_malformed_or_unknown_event_ids_are_404(client_with: Any, event_id: str) -> None:
    client = client_with(*PERMS)
    for action, body in (("replay", {}), ("skip", {"note": "x"})):
        response = client.post(f"{API}dead-letters/{event_id}/{action}/", body, format="json")
        assert response.status_code == 404, response.content
        assert response.json()["code"] == "not_found"


@pytest.mark.parametrize("body", [{"note": ""}, {}, {"note": 5}, {"note": "x", "extra": 1}])
def test_skip_needs_a_note(client_with: Any, dead: OutboxEvent, body: Any) -> None:
    response = client_with(*PERMS).post(f"{API}dead-letters/{dead.pk}/skip/", body, format="json")
    assert response.status_code == 400 and response.json()["code"] == "invalid"
    dead.refresh_from_db()
    assert dead.skipped_at is None


@pytest.mark.parametrize(
    ("route", "needed"),
    [("replay/", "replay_outboxevent"), ("skip/", "skip_outboxevent")],
)
def test_each_operation_needs_its_permission(
    client_with: Any, dead: OutboxEvent, route: str, needed: str
) -> None:
    others = [p for p in PERMS if p != needed]
    response = client_with(*others).post(
        f"{API}dead-letters/{dead.pk}/{route}", {"note": "x"}, format="json"
    )
    assert response.status_code == 403 and needed in response.json()["message"]
    dead.refresh_from_db()
    assert dead.dlq_at is not None and dead.skipped_at is None
    assert client_with().get(f"{API}dead-letters/").status_code == 403
