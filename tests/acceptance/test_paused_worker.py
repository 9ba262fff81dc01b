"""A worker paused past its lease (SIGSTOP/SIGCONT) while it executes a stage (issue 7).

``pause-pipeline`` (``tests/acceptance/crashapp/faults.py``): first -> slow -> reader -> gate.
The first delivery of ``slow`` announces its pid and waits; the test freezes that worker
process with SIGSTOP - its heartbeat thread freezes with it. After ``STALE_LEASE_SECONDS`` (3 s)
a maintenance tick releases the job, django-q2's other worker (``Q_WORKERS=2``) takes delivery 2,
which completes ``slow`` with its own output; ``reader`` reads that output and ``gate`` then holds
the run RUNNING. Only then does the test SIGCONT the paused worker: its delivery 1 finishes
late - with a success, or with a failure - and must be discarded by the fence (the job's
attempt moved on): no second ``stage:completed``, no overwritten output, no ``stage:failed``,
no failed run; a WARN line says it was discarded. Then the gate opens and the run completes.

A ``workflows_tick --loop`` process beside the cluster notices the expired lease within a tick
(0.2 s); the cluster's own supervisor threads do not tick here (``SUPERVISOR_TICKS`` off, see
``PAUSE_ENV``). Each test takes about 20-25 s; they run
on PostgreSQL and on SQLite.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from .harness import (
    Cluster,
    assert_outbox_gap_free,
    assert_outcomes_once,
    assert_runs_completed,
    create_runs,
    executions,
    settle_runs,
    shell_json,
    tick_command,
    wait_for,
)

pytestmark = [pytest.mark.acceptance]

STALE_LEASE_SECONDS = 3
#: The worker stays frozen at least this long (well past its lease), even if the run moved on
#: sooner.
MIN_PAUSE_SECONDS = 8

PAUSE_ENV = {
    "EXTRA_INSTALLED_APPS": "tests.acceptance.crashapp",
    "WORKFLOWS_STALE_LEASE_SECONDS": str(STALE_LEASE_SECONDS),
    "WORKFLOWS_HEARTBEAT_SECONDS": "1",
    "WORKFLOWS_TICK_INTERVAL": "0.2",
    # Maintenance runs only in the tick loop beside the cluster: a worker process whose
    # supervisor thread ticks could be frozen inside a tick's write transaction, and on SQLite
    # a frozen holder of the write lock blocks every other process for the whole pause.
    "WORKFLOWS_SUPERVISOR_TICKS": "0",
    "Q_WORKERS": "2",
}

#: Waits until the resumed delivery of ``slow`` has visibly ended, whichever way: a second
#: ``stage:completed`` or a ``stage:failed`` of ``slow`` (the old, unfenced kernel), the run
#: leaving RUNNING, or a "discarded" line in the workflow log or in the cluster's log.
LATE_DONE = """
import json, time
from pathlib import Path
from django_workflows.models import OutboxEvent, WorkflowLog, WorkflowRun
run_id = {run_id!r}
cluster_log = Path({log!r})
start = time.monotonic()
seen = []
while time.monotonic() < start + {timeout} and not seen:
    slow = list(
        OutboxEvent.objects.filter(workflow_run_id=run_id, payload__stage_id="slow")
        .values_list("event_type", flat=True)
    )
    if slow.count("stage:completed") > 1:
        seen.append("second stage:completed of slow")
    if "stage:failed" in slow:
        seen.append("stage:failed of slow")
    status = WorkflowRun.objects.get(pk=run_id).status
    if status != "RUNNING":
        seen.append("run " + status)
    if WorkflowLog.objects.filter(run_id=run_id, message__icontains="discard").exists():
        seen.append("discarded (workflow log)")
    if "discard" in cluster_log.read_text().lower():
        seen.append("discarded (cluster log)")
    time.sleep(0.1)
print(json.dumps({{"seen": seen, "seconds": round(time.monotonic() - start, 1)}}))
"""


#: Waits until worker ``pid``'s outbox flusher has given the ``outbox-flush`` lease up and no
#: event is left to publish. The flusher thread writes right after the commit that leased
#: ``slow``, so a SIGSTOP at once could freeze it inside a write transaction; on SQLite that
#: frozen holder of the write lock would block every other process for the whole pause (the
#: CI of stop 22 saw it: "database is locked" in the ticker, the run never moved on).
FLUSHER_QUIET = """
import json, time
from django_workflows.models import MaintenanceLease, OutboxEvent
start = time.monotonic()
quiet = False
while time.monotonic() < start + {timeout} and not quiet:
    held = MaintenanceLease.objects.filter(
        name="outbox-flush", owner__startswith="flusher-{pid}-"
    ).exists()
    waiting = OutboxEvent.objects.filter(published_at__isnull=True, dlq_at__isnull=True).exists()
    quiet = not held and not waiting
    if not quiet:
        time.sleep(0.05)
print(json.dumps({{"quiet": quiet, "seconds": round(time.monotonic() - start, 2)}}))
"""


def _pause_slow_delivery(
    env: dict[str, str],
    clusters: Callable[..., Cluster],
    late: str,
) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """Run ``pause-pipeline`` with its first ``slow`` delivery frozen until the run has moved
    on to ``gate``; returns the run id, what was seen after the resume, and the settled state.
    """
    crash_dir = Path(env["CRASH_DIR"])
    cluster = clusters(env)
    ticker = clusters(env, *tick_command(), log="ticker.log")
    [run_id] = create_runs(env, "pause-pipeline", [{"late": late}])

    def context() -> str:
        return (
            f"run {run_id}\nexecutions: {executions(crash_dir)}\n--- qcluster ---\n"
            f"{cluster.log()[-4000:]}\n--- ticker ---\n{ticker.log()[-1500:]}"
        )

    blocked = crash_dir / f"{run_id}.slow.blocked"
    try:
        wait_for(blocked.exists, timeout=40)
    except TimeoutError:
        pytest.fail(f"slow never started\n{context()}")
    paused_pid = int(blocked.read_text())
    quiet = shell_json(env, FLUSHER_QUIET.format(pid=paused_pid, timeout=20), timeout=60)
    assert quiet["quiet"], f"the flusher of {paused_pid} kept its lease: {quiet}\n{context()}"
    os.kill(paused_pid, signal.SIGSTOP)
    paused_at = time.monotonic()
    try:
        # Delivery 2 runs in the other worker, reader reads its output, gate holds the run.
        wait_for((crash_dir / f"{run_id}.gate.blocked").exists, timeout=40)
        time.sleep(max(0.0, paused_at + MIN_PAUSE_SECONDS - time.monotonic()))
    except TimeoutError:
        pytest.fail(f"the run did not move on while a worker was paused\n{context()}")
    finally:
        paused_for = time.monotonic() - paused_at
        (crash_dir / f"{run_id}.slow.resume").write_text("go")
        os.kill(paused_pid, signal.SIGCONT)
    assert paused_for > STALE_LEASE_SECONDS, paused_for

    late_done = shell_json(
        env, LATE_DONE.format(run_id=run_id, log=str(cluster.log_path), timeout=20)
    )
    (crash_dir / f"{run_id}.gate.go").write_text("go")
    runs = settle_runs(env, [run_id], timeout=30)
    late_done.update(paused_pid=paused_pid, paused_for=round(paused_for, 1))
    print(f"late {late}: {late_done}")
    return run_id, late_done, {"runs": runs, "context": context()}


def _assert_second_delivery_won(
    crash_dir: Path, run_id: str, late_done: dict[str, Any], settled: dict[str, Any]
) -> None:
    runs, ctx = settled["runs"], settled["context"]
    run = runs[run_id]
    where = f"{json.dumps(run)}\nafter resume: {late_done}\n{ctx}"
    assert_runs_completed(runs, where)
    assert_outcomes_once(runs, where)
    assert_outbox_gap_free(runs, where)
    assert not [e for e in run["events"] if e[1] in ("stage:failed", "workflow:failed")], where

    slow = [e for e in executions(crash_dir) if e["run"] == run_id and e["stage"] == "slow"]
    assert [e["entry"] for e in slow] == [1, 2], where
    assert slow[0]["pid"] == late_done["paused_pid"] != slow[1]["pid"], where
    second = {"delivery": 2, "pid": slow[1]["pid"]}
    # The stored output of slow is delivery 2's, and it is what reader and gate read.
    assert {k: run["outputs"]["slow"][k] for k in second} == second, where
    assert run["outputs"]["reader"] == second, where
    assert run["output"] == second, where
    assert all(job[1] == "COMPLETED" for job in run["jobs"]), where
    # The late result was discarded, and said so (WARN "discarded").
    assert any("discarded" in s for s in late_done["seen"]), where


@pytest.fixture
def pause_env(project: Callable[..., dict[str, str]], tmp_path: Path) -> dict[str, str]:
    crash_dir = tmp_path / "crash"
    crash_dir.mkdir()
    return project(**PAUSE_ENV, CRASH_DIR=str(crash_dir))


def test_paused_worker_late_success_is_discarded(
    pause_env: dict[str, str], clusters: Callable[..., Cluster]
) -> None:
    """The paused delivery 1 of ``slow`` returns a result after delivery 2 completed the stage
    and ``reader`` consumed that output: the late success changes nothing - one
    ``stage:completed`` for ``slow``, its stored output is delivery 2's (the one ``reader``
    read), and the run completes.
    """
    run_id, late_done, settled = _pause_slow_delivery(pause_env, clusters, "success")
    _assert_second_delivery_won(Path(pause_env["CRASH_DIR"]), run_id, late_done, settled)


@pytest.mark.parametrize("late", ["fail", "retryable"])
def test_paused_worker_late_failure_is_discarded(
    pause_env: dict[str, str], clusters: Callable[..., Cluster], late: str
) -> None:
    """The paused delivery 1 of ``slow`` raises after delivery 2 completed the stage - a
    non-retryable error (``fail``) or a retryable one (``retryable``): the late failure is
    discarded - ``slow`` stays COMPLETED with delivery 2's output, its job is neither failed
    nor queued again, no ``stage:failed`` or ``workflow:failed`` is written, the run completes.
    """
    run_id, late_done, settled = _pause_slow_delivery(pause_env, clusters, late)
    _assert_second_delivery_won(Path(pause_env["CRASH_DIR"]), run_id, late_done, settled)
