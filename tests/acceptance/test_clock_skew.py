"""Two clusters on one database, one host's clock 90 s ahead (issue 7: leases must not compare
two hosts' clocks).

Cluster A uses the system clock; cluster B's kernel clock runs ``CLOCK_OFFSET_SECONDS`` ahead
(``WORKFLOWS_CLOCK=tests.acceptance.crashapp.clocks.SkewedClock``). Both use the README's
"faster failover" settings (30 s lease, 5 s heartbeat) and each has its maintenance-tick loop
beside it (``workflows_tick --loop``, with that host's clock), as two hosts would. ``RUNS`` runs
of ``fault-pipeline`` (a -> [b | c] -> d, each stage ``STAGE_SECONDS`` long) go through both
clusters. No worker dies, so no lease may expire: every stage must execute exactly once (the
crash app records each execution of a stage body), with exactly one ``stage:completed``; every
run completes and its outbox is gap-free.

On a kernel that stamps ``locked_at`` with the worker's clock and judges it with the reaper's,
B's tick sees every job A is executing as 90 s old and releases it at once: second deliveries
overlap live first ones. PostgreSQL only (two clusters' workers on one SQLite file are not a
deployment we support). About 40-50 s.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.markers import postgres_only

from .harness import (
    Cluster,
    assert_executed_once,
    assert_outbox_gap_free,
    assert_outcomes_once,
    assert_runs_completed,
    create_runs,
    executions,
    settle_runs,
    tick_command,
)

pytestmark = [pytest.mark.acceptance, postgres_only]

RUNS = 60
CLOCK_OFFSET_SECONDS = 90
STAGE_SECONDS = 0.3

#: The README's "faster failover" settings, two workers per cluster.
SKEW_ENV = {
    "EXTRA_INSTALLED_APPS": "tests.acceptance.crashapp",
    "WORKFLOWS_STALE_LEASE_SECONDS": "30",
    "WORKFLOWS_HEARTBEAT_SECONDS": "5",
    "WORKFLOWS_TICK_INTERVAL": "0.2",
    "Q_WORKERS": "2",
    "CRASH_STAGE_SECONDS": str(STAGE_SECONDS),
}


def _group_of(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


def test_skewed_clock_cluster_executes_each_stage_once(
    project: Callable[..., dict[str, str]],
    clusters: Callable[..., Cluster],
    tmp_path: Path,
) -> None:
    """60 runs through a cluster on the right time and one 90 s ahead: each stage executed
    once, one ``stage:completed`` each, all runs COMPLETED, gap-free outboxes.
    """
    crash_dir = tmp_path / "crash"
    crash_dir.mkdir()
    env = project(**SKEW_ENV, CRASH_DIR=str(crash_dir))
    skewed = dict(
        env,
        WORKFLOWS_CLOCK="tests.acceptance.crashapp.clocks.SkewedClock",
        CRASH_CLOCK_OFFSET_SECONDS=str(CLOCK_OFFSET_SECONDS),
    )
    right = clusters(env)
    ahead = clusters(skewed)
    clusters(env, *tick_command(), log="ticker-right.log")
    clusters(skewed, *tick_command(), log="ticker-ahead.log")

    run_ids = create_runs(env, "fault-pipeline", [{"n": i} for i in range(RUNS)])
    runs = settle_runs(env, run_ids, timeout=50)

    # Which cluster ran each execution (its workers are in the cluster's process group).
    assert right.proc is not None and ahead.proc is not None
    groups = {right.proc.pid: "right", ahead.proc.pid: "ahead"}
    done = executions(crash_dir)
    by_cluster = Counter(groups.get(_group_of(e["pid"]) or -1, "?") for e in done)
    statuses = Counter(r["status"] for r in runs.values())
    summary = (
        f"{len(done)} executions for {4 * RUNS} stages, by cluster {dict(by_cluster)}, "
        f"runs {dict(statuses)}"
    )
    print(summary)
    context = f"{summary}\n--- qcluster ---\n{right.log()[-3000:]}"

    assert len(runs) == RUNS
    assert_executed_once(crash_dir, runs, context)
    assert_outcomes_once(runs, context)
    assert_runs_completed(runs, context)
    assert_outbox_gap_free(runs, context)
    for rid, run in runs.items():
        assert run["output"]["path"] == ["a", "b", "c", "d"], f"{rid}: {run['output']}"
    # Both clusters did work, so the skewed one's leases and ticks met the other's jobs.
    assert by_cluster["right"] > 0 and by_cluster["ahead"] > 0, context


#: Long stages (issue 17): each longer than the lease, kept alive by heartbeats only.
LONG_RUNS = 2
LONG_STAGE_SECONDS = 12
LONG_ENV = {
    "EXTRA_INSTALLED_APPS": "tests.acceptance.crashapp",
    "WORKFLOWS_STALE_LEASE_SECONDS": "10",
    "WORKFLOWS_HEARTBEAT_SECONDS": "2",
    "WORKFLOWS_STUCK_THRESHOLD": "15",
    "WORKFLOWS_TICK_INTERVAL": "0.2",
    "Q_WORKERS": "4",
    "CRASH_STAGE_SECONDS": str(LONG_STAGE_SECONDS),
}


def test_a_reaper_90s_ahead_leaves_long_heartbeated_stages_alone(
    project: Callable[..., dict[str, str]],
    clusters: Callable[..., Cluster],
    tmp_path: Path,
) -> None:
    """Issue 17: a cluster on the right time executes ``fault-pipeline`` runs whose stages last
    12 s (a 10 s lease, 2 s heartbeats, a 15 s stuck threshold) and never ticks itself
    (``SUPERVISOR_TICKS`` off); every maintenance tick comes from a tick loop whose clock runs
    90 s ahead. To that reaper every run looks idle for 90 s and more, but its jobs' leases are
    fresh in database time: no run is reaped, each stage runs once, every run completes.

    On a reaper that judged ``locked_at`` (database time) with its own clock, every live lease
    looked 90 s old and its first tick failed each run with ``STUCK_RUN_REAPED``.
    """
    crash_dir = tmp_path / "crash"
    crash_dir.mkdir()
    env = project(**LONG_ENV, CRASH_DIR=str(crash_dir))
    clusters(dict(env, WORKFLOWS_SUPERVISOR_TICKS="0"))
    skewed = dict(
        env,
        WORKFLOWS_CLOCK="tests.acceptance.crashapp.clocks.SkewedClock",
        CRASH_CLOCK_OFFSET_SECONDS=str(CLOCK_OFFSET_SECONDS),
    )
    ticker = clusters(skewed, *tick_command(), log="ticker-ahead.log")

    run_ids = create_runs(env, "fault-pipeline", [{"n": i} for i in range(LONG_RUNS)])
    runs = settle_runs(env, run_ids, timeout=3 * LONG_STAGE_SECONDS + 60)
    context = f"--- ticker ---\n{ticker.log()[-3000:]}"
    statuses = Counter(r["status"] for r in runs.values())
    print(f"runs {dict(statuses)}, {len(executions(crash_dir))} executions")
    assert_runs_completed(runs, context)
    assert_executed_once(crash_dir, runs, context)
    assert_outcomes_once(runs, context)
