"""Skipped stages and branches on the operator surfaces (issue 18): the admin run page
(stage table, Gantt, timeline), the HTTP API run detail and schema, ``workflows_status``."""

from __future__ import annotations

import json
from collections.abc import Iterator
from io import StringIO
from typing import Any

import pytest
from django.core.management import call_command
from django.urls import reverse
from pydantic import BaseModel

from django_workflows import Condition, define_stage, define_workflow
from django_workflows.definition.registry import registry
from django_workflows.kernel import CreateRun
from django_workflows.kernel.runtime import get_kernel
from django_workflows.testing import run_to_completion

pytestmark = pytest.mark.django_db

API = "/api/workflows/"


class Order(BaseModel):
    total: int


def _flow() -> Any:
    charge = define_stage(id="charge", execute=lambda ctx: {"total": ctx.input.total}, input=Order)
    review = define_stage(id="review", execute=lambda ctx: {"ok": True})
    small = define_stage(id="small-ship", execute=lambda ctx: "small")
    large = define_stage(id="large-ship", execute=lambda ctx: "large")
    return (
        define_workflow(id="cond-surfaces", input=Order)
        .pipe(charge)
        .pipe(
            review,
            when=Condition(lambda c: c.output("charge")["total"] > 1000, reason="total over 1000"),
        )
        .branch(lambda c: "small", {"small": [small], "large": [large]}, id="size")
        .build()
    )


@pytest.fixture
def run_id() -> Iterator[str]:
    wf = _flow()
    registry.register(wf)
    try:
        kernel = get_kernel()
        rid = str(kernel.dispatch(CreateRun(wf.id, {"total": 5})).workflow_run_id)
        run = run_to_completion(kernel, rid)
        assert run.status == "COMPLETED" and run.output == "small"
        yield rid
    finally:
        registry.unregister(wf.id)


def test_admin_run_page_shows_skipped_with_reason(admin_client, run_id: str) -> None:
    url = reverse("admin:django_workflows_workflowrun_change", args=[run_id])
    html = admin_client.get(url).content.decode()
    assert 'class="dw-muted dw-skip-reason">condition not met: total over 1000<' in html
    assert "branch &#x27;small&#x27; of &#x27;size&#x27; was chosen" in html  # large-ship
    assert 'dw-condition">when: total over 1000<' in html
    assert 'dw-condition">branch &#x27;large&#x27; of size<' in html
    assert "dw-seg-skipped" in html  # the Gantt marks skipped stages
    assert "stage:skipped" in html and "branch:chosen" in html  # the timeline
    assert "4 / 4" in html or "4/4" in html  # progress counts SKIPPED as done


def test_api_run_detail_and_events_show_skipped(admin_client, run_id: str) -> None:
    detail = admin_client.get(f"{API}runs/{run_id}/").json()
    stages = {s["stage_id"]: s for s in detail["stages"]}
    assert stages["review"]["status"] == "SKIPPED"
    assert stages["review"]["skip_reason"] == "condition not met: total over 1000"
    assert stages["charge"]["skip_reason"] == ""
    assert stages["large-ship"]["status"] == "SKIPPED"
    events = admin_client.get(f"{API}runs/{run_id}/events/").json()
    types = [e["event_type"] for e in events["results"]]
    assert "stage:skipped" in types and "branch:chosen" in types
    schema = json.dumps(admin_client.get(f"{API}schema/?format=json").json())
    assert "skip_reason" in schema and "SKIPPED" in schema


def test_status_command_shows_skip_reason(run_id: str) -> None:
    out = StringIO()
    call_command("workflows_status", run_id, stdout=out)
    text = out.getvalue()
    line = next(x for x in text.splitlines() if " review " in x)
    assert "SKIPPED" in line and "(skipped: condition not met: total over 1000)" in line
    out = StringIO()
    call_command("workflows_status", run_id, "--json", stdout=out)
    doc = json.loads(out.getvalue())
    review = next(s for s in doc["stages"] if s["stage_id"] == "review")
    assert review["skip_reason"] == "condition not met: total over 1000"


def test_api_definition_shows_when_and_branch(admin_client, run_id: str) -> None:
    doc = admin_client.get(f"{API}definitions/cond-surfaces/").json()
    stages = {s["stage_id"]: s for g in doc["execution_groups"] for s in g["stages"]}
    assert stages["charge"]["when"] is None and stages["charge"]["branch"] is None
    assert stages["review"]["when"]["reason"] == "total over 1000"
    assert stages["large-ship"]["branch"]["branches"] == ["small", "large"]
    assert stages["large-ship"]["branch"]["name"] == "large"
