"""Health at scale (issue 20): how long :func:`django_workflows.health.state.snapshot` and the
``metrics/`` view take on a database filled by :func:`bench.scale.populate` (1M finished runs
and 10k live ones), and the plan of each statement of the snapshot.

``.venv/bin/python manage.py shell -c "from bench import health; health.main()"`` measures
the database ``DATABASE_URL`` names as it is (populate it first:
``from bench import scale; scale.populate(1_000_000, 10_000)``, then
:func:`add_recent_and_presence`); ``tests/integration/test_health_million_pg.py`` does both
on the test database. Only SELECTs are measured: nothing is changed.
"""

from __future__ import annotations

import json
import re
import time
from typing import Any

#: Statements whose plan scans one of these tables sequentially are flagged.
BIG_TABLES = ("workflow_runs", "workflow_stages", "workflow_jobs", "outbox_events")

RECENT_SQL = """
INSERT INTO workflow_runs (id, created_at, updated_at, version, workflow_id, workflow_name,
    workflow_type, status, started_at, completed_at, duration_ms, input, config, total_cost,
    total_tokens, priority, event_sequence, definition_version)
SELECT gen_random_uuid(), now() - i * interval '10 milliseconds' - interval '40 seconds',
    now() - i * interval '10 milliseconds', 5,
    (ARRAY['scale-etl', 'scale-fanout', 'scale-batch'])[i %% 3 + 1], 'recent', 'scale',
    CASE WHEN i %% 20 = 0 THEN 'FAILED' ELSE 'COMPLETED' END,
    now() - i * interval '10 milliseconds' - interval '39 seconds',
    now() - i * interval '10 milliseconds', 39000, '{}'::jsonb, '{}'::jsonb, 0, 0, 5, 0, ''
FROM generate_series(1, %(recent)s) AS i
"""

#: Three finished stages of each recent run (the stage durations read the newest 10,000).
RECENT_STAGES_SQL = """
INSERT INTO workflow_stages (id, created_at, updated_at, version, run_id, stage_id, stage_name,
    stage_number, execution_group, generation, status, started_at, completed_at, duration_ms,
    progress_message, skip_reason)
SELECT gen_random_uuid(), r.created_at, r.completed_at, 3, r.id, 's' || n, 's' || n, n, n, 0,
    'COMPLETED', r.started_at, r.completed_at - (3 - n) * interval '10 seconds', 9000 + n, '', ''
FROM workflow_runs r CROSS JOIN generate_series(0, 2) AS n
WHERE r.workflow_name = 'recent' AND r.completed_at > now() - interval '1 hour'
"""

#: The jobs of those stages, one in ten delivered twice (the redeliveries read them).
RECENT_JOBS_SQL = """
INSERT INTO workflow_jobs (created_at, updated_at, workflow_run_id, workflow_id, stage_id,
    status, priority, attempt, max_attempts, started_at, completed_at, payload,
    run_created_at, queue, definition_version)
SELECT s.created_at, s.completed_at, r.id, r.workflow_id, s.stage_id, 'COMPLETED', 5,
    CASE WHEN s.stage_number = 1 AND r.event_sequence = 0 AND random() < 0.1 THEN 2 ELSE 1 END,
    3, s.started_at, s.completed_at, '{}'::jsonb, r.created_at, 'default', ''
FROM workflow_stages s JOIN workflow_runs r ON r.id = s.run_id
WHERE r.workflow_name = 'recent' AND r.completed_at > now() - interval '1 hour'
"""


def add_recent_and_presence(recent: int = 30_000, workers: int = 8) -> None:
    """``recent`` runs finished over the last ``recent / 100`` seconds (100 runs/s: the
    window's gauge reads them) with three finished stages and jobs each, and ``workers`` live worker
    processes on queues ``default`` and ``batch`` with one holding the ticker lease."""
    from django.db import connection

    from django_workflows.kernel.routing import _presence_name

    with connection.cursor() as cursor:
        cursor.execute(RECENT_SQL, {"recent": int(recent)})
        cursor.execute(RECENT_STAGES_SQL)
        cursor.execute(RECENT_JOBS_SQL)
        for n in range(workers):
            worker = f"worker-bench-{n}-abcdef"
            for queue in ("default", "batch"):
                cursor.execute(
                    "INSERT INTO workflow_maintenance_leases (name, owner, expires_at) "
                    "VALUES (%s, %s, now() + interval '1 hour') ON CONFLICT (name) DO NOTHING",
                    [_presence_name(queue, worker), worker],
                )
            cursor.execute(
                "INSERT INTO workflow_worker_versions (worker_id, versions, expires_at) "
                "VALUES (%s, %s, now() + interval '1 hour') ON CONFLICT DO NOTHING",
                [worker, json.dumps({"scale-etl": ["1"]})],
            )
        cursor.execute(
            "INSERT INTO workflow_maintenance_leases (name, owner, expires_at) "
            "VALUES ('ticker', 'worker-bench-0-abcdef-ticker', now() + interval '1 hour') "
            "ON CONFLICT (name) DO NOTHING"
        )
        cursor.execute("ANALYZE workflow_runs")
        cursor.execute("ANALYZE workflow_stages")
        cursor.execute("ANALYZE workflow_jobs")


def _pct(values: list[float], q: float) -> float:
    from .common import percentile

    value = percentile(values, q)
    return round(value or 0.0, 2)


def measure(reps: int = 50) -> dict[str, Any]:
    """p50/p95 (ms) of ``snapshot()`` and of ``GET metrics/`` over ``reps`` calls (after one
    warm-up), the statements of one snapshot with their ``EXPLAIN ANALYZE`` execution time,
    and the tables any of them scans sequentially (``seq_scans``; should stay empty)."""
    from django.db import connection
    from django.test import Client
    from django.test.utils import CaptureQueriesContext

    from django_workflows.health.state import snapshot

    snapshot()
    calls: list[float] = []
    for _ in range(reps):
        t0 = time.perf_counter()
        snap = snapshot()
        calls.append((time.perf_counter() - t0) * 1000)
    client = Client()
    client.get("/workflows/health/metrics/")
    pages: list[float] = []
    for _ in range(reps):
        t0 = time.perf_counter()
        response = client.get("/workflows/health/metrics/")
        pages.append((time.perf_counter() - t0) * 1000)
        assert response.status_code == 200, response.content[:200]
    with CaptureQueriesContext(connection) as captured:
        snapshot()
    statements = []
    seq_scans: list[str] = []
    with connection.cursor() as cursor:
        for query in captured.captured_queries:
            sql = query["sql"]
            if not sql.lstrip().upper().startswith("SELECT") or "CURRENT_TIMESTAMP" in sql:
                continue
            cursor.execute("EXPLAIN (ANALYZE, BUFFERS) " + sql)
            plan = "\n".join(row[0] for row in cursor.fetchall())
            ms = float(re.search(r"Execution Time: ([\d.]+) ms", plan)[1])  # type: ignore[index]
            for table in BIG_TABLES:
                if re.search(rf"Seq Scan on {table}\b", plan):
                    seq_scans.append(f"{table}: {sql[:120]}")
            statements.append({"sql": sql, "ms": round(ms, 2), "plan": plan})
    return {
        "reps": reps,
        "snapshot_p50_ms": _pct(calls, 50),
        "snapshot_p95_ms": _pct(calls, 95),
        "metrics_p50_ms": _pct(pages, 50),
        "metrics_p95_ms": _pct(pages, 95),
        "statements": statements,
        "slowest_statement_ms": max((s["ms"] for s in statements), default=0.0),
        "seq_scans": seq_scans,
        "snapshot": {
            "queues": [q.__dict__ for q in snap.queues],
            "runs_by_status": snap.runs_by_status,
            "outbox_undelivered": snap.outbox_undelivered,
            "dead_letters": snap.dead_letters,
            "finished_recently": sum(f.count for f in snap.finished_recently),
        },
    }


def main(reps: int = 50) -> None:
    """Print :func:`measure`'s numbers and each statement's plan."""
    result = measure(reps)
    for s in result["statements"]:
        print(f"--- {s['ms']} ms\n{s['sql']}\n{s['plan']}\n")
    summary = {k: v for k, v in result.items() if k != "statements"}
    print(json.dumps(summary, indent=2, default=str))
