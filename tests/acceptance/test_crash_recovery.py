"""Crash recovery with real processes: a ``qcluster`` killed with SIGKILL mid-stage and mid-poll.

Each test runs the crash app's workflows (``tests/acceptance/crashapp``) on a fresh database
with a short lease (``STALE_LEASE_SECONDS=3``, heartbeat every second), waits until the stage
(or ``check_completion``) signals that it is blocked, SIGKILLs the whole cluster process group,
starts a new cluster and checks that the run completes with every stage output stored once and
a gap-free, ordered outbox (H-4, DM-45, K-LR-1, EC-11, EV-3; Part I items 1 and 3).

The new cluster's worker processes start ticking on their own (their supervisor threads take
the ``ticker`` lease once the dead cluster's has expired), so each test takes a few seconds
plus start-up. Reliable on PostgreSQL and on SQLite (WAL mode recovers the killed processes'
transactions), so they run on both passes.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from .harness import Cluster, manage, shell_json, wait_for

pytestmark = [pytest.mark.acceptance]

#: Settings of the crash tests' subprocesses: the crash app and a 3 s lease.
CRASH_ENV = {
    "EXTRA_INSTALLED_APPS": "tests.acceptance.crashapp",
    "WORKFLOWS_STALE_LEASE_SECONDS": "3",
    "WORKFLOWS_HEARTBEAT_SECONDS": "1",
    "WORKFLOWS_TICK_INTERVAL": "0.2",
    "Q_WORKERS": "2",
}

#: How long a run may take to finish after the restart (generous: the new cluster's supervisor
#: ticks within a few seconds and its tick releases the stale lease).
SETTLE_SECONDS = 50

#: Waits until the run is terminal and its outbox is published, then prints its state.
SETTLE = """
import json, time
from django_workflows.models import OutboxEvent, WorkflowBlob, WorkflowJob, WorkflowRun
run_id = {run_id!r}
deadline = time.monotonic() + {timeout}
while time.monotonic() < deadline:
    run = WorkflowRun.objects.get(pk=run_id)
    unpublished = OutboxEvent.objects.filter(workflow_run_id=run_id, published_at=None).count()
    if run.status in ("COMPLETED", "FAILED", "CANCELLED") and not unpublished:
        break
    time.sleep(0.1)
run = WorkflowRun.objects.get(pk=run_id)
print(json.dumps({{
    "status": run.status,
    "output": run.output,
    "stages": {{s.stage_id: s.status for s in run.stages.all()}},
    "jobs": {{
        j.stage_id: [j.status, j.attempt]
        for j in WorkflowJob.objects.filter(workflow_run_id=run_id)
    }},
    "blobs": sorted(
        WorkflowBlob.objects.filter(run_id=run_id, key__endswith="/output.json")
        .values_list("key", flat=True)
    ),
    "events": [
        [e.sequence, e.event_type, e.payload.get("stage_id"), e.published_at is not None]
        for e in OutboxEvent.objects.filter(workflow_run_id=run_id).order_by("sequence")
    ],
}}))
"""

#: The state of the run and its jobs right after the kill.
SNAPSHOT = """
import json
from django_workflows.models import WorkflowJob, WorkflowStage
run_id = {run_id!r}
print(json.dumps({{
    "stages": {{
        s.stage_id: s.status for s in WorkflowStage.objects.filter(run_id=run_id)
    }},
    "jobs": {{
        j.stage_id: [j.status, j.attempt]
        for j in WorkflowJob.objects.filter(workflow_run_id=run_id)
    }},
}}))
"""


@pytest.fixture
def crash_env(project: Callable[..., dict[str, str]], tmp_path: Path) -> dict[str, str]:
    crash_dir = tmp_path / "crash"
    crash_dir.mkdir()
    return project(**CRASH_ENV, CRASH_DIR=str(crash_dir))


def _start_run(env: dict[str, str], workflow_id: str, label: str) -> str:
    done = manage(env, "workflows_run", workflow_id, "--input", json.dumps({"label": label}))
    assert done.returncode == 0, done.stderr
    first = done.stdout.split()
    assert first[0] == "run" and first[2] == "created", done.stdout
    return first[1]


def _kill_when_blocked(cluster: Cluster, marker: Path) -> None:
    try:
        wait_for(marker.exists, timeout=60)
    except TimeoutError:
        pytest.fail(f"{marker.name} never appeared\n--- qcluster ---\n{cluster.log()}")
    cluster.kill()


def _settle(env: dict[str, str], run_id: str, cluster: Cluster) -> dict[str, Any]:
    state = shell_json(env, SETTLE.format(run_id=run_id, timeout=SETTLE_SECONDS))
    assert state["status"] == "COMPLETED", f"{state}\n--- qcluster ---\n{cluster.log()}"
    return state


def _assert_outbox(state: dict[str, Any]) -> list[tuple[str, str | None]]:
    """Sequences 1..N, gap-free, in order, all published; returns ``(type, stage_id)`` pairs."""
    events = state["events"]
    assert [e[0] for e in events] == list(range(1, len(events) + 1))
    assert all(e[3] for e in events), events
    return [(e[1], e[2]) for e in events]


def _entries(crash_dir: Path, run_id: str, name: str) -> list[str]:
    """The pid of each entry into the crash app's stage or poll ``name``, in order."""
    path = crash_dir / f"{run_id}.{name}.entries"
    return path.read_text().splitlines() if path.exists() else []


def test_crash_mid_stage_redelivers_after_lease_expiry(
    crash_env: dict[str, str], clusters: Callable[[dict[str, str]], Cluster]
) -> None:
    """SIGKILL of the whole cluster while ``hang`` executes: the job stays RUNNING with a lease
    nobody refreshes; a new cluster's tick releases it once the lease is older than
    ``STALE_LEASE_SECONDS`` (DM-45, K-LR-1), the stage runs again on delivery 2 (H-4, SM-20)
    and the run completes; each output is stored once and the outbox stays gap-free (EV-3).
    """
    env = crash_env
    crash_dir = Path(env["CRASH_DIR"])
    first = clusters(env)
    run_id = _start_run(env, "crash-pipeline", "mid-stage")
    _kill_when_blocked(first, crash_dir / f"{run_id}.hang.blocked")

    at_kill = shell_json(env, SNAPSHOT.format(run_id=run_id))
    assert at_kill["stages"] == {"prepare": "COMPLETED", "hang": "RUNNING"}
    assert at_kill["jobs"]["hang"] == ["RUNNING", 1]

    second = clusters(env)
    state = _settle(env, run_id, second)

    assert state["stages"] == {"prepare": "COMPLETED", "hang": "COMPLETED", "finish": "COMPLETED"}
    assert state["jobs"] == {
        "prepare": ["COMPLETED", 1],
        "hang": ["COMPLETED", 2],
        "finish": ["COMPLETED", 1],
    }
    first_pid, second_pid = _entries(crash_dir, run_id, "hang")
    assert first_pid != second_pid  # delivery 2 ran in the new cluster
    output = state["output"]
    assert (output["label"], output["deliveries"]) == ("mid-stage", 2)
    assert output["summary"].endswith(":2")
    prefix = f"workflow-v2/crash-pipeline/{run_id}/"
    assert state["blobs"] == [f"{prefix}{sid}/output.json" for sid in ("finish", "hang", "prepare")]

    types = _assert_outbox(state)
    assert types == [
        ("workflow:created", None),
        ("workflow:started", None),
        ("stage:started", "prepare"),
        ("stage:completed", "prepare"),
        ("stage:started", "hang"),  # delivery 1, killed
        ("stage:started", "hang"),  # delivery 2 after the lease expired
        ("stage:completed", "hang"),
        ("stage:started", "finish"),
        ("stage:completed", "finish"),
        ("workflow:completed", None),
    ]


def test_crash_mid_poll_resumes_on_next_poll(
    crash_env: dict[str, str], clusters: Callable[[dict[str, str]], Cluster]
) -> None:
    """SIGKILL of the whole cluster while the tick runs ``check_completion`` of the suspended
    ``batch`` stage: nothing of the poll was written (its outcome transaction never ran,
    K-PS-5), the stage stays SUSPENDED with its poll due; the new cluster's tick polls again,
    the stage completes with its output stored once, and the run completes with a gap-free
    outbox (K-PS-6.2, EV-3).
    """
    env = crash_env
    crash_dir = Path(env["CRASH_DIR"])
    first = clusters(env)
    run_id = _start_run(env, "crash-poll", "mid-poll")
    _kill_when_blocked(first, crash_dir / f"{run_id}.poll.blocked")

    at_kill = shell_json(env, SNAPSHOT.format(run_id=run_id))
    assert at_kill["stages"] == {"prepare": "COMPLETED", "batch": "SUSPENDED"}
    assert at_kill["jobs"]["batch"] == ["SUSPENDED", 1]

    second = clusters(env)
    state = _settle(env, run_id, second)

    assert state["stages"] == {
        "prepare": "COMPLETED",
        "batch": "COMPLETED",
        "finish": "COMPLETED",
    }
    assert state["jobs"] == {
        "prepare": ["COMPLETED", 1],
        "batch": ["COMPLETED", 1],
        "finish": ["COMPLETED", 1],
    }
    assert len(_entries(crash_dir, run_id, "submit")) == 1  # execute is not run again
    first_pid, second_pid = _entries(crash_dir, run_id, "poll")
    assert first_pid != second_pid  # the second poll ran in the new cluster
    assert state["output"]["deliveries"] == 2
    prefix = f"workflow-v2/crash-poll/{run_id}/"
    assert state["blobs"] == [
        f"{prefix}{sid}/output.json" for sid in ("batch", "finish", "prepare")
    ]

    types = _assert_outbox(state)
    assert types == [
        ("workflow:created", None),
        ("workflow:started", None),
        ("stage:started", "prepare"),
        ("stage:completed", "prepare"),
        ("stage:started", "batch"),
        ("stage:suspended", "batch"),
        ("workflow:suspended", "batch"),
        ("stage:completed", "batch"),
        ("stage:started", "finish"),
        ("stage:completed", "finish"),
        ("workflow:completed", None),
    ]
