"""``POST runs/`` of a misspelt workflow id: the 400 names the closest registered id (the
kernel's ``WorkflowNotFoundError`` message, issue 17 section 5); no run is created."""

from __future__ import annotations

from typing import Any

from django_workflows.models import WorkflowRun

from .conftest import API


def test_create_of_a_misspelt_workflow_says_did_you_mean(api: Any) -> None:
    response = api.post(
        f"{API}runs/", {"workflow_id": "api-two-stag", "input": {"value": 1}}, format="json"
    )
    assert response.status_code == 400
    body = response.json()
    assert body["code"] == "unknown_workflow"
    assert body["message"].startswith(
        "Workflow 'api-two-stag' not found in registry; did you mean 'api-two-stage'"
    )
    assert body["errors"]["workflow_id"] == [body["message"]]
    assert not WorkflowRun.objects.exists()
