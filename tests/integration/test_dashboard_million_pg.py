"""The admin dashboard at 1,000,000 finished runs and 10,000 live ones (PostgreSQL only; issue 20
item 5): the whole page, in every window and with a workflow filter, answers with p95 under 200
ms - or, on a slower machine, under 5 times the database's own count of the 30-day window
(:data:`REFERENCE_RATIO`) - (the page as operators reload it: closed buckets from the cache, the
bucket in progress and the queues read live), in a bounded number of statements, without a
sequential scan of the runs or stages. The cold page (empty cache: every closed bucket counted)
is measured and printed too, and held to the same budget in every window (the 30-day one
counts ~320,000 index entries for its closed buckets: the slowest).

Rows (set-based SQL, :data:`FINISHED_SQL` / :data:`LIVE_SQL`): 1M terminal runs spread evenly
over 90 days (one every 7.8 s; COMPLETED 93 %, FAILED 5 %, CANCELLED 2 %; workflows
``dash-etl`` / ``dash-fanout`` / ``dash-batch`` of 3, 4 and 3 stages, each with its stage
records and durations that vary per stage), then 10,000 live runs (2,000 PENDING, 8,000 RUNNING
with a RUNNING or a ready PENDING job on two queues, 1 in 10 in retry back-off), then
``VACUUM ANALYZE`` (what autovacuum would have done). p50/p95 per page and the ``EXPLAIN
(ANALYZE, BUFFERS)`` of the heavy statements of the 30-day window are printed with ``-s``.

``DW_ADMIN_MILLION=0`` skips it (seeding takes a minute or two).
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any

import pytest
from django.core.cache import cache
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.urls import reverse

from tests.markers import ON_POSTGRES

pytestmark = [
    pytest.mark.postgres,
    pytest.mark.django_db(transaction=True),  # VACUUM: index-only scans as in production
    pytest.mark.skipif(not ON_POSTGRES, reason="needs PostgreSQL (1M rows)"),
    pytest.mark.skipif(os.environ.get("DW_ADMIN_MILLION") == "0", reason="DW_ADMIN_MILLION=0"),
]

FINISHED = 1_000_000
LIVE = 10_000
#: The target: p95 of the whole page (ms).
TARGET_P95_MS = 200.0
#: A slower machine's allowance: a page may take this many times :func:`_reference_ms` (the
#: database counting the 30-day window's finished runs through its index, the bulk of the cold
#: 30-day page's work) where that is more than :data:`TARGET_P95_MS`. On 2026-12-07, with the
#: machine at about half its usual speed (pgbench), the reference took 65 ms and the cold
#: 30-day page 200-262 ms p95 (3-4 times it) with the dashboard's code unchanged: a
#: wall-clock bound alone failed CI on a slow day. On a machine where the reference is under
#: 40 ms the budget stays 200 ms.
REFERENCE_RATIO = 5.0
#: Requests per page measured.
REPS = 30
#: Statements per dashboard page: session, user, the eight reads, the workflow check.
MAX_QUERIES = 11
#: Requests per page with an empty cache (every closed bucket counted).
COLD_REPS = 5

LAYOUT_SQL = "CREATE TEMP TABLE dash_layout (wf text, stage_id text, num int, last bool, base int)"
LAYOUT_ROWS = """
INSERT INTO dash_layout VALUES
  ('dash-etl', 'extract', 1, false, 800), ('dash-etl', 'transform', 2, false, 4000),
  ('dash-etl', 'load', 3, true, 1500),
  ('dash-fanout', 'a', 1, false, 200), ('dash-fanout', 'b', 2, false, 9000),
  ('dash-fanout', 'c', 3, false, 12000), ('dash-fanout', 'd', 4, true, 300),
  ('dash-batch', 'submit', 1, false, 500), ('dash-batch', 'wait', 2, false, 60000),
  ('dash-batch', 'finish', 3, true, 700)
"""

FINISHED_SQL = [
    """
INSERT INTO workflow_runs (id, created_at, updated_at, version, workflow_id, workflow_name,
    workflow_type, status, started_at, completed_at, duration_ms, input, config, total_cost,
    total_tokens, priority, event_sequence, error, definition_version)
SELECT gen_random_uuid(), t.done - interval '40 seconds', t.done, 5, t.wf, t.wf, 'dash', t.st,
    t.done - interval '39 seconds', t.done, 39000, '{}'::jsonb, '{}'::jsonb, 0, 0, 5, 9,
    CASE WHEN t.st = 'FAILED' THEN jsonb_build_object('stage_id',
        (SELECT stage_id FROM dash_layout l WHERE l.wf = t.wf AND l.num = 1 + i %% 3),
        'message', 'boom', 'error_type', 'ValueError') END, ''
FROM generate_series(1, %(finished)s) AS i
CROSS JOIN LATERAL (SELECT
    now() - i * (interval '90 days' / %(finished)s) AS done,
    CASE WHEN i %% 20 = 0 THEN 'FAILED' WHEN i %% 50 = 1 THEN 'CANCELLED' ELSE 'COMPLETED' END
        AS st,
    (ARRAY['dash-etl', 'dash-fanout', 'dash-batch'])[i %% 3 + 1] AS wf) AS t
""",
    """
INSERT INTO workflow_stages (id, created_at, updated_at, version, run_id, stage_id, stage_name,
    stage_number, execution_group, generation, status, started_at, completed_at, duration_ms,
    input_data, config, metrics, progress, progress_message, skip_reason)
SELECT gen_random_uuid(), r.created_at, r.completed_at, 3, r.id, l.stage_id, l.stage_id, l.num,
    l.num, 0, x.st, r.created_at, r.completed_at, x.ms, '{}'::jsonb, '{}'::jsonb, '{}'::jsonb,
    100, '', ''
FROM workflow_runs r JOIN dash_layout l ON l.wf = r.workflow_id
CROSS JOIN LATERAL (SELECT
    CASE WHEN l.last AND r.status <> 'COMPLETED' THEN r.status ELSE 'COMPLETED' END AS st,
    l.base / 2 + abs(hashtext(r.id::text || l.stage_id)) %% (l.base * 2) AS ms) AS x
WHERE r.status IN ('COMPLETED', 'FAILED', 'CANCELLED')
""",
]

LIVE_SQL = [
    """
INSERT INTO workflow_runs (id, created_at, updated_at, version, workflow_id, workflow_name,
    workflow_type, status, started_at, input, config, total_cost, total_tokens, priority,
    event_sequence, definition_version)
SELECT gen_random_uuid(), now() - i * interval '0.3 seconds', now(), 2,
    (ARRAY['dash-etl', 'dash-fanout', 'dash-batch'])[i %% 3 + 1], 'live', 'dash',
    CASE WHEN i %% 5 = 0 THEN 'PENDING' ELSE 'RUNNING' END, now(), '{}'::jsonb, '{}'::jsonb,
    0, 0, 5, 3, ''
FROM generate_series(1, %(live)s) AS i
""",
    """
INSERT INTO workflow_jobs (created_at, updated_at, workflow_run_id, workflow_id, stage_id,
    status, priority, attempt, max_attempts, worker_id, locked_at, started_at, next_poll_at,
    payload, run_created_at, queue, definition_version)
SELECT r.created_at, now(), r.id, r.workflow_id, 'extract',
    CASE WHEN h %% 2 = 0 THEN 'RUNNING' ELSE 'PENDING' END, 5, 1, 3,
    CASE WHEN h %% 2 = 0 THEN 'w1' END, CASE WHEN h %% 2 = 0 THEN now() END, r.created_at,
    CASE WHEN h %% 10 = 1 THEN now() + interval '1 hour' END, '{}'::jsonb, r.created_at,
    CASE WHEN h %% 3 = 0 THEN 'batch' ELSE 'default' END, ''
FROM (SELECT *, abs(hashtext(id::text)) AS h FROM workflow_runs WHERE status = 'RUNNING') AS r
""",
]


def seed(finished: int = FINISHED, live: int = LIVE) -> None:
    """Insert the rows (see the module docstring) and ``VACUUM ANALYZE`` the tables."""
    params = {"finished": finished, "live": live}
    with connection.cursor() as cursor:
        cursor.execute("SET synchronous_commit = off")
        cursor.execute(LAYOUT_SQL)
        cursor.execute(LAYOUT_ROWS)
        for sql in [*FINISHED_SQL, *LIVE_SQL]:
            cursor.execute(sql, params)
        cursor.execute("DROP TABLE dash_layout")
        for table in ("workflow_runs", "workflow_stages", "workflow_jobs"):
            cursor.execute(f"VACUUM ANALYZE {table}")
        cursor.execute("SET synchronous_commit = on")


def _reference_ms() -> float:
    """p50 (ms) of ``SELECT count(*)`` of the finished runs of the last 30 days: an index-only
    scan of the ~320,000 entries the cold 30-day page counts, without the page around it."""
    since = time.time() - 30 * 86400
    times = []
    with connection.cursor() as cursor:
        for _ in range(9):
            t0 = time.perf_counter()
            cursor.execute(
                "SELECT count(*) FROM workflow_runs WHERE completed_at >= to_timestamp(%s)",
                [since],
            )
            cursor.fetchone()
            times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)


def _pct(values: list[float]) -> tuple[float, float]:
    ordered = sorted(values)
    return statistics.median(ordered), ordered[max(0, int(len(ordered) * 0.95) - 1)]


def _explain(sql: str, analyze: bool = False) -> str:
    with connection.cursor() as cursor:
        cursor.execute(("EXPLAIN (ANALYZE, BUFFERS) " if analyze else "EXPLAIN ") + sql)
        return "\n".join(row[0] for row in cursor.fetchall())


def test_dashboard_at_a_million_runs(django_user_model: Any) -> None:
    started = time.perf_counter()
    seed()
    print(
        f"\nseeded {FINISHED} finished + {LIVE} live runs in {time.perf_counter() - started:.0f} s"
    )
    user = django_user_model.objects.create_superuser("ops", "ops@example.com", "pw")
    client = Client()
    client.force_login(user)
    base = reverse("admin:django_workflows_dashboard_changelist")
    pages = {
        "default (24h)": base,
        "1h": base + "?window=1h",
        "7d": base + "?window=7d",
        "30d": base + "?window=30d",
        "30d, one workflow": base + "?window=30d&workflow=dash-fanout",
        "24h, one workflow": base + "?workflow=dash-batch",
    }
    client.get(base)  # warm the session, content types and caches
    report: dict[str, tuple[float, float]] = {}
    cold: dict[str, tuple[float, float]] = {}
    explained: dict[str, str] = {}
    for label, url in pages.items():
        cache.clear()
        with CaptureQueriesContext(connection) as queries:
            response = client.get(url)
        assert response.status_code == 200, label
        data = response.context["dw"]
        assert data.total.total > 0 and data.stages and data.failing and data.queues, label
        sqls = [q["sql"] for q in queries.captured_queries]
        assert len(sqls) <= MAX_QUERIES, (label, len(sqls), sqls)
        for sql in sqls:
            if "workflow_runs" in sql or "workflow_stages" in sql:
                plan = _explain(sql)
                assert "Seq Scan on workflow_runs" not in plan, (label, sql, plan)
                assert "Seq Scan on workflow_stages" not in plan, (label, sql, plan)
                if label == "30d":
                    explained[sql] = _explain(sql, analyze=True)
        times = []
        for _ in range(COLD_REPS):
            cache.clear()
            t0 = time.perf_counter()
            assert client.get(url).status_code == 200
            times.append((time.perf_counter() - t0) * 1000)
        cold[label] = _pct(times)
        times = []
        for _ in range(REPS):
            t0 = time.perf_counter()
            assert client.get(url).status_code == 200
            times.append((time.perf_counter() - t0) * 1000)
        report[label] = _pct(times)

    reference = _reference_ms()
    budget = max(TARGET_P95_MS, REFERENCE_RATIO * reference)
    print(f"reference {reference:.1f} ms, budget {budget:.1f} ms")
    print(f"{'page':>20}  p50 ms  p95 ms  (cold: p50  p95)")
    for label, (p50, p95) in report.items():
        print(f"{label:>20}  {p50:6.1f}  {p95:6.1f}  ({cold[label][0]:6.1f} {cold[label][1]:6.1f})")
    for sql, plan in explained.items():
        print(f"\n--- {sql[:300]}\n{plan}")
    print(f"total {time.perf_counter() - started:.0f} s")

    thirty = client.get(base + "?window=30d").context["dw"]
    # one run every 7.776 s over 90 days; the window starts 29 days before today's midnight
    since = (thirty.window.end - thirty.window.start).total_seconds() - (
        thirty.window.end.timestamp() - time.time()
    )
    assert thirty.total.total == pytest.approx(since / (90 * 86400 / FINISHED), rel=0.01)
    assert not thirty.sample_exact and thirty.sampled_runs == 1000  # in proportion, exactly
    # each workflow fails at one stage: 5 % of its runs
    assert thirty.failing[0].share == pytest.approx(0.05, rel=0.05)
    assert thirty.slowest[0].stage_id == "wait"  # the 60 s batch wait
    slow = {label: p95 for label, (_p50, p95) in report.items() if p95 >= budget}
    assert not slow, f"p95 >= {budget:.0f} ms (reference {reference:.1f} ms): {slow}"
    cold_slow = {label: p95 for label, (_p50, p95) in cold.items() if p95 >= budget}
    assert not cold_slow, f"cold p95 >= {budget:.0f} ms (reference {reference:.1f} ms): {cold_slow}"
