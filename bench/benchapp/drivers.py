"""Workload drivers that run *inside* the example project (``manage.py shell -c``), one per
measurement; each prints one JSON line (read by :func:`bench.common.shell_json`).

Only the public ``start_run`` helper and the engine's models are used here (no kernel
internals): runs are created as a user would, and timings are read from the rows the engine
writes (``created_at``, ``started_at``, ``completed_at``) and from the outbox.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

from django.db import transaction

TERMINAL = ("COMPLETED", "FAILED", "CANCELLED")


def _ts(value: datetime | None) -> float | None:
    return value.timestamp() if value is not None else None


def _wait(predicate: Callable[[], bool], timeout: float, interval: float = 0.1) -> bool:
    """Poll ``predicate`` every ``interval`` seconds (0.1: the driver's own queries load the
    database it measures; completion times come from the rows, not from this poll)."""
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(interval)


class _ServerCounters:
    """The opening ``pg_stat_database`` read of a measured window (bench/pgstats.py) and the
    count of this driver's own transactions in it; a no-op on SQLite.

    The closing read is the parent's, after the cluster and this process have exited (a
    backend flushes its counters at exit; an idle one otherwise keeps them up to 10 s). The
    opening read waits until the cluster has been up :data:`bench.pgstats.IDLE_FLUSH_S`, so
    what its backends did at start-up is flushed before it.
    """

    def __init__(self) -> None:
        from django.db import connection

        self.before: dict[str, float] | None = None
        self.conn: Any = None
        self.driver_xacts = 0
        self.counting = False
        if connection.vendor != "postgresql":
            return
        import psycopg

        from bench.common import PG_ADMIN_URL

        with connection.cursor() as cursor:  # open + initialise our own connection first
            cursor.execute("SELECT 1")
        self.dbname = connection.settings_dict["NAME"]
        self.conn = psycopg.connect(PG_ADMIN_URL, autocommit=True)
        self.own_same_db = PG_ADMIN_URL.rsplit("/", 1)[1].split("?")[0] == self.dbname
        connection.execute_wrappers.append(self._count)

    def _count(self, execute: Callable[..., Any], sql: str, params: Any, many: bool, ctx: Any):
        # every statement of this driver outside the creates is an autocommit read: one
        # server transaction each (subtracted from the window's commits)
        if self.counting:
            self.driver_xacts += 1
        return execute(sql, params, many, ctx)

    def start(self, warmed_at: float = 0) -> None:
        """The opening read, once the cluster has been up (and idle since ``warmed_at``, the
        end of the driver's warm-up) :data:`bench.pgstats.IDLE_FLUSH_S`."""
        if self.conn is None:
            return
        import os

        from bench.pgstats import IDLE_FLUSH_S, db_counters

        started = float(os.environ.get("BENCH_CLUSTER_STARTED") or 0)
        time.sleep(max(1.5, max(started, warmed_at) + IDLE_FLUSH_S - time.time()))
        self.before = db_counters(self.conn, self.dbname)
        self.conn.close()

    def creating(self, active: bool) -> None:
        """``True`` while the driver creates runs (engine work, counted), else ``False``."""
        self.counting = not active and self.before is not None

    def result(self) -> dict[str, Any] | None:
        if self.before is None:
            return None
        return {
            "before": self.before,
            "driver_xacts": self.driver_xacts,
            "own_xacts": 1 if self.own_same_db else 0,
        }


def _run_rows(run_ids: list[str]) -> list[dict[str, Any]]:
    from django_workflows.models import WorkflowRun, WorkflowStage

    first_started: dict[str, float] = {}
    for stage in WorkflowStage.objects.filter(run_id__in=run_ids).values(
        "run_id", "stage_id", "started_at", "execution_group"
    ):
        if stage["execution_group"] == 1 and stage["started_at"] is not None:
            first_started[str(stage["run_id"])] = stage["started_at"].timestamp()
    rows = []
    for run in WorkflowRun.objects.filter(pk__in=run_ids).values(
        "id", "status", "created_at", "completed_at"
    ):
        rid = str(run["id"])
        rows.append(
            {
                "id": rid,
                "status": run["status"],
                "created_at": _ts(run["created_at"]),
                "completed_at": _ts(run["completed_at"]),
                "first_stage_started_at": first_started.get(rid),
            }
        )
    return rows


def _terminal_count(run_ids: list[str]) -> int:
    from django_workflows.models import WorkflowRun

    return WorkflowRun.objects.filter(pk__in=run_ids, status__in=TERMINAL).count()


#: How often a throughput driver looks whether its runs or chains are done, in seconds. Rates
#: and latencies come from the rows' own timestamps, never from this poll, so it only sets how
#: soon the driver notices the end; each look is load on the machine being measured, charged
#: to whichever side is measured. At 0.05 s with a ``COUNT(*)`` over all 300 run ids the
#: poll cost PostgreSQL about 12 ms a look under load (0.1-0.38 ms per stage, up to a fifth of
#: the database's time in a round; pg_stat_statements, 2026-12-07).
DONE_POLL_SECONDS = 0.25


class _Unfinished:
    """The runs of ``run_ids`` not yet seen terminal; each look reads only those still open
    (primary-key lookups), so the looks get cheaper as runs finish."""

    def __init__(self, run_ids: list[str]) -> None:
        self.open = list(run_ids)

    def done(self) -> bool:
        from django_workflows.models import WorkflowRun

        self.open = list(
            WorkflowRun.objects.filter(pk__in=self.open)
            .exclude(status__in=TERMINAL)
            .values_list("pk", flat=True)
        )
        return not self.open


#: Runs (chains) driven through the cluster before a measured window, not measured: as many as
#: the DBOS peer's warm-up workflows (bench/dbos_peer.py), so every peer is measured warm.
WARMUP_RUNS = 2


def _warm_up(workflow: str, count: int, timeout: float) -> float:
    """Drive ``count`` runs of ``workflow`` through the cluster, one after another, before the
    measured window (its workers' first deliveries: their connections' first statements, the
    server's catalog caches); returns the wall time they were seen done. Their input is
    ``{"n": -1 - i}``, so no measured run's matches."""
    from django_workflows import start_run

    for i in range(count):
        _wait(_Unfinished([start_run(workflow, {"n": -1 - i})]).done, timeout, interval=0.01)
    return time.time()


def create_and_wait(
    n: int,
    *,
    workflow: str = "bench-4",
    one_transaction: bool = False,
    timeout: float = 600,
    delivery_timeout: float = 0,
    warmup: int = WARMUP_RUNS,
) -> None:
    """Create ``n`` runs as fast as possible (or all in one transaction: a burst that becomes
    visible at once), then wait until all are terminal. Prints wall times and the run rows;
    with ``delivery_timeout`` > 0 it then waits up to that long for the runs' outbox events to
    be published and adds the outbox rows and the plugin's delivery records.

    ``warmup`` runs go first, unmeasured (:func:`_warm_up`), as the DBOS peer's do.
    """
    from django_workflows import start_run

    counters = _ServerCounters()
    counters.start(_warm_up(workflow, warmup, timeout))
    counters.creating(True)
    t_start = time.time()
    t_committed: list[float] = []
    if one_transaction:
        with transaction.atomic():
            # first of the transaction's on_commit callbacks: it runs right after the commit,
            # before the runs' own (their wake-ups take a while for 300 runs)
            transaction.on_commit(lambda: t_committed.append(time.time()))
            ids = [start_run(workflow, {"n": i}) for i in range(n)]
    else:
        ids = [start_run(workflow, {"n": i}) for i in range(n)]
    t_created = time.time()
    counters.creating(False)
    finished = _wait(_Unfinished(ids).done, timeout, interval=DONE_POLL_SECONDS)
    t_seen = time.time()
    out: dict[str, Any] = {
        "t_start": t_start,
        "t_created": t_created,
        # one_transaction: when the creation transaction committed (the runs became visible)
        "t_committed": t_committed[0] if t_committed else None,
        "t_seen_done": t_seen,
        "timed_out": not finished,
        "runs": _run_rows(ids),
    }
    if delivery_timeout > 0:
        out.update(_wait_for_deliveries(ids, delivery_timeout))
    out["server"] = counters.result()
    print(json.dumps(out))


def _wait_for_deliveries(run_ids: list[str], timeout: float) -> dict[str, Any]:
    """Wait up to ``timeout`` s until no outbox event of the runs is unpublished; returns the
    outbox rows and the delivery plugin's records."""
    from django_workflows.models import OutboxEvent

    from .workflows import bench_dir

    _wait(
        lambda: (
            not OutboxEvent.objects.filter(
                workflow_run_id__in=run_ids, published_at__isnull=True
            ).exists()
        ),
        timeout,
        interval=0.1,
    )
    directory = bench_dir()
    assert directory is not None, "BENCH_DIR is not set"
    return {
        "outbox": _outbox_rows(run_ids),
        "deliveries": _read_jsonl(directory / "deliveries.jsonl"),
    }


def _outbox_rows(run_ids: list[str]) -> list[dict[str, Any]]:
    from django_workflows.models import OutboxEvent

    return [
        {
            "event_id": row["id"],
            "run": str(row["workflow_run_id"]),
            "sequence": row["sequence"],
            "type": row["event_type"],
            "created_at": _ts(row["created_at"]),
            "occurred_at": _ts(row["occurred_at"]),
            "published_at": _ts(row["published_at"]),
            "payload": row["payload"],
        }
        for row in OutboxEvent.objects.filter(workflow_run_id__in=run_ids).values(
            "id",
            "workflow_run_id",
            "sequence",
            "event_type",
            "created_at",
            "occurred_at",
            "published_at",
            "payload",
        )
    ]


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def idle_latency(
    n: int, *, pause: float, delivery_timeout: float, suspend_runs: int, timeout: float = 120
) -> None:
    """On an idle cluster: ``n`` ``bench-4`` runs created one at a time (each waited for, then
    ``pause`` s of idleness), then ``suspend_runs`` ``bench-suspend`` runs the same way; then
    wait up to ``delivery_timeout`` s for every outbox event of these runs to be published.

    Prints the run rows, the outbox rows, the plugin's delivery records and the suspended
    stage's check records (``BENCH_DIR`` files written by the bench app).
    """
    from django_workflows import start_run

    from .workflows import bench_dir

    ids: list[str] = []
    suspend_ids: list[str] = []
    for i in range(n + suspend_runs):
        time.sleep(pause)
        workflow = "bench-4" if i < n else "bench-suspend"
        rid = start_run(workflow, {"n": i})
        (ids if i < n else suspend_ids).append(rid)
        _wait(lambda rid=rid: _terminal_count([rid]) == 1, timeout)
    every = ids + suspend_ids
    t_done = time.time()
    delivered = _wait_for_deliveries(every, delivery_timeout)
    directory = bench_dir()
    assert directory is not None, "BENCH_DIR is not set"
    print(
        json.dumps(
            {
                "t_done": t_done,
                "runs": _run_rows(ids),
                "suspend_runs": _run_rows(suspend_ids),
                "suspend_stage_completed": _stage_completed(suspend_ids),
                **delivered,
                "checks": _read_jsonl(directory / "suspend-checks.jsonl"),
            }
        )
    )


def _stage_completed(run_ids: list[str]) -> dict[str, float | None]:
    from django_workflows.models import WorkflowStage

    return {
        str(s["run_id"]): _ts(s["completed_at"])
        for s in WorkflowStage.objects.filter(run_id__in=run_ids).values("run_id", "completed_at")
    }


def chain_and_wait(n: int, *, timeout: float = 600, warmup: int = WARMUP_RUNS) -> None:
    """The bare django-q2 peer: start ``n`` chains of 4 trivial tasks as fast as possible, wait
    until every chain's marker row exists. Prints wall times. ``warmup`` chains (ids -1, -2,
    ...) go first, one after another, unmeasured, as the other peers' warm-ups do."""
    from django_q.tasks import async_task

    from django_workflows.models import WorkflowBlob

    from .tasks import MARKER_PREFIX

    def markers() -> int:
        return WorkflowBlob.objects.filter(key__startswith=MARKER_PREFIX).count()

    for i in range(warmup):
        async_task("bench.benchapp.tasks.chain_step", -1 - i, 1)
        _wait(lambda i=i: markers() >= i + 1, timeout, interval=0.01)
    counters = _ServerCounters()
    counters.start(time.time())
    counters.creating(True)
    t_start = time.time()
    for i in range(n):
        async_task("bench.benchapp.tasks.chain_step", i, 1)
    t_created = time.time()
    counters.creating(False)
    finished = _wait(
        lambda: markers() >= n + warmup,
        timeout,
        interval=DONE_POLL_SECONDS,
    )
    t_seen = time.time()
    last = (
        WorkflowBlob.objects.filter(key__startswith=MARKER_PREFIX)
        .order_by("-created_at")
        .values_list("created_at", flat=True)
        .first()
    )
    print(
        json.dumps(
            {
                "t_start": t_start,
                "t_created": t_created,
                "t_seen_done": t_seen,
                "t_last_done": _ts(last),
                "timed_out": not finished,
                "server": counters.result(),
            }
        )
    )
