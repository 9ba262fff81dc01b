"""The claim of a PENDING run stays one index step however many runs wait (issue 19;
PostgreSQL only).

The engine's statements run as prepared statements on PostgreSQL (psycopg's
``prepare_threshold``, the example project's default), and after five executions PostgreSQL
may keep a *generic* plan, made without the parameters' values and from the table statistics
of that moment. With the claim's tie-breaker (``id``) outside the claim index, the generic
plan made while the table was small sorted every PENDING run for each claim: 4-7 ms a claim
with 3,000 runs waiting, measured with ``auto_explain`` in a 3,000-run backlog. With the index
in the claim's order the plan needs no sort and reads the first index entry.

The test takes the claim statement as the engine sends it (SQL and parameters, through an
execute wrapper), makes the statistics say the table is tiny (``ANALYZE`` before the backlog
is inserted), and explains the statement under ``plan_cache_mode = force_generic_plan``.
"""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from django.db import connection, transaction
from psycopg.sql import Literal

from django_workflows.kernel.locking import claim_next_pending_run
from django_workflows.models import Status, WorkflowRun
from tests.markers import postgres_only

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.postgres, postgres_only]

BACKLOG = 3_000
START = datetime(2026, 1, 1, tzinfo=UTC)


def _runs(n: int, offset: int = 0) -> list[WorkflowRun]:
    return [
        WorkflowRun(
            created_at=START + timedelta(milliseconds=offset + i),
            updated_at=START,
            workflow_id="claim-plan",
            workflow_name="claim-plan",
            workflow_type="claim-plan",
            status=Status.PENDING,
        )
        for i in range(n)
    ]


def _nodes(plan: dict[str, Any]) -> list[dict[str, Any]]:
    out = [plan]
    for child in plan.get("Plans", []):
        out += _nodes(child)
    return out


def _claim_statement(versions: Any, start_at: Any = None) -> tuple[str, list[Any]]:
    """The claim's SQL and parameters as :func:`claim_next_pending_run` sends them (with
    ``start_at``: the claim that also makes the run RUNNING, an ``UPDATE`` around the same
    ``SELECT``)."""
    seen: list[tuple[str, list[Any]]] = []

    def wrapper(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        if "FOR UPDATE SKIP LOCKED" in sql and "workflow_runs" in sql:
            seen.append((sql, list(params or [])))
        return execute(sql, params, many, context)

    with connection.execute_wrapper(wrapper), transaction.atomic():
        assert claim_next_pending_run(versions, start_at=start_at) is not None
    assert len(seen) == 1, seen
    return seen[0]


@pytest.mark.parametrize("starts", [False, True], ids=["lock", "lock-and-start"])
@pytest.mark.parametrize(
    "versions", [None, (("claim-plan", "v1"),)], ids=["any-version", "versioned"]
)
def test_a_generic_claim_plan_reads_one_index_entry_without_sorting(
    versions: Any, starts: bool
) -> None:
    with connection.cursor() as cursor:
        # a new table and indexes, as at deploy (an earlier test may have grown them and
        # rolled its rows back: the pages stay, and they weigh in the planner's costs)
        cursor.execute("TRUNCATE workflow_runs CASCADE")
    WorkflowRun.objects.bulk_create(_runs(1))
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE workflow_runs")  # statistics of a tiny table, as at deploy
    WorkflowRun.objects.bulk_create(_runs(BACKLOG, offset=1))

    sql, params = _claim_statement(versions, START if starts else None)
    assert sql.startswith("UPDATE") == starts, sql
    numbered = iter(range(1, len(params) + 1))
    prepared = re.sub(r"%s", lambda _m: f"${next(numbered)}", sql)
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute("SET LOCAL plan_cache_mode = force_generic_plan")
        cursor.execute(f"PREPARE claim_plan_probe AS {prepared}")
        try:
            # the values as literals: EXECUTE's own parameters would need their types
            values = ", ".join(Literal(p).as_string(connection.connection) for p in params)
            args = f"({values})" if params else ""  # the any-version claim has no parameter
            cursor.execute(f"EXPLAIN (ANALYZE, FORMAT JSON) EXECUTE claim_plan_probe{args}")
            raw = cursor.fetchone()[0]
        finally:
            cursor.execute("DEALLOCATE claim_plan_probe")
    plan = (json.loads(raw) if isinstance(raw, str) else raw)[0]["Plan"]
    nodes = _nodes(plan)
    kinds = [n["Node Type"] for n in nodes]
    assert "Sort" not in kinds and "Incremental Sort" not in kinds, (
        kinds,
        [n.get("Index Name") for n in nodes],
        sql,
    )
    scans = [n for n in nodes if n.get("Index Name") == "wf_run_claim_id_idx"]
    assert scans, kinds
    # the first entry in the claim's order is the run claimed: no walk over the backlog
    assert scans[0]["Actual Rows"] <= 2, scans[0]
