"""Retention under concurrent workers (issue 20 part 1), PostgreSQL: nothing live is lost.

A real 2-worker cluster with a retention policy (every terminal run older than one hour) and
its supervisor's retention duty pruning every 0.5 s, plus a ``workflows_prune`` loop in
another process, while:

- 5,000 old finished runs (bench/scale.py's bulk rows: stages, jobs, published events,
  annotations) wait to be pruned;
- 40 new ``race-pipeline`` runs (a -> [b | c] -> d async batch -> e) execute;
- 8 old COMPLETED runs of ours (aged by 90 minutes: younger than the seeded ones, so pruned
  after them, oldest first) are rerun from stage ``b`` at random moments over 15 s - a rerun
  turns a COMPLETED run RUNNING again: it races the prune, which must either have deleted the
  run first (the rerun then says the run does not exist) or leave it alone;
- one old run has a dead-lettered event: kept.

Then: every new run and every rerun that was accepted COMPLETED with all its stages and a
gap-free, fully published outbox; the dead-letter run is still there with all its rows; every
seeded run and every aged run that was not rerun is gone with all its rows.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest

from tests.markers import ON_POSTGRES

from .harness import (
    ROOT,
    Cluster,
    assert_outbox_gap_free,
    assert_runs_completed,
    create_runs,
    settle_runs,
    shell_json,
    wait_for,
)

pytestmark = [
    pytest.mark.acceptance,
    pytest.mark.postgres,
    pytest.mark.skipif(not ON_POSTGRES, reason="bulk seeding and SKIP LOCKED: PostgreSQL"),
]

POLICY = {"DEFAULT_DAYS": {"COMPLETED": 1 / 24, "FAILED": 1 / 24, "CANCELLED": 1 / 24}}
ENV = {
    "EXTRA_INSTALLED_APPS": "tests.acceptance.crashapp",
    "WORKFLOWS_TICK_INTERVAL": "0.1",
    "WORKFLOWS_RETENTION": json.dumps(POLICY),
    "WORKFLOWS_RETENTION_INTERVAL": "0.5",
    "WORKFLOWS_RETENTION_BATCH_SIZE": "100",
    "WORKFLOWS_SUPERVISOR_INTERVAL": "0.5",
}
SEEDED = 5000

AGE = """
import json
from datetime import timedelta
from django_workflows.models import OutboxEvent, WorkflowRun
ids = {ids!r}
for run in WorkflowRun.objects.filter(pk__in=ids):
    WorkflowRun.objects.filter(pk=run.pk).update(
        completed_at=run.completed_at - timedelta(minutes=90)
    )
last = OutboxEvent.objects.filter(workflow_run_id={dead!r}).order_by("-sequence").first()
OutboxEvent.objects.filter(pk=last.pk).update(published_at=None, dlq_at=last.occurred_at)
print(json.dumps(WorkflowRun.objects.filter(pk__in=ids).count()))
"""

RACE = """
import json, random, time
from django_workflows.kernel.commands import CreateRun, RerunFrom
from django_workflows.kernel.errors import WorkflowError
from django_workflows.kernel.runtime import get_kernel
kernel = get_kernel()
rng = random.Random(7)
plan = [("create", rng.uniform(0, 3.0), i) for i in range(40)]
plan += [("rerun", rng.uniform(0, 15.0), rid) for rid in {rerun!r}]
plan.sort(key=lambda p: p[1])
start = time.monotonic()
created, reruns, refused = [], [], {{}}
for action, at, arg in plan:
    time.sleep(max(0.0, start + at - time.monotonic()))
    if action == "create":
        created.append(kernel.dispatch(CreateRun("race-pipeline", {{"seed": arg}})).workflow_run_id)
        continue
    try:
        kernel.dispatch(RerunFrom(arg, "b"))
        reruns.append(arg)
    except WorkflowError as exc:
        refused[arg] = f"{{type(exc).__name__}}: {{exc}}"
print(json.dumps({{"created": created, "reruns": reruns, "refused": refused}}))
"""

PRUNE_LOOP = """
import json, time
from django_workflows.retention import prune
total, calls = 0, 0
deadline = time.monotonic() + 60
while time.monotonic() < deadline:
    report = prune(batch_size=50)
    total += report.runs_total
    calls += 1
    if report.complete and report.runs_total == 0 and calls > 20:
        break
print(json.dumps({"runs": total, "calls": calls}))
"""

LEFT = """
import json
from django_workflows.models import (
    OutboxEvent, WorkflowAnnotation, WorkflowJob, WorkflowRun, WorkflowStage,
)
ids = {ids!r}
print(json.dumps({{
    "seeded_runs": WorkflowRun.objects.filter(workflow_type="scale").count(),
    "seeded_stages": WorkflowStage.objects.filter(run__workflow_type="scale").count(),
    "orphan_stages": WorkflowStage.objects.exclude(run_id__in=WorkflowRun.objects.values("pk"))
        .count(),
    "orphan_jobs": WorkflowJob.objects.exclude(
        workflow_run_id__in=WorkflowRun.objects.values("pk")).count(),
    "orphan_events": OutboxEvent.objects.exclude(
        workflow_run_id__in=WorkflowRun.objects.values("pk")).count(),
    "orphan_annotations": WorkflowAnnotation.objects.exclude(
        run_id__in=WorkflowRun.objects.values("pk")).count(),
    "present": [str(i) for i in WorkflowRun.objects.filter(pk__in=ids).values_list("pk",
                                                                                  flat=True)],
}}))
"""


def test_prune_beside_a_busy_cluster_loses_nothing_live(
    project: Callable[..., dict[str, str]], clusters: Callable[..., Cluster]
) -> None:
    env = project(**ENV)
    seeded = shell_json(
        env,
        f"import json; from bench.scale import populate; print(json.dumps(populate({SEEDED}, 0)))",
        timeout=600,
    )
    assert seeded["rows"]["workflow_runs"] == SEEDED
    # Our own old runs first, with no retention running yet (no cluster): 10 runs, aged.
    cluster = clusters({**env, "WORKFLOWS_RETENTION": ""})
    old = create_runs(env, "race-pipeline", [{"seed": 100 + i} for i in range(10)])
    states = settle_runs(env, old, timeout=120)
    assert_runs_completed(states)
    cluster.stop()
    dead, rerun, plain = old[0], old[1:9], old[9:]
    assert shell_json(env, AGE.format(ids=old, dead=dead)) == 10

    clusters(env)  # the cluster's retention duty prunes from now on
    pruner = subprocess.Popen(
        [sys.executable, "manage.py", "shell", "-v0", "-c", PRUNE_LOOP],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        race = shell_json(env, RACE.format(rerun=rerun), timeout=120)
        accepted = race["reruns"]
        print(f"reruns accepted {len(accepted)}, refused (already pruned) {len(race['refused'])}")
        new = settle_runs(env, race["created"], timeout=180)
        assert len(new) == 40
        assert_runs_completed(new, "new runs while pruning")
        assert_outbox_gap_free(new, "new runs while pruning")
        reran = settle_runs(env, accepted, timeout=120)
        assert set(reran) == set(accepted), "an accepted rerun lost its run"
        assert_runs_completed(reran, "reruns while pruning")
        assert_outbox_gap_free(reran, "reruns while pruning")
        for rid in race["refused"]:
            assert "not found" in race["refused"][rid].lower(), race["refused"]
        out, err = pruner.communicate(timeout=120)
        assert pruner.returncode == 0, err[-3000:]
        loop = json.loads(out.strip().splitlines()[-1])
    finally:
        if pruner.poll() is None:
            pruner.kill()
            pruner.wait()

    def pruned() -> dict[str, Any] | None:
        left = shell_json(env, LEFT.format(ids=old))
        return left if left["seeded_runs"] == 0 else None

    left = wait_for(pruned, timeout=120, interval=1.0)
    assert left["seeded_stages"] == 0
    assert {k: v for k, v in left.items() if k.startswith("orphan")} == dict.fromkeys(
        ("orphan_stages", "orphan_jobs", "orphan_events", "orphan_annotations"), 0
    )
    present = set(left["present"])
    assert dead in present, "the run with a dead letter was pruned"
    assert set(accepted) <= present
    gone = set(plain) | (set(rerun) - set(accepted))
    assert not (gone & present), f"aged runs not pruned: {gone & present}"
    dead_state = settle_runs(env, [dead], timeout=0)[dead]
    assert set(dead_state["stages"].values()) == {"COMPLETED"} and dead_state["events"]
    # The loop took part beside the cluster's own duty; together they deleted everything.
    assert loop["runs"] > 0
