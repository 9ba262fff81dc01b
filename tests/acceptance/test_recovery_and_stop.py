"""Prompt recovery and graceful stop with real clusters (issue 8 items 2-3; scenarios c, g).

No ``workflows_tick`` loop runs beside the clusters: they recover on their own, through the
supervisor thread of each worker process (``django_workflows.kernel.supervisor``).

* (c) Two clusters; the one running a stage is SIGKILLed (whole process group) mid-stage,
  several times: the other re-delivers the stage within ``STALE_LEASE_SECONDS`` + 5 s, every
  run completes, each stage's outcome is committed once and the outbox is gap-free. The
  cluster holding the ``ticker`` lease is SIGKILLed: another process holds it within its TTL
  + a tick.
* (g) SIGTERM to one of two clusters mid-burst: no stage is started by the stopping cluster
  after the SIGTERM, it exits promptly, every run completes. Past ``STOP_GRACE_SECONDS`` a
  stage still running is released and re-run elsewhere, its late result discarded, and the
  cluster exits within the grace period + a few seconds.

Measured times are written to ``$LIFE_TIMINGS`` (a JSON-lines file) when it is set.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from .harness import (
    ROOT,
    Cluster,
    assert_outbox_gap_free,
    assert_outcomes_once,
    assert_runs_completed,
    create_runs,
    executions,
    settle_runs,
    wait_for,
    without,
)

pytestmark = [pytest.mark.acceptance]

STALE = 3
ENV = {
    "EXTRA_INSTALLED_APPS": "tests.acceptance.crashapp",
    "WORKFLOWS_STALE_LEASE_SECONDS": str(STALE),
    "WORKFLOWS_HEARTBEAT_SECONDS": "1",
    "WORKFLOWS_TICK_INTERVAL": "0.2",
    "WORKFLOWS_SUPERVISOR_INTERVAL": "0.5",
    "WORKFLOWS_TICKER_LEASE_SECONDS": str(STALE),
    "Q_WORKERS": "2",
}


def _record(name: str, **values: Any) -> None:
    path = os.environ.get("LIFE_TIMINGS")
    if path:
        with open(path, "a") as fh:
            fh.write(json.dumps({"test": name, **values}) + "\n")


def _group_of(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


def _pids_of(cluster: Cluster) -> set[int]:
    """Every live process in the cluster's process group (main, sentinel, workers...)."""
    assert cluster.proc is not None
    out = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and _group_of(int(entry.name)) == cluster.proc.pid:
            out.add(int(entry.name))
    return out


@pytest.fixture
def env(project: Callable[..., dict[str, str]], tmp_path: Path) -> dict[str, str]:
    crash_dir = tmp_path / "crash"
    crash_dir.mkdir()
    return project(**ENV, CRASH_DIR=str(crash_dir))


def _entries(crash_dir: Path, run_id: str, name: str) -> list[int]:
    path = crash_dir / f"{run_id}.{name}.entries"
    return [int(p) for p in path.read_text().splitlines()] if path.exists() else []


def _ready(cluster: Cluster) -> None:
    """Wait until the cluster's workers run (their supervisor threads started)."""
    wait_for(lambda: "running" in cluster.log().lower() or len(_pids_of(cluster)) >= 5, timeout=60)


def test_sigkill_of_the_cluster_running_a_stage_recovers_within_the_lease(
    env: dict[str, str], clusters: Callable[..., Cluster]
) -> None:
    """(c) Four times: two clusters alive, the one executing ``hang`` is SIGKILLed; the other
    starts the stage again within ``STALE_LEASE_SECONDS`` + 5 s without any tick loop or
    django-q2 schedule (the survivors' supervisors take the ticker over and reap the lease).
    """
    crash_dir = Path(env["CRASH_DIR"])
    alive = [clusters(env), clusters(env)]
    for c in alive:
        _ready(c)
    run_ids: list[str] = []
    recoveries: list[float] = []
    for i in range(4):
        (run_id,) = create_runs(env, "crash-pipeline", [{"label": f"kill-{i}"}])
        run_ids.append(run_id)
        blocked = crash_dir / f"{run_id}.hang.blocked"
        wait_for(blocked.exists, timeout=60)
        pid = int(blocked.read_text())
        victim = next(c for c in alive if c.proc is not None and _group_of(pid) == c.proc.pid)
        killed_at = time.monotonic()
        victim.kill()
        restarted = wait_for(
            lambda run_id=run_id: len(_entries(crash_dir, run_id, "hang")) >= 2,
            timeout=STALE + 30,
            interval=0.02,
        )
        assert restarted
        recoveries.append(time.monotonic() - killed_at)
        alive.remove(victim)
        fresh = clusters(env)
        _ready(fresh)
        alive.append(fresh)
    log = "\n".join(c.log()[-3000:] for c in alive)
    runs = settle_runs(env, run_ids, timeout=60)
    assert_runs_completed(runs, log)
    assert_outcomes_once(runs, log)
    assert_outbox_gap_free(runs, log)
    for rid in run_ids:
        first, second = _entries(crash_dir, rid, "hang")
        assert first != second
        assert runs[rid]["output"]["deliveries"] == 2
    _record("sigkill_mid_stage", recoveries=recoveries, stale=STALE)
    assert max(recoveries) <= STALE + 5, recoveries


LEASE_OWNER = """
import json, sys, time
from django_workflows.models import MaintenanceLease
last = None
deadline = time.monotonic() + {timeout}
while time.monotonic() < deadline:
    row = (
        MaintenanceLease.objects.filter(name__startswith="ticker@")
        .values_list("owner", flat=True).first()
    )
    if row != last:
        print(json.dumps([time.monotonic(), row]), flush=True)
        last = row
    time.sleep(0.02)
"""


def test_sigkill_of_the_ticker_holder_is_replaced_within_its_ttl(
    env: dict[str, str], clusters: Callable[..., Cluster], tmp_path: Path
) -> None:
    """(c) The cluster whose worker holds the ``ticker`` lease (while a run is live) is
    SIGKILLed; a process of the other cluster holds the lease within its TTL + one
    supervisor interval + a tick, and the run still completes.
    """
    crash_dir = Path(env["CRASH_DIR"])
    a, b = clusters(env), clusters(env)
    _ready(a)
    _ready(b)
    (run_id,) = create_runs(env, "crash-pipeline", [{"label": "ticker"}])
    wait_for((crash_dir / f"{run_id}.hang.blocked").exists, timeout=60)
    watcher = subprocess.Popen(
        [sys.executable, "manage.py", "shell", "-v0", "-c", LEASE_OWNER.format(timeout=60)],
        cwd=ROOT,
        env=without(env),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert watcher.stdout is not None
        changes: list[tuple[float, str | None]] = []

        def owner() -> str | None:
            line = watcher.stdout.readline()  # type: ignore[union-attr]
            changes.append(tuple(json.loads(line)))  # type: ignore[arg-type]
            return changes[-1][1]

        holder = None
        while holder is None:
            holder = owner()
        holder_pid = int(holder.split("-")[-3])
        victim = a if a.proc is not None and _group_of(holder_pid) == a.proc.pid else b
        survivor = b if victim is a else a
        survivor_pids = _pids_of(survivor)
        killed_at = time.monotonic()
        victim.kill()
        while True:
            new = owner()
            if new is not None and new != holder:
                break
        replaced = changes[-1][0] - killed_at
        assert int(new.split("-")[-3]) in survivor_pids, (new, survivor_pids)
    finally:
        watcher.kill()
        watcher.wait()
    runs = settle_runs(env, [run_id], timeout=60)
    assert_runs_completed(runs, survivor.log()[-3000:])
    assert_outbox_gap_free(runs)
    _record("sigkill_ticker_holder", replaced=replaced, ttl=STALE)
    # TTL + supervisor interval (0.5 s) + a tick + the watcher's and the kill's latency.
    assert replaced <= STALE + 2, changes


def test_sigterm_mid_burst_starts_nothing_new_and_exits_promptly(
    project: Callable[..., dict[str, str]], clusters: Callable[..., Cluster], tmp_path: Path
) -> None:
    """(g) 30 runs of ``fault-pipeline`` (stages of 0.3 s) on two clusters; SIGTERM to one
    mid-burst: no stage body starts in its processes after the SIGTERM, it exits within a few
    seconds (it finishes what it runs), and the other cluster completes every run.
    """
    crash_dir = tmp_path / "crash"
    crash_dir.mkdir()
    env = project(**ENV, CRASH_DIR=str(crash_dir), CRASH_STAGE_SECONDS="0.3")
    stopping, other = clusters(env), clusters(env)
    _ready(stopping)
    _ready(other)
    run_ids = create_runs(env, "fault-pipeline", [{"n": i} for i in range(30)])
    stopping_pids = _pids_of(stopping)
    wait_for(
        lambda: sum(1 for e in executions(crash_dir) if e["pid"] in stopping_pids) >= 4,
        timeout=60,
    )
    assert stopping.proc is not None
    sigterm_at = time.time()
    t0 = time.monotonic()
    stopping.proc.send_signal(signal.SIGTERM)
    stopping.proc.wait(timeout=30)
    exit_seconds = time.monotonic() - t0
    runs = settle_runs(env, run_ids, timeout=90)
    log = stopping.log()[-4000:]
    assert_runs_completed(runs, log)
    assert_outcomes_once(runs, log)
    assert_outbox_gap_free(runs, log)
    late = [e for e in executions(crash_dir) if e["pid"] in stopping_pids and e["at"] > sigterm_at]
    assert not late, f"stages started by the stopping cluster after SIGTERM: {late}\n{log}"
    by_stopping = sum(1 for e in executions(crash_dir) if e["pid"] in stopping_pids)
    _record("sigterm_mid_burst", exit_seconds=exit_seconds, stages_by_stopping=by_stopping)
    assert exit_seconds < 10, exit_seconds


@pytest.mark.parametrize("cancellable", [True, False], ids=["returns-when-cancelled", "ignores"])
def test_sigterm_past_the_grace_period_releases_the_running_stage(
    project: Callable[..., dict[str, str]],
    clusters: Callable[..., Cluster],
    tmp_path: Path,
    cancellable: bool,
) -> None:
    """(g) A stage longer than ``STOP_GRACE_SECONDS`` (2 s) when its cluster gets SIGTERM: it is
    released (PENDING for another worker, ``ctx.is_cancelled()`` true), the other cluster runs
    it again, the late result of the released delivery (``returns-when-cancelled``) is
    discarded by the fence, and the stopping cluster exits within grace + a few seconds - also
    when the stage body ignores the cancellation (``ignores``: its process exits).
    """
    grace = 2.0
    crash_dir = tmp_path / "crash"
    crash_dir.mkdir()
    extra = {"CRASH_SLOW_CANCELLABLE": "1"} if cancellable else {}
    env = project(
        **ENV,
        CRASH_DIR=str(crash_dir),
        WORKFLOWS_STOP_GRACE_SECONDS=str(grace),
        CRASH_BLOCK_SECONDS="40",
        **extra,
    )
    first = clusters(env)
    _ready(first)
    (run_id,) = create_runs(env, "pause-pipeline", [{"late": "success"}])
    (crash_dir / f"{run_id}.gate.go").write_text("")  # the gate stage goes straight through
    blocked = crash_dir / f"{run_id}.slow.blocked"
    wait_for(blocked.exists, timeout=60)
    second = clusters(env)
    _ready(second)
    assert first.proc is not None
    t0 = time.monotonic()
    first.proc.send_signal(signal.SIGTERM)
    first.proc.wait(timeout=30)
    exit_seconds = time.monotonic() - t0
    runs = settle_runs(env, [run_id], timeout=60)
    log = first.log()[-4000:]
    assert_runs_completed(runs, log)
    assert_outcomes_once(runs, log)
    assert_outbox_gap_free(runs, log)
    run = runs[run_id]
    slow = [e for e in executions(crash_dir) if e["stage"] == "slow"]
    assert [e["entry"] for e in slow] == [1, 2], slow
    assert slow[0]["pid"] != slow[1]["pid"]
    assert run["output"]["delivery"] == 2  # the re-run's result was kept
    messages = [m for _, m in run["logs"]]
    assert any("released by a stopping worker" in m for m in messages), messages
    if cancellable:  # the late result came back and was thrown away by the fence
        assert any("its result was discarded" in m for m in messages), messages
    slow_job = next(j for j in run["jobs"] if j[0] == "slow")
    assert slow_job[1:3] == ["COMPLETED", 2], run["jobs"]
    _record("sigterm_grace", cancellable=cancellable, exit_seconds=exit_seconds, grace=grace)
    assert exit_seconds <= grace + 5, exit_seconds
