"""The run list and run detail at 1,000,000 runs (PostgreSQL only): a bounded number of
queries, each served by an index (EXPLAIN), however deep the page. Timings (p50/p95) are
printed with ``-s``; they are not asserted.

Runs with ``DW_API_MILLION=0`` skip it (it takes about half a minute)."""

from __future__ import annotations

import os
import statistics
import time
from typing import Any

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from tests.markers import ON_POSTGRES

from .conftest import ALL_PERMS, API, make_user, token_client

pytestmark = [
    pytest.mark.postgres,
    pytest.mark.django_db,
    pytest.mark.skipif(not ON_POSTGRES, reason="needs PostgreSQL (1M-row EXPLAIN)"),
    pytest.mark.skipif(os.environ.get("DW_API_MILLION") == "0", reason="DW_API_MILLION=0"),
]

RUNS = 1_000_000
#: Statements per request: token + user lookups, two permission loads, the page.
MAX_QUERIES = 8

INSERT = """
INSERT INTO workflow_runs (id, created_at, updated_at, version, workflow_id, workflow_name,
    workflow_type, status, input, config, total_cost, total_tokens, priority, event_sequence)
SELECT gen_random_uuid(), now() - (i * interval '1 second'), now(), 1,
    CASE WHEN i %% 10 = 0 THEN 'api-fails' ELSE 'api-two-stage' END, 'bulk', 'bulk',
    CASE WHEN i %% 100 = 0 THEN 'RUNNING' WHEN i %% 10 = 0 THEN 'FAILED' ELSE 'COMPLETED' END,
    '{"value": 1}'::jsonb, '{}'::jsonb, 0, 0, 5, 0
FROM generate_series(1, %s) AS i
"""


def _timed(client: Any, url: str, n: int = 30) -> tuple[list[float], Any]:
    times, response = [], None
    for _ in range(n):
        started = time.perf_counter()
        response = client.get(url)
        times.append((time.perf_counter() - started) * 1000)
        assert response.status_code == 200
    return times, response


def _pct(values: list[float]) -> str:
    ordered = sorted(values)
    p95 = ordered[int(len(ordered) * 0.95) - 1]
    return f"p50 {statistics.median(ordered):.1f} ms, p95 {p95:.1f} ms"


def _explain(sql: str) -> str:
    with connection.cursor() as cursor:
        cursor.execute("EXPLAIN " + sql)
        return "\n".join(row[0] for row in cursor.fetchall())


def _page_query(queries: CaptureQueriesContext) -> str:
    return next(q["sql"] for q in queries.captured_queries if 'FROM "workflow_runs"' in q["sql"])


def test_list_and_detail_at_a_million_runs() -> None:
    started = time.perf_counter()
    with connection.cursor() as cursor:
        cursor.execute(INSERT, [RUNS])
        cursor.execute("ANALYZE workflow_runs")
    print(f"\ninserted {RUNS} runs and analyzed in {time.perf_counter() - started:.1f} s")
    client = token_client(make_user("bulk", *ALL_PERMS))
    client.get(f"{API}runs/")  # warm the permission cache of nothing: each request reloads

    report = {}
    urls = {
        "list first page": f"{API}runs/",
        "list status=FAILED": f"{API}runs/?status=FAILED",
        "list status=RUNNING": f"{API}runs/?status=RUNNING",
    }
    for label, url in urls.items():
        with CaptureQueriesContext(connection) as queries:
            response = client.get(url)
        assert response.status_code == 200 and len(response.json()["results"]) == 50
        assert len(queries.captured_queries) <= MAX_QUERIES
        assert not any("COUNT(" in q["sql"].upper() for q in queries.captured_queries)
        plan = _explain(_page_query(queries))
        assert "Index" in plan and "Seq Scan on workflow_runs" not in plan, plan
        assert "Sort" not in plan.split("\n")[1], plan
        report[label] = _pct(_timed(client, url)[0])

    # a deep page: follow 20 cursors, then time the 21st
    url = f"{API}runs/?status=COMPLETED"
    for _ in range(20):
        url = client.get(url).json()["next"]
    with CaptureQueriesContext(connection) as queries:
        response = client.get(url)
    assert len(queries.captured_queries) <= MAX_QUERIES
    plan = _explain(_page_query(queries))
    assert "Index" in plan and "Seq Scan" not in plan, plan
    report["list page 21 (cursor)"] = _pct(_timed(client, url)[0])

    run_id = response.json()["results"][0]["id"]
    with CaptureQueriesContext(connection) as queries:
        detail = client.get(f"{API}runs/{run_id}/")
    assert detail.status_code == 200
    assert len(queries.captured_queries) <= MAX_QUERIES
    for query in queries.captured_queries:
        if "workflow_runs" in query["sql"] or "workflow_stages" in query["sql"]:
            plan = _explain(query["sql"])
            assert "Seq Scan on workflow_runs" not in plan, plan
    report["detail"] = _pct(_timed(client, f"{API}runs/{run_id}/")[0])
    for label, timing in report.items():
        print(f"{label:>24}: {timing}")
    print(f"total {time.perf_counter() - started:.1f} s")
