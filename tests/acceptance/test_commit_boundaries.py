"""A worker process dies at each commit boundary of the stage path (issue 7: fault injection).

``django_workflows.kernel.faults`` reads ``WORKFLOWS_CRASH_AT=<point>`` and
``WORKFLOWS_CRASH_ONCE_FILE=<path>``: the first process to reach the named point (and create the
once-file) calls ``os._exit(70)``. The points:

* ``lease.before_commit`` / ``lease.after_commit`` - the job's lease transaction;
* ``stage.executing`` - the stage body returned, its outcome transaction has not begun;
* ``outcome.before_commit`` / ``outcome.after_commit`` - the outcome transaction (outcome, job
  completion, group transition and the next group's jobs).

For each point a cluster (two workers, 3 s lease, 1 s heartbeat) runs ``RUNS`` runs of
``fault-pipeline`` (a -> [b | c] -> d); one worker dies at the point and django-q2 starts a new
one. A ``workflows_tick --loop`` beside the cluster (without the crash variables) releases the
dead worker's lease and re-wakes ready jobs. Then: the fault fired (the once-file exists), every
run COMPLETED, each stage has exactly one ``stage:completed``, each outbox is gap-free, and
each stage body ran once - twice for the one stage whose worker died after running it but
before its outcome committed (``stage.executing``, ``outcome.before_commit``). A crash after
the outcome committed must not lose the transition (the run is advanced, not failed).

Runs on PostgreSQL and SQLite. About 15-25 s per point.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest

from .harness import (
    Cluster,
    assert_outbox_gap_free,
    assert_outcomes_once,
    assert_runs_completed,
    create_runs,
    executions,
    settle_runs,
    tick_command,
)

pytestmark = [pytest.mark.acceptance]

RUNS = 3
STAGES = ("a", "b", "c", "d")

POINTS = (
    "lease.before_commit",
    "lease.after_commit",
    "stage.executing",
    "outcome.before_commit",
    "outcome.after_commit",
)
#: Points where the dying worker has run the stage body but its outcome never committed.
RERUN_POINTS = {"stage.executing", "outcome.before_commit"}

FAULT_ENV = {
    "EXTRA_INSTALLED_APPS": "tests.acceptance.crashapp",
    "WORKFLOWS_STALE_LEASE_SECONDS": "3",
    "WORKFLOWS_HEARTBEAT_SECONDS": "1",
    "WORKFLOWS_TICK_INTERVAL": "0.2",
    "Q_WORKERS": "2",
    "CRASH_STAGE_SECONDS": "0.05",
}


@pytest.mark.parametrize("point", POINTS)
def test_crash_at_commit_boundary_every_run_completes(
    point: str,
    project: Callable[..., dict[str, str]],
    clusters: Callable[..., Cluster],
    tmp_path: Path,
) -> None:
    """The kernel's fault point ``point`` ends one worker; every run still completes once."""
    once = tmp_path / "crash.once"
    _crash_and_check(
        point,
        {"WORKFLOWS_CRASH_AT": point, "WORKFLOWS_CRASH_ONCE_FILE": str(once)},
        once,
        project,
        clusters,
        tmp_path,
    )


def test_worker_exit_inside_stage_body_every_run_completes(
    project: Callable[..., dict[str, str]],
    clusters: Callable[..., Cluster],
    tmp_path: Path,
) -> None:
    """The same checks with the worker ending itself inside the body of stage ``b`` (no kernel
    fault point needed): django-q2 replaces the worker, the lease expires, ``b`` runs again.
    This one holds on the current kernel too and checks the harness.
    """
    once = tmp_path / "crash.once"
    _crash_and_check(
        "stage.executing",
        {"CRASH_EXIT_IN_STAGE": "b", "CRASH_EXIT_ONCE_FILE": str(once)},
        once,
        project,
        clusters,
        tmp_path,
    )


def _crash_and_check(
    point: str,
    crash_vars: dict[str, str],
    once: Path,
    project: Callable[..., dict[str, str]],
    clusters: Callable[..., Cluster],
    tmp_path: Path,
) -> None:
    crash_dir = tmp_path / "crash"
    crash_dir.mkdir()
    env = project(**FAULT_ENV, CRASH_DIR=str(crash_dir))
    cluster = clusters(dict(env, **crash_vars))
    ticker = clusters(env, *tick_command(), log="ticker.log")

    run_ids = create_runs(env, "fault-pipeline", [{"n": i} for i in range(RUNS)])
    runs = settle_runs(env, run_ids, timeout=40)

    ran = Counter((e["run"], e["stage"]) for e in executions(crash_dir))
    statuses = Counter(r["status"] for r in runs.values())
    summary = (
        f"{point}: fault fired={once.exists()}, runs {dict(statuses)}, "
        f"{sum(ran.values())} executions for {RUNS * len(STAGES)} stages"
    )
    print(summary)
    context = (
        f"{summary}\n--- qcluster ---\n{cluster.log()[-4000:]}\n"
        f"--- ticker ---\n{ticker.log()[-1000:]}"
    )

    assert once.exists(), f"the fault never fired (no {once.name})\n{context}"
    assert_runs_completed(runs, context)
    assert_outcomes_once(runs, context)
    assert_outbox_gap_free(runs, context)
    for rid, run in runs.items():
        assert run["output"]["path"] == ["a", "b", "c", "d"], f"{rid}: {run['output']}"
    twice = sorted(key for key, count in ran.items() if count > 1)
    assert all(ran[(rid, sid)] >= 1 for rid in run_ids for sid in STAGES), context
    assert all(count <= 2 for count in ran.values()), f"{ran}\n{context}"
    assert len(twice) == (1 if point in RERUN_POINTS else 0), f"ran twice: {twice}\n{context}"
