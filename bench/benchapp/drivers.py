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


#: how many times :func:`_wait` evaluated a predicate (each one autocommit query = one
#: server transaction): subtracted from the server's commit count of a round
POLLS = {"count": 0}


def _wait(predicate: Callable[[], bool], timeout: float, interval: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout
    while True:
        POLLS["count"] += 1
        if predicate():
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(interval)


class _ServerCounters:
    """``pg_stat_database`` of this process's database read from an admin connection (see
    bench/pgstats.py) around a measured window; a no-op on SQLite."""

    def __init__(self) -> None:
        from django.db import connection

        self.before: dict[str, float] | None = None
        self.conn: Any = None
        if connection.vendor != "postgresql":
            return
        import psycopg

        from bench.common import PG_ADMIN_URL

        with connection.cursor() as cursor:  # open + initialise our own connection first
            cursor.execute("SELECT 1")
        self.dbname = connection.settings_dict["NAME"]
        self.conn = psycopg.connect(PG_ADMIN_URL, autocommit=True)
        self.own_same_db = PG_ADMIN_URL.rsplit("/", 1)[1].split("?")[0] == self.dbname

    def start(self) -> None:
        if self.conn is not None:
            from bench.pgstats import db_counters

            time.sleep(1.5)  # let every backend flush what it did before the window
            self.polls0 = POLLS["count"]
            self.before = db_counters(self.conn, self.dbname)

    def finish(self) -> dict[str, Any] | None:
        """The window's delta, read :data:`bench.pgstats.FLUSH_WAIT_S` after now; this
        driver's polling transactions are subtracted."""
        if self.conn is None or self.before is None:
            return None
        from bench.pgstats import FLUSH_WAIT_S, counter_delta, db_counters

        polls = POLLS["count"] - self.polls0
        t_end = time.time()
        time.sleep(FLUSH_WAIT_S)
        after = db_counters(self.conn, self.dbname)
        # flush check: commits in a second equal wait after the read; about the idle rate x
        # wait if every backend had flushed by the read, much more if the read was early
        time.sleep(FLUSH_WAIT_S)
        late = db_counters(self.conn, self.dbname)
        self.conn.close()
        out = counter_delta(
            self.before, after, own_xacts=1 if self.own_same_db else 0, driver_xacts=polls
        )
        out["t_end"] = t_end
        out["flush_wait_s"] = FLUSH_WAIT_S
        out["late_commits"] = int(late["xact_commit"] - after["xact_commit"])
        return out


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


def create_and_wait(
    n: int,
    *,
    workflow: str = "bench-4",
    one_transaction: bool = False,
    timeout: float = 600,
    delivery_timeout: float = 0,
) -> None:
    """Create ``n`` runs as fast as possible (or all in one transaction: a burst that becomes
    visible at once), then wait until all are terminal. Prints wall times and the run rows;
    with ``delivery_timeout`` > 0 it then waits up to that long for the runs' outbox events to
    be published and adds the outbox rows and the plugin's delivery records.
    """
    from django_workflows import start_run

    counters = _ServerCounters()
    counters.start()
    t_start = time.time()
    if one_transaction:
        with transaction.atomic():
            ids = [start_run(workflow, {"n": i}) for i in range(n)]
    else:
        ids = [start_run(workflow, {"n": i}) for i in range(n)]
    t_created = time.time()
    finished = _wait(lambda: _terminal_count(ids) >= n, timeout, interval=0.05)
    t_seen = time.time()
    server = counters.finish()
    out: dict[str, Any] = {
        "t_start": t_start,
        "t_created": t_created,
        "t_seen_done": t_seen,
        "timed_out": not finished,
        "runs": _run_rows(ids),
        "server": server,
    }
    if delivery_timeout > 0:
        out.update(_wait_for_deliveries(ids, delivery_timeout))
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


def chain_and_wait(n: int, *, timeout: float = 600) -> None:
    """The bare django-q2 peer: start ``n`` chains of 4 trivial tasks as fast as possible, wait
    until every chain's marker row exists. Prints wall times."""
    from django_q.tasks import async_task

    from django_workflows.models import WorkflowBlob

    from .tasks import MARKER_PREFIX

    counters = _ServerCounters()
    counters.start()
    t_start = time.time()
    for i in range(n):
        async_task("bench.benchapp.tasks.chain_step", i, 1)
    t_created = time.time()
    finished = _wait(
        lambda: WorkflowBlob.objects.filter(key__startswith=MARKER_PREFIX).count() >= n,
        timeout,
        interval=0.05,
    )
    t_seen = time.time()
    server = counters.finish()
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
                "server": server,
            }
        )
    )
