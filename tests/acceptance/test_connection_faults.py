"""Real-process connection faults on one host (issue 8, scenarios (e) and (f)).

* (e) A burst of runs of ``conn-pipeline`` (one -> two, each stage idling a random 1-3 s) on a
  qcluster while a killer thread terminates every backend of the test database every 2-3 s.
* (f) ``idle_session_timeout = 3s`` on the test database and stages that idle 5 s: the
  server closes every worker connection that sat through a stage.

Both: every run COMPLETED, each stage's outcome committed once, outbox gap-free, and no stage
delivered twice because of a lost connection (job attempts all 1, one execution per stage).
A kill costs a retried write (WARN "reconnecting, retry"), never a delivery. They need
PostgreSQL (SQLite has no connection to lose) and take 40-70 s each; the numbers they print
(``-s``) are the measurements of notes/bench.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import pytest

from tests.markers import ON_POSTGRES

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
    wait_for,
)

pytestmark = [
    pytest.mark.acceptance,
    pytest.mark.skipif(not ON_POSTGRES, reason="needs PostgreSQL: connections to terminate"),
]

CONN_ENV = {
    "EXTRA_INSTALLED_APPS": "tests.acceptance.crashapp",
    "WORKFLOWS_STALE_LEASE_SECONDS": "5",
    "WORKFLOWS_HEARTBEAT_SECONDS": "1",
    "WORKFLOWS_TICK_INTERVAL": "0.2",
    "Q_WORKERS": "4",
}

#: Connections of the test itself (polling) carry this name and are spared by the killer.
SPARED = "res-connection-faults-test"


def _admin_url(database_url: str) -> str:
    return database_url.rsplit("/", 1)[0] + "/postgres"


def _db_name(database_url: str) -> str:
    return database_url.rsplit("/", 1)[1]


class Killer(threading.Thread):
    """Terminates every backend of one database every 2-3 s (bounded: stops by itself after
    ``max_seconds``), counting the rounds and the backends it terminated."""

    def __init__(self, database_url: str, max_seconds: float = 120) -> None:
        super().__init__(name="connection-killer", daemon=True)
        self.admin = _admin_url(database_url)
        self.name_ = _db_name(database_url)
        self.deadline = time.monotonic() + max_seconds
        self.stopped = threading.Event()
        self.rounds = 0
        self.terminated = 0

    def run(self) -> None:
        with psycopg.connect(self.admin, autocommit=True) as conn:
            while not self.stopped.wait(random.uniform(2.0, 3.0)):
                if time.monotonic() > self.deadline:
                    return
                killed = conn.execute(
                    "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                    "WHERE datname = %s AND pid <> pg_backend_pid() "
                    "AND application_name <> %s",
                    [self.name_, SPARED],
                ).fetchone()[0]
                self.rounds += 1
                self.terminated += int(killed)

    def stop(self) -> None:
        self.stopped.set()
        self.join(timeout=10)


def _live_runs(database_url: str, run_ids: list[str]) -> int:
    with psycopg.connect(database_url, autocommit=True, application_name=SPARED) as conn:
        return int(
            conn.execute(
                "SELECT count(*) FROM workflow_runs WHERE id = ANY(%s::uuid[]) "
                "AND status NOT IN ('COMPLETED', 'FAILED', 'CANCELLED')",
                [run_ids],
            ).fetchone()[0]
        )


def _measure(
    runs: dict[str, dict[str, Any]], crash_dir: Path, log: str, seconds: float
) -> dict[str, Any]:
    attempts = [job[2] for run in runs.values() for job in run["jobs"]]
    stages = sum(len(run["stages"]) for run in runs.values())
    return {
        "runs": len(runs),
        "completed": sum(r["status"] == "COMPLETED" for r in runs.values()),
        "stages": stages,
        "executions": len(executions(crash_dir)),
        "max_attempt": max(attempts, default=0),
        "deliveries_per_stage": round(sum(attempts) / max(stages, 1), 3),
        "retried_writes": log.count("reconnecting, retry"),
        "lost_acks_recognised": log.count("had committed before the connection was lost"),
        "discarded": log.lower().count("discarded"),
        "seconds_to_settle": round(seconds, 1),
    }


def _assert_clean(
    runs: dict[str, dict[str, Any]], crash_dir: Path, context: str, expected: int
) -> None:
    assert len(runs) == expected, context
    assert_runs_completed(runs, context)
    assert_outcomes_once(runs, context)
    assert_outbox_gap_free(runs, context)
    redelivered = {
        rid[:8]: [j for j in run["jobs"] if j[2] != 1]
        for rid, run in runs.items()
        if any(j[2] != 1 for j in run["jobs"])
    }
    assert not redelivered, f"stages delivered more than once: {redelivered}\n{context}"
    assert_executed_once(crash_dir, runs, context)


def test_every_connection_terminated_every_few_seconds_during_a_burst(
    project: Callable[..., dict[str, str]],
    clusters: Callable[..., Cluster],
    database_url: str,
    tmp_path: Path,
) -> None:
    """Scenario (e): 20 runs, stages of 1-3 s, all backends terminated every 2-3 s."""
    crash_dir = tmp_path / "crash"
    crash_dir.mkdir()
    env = project(**CONN_ENV, CRASH_DIR=str(crash_dir), CONN_STAGE_SECONDS="1-3")
    cluster = clusters(env)
    ticker = clusters(env, *tick_command(), log="ticker.log")
    run_ids = create_runs(env, "conn-pipeline", [{"n": i} for i in range(20)])
    killer = Killer(database_url)
    started = time.monotonic()
    killer.start()
    try:
        wait_for(lambda: _live_runs(database_url, run_ids) == 0, timeout=150, interval=0.5)
    except TimeoutError:
        pass  # the assertions below say what is wrong
    finally:
        killer.stop()
    seconds = time.monotonic() - started
    runs = settle_runs(env, run_ids, timeout=30)
    log = cluster.log()
    numbers = _measure(runs, crash_dir, log, seconds)
    numbers.update(kill_rounds=killer.rounds, backends_terminated=killer.terminated)
    print("scenario (e):", numbers)
    context = f"{numbers}\n--- qcluster ---\n{log[-5000:]}\n--- ticker ---\n{ticker.log()[-1500:]}"
    assert killer.rounds >= 3 and killer.terminated > 0, context
    _assert_clean(runs, crash_dir, context, expected=20)
    assert numbers["retried_writes"] > 0, context  # the kills did hit the stage path


def test_idle_session_timeout_shorter_than_a_stage(
    project: Callable[..., dict[str, str]],
    clusters: Callable[..., Cluster],
    database_url: str,
    tmp_path: Path,
) -> None:
    """Scenario (f): idle_session_timeout = 3s, stages that idle 5 s: 10/10 COMPLETED."""
    crash_dir = tmp_path / "crash"
    crash_dir.mkdir()
    env = project(**CONN_ENV, CRASH_DIR=str(crash_dir), CONN_STAGE_SECONDS="5")
    with psycopg.connect(_admin_url(database_url), autocommit=True) as conn:
        conn.execute(f"ALTER DATABASE \"{_db_name(database_url)}\" SET idle_session_timeout = '3s'")
    cluster = clusters(env)
    ticker = clusters(env, *tick_command(), log="ticker.log")
    run_ids = create_runs(env, "conn-pipeline", [{"n": i} for i in range(10)])
    started = time.monotonic()
    try:
        wait_for(lambda: _live_runs(database_url, run_ids) == 0, timeout=150, interval=0.5)
    except TimeoutError:
        pass
    seconds = time.monotonic() - started
    runs = settle_runs(env, run_ids, timeout=30)
    log = cluster.log()
    numbers = _measure(runs, crash_dir, log, seconds)
    print("scenario (f):", numbers)
    context = f"{numbers}\n--- qcluster ---\n{log[-5000:]}\n--- ticker ---\n{ticker.log()[-1500:]}"
    _assert_clean(runs, crash_dir, context, expected=10)
    assert numbers["retried_writes"] > 0, context  # the server did close idle connections
