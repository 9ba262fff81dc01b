"""Child workflows in the HTTP API, the admin run page and the CLI (issue 18 item 5): a run's
detail names its parent and lists its children, ``?parent=`` lists a parent's children, the
waiting reason of a parent names its child."""

from __future__ import annotations

import json
from io import StringIO
from typing import Any

import pytest
from django.core.management import call_command
from django.urls import reverse

from django_workflows.kernel import CreateRun
from django_workflows.models import WorkflowRun
from django_workflows.testing import drive, make_kernel, run_workflow
from tests.integration.test_child_workflows import orders, slow_orders

from .conftest import API

pytestmark = pytest.mark.django_db


def _waiting_parent() -> tuple[str, WorkflowRun]:
    kernel = make_kernel(slow_orders)
    run_id = kernel.dispatch(
        CreateRun(workflow_id="slow-orders", input={"order_id": "hold-api"})
    ).workflow_run_id
    drive(kernel, run_id, rounds=3)
    return run_id, WorkflowRun.objects.get(parent_run_id=run_id)


def test_detail_shows_parent_and_children_and_the_list_filters_by_parent(api: Any) -> None:
    result = run_workflow(orders, {"order_id": "API1"})
    parent_id = str(result.run.pk)
    child = WorkflowRun.objects.get(parent_run_id=parent_id)
    body = api.get(f"{API}runs/{parent_id}/").json()
    assert body["parent_run_id"] is None and body["parent_stage_id"] is None
    assert [(c["id"], c["status"], c["parent_stage_id"]) for c in body["children"]] == [
        (str(child.pk), "COMPLETED", "ship")
    ]
    assert body["children"][0]["parent_generation"] == 0
    assert body["children"][0]["url"].endswith(f"runs/{child.pk}/")
    child_body = api.get(f"{API}runs/{child.pk}/").json()
    assert child_body["parent_run_id"] == parent_id
    assert child_body["parent_stage_id"] == "ship" and child_body["children"] == []
    listed = api.get(f"{API}runs/", {"parent": parent_id}).json()["results"]
    assert [r["id"] for r in listed] == [str(child.pk)]
    bad = api.get(f"{API}runs/", {"parent": "not-a-uuid"})
    assert bad.status_code == 400 and "parent" in json.dumps(bad.json())


def test_waiting_parent_names_its_child_in_api_and_cli(api: Any) -> None:
    run_id, child = _waiting_parent()
    waiting = api.get(f"{API}runs/{run_id}/").json()["waiting"]
    assert [(w["reason"], w["stage_id"]) for w in waiting] == [("child", "ship")]
    assert waiting[0]["message"] == f"waiting for child run {child.pk} (RUNNING, stage slow)"
    out = StringIO()
    call_command("workflows_status", str(run_id), stdout=out)
    text = out.getvalue()
    assert f"waiting for child run {child.pk} (RUNNING, stage slow)" in text
    assert f"python manage.py workflows_status {child.pk}" in text
    assert f"children:  {child.pk} slow-shipping RUNNING (stage ship, generation 0)" in text
    out = StringIO()
    call_command("workflows_status", str(child.pk), "--json", stdout=out)
    doc = json.loads(out.getvalue())
    assert doc["parent_run_id"] == str(run_id) and doc["parent_stage_id"] == "ship"


def test_admin_run_page_links_parent_and_children(admin_client: Any) -> None:
    run_id, child = _waiting_parent()
    change = "admin:django_workflows_workflowrun_change"
    page = admin_client.get(reverse(change, args=[run_id])).content.decode()
    assert 'id="dw-children"' in page
    assert reverse(change, args=[str(child.pk)]) in page
    assert "slow-shipping" in page
    child_page = admin_client.get(reverse(change, args=[str(child.pk)])).content.decode()
    assert 'id="dw-parent"' in child_page and reverse(change, args=[run_id]) in child_page
    changelist = reverse("admin:django_workflows_workflowrun_changelist")
    parent_link = reverse(change, args=[run_id])
    child_link = reverse(change, args=[str(child.pk)])
    only_children = admin_client.get(changelist, {"has_parent": "yes"}).content.decode()
    assert child_link in only_children and parent_link not in only_children
    top = admin_client.get(changelist, {"has_parent": "no"}).content.decode()
    assert parent_link in top and child_link not in top
    assert f"waiting for child run {child.pk}" in top  # the list's reason, read without a query


def test_schema_documents_the_child_fields() -> None:
    from drf_spectacular.generators import SchemaGenerator

    schema = SchemaGenerator().get_schema(request=None, public=True)
    detail = schema["components"]["schemas"]["RunDetail"]["properties"]
    assert {"parent_run_id", "parent_stage_id", "children"} <= set(detail)
    child = schema["components"]["schemas"]["ChildRun"]["properties"]
    assert {"id", "workflow_id", "status", "parent_stage_id", "parent_generation"} <= set(child)
    (runs_path,) = [p for p in schema["paths"] if p.endswith("/runs/")]
    names = {p["name"] for p in schema["paths"][runs_path]["get"]["parameters"]}
    assert "parent" in names
