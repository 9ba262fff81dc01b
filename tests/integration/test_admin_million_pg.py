"""The admin at 1,000,000 runs (PostgreSQL only; issue 10): the runs list (first and deep
pages), every filter, every search and the run page issue a bounded number of queries, never
an unbounded ``COUNT(*)``, and ``EXPLAIN`` shows index use (no sequential scan of the runs);
the engine's poll-due and outbox-flush queries use their indexes however large the backlog.
p50/p95 timings of each page are printed with ``-s`` (not asserted).

``DW_ADMIN_MILLION=0`` skips it (it takes about a minute).
"""

from __future__ import annotations

import os
import re
import statistics
import time
from typing import Any

import pytest
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.urls import reverse

from tests.markers import ON_POSTGRES

pytestmark = [
    pytest.mark.postgres,
    pytest.mark.django_db,
    pytest.mark.skipif(not ON_POSTGRES, reason="needs PostgreSQL (1M-row EXPLAIN)"),
    pytest.mark.skipif(os.environ.get("DW_ADMIN_MILLION") == "0", reason="DW_ADMIN_MILLION=0"),
]

RUNS = 1_000_000
#: Statements per admin list page: session, user, (permissions), the page's own reads.
MAX_QUERIES = 14
#: The run page: session, user, the run, its stages, jobs, dead letter, the timeline's three
#: sources, reruns, the Gantt chart's events and groups, the run error's stages.
MAX_RUN_PAGE_QUERIES = 20

RUNS_SQL = """
INSERT INTO workflow_runs (id, created_at, updated_at, version, workflow_id, workflow_name,
    workflow_type, status, input, config, total_cost, total_tokens, priority, event_sequence)
SELECT gen_random_uuid(), now() - (i * interval '1 second'), now(), 1,
    CASE WHEN i %% 10 = 0 THEN 'adm-fails' ELSE 'adm-two-stage' END, 'bulk', 'bulk',
    CASE WHEN i %% 100 = 0 THEN 'RUNNING' WHEN i %% 10 = 0 THEN 'FAILED' ELSE 'COMPLETED' END,
    '{"value": 1}'::jsonb, '{}'::jsonb, 0, 0, 5, 0
FROM generate_series(1, %s) AS i
"""

# A suspended approval stage for 1 in 10 RUNNING runs, a SUSPENDED poll stage for the others.
STAGES_SQL = """
INSERT INTO workflow_stages (id, created_at, updated_at, version, run_id, stage_id, stage_name,
    stage_number, execution_group, generation, status, suspended_state, next_poll_at,
    progress_message)
SELECT gen_random_uuid(), r.created_at, now(), 1, r.id, 'review', 'review', 1, 1, 0,
    'SUSPENDED',
    CASE WHEN row_number() OVER () % 10 = 0
         THEN '{"kind": "django_workflows.approval", "allowed_approvers": ["alice"]}'::jsonb
         ELSE '{"batch_id": "b"}'::jsonb END,
    now() + interval '1 hour', ''
FROM workflow_runs r WHERE r.status = 'RUNNING'
"""

# 200,000 published outbox rows and 50,000 unpublished (a backlog) on the RUNNING runs.
OUTBOX_SQL = """
INSERT INTO outbox_events (created_at, workflow_run_id, sequence, event_type, payload,
    causation_id, occurred_at, published_at, retry_count, skip_note)
SELECT now(), r.id, s, 'workflow:created', '{}'::jsonb, 'bulk', now(),
    CASE WHEN s <= 20 THEN now() ELSE NULL END, 0, ''
FROM workflow_runs r CROSS JOIN generate_series(1, 25) AS s WHERE r.status = 'RUNNING'
"""


def _timed(client: Client, url: str, n: int = 20) -> list[float]:
    times = []
    for _ in range(n):
        started = time.perf_counter()
        response = client.get(url)
        times.append((time.perf_counter() - started) * 1000)
        assert response.status_code == 200, url
    return times


def _pct(values: list[float]) -> tuple[float, float]:
    ordered = sorted(values)
    return statistics.median(ordered), ordered[max(0, int(len(ordered) * 0.95) - 1)]


def _explain(sql: str) -> str:
    with connection.cursor() as cursor:
        cursor.execute("EXPLAIN " + sql)
        return "\n".join(row[0] for row in cursor.fetchall())


def _check_queries(queries: CaptureQueriesContext, label: str) -> None:
    sqls = [q["sql"] for q in queries.captured_queries]
    limit = MAX_RUN_PAGE_QUERIES if label == "run page" else MAX_QUERIES
    assert len(sqls) <= limit, (label, len(sqls), sqls)
    for sql in sqls:
        if re.search(r"COUNT\(", sql, re.I):
            plan = _explain(sql)
            if re.search(r"LIMIT \d+\) subquery", sql):
                # the capped paginator's count: a LIMIT bounds whatever it reads
                assert plan.splitlines()[1].strip().startswith("->  Limit"), (label, plan)
            elif re.search(r'"(workflow_)?run_id" = ', sql):
                assert "Index" in plan, (label, plan)  # one run's rows
            else:  # the dead-letter counts: the partial index holds only dead letters
                assert "wf_outbox_dead_letter_idx" in plan, (label, "unbounded count", plan)
            continue
        if '"workflow_runs"' in sql or "workflow_stages" in sql or "outbox_events" in sql:
            plan = _explain(sql)
            assert "Seq Scan on workflow_runs" not in plan, (label, sql, plan)
            assert "Seq Scan on outbox_events" not in plan, (label, sql, plan)


def test_admin_pages_at_a_million_runs(django_user_model: Any) -> None:
    started = time.perf_counter()
    with connection.cursor() as cursor:
        cursor.execute(RUNS_SQL, [RUNS])
        cursor.execute(STAGES_SQL)
        cursor.execute(OUTBOX_SQL)
        cursor.execute(
            "INSERT INTO idempotency_keys (created_at, key, command_type, state, result) "
            "SELECT now(), 'order-42', 'run.create', 'completed', "
            "jsonb_build_object('workflow_run_id', id::text, 'status', 'PENDING') "
            "FROM workflow_runs WHERE status = 'FAILED' LIMIT 1"
        )
        for table in ("workflow_runs", "workflow_stages", "outbox_events", "idempotency_keys"):
            cursor.execute(f"ANALYZE {table}")
        cursor.execute("SELECT id FROM workflow_runs WHERE status = 'FAILED' LIMIT 1")
        failed_id = str(cursor.fetchone()[0])
    print(f"\ninserted {RUNS} runs (+ stages, outbox) in {time.perf_counter() - started:.1f} s")

    user = django_user_model.objects.create_superuser("ops", "ops@example.com", "pw")
    client = Client()
    client.force_login(user)
    base = reverse("admin:django_workflows_workflowrun_changelist")
    pages = {
        "list first page": base,
        "list page 500": base + "?p=500",
        "status=FAILED page 500": base + "?status=FAILED&p=500",
        "status=RUNNING": base + "?status=RUNNING",
        "workflow filter": base + "?workflow_id=adm-fails",
        "waiting for a human": base + "?attention=human",
        "has failures": base + "?attention=failures",
        "created last 24h": base + "?created=24h",
        "search full run id": base + f"?q={failed_id}",
        "search idempotency key": base + "?q=order-42",
        "search workflow id": base + "?q=adm-fails",
        "run page": reverse("admin:django_workflows_workflowrun_change", args=[failed_id]),
        "outbox list": reverse("admin:django_workflows_outboxevent_changelist"),
        "outbox unpublished": reverse("admin:django_workflows_outboxevent_changelist")
        + "?delivery=unpublished",
    }
    client.get(base)  # warm the content types and session
    report = {}
    for label, url in pages.items():
        with CaptureQueriesContext(connection) as queries:
            response = client.get(url)
        assert response.status_code == 200, (label, response.status_code)
        if "cl" in (response.context or {}):
            cl = response.context["cl"]
            assert cl.result_count > 0 or label.startswith("search"), label
            if label.startswith("search"):
                assert cl.result_count >= 1, label
        _check_queries(queries, label)
        report[label] = _pct(_timed(client, url))

    human = client.get(base + "?attention=human").context["cl"]
    assert all(r.status == "RUNNING" for r in human.result_list)
    assert any(w.reason == "approval" for r in human.result_list for w in r.dw_waiting)
    found = client.get(base + "?q=order-42").context["cl"]
    assert [str(r.pk) for r in found.result_list] == [failed_id]

    print(f"{'page':>26}  p50 ms  p95 ms")
    for label, (p50, p95) in report.items():
        print(f"{label:>26}  {p50:6.1f}  {p95:6.1f}")

    # The engine's poll-due and flush queries read through their indexes.
    poll = _explain(
        "SELECT id FROM workflow_stages WHERE status = 'SUSPENDED' AND next_poll_at <= now() "
        "ORDER BY next_poll_at LIMIT 50"
    )
    assert "Index Scan using wf_stage_" in poll and "Seq Scan" not in poll, poll
    flush = _explain(
        "SELECT id FROM outbox_events WHERE published_at IS NULL AND dlq_at IS NULL AND "
        "workflow_run_id NOT IN (SELECT workflow_run_id FROM outbox_events WHERE dlq_at IS NOT "
        "NULL AND published_at IS NULL) ORDER BY workflow_run_id, sequence LIMIT 100"
    )
    assert "wf_outbox_unpublished_idx" in flush and "Seq Scan" not in flush, flush
    print(f"total {time.perf_counter() - started:.1f} s")
