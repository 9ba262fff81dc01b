"""Stage timeouts on a real ``qcluster`` (issue 12 item 2).

``timeout-pipeline``'s stage ``timed`` has ``timeout_seconds=1.5`` and overruns it on its first
delivery in four ways: a ``time.sleep`` loop that checks nothing, a 30 s ``sleep(3)`` inside C
(``ctypes``), a loop that asks ``ctx.is_cancelled()`` and ignores the answer, and a polite body
that returns (a late result) once ``ctx.is_cancelled()`` turns true. Each delivery must fail
with ``StageTimeout`` naming the stage and limit, the retry (``MAX_ATTEMPTS=2``) must complete
the run, and the later stage must run on the same cluster. The three bodies that do not return
must have their worker process recycled (it no longer exists; django-q2 started another);
the polite one keeps its process, and its late result is discarded. A run whose every delivery
overruns fails after its two attempts. Django-q2's own ``timeout`` (600 s) never fires.

The queue-wait limit: with ``DEFAULT_QUEUE_TIMEOUT_SECONDS`` set and only the default cluster
running, ``routed-pipeline``'s ``embed`` job (queue ``gpu``) is failed by the ticker's
maintenance tick, naming the missing queue; its run fails, the stage before it completed.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from .harness import (
    Cluster,
    assert_outbox_gap_free,
    assert_runs_completed,
    create_runs,
    settle_runs,
    wait_for,
)

pytestmark = [pytest.mark.acceptance]

ERROR = "StageTimeout: stage 'timed' timed out after 1.5 s (timeout_seconds=1.5)"
MODES = ["python", "c", "stubborn", "polite"]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_overrunning_stages_time_out_are_retried_and_their_workers_recycled(
    project: Callable[..., dict[str, str]],
    clusters: Callable[..., Cluster],
    tmp_path: Path,
) -> None:
    crash_dir = tmp_path / "crash"
    crash_dir.mkdir()
    env = project(
        EXTRA_INSTALLED_APPS="tests.acceptance.crashapp",
        CRASH_DIR=str(crash_dir),
        Q_WORKERS="2",
        WORKFLOWS_STAGE_TIMEOUT_GRACE="1",
        WORKFLOWS_MAX_ATTEMPTS="2",
        WORKFLOWS_RETRY_BACKOFF_BASE="0.2",
        WORKFLOWS_STALE_LEASE_SECONDS="120",  # lease expiry must play no part
        WORKFLOWS_HEARTBEAT_SECONDS="1",
    )
    cluster = clusters(env)
    began = time.monotonic()
    run_ids = create_runs(env, "timeout-pipeline", [{"mode": m} for m in MODES])
    [always] = create_runs(env, "timeout-pipeline", [{"mode": "python", "always": True}])
    runs = settle_runs(env, [*run_ids, always], timeout=120)
    elapsed = time.monotonic() - began
    context = f"{runs}\n--- qcluster ---\n{cluster.log()[-6000:]}"

    finished = {rid: runs[rid] for rid in run_ids}
    assert_runs_completed(finished, context)
    assert_outbox_gap_free(runs, context)
    for mode, rid in zip(MODES, run_ids, strict=True):
        run = runs[rid]
        events = [(e[1], e[2]) for e in run["events"]]
        assert events == [
            ("workflow:created", None),
            ("workflow:started", None),
            ("stage:started", "timed"),
            ("stage:failed", "timed"),  # the timed-out delivery, once
            ("stage:started", "timed"),
            ("stage:completed", "timed"),  # the retry
            ("stage:started", "after"),
            ("stage:completed", "after"),
            ("workflow:completed", None),
        ], f"{mode}: {events}\n{context}"
        job = next(j for j in run["jobs"] if j[0] == "timed")
        assert (job[1], job[2]) == ("COMPLETED", 2), f"{mode}: {job}\n{context}"
        assert run["outputs"]["timed"] == {"mode": mode, "delivery": 2, "late": False}, context
        assert run["outputs"]["after"]["delivery"] == 2, context  # the later stage ran
        pids = [int(p) for p in (crash_dir / f"{rid}.timed.entries").read_text().split()]
        assert len(pids) == 2, f"{mode}: {pids}\n{context}"
        if mode == "polite":
            # Returned within the grace: its late result was discarded (not recycled: see the
            # log counts below; its process may be recycled later, by the doomed run).
            assert (crash_dir / f"{rid}.timed.late").exists(), context
        else:
            assert not _alive(pids[0]), f"{mode}: worker {pids[0]} still exists\n{context}"
    errors = [log[1] for rid in run_ids for log in runs[rid]["logs"] if "StageTimeout" in log[1]]
    assert all(ERROR in e for e in errors) and len(errors) >= len(MODES), context

    doomed = runs[always]
    assert doomed["status"] == "FAILED", context
    assert doomed["stages"]["timed"] == "FAILED", context
    [job] = doomed["jobs"]
    assert (job[1], job[2], job[3]) == ("FAILED", 2, ERROR), context
    assert [(e[1], e[2]) for e in doomed["events"]].count(("stage:failed", "timed")) == 2

    log = cluster.log()
    # Six deliveries timed out (4 first deliveries, 2 of the doomed run); all but the polite
    # one were still running after the grace and had their process recycled.
    assert log.count("passed its timeout of 1.5 s") == 6, context
    assert log.count("recycling this worker process") == 5, context
    assert "reincarnated worker" in log, context
    assert "django-q2's timeout" not in log, context
    assert cluster.running, context

    # The cluster still works: a new run goes straight through (its first delivery overruns
    # too, and is retried on a fresh worker).
    [fresh] = create_runs(env, "timeout-pipeline", [{"mode": "c"}])
    state = settle_runs(env, [fresh], timeout=60)
    assert_runs_completed(state, f"{state}\n{cluster.log()[-3000:]}")
    wait_for(lambda: cluster.running, timeout=1)
    print(f"stage timeouts: {len(runs)} runs settled in {elapsed:.1f} s")


def test_a_job_no_worker_of_its_queue_picks_up_fails_naming_the_queue(
    project: Callable[..., dict[str, str]],
    clusters: Callable[..., Cluster],
    tmp_path: Path,
) -> None:
    crash_dir = tmp_path / "crash"
    crash_dir.mkdir()
    env = project(
        EXTRA_INSTALLED_APPS="tests.acceptance.crashapp",
        CRASH_DIR=str(crash_dir),
        WORKFLOWS_QUEUES="gpu=gpu",
        WORKFLOWS_DEFAULT_QUEUE_TIMEOUT="6",
        Q_WORKERS="2",
    )
    cluster = clusters(env)  # the default cluster only: nobody serves "gpu"
    began = time.monotonic()
    run_ids = create_runs(env, "routed-pipeline", [{"n": 1}, {"n": 2}])
    runs = settle_runs(env, run_ids, timeout=60)
    elapsed = time.monotonic() - began
    context = f"{runs}\n--- qcluster ---\n{cluster.log()[-3000:]}"
    message = (
        "QueueTimeout: no worker of queue 'gpu' picked up the job within 6 s (stage 'embed', "
        "queue_timeout_seconds=6); is a worker of that queue running?"
    )
    assert_outbox_gap_free(runs, context)
    for run in runs.values():
        assert run["status"] == "FAILED", context
        assert run["stages"] == {"prep": "COMPLETED", "embed": "FAILED"}, context
        embed = next(j for j in run["jobs"] if j[0] == "embed")
        assert (embed[1], embed[2], embed[3]) == ("FAILED", 0, message), context
        assert ("stage:failed", "embed") in [(e[1], e[2]) for e in run["events"]], context
    assert 6 <= elapsed < 40, context
    print(f"queue-wait limit: {len(runs)} runs failed {elapsed:.1f} s after creation")
