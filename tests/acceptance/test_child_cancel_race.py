"""Child workflows with real processes (issue 18 item 5): parents cancelled while their child
runs complete.

A driver (``manage.py shell``) creates 40 ``family-parent`` runs (kid: a child-workflow stage
running ``family-child``, whose one stage sleeps 0-400 ms -> done) and cancels about half of
them at random moments over the next seconds, while two django-q2 workers execute parents and
children. Once every run is terminal the test checks that parents and children agree: a
CANCELLED parent has no child left PENDING or RUNNING, a COMPLETED parent took its one child's
output, no parent FAILED (a cascaded cancel never fails its parent), every parent stage
generation has at most one child, and every run has exactly one terminal event (no outcome
twice). PostgreSQL only (the row-lock order of cancel versus a finishing child is the point);
about 10-20 s.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import pytest

from tests.markers import postgres_only

from .harness import Cluster, shell_json

pytestmark = [pytest.mark.acceptance, postgres_only]

PARENTS = 40

ENV = {
    "EXTRA_INSTALLED_APPS": "tests.acceptance.crashapp",
    "WORKFLOWS_TICK_INTERVAL": "0.1",
    "Q_WORKERS": "2",
}

DRIVER = """
import json, random, time
from django_workflows.kernel.commands import CancelRun, CreateRun
from django_workflows.kernel.runtime import get_kernel
from django_workflows.models import OutboxEvent, WorkflowRun

rng = random.Random({seed})
kernel = get_kernel()
start = time.monotonic()
plan = []
for i in range({parents}):
    created_at = rng.uniform(0, 1.5)
    plan.append(("create", created_at, i))
    if rng.random() < 0.5:
        plan.append(("cancel", created_at + rng.uniform(0.05, 2.5), i))
plan.sort(key=lambda p: p[1])
ids = {{}}
cancels = {{}}
for action, at, i in plan:
    delay = start + at - time.monotonic()
    if delay > 0:
        time.sleep(delay)
    if action == "create":
        ids[i] = kernel.dispatch(CreateRun("family-parent", {{"seed": i}})).workflow_run_id
    else:
        cancels[ids[i]] = kernel.dispatch(CancelRun(ids[i], reason="race")).cancelled

parents = list(ids.values())
deadline = time.monotonic() + {timeout}
while time.monotonic() < deadline:
    live = WorkflowRun.objects.filter(status__in=["PENDING", "RUNNING"]).count()
    if not live:
        break
    time.sleep(0.1)

def terminal_events(run_id):
    return list(
        OutboxEvent.objects.filter(
            workflow_run_id=run_id,
            event_type__in=["workflow:completed", "workflow:failed", "workflow:cancelled"],
        ).values_list("event_type", flat=True)
    )

out = {{}}
for run in WorkflowRun.objects.filter(pk__in=parents):
    kids = WorkflowRun.objects.filter(parent_run_id=run.pk)
    out[str(run.pk)] = {{
        "status": run.status,
        "output": run.output,
        "error": run.error,
        "cancel": cancels.get(str(run.pk)),
        "events": terminal_events(run.pk),
        "children": [
            {{
                "status": k.status,
                "output": k.output,
                "stage": k.parent_stage_id,
                "generation": k.parent_generation,
                "events": terminal_events(k.pk),
            }}
            for k in kids
        ],
    }}
print(json.dumps({{
    "parents": out,
    "live": WorkflowRun.objects.filter(status__in=["PENDING", "RUNNING"]).count(),
    "seconds": round(time.monotonic() - start, 1),
}}))
"""


def test_parent_cancel_racing_child_completion(
    project: Callable[..., dict[str, str]], clusters: Callable[[dict[str, str]], Cluster]
) -> None:
    seed = random.randrange(1_000_000)
    env = project(**ENV)
    cluster = clusters(env)
    result = shell_json(env, DRIVER.format(seed=seed, parents=PARENTS, timeout=35), timeout=90)
    parents: dict[str, dict[str, Any]] = result["parents"]
    context = f"seed={seed} ({result['seconds']} s)\n--- qcluster ---\n{cluster.log()[-3000:]}"
    assert len(parents) == PARENTS and result["live"] == 0, context

    seen = {"COMPLETED": 0, "CANCELLED": 0, "with_child": 0}
    for rid, p in parents.items():
        where = f"parent {rid}: {p}\n{context}"
        assert p["status"] in ("COMPLETED", "CANCELLED"), where
        seen[p["status"]] += 1
        assert len(p["events"]) == 1, where  # one outcome, never two
        kids = p["children"]
        assert len(kids) <= 1, where  # one stage generation, one child
        for kid in kids:
            seen["with_child"] += 1
            assert (kid["stage"], kid["generation"]) == ("kid", 0), where
            assert kid["status"] in ("COMPLETED", "CANCELLED"), where
            assert len(kid["events"]) == 1, where
        if p["status"] == "COMPLETED":
            assert p["cancel"] is not True, where  # a cancel that committed always wins
            assert [k["status"] for k in kids] == ["COMPLETED"], where
            assert p["output"] == kids[0]["output"], where
            assert p["output"]["value"] == p["output"]["seed"] * 7, where
        else:
            assert p["cancel"] is True, where
            if kids and kids[0]["status"] == "CANCELLED":
                assert kids[0]["output"]["error"]["message"] == (
                    f"parent run {rid} was cancelled"
                ), where
    # The race is real: some parents completed, some were cancelled with a child under way.
    assert seen["COMPLETED"] and seen["CANCELLED"], f"{seen}\n{context}"
    assert seen["with_child"] > seen["COMPLETED"], f"{seen}\n{context}"
