"""Cancel race with real processes: many runs cancelled at random moments while two django-q2
workers execute them.

A driver (``manage.py shell``) creates 30 ``race-pipeline`` runs (a -> [b | c] -> d (async
batch) -> e, short random stage times) and cancels about two thirds of them at random moments
over the next seconds, through ``run.cancel``. A plugin of the crash app records every event it
receives. Once every run is terminal and its outbox is published, the test checks that a cancel
that committed always won (K-CA-1..3, K-JE-15, K-PS-2/5; Part I items 1, 11, 16): no CANCELLED
run has a stage that completed after the cancel, no event follows ``workflow:cancelled``, and
the plugin saw every run's events exactly once, in order, and nothing after
``workflow:cancelled``. Runs on PostgreSQL and SQLite (about 10 s).
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from .harness import Cluster, shell_json

pytestmark = [pytest.mark.acceptance]

RUNS = 30

RACE_ENV = {
    "EXTRA_INSTALLED_APPS": "tests.acceptance.crashapp",
    "WORKFLOWS_PLUGINS": "tests.acceptance.crashapp.plugins.recorder",
    "WORKFLOWS_TICK_INTERVAL": "0.1",
    "Q_WORKERS": "2",
}

DRIVER = """
import json, random, time
from django_workflows.kernel.commands import CancelRun, CreateRun
from django_workflows.kernel.runtime import get_kernel
from django_workflows.models import (
    OutboxEvent, WorkflowBlob, WorkflowJob, WorkflowRun, WorkflowStage,
)

rng = random.Random({seed})
kernel = get_kernel()
start = time.monotonic()
plan = []
for i in range({runs}):
    created_at = rng.uniform(0, 2.0)
    cancel_at = created_at + rng.uniform(0, 3.0) if rng.random() < 0.7 else None
    plan.append(("create", created_at, i))
    if cancel_at is not None:
        plan.append(("cancel", cancel_at, i))
plan.sort(key=lambda p: p[1])
run_ids = {{}}
cancels = {{}}
for action, at, i in plan:
    delay = start + at - time.monotonic()
    if delay > 0:
        time.sleep(delay)
    if action == "create":
        run_ids[i] = kernel.dispatch(CreateRun("race-pipeline", {{"seed": i}})).workflow_run_id
    else:
        cancels[run_ids[i]] = kernel.dispatch(CancelRun(run_ids[i], reason="race")).cancelled

ids = list(run_ids.values())
deadline = time.monotonic() + {timeout}
settled_at = None
while time.monotonic() < deadline:
    live = WorkflowRun.objects.filter(pk__in=ids, status__in=["PENDING", "RUNNING"]).count()
    unpublished = OutboxEvent.objects.filter(workflow_run_id__in=ids, published_at=None).count()
    if not live and settled_at is None:
        settled_at = time.monotonic()
    if not live and not unpublished:
        break
    time.sleep(0.1)
flush_lag = round(time.monotonic() - settled_at, 1) if settled_at else None

runs = {{}}
for run in WorkflowRun.objects.filter(pk__in=ids):
    rid = str(run.pk)
    runs[rid] = {{
        "status": run.status,
        "completed_at": run.completed_at.isoformat() if run.completed_at else None,
        "output": run.output,
        "cancel": cancels.get(rid),
        "stages": {{
            s.stage_id: [s.status, s.completed_at.isoformat() if s.completed_at else None]
            for s in WorkflowStage.objects.filter(run_id=run.pk)
        }},
        "jobs": sorted(
            [j.stage_id, j.status, j.last_error or ""]
            for j in WorkflowJob.objects.filter(workflow_run_id=run.pk)
        ),
        "blobs": sorted(
            k.split("/")[-2]
            for k in WorkflowBlob.objects.filter(
                run_id=run.pk, key__endswith="/output.json"
            ).values_list("key", flat=True)
        ),
        "events": [
            [e.sequence, e.event_type, e.payload.get("stage_id"), e.published_at is not None]
            for e in OutboxEvent.objects.filter(workflow_run_id=run.pk).order_by("sequence")
        ],
    }}
print(json.dumps({{
    "runs": runs, "seconds": round(time.monotonic() - start, 1), "flush_lag": flush_lag,
}}))
"""


def _events_after_cancel(events: list[list[Any]]) -> list[list[Any]]:
    types = [e[1] for e in events]
    if "workflow:cancelled" not in types:
        return []
    return events[types.index("workflow:cancelled") + 1 :]


def test_cancel_race_cancel_always_wins_with_two_workers(
    project: Callable[..., dict[str, str]],
    clusters: Callable[[dict[str, str]], Cluster],
    tmp_path: Path,
) -> None:
    """30 runs, two workers, random cancels: every CANCELLED run stays cancelled - no stage of it
    completed after the cancel and no output of a discarded stage result was kept (K-JE-15,
    Part I item 1) - every run's outbox is gap-free and ends at ``workflow:cancelled`` (EV-3,
    K-CA-2), and the plugin saw each run's events once, in order, with nothing after
    ``workflow:cancelled`` (EV-4, Part I item 16).
    """
    seed = random.randrange(1_000_000)
    crash_dir = tmp_path / "crash"
    crash_dir.mkdir()
    env = project(**RACE_ENV, CRASH_DIR=str(crash_dir))
    cluster = clusters(env)
    result = shell_json(env, DRIVER.format(seed=seed, runs=RUNS, timeout=45), timeout=120)
    runs: dict[str, dict[str, Any]] = result["runs"]
    context = f"seed={seed} ({result['seconds']} s)\n--- qcluster ---\n{cluster.log()[-3000:]}"

    assert len(runs) == RUNS
    statuses = {rid: r["status"] for rid, r in runs.items()}
    assert set(statuses.values()) <= {"COMPLETED", "CANCELLED"}, f"{statuses}\n{context}"

    received: dict[str, list[tuple[str, str | None]]] = {rid: [] for rid in runs}
    for line in (crash_dir / "plugin-events.jsonl").read_text().splitlines():
        event = json.loads(line)
        received[event["run"]].append((event["type"], event["stage"]))

    stats = dict.fromkeys(
        ("completed", "cancelled_pending", "cancelled_mid_run", "cancelled_suspended", "ghosts"), 0
    )
    for rid, run in runs.items():
        where = f"run {rid}: {json.dumps(run)}\n{context}"
        events = run["events"]
        assert [e[0] for e in events] == list(range(1, len(events) + 1)), where
        assert all(e[3] for e in events), where  # all published
        outbox = [(e[1], e[2]) for e in events]
        assert received[rid] == outbox, where  # each event once, in order
        assert all(status in ("COMPLETED", "FAILED", "CANCELLED") for _, status, _ in run["jobs"])
        completed_stages = sorted(s for s, (st, _) in run["stages"].items() if st == "COMPLETED")
        assert run["blobs"] == completed_stages, where  # discarded results left no output
        stats["ghosts"] += sum(1 for job in run["jobs"] if "result was discarded" in job[2])

        if run["status"] == "COMPLETED":
            stats["completed"] += 1
            assert run["cancel"] in (None, False), where
            assert completed_stages == ["a", "b", "c", "d", "e"], where
            assert run["output"] == {"seed": run["output"]["seed"], "path": list("abcde")}
            assert outbox[-1] == ("workflow:completed", None), where
            continue

        assert run["cancel"] is True, where
        assert outbox[-1][0] == "workflow:cancelled", where
        assert _events_after_cancel(events) == [], where
        seen = [kind for kind, _ in received[rid]]
        assert seen.index("workflow:cancelled") == len(seen) - 1, where  # plugin saw nothing after
        cancelled_at = datetime.fromisoformat(run["completed_at"])
        for stage_id, (status, completed_at) in run["stages"].items():
            assert status in ("COMPLETED", "CANCELLED"), where
            if status == "COMPLETED":
                assert datetime.fromisoformat(completed_at) <= cancelled_at, (
                    f"{stage_id} completed after the cancel: {where}"
                )
        if any(kind == "stage:started" for kind, _ in outbox):
            stats["cancelled_mid_run"] += 1
            if (
                run["stages"].get("d", [None])[0] == "CANCELLED"
                and (
                    "stage:suspended",
                    "d",
                )
                in outbox
            ):
                stats["cancelled_suspended"] += 1
        else:
            stats["cancelled_pending"] += 1

    print(f"cancel race seed={seed} {result['seconds']} s lag={result['flush_lag']} s {stats}")
    assert stats["cancelled_mid_run"] >= 1, f"{stats}\n{context}"
    assert stats["completed"] >= 1, f"{stats}\n{context}"
