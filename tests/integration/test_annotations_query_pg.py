"""``annotations.list`` on a run with 100,000 annotations (PostgreSQL only): every filter of AN-9
is served by an index of ``workflow_annotations`` (no sequential scan), and its timing is
printed (run with ``-s`` to see the table).

The rows are inserted with one ``INSERT ... SELECT generate_series`` (plus two smaller runs so
the run filter is not the whole table), then ``ANALYZE``. Each case runs ``list_annotations``
under ``CaptureQueriesContext``; every captured query that reads ``workflow_annotations`` is
re-run with ``EXPLAIN (ANALYZE, FORMAT JSON)`` and its plan walked.
"""

from __future__ import annotations

import json
import statistics
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from django_workflows.kernel.annotations import list_annotations
from django_workflows.models import Status, WorkflowRun
from tests.markers import postgres_only

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.postgres, postgres_only]

ROWS = 100_000
#: Plan nodes that read the table through an index (a bitmap heap scan reads the pages a
#: bitmap index scan found).
INDEX_SCANS = {"Index Scan", "Index Only Scan", "Bitmap Heap Scan"}
KEY_NAMESPACES = ("decision", "approval", "trigger", "acme", "review")
START = datetime(2026, 1, 1, tzinfo=UTC)


def _make_run(now: datetime, metadata: dict[str, Any] | None = None) -> WorkflowRun:
    return WorkflowRun.objects.create(
        created_at=now,
        updated_at=now,
        workflow_id="bulk",
        workflow_name="bulk",
        workflow_type="bulk",
        status=Status.COMPLETED,
        metadata=metadata,
    )


def _bulk_insert(run_id: uuid.UUID, rows: int, start: datetime) -> None:
    """``rows`` annotations, 10 ms apart: 55 keys in 5 namespaces, 3/4 stage-scope rows over
    10 stages, 50 actors of 3 kinds, attempts 0-2, every tenth row with an idempotency key.
    """
    with connection.cursor() as cursor:
        cursor.execute(
            """
            INSERT INTO workflow_annotations (
                created_at, run_id, stage_record_id, generation, scope, scope_id,
                actor_kind, actor_id, actor_version, key, value, payload, idempotency_key
            )
            SELECT
                %s::timestamptz + g * interval '10 milliseconds',
                %s::uuid,
                NULL,
                g %% 3,
                CASE WHEN g %% 4 = 0 THEN 'run' ELSE 'stage' END,
                CASE WHEN g %% 4 = 0 THEN NULL ELSE 'stage-' || (g %% 10) END,
                (ARRAY['user', 'model', 'system'])[1 + (g / 7) %% 3],
                'actor-' || (g %% 50),
                NULL,
                (%s::text[])[1 + g %% 5] || '.field_' || (g %% 11),
                to_jsonb(g),
                NULL,
                CASE WHEN g %% 10 = 0 THEN 'idem-' || g ELSE NULL END
            FROM generate_series(1, %s) AS g
            """,
            [start, str(run_id), list(KEY_NAMESPACES), rows],
        )


def _plan_nodes(node: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield node
    for child in node.get("Plans", []):
        yield from _plan_nodes(child)


def _explain(sql: str) -> tuple[list[dict[str, Any]], float]:
    with connection.cursor() as cursor:
        cursor.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + sql)
        raw = cursor.fetchone()[0]
    doc = (json.loads(raw) if isinstance(raw, str) else raw)[0]
    return list(_plan_nodes(doc["Plan"])), float(doc["Execution Time"])


def _annotation_scans(nodes: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [n for n in nodes if n.get("Relation Name") == "workflow_annotations"]


def test_list_annotations_100k_every_filter_uses_an_index(capsys: pytest.CaptureFixture[str]):
    """AN-9, DM-16, AN-30: on a run with 100,000 annotations each filter of
    ``annotations.list`` (none, key, key prefix, scope, scope id incl. null, actor id, actor
    kind, generation, since, until, a window, a small limit, and the legacy-shim probe) returns
    the right rows in (created_at, id) order, and every query it sends reads
    ``workflow_annotations`` through an index - never a sequential scan.
    """
    now = START
    run = _make_run(now, metadata={"ticket": "T-1"})
    other_a, other_b = _make_run(now), _make_run(now)
    _bulk_insert(run.pk, ROWS, now)
    _bulk_insert(other_a.pk, 2_000, now)
    _bulk_insert(other_b.pk, 2_000, now)
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE workflow_annotations")

    mid = now + timedelta(milliseconds=10 * ROWS // 2)
    cases: list[tuple[str, dict[str, Any], int]] = [
        ("no filter (limit 1000)", {}, 1000),
        ("key", {"key": "decision.field_3"}, 1000),
        ("key, rare (limit 10000)", {"key": "review.field_10", "limit": 10_000}, -1),
        ("key_prefix", {"key_prefix": "acme."}, 1000),
        ("key_prefix, all of it", {"key_prefix": "approval.field_1", "limit": 100_000}, -1),
        ("scope", {"scope": "run"}, 1000),
        ("scope + scope_id", {"scope": "stage", "scope_id": "stage-7"}, 1000),
        ("scope_id", {"scope_id": "stage-3"}, 1000),
        ("scope_id null", {"scope_id": None}, 1000),
        ("actor_id", {"actor_id": "actor-42"}, 1000),
        ("actor_kind", {"actor_kind": "system"}, 1000),
        ("generation", {"generation": 2}, 1000),
        ("since", {"since": mid}, 1000),
        ("until", {"until": mid}, 1000),
        ("since + until (1 s window)", {"since": mid, "until": mid + timedelta(seconds=1)}, 101),
        ("limit 10", {"limit": 10}, 10),
        (
            "key + actor_kind + generation",
            {"key": "trigger.field_2", "actor_kind": "user", "generation": 1},
            -1,
        ),
    ]
    report = []
    for label, filters, expected_count in cases:
        with CaptureQueriesContext(connection) as captured:
            rows = list_annotations(run.pk, **filters)
        if expected_count >= 0:
            assert len(rows) == expected_count, label
        assert rows, label
        order = [(r.created_at, r.id if isinstance(r.id, int) else 0) for r in rows]
        assert order == sorted(order), label
        for r in rows:
            if "key" in filters:
                assert r.key == filters["key"], label
            if "key_prefix" in filters:
                assert r.key.startswith(filters["key_prefix"]), label
            if "scope_id" in filters:
                assert r.scope_id == filters["scope_id"], label
            if "actor_kind" in filters:
                assert r.actor_kind == filters["actor_kind"], label
            if "generation" in filters:
                assert r.generation == filters["generation"], label

        selects = [q["sql"] for q in captured if "workflow_annotations" in q["sql"]]
        assert selects, label
        db_ms = 0.0
        indexes: list[str] = []
        for sql in selects:
            nodes, exec_ms = _explain(sql)
            db_ms += exec_ms
            scans = _annotation_scans(nodes)
            assert scans, (label, sql)
            for scan in scans:
                assert scan["Node Type"] in INDEX_SCANS, (label, sql, scan["Node Type"])
                if scan["Node Type"] == "Bitmap Heap Scan":
                    bitmap = [n for n in _plan_nodes(scan) if n["Node Type"] == "Bitmap Index Scan"]
                    assert bitmap, (label, scan)
                    indexes += [n["Index Name"] for n in bitmap]
                else:
                    indexes.append(scan["Index Name"])
        assert all(name.startswith("wf_ann") for name in indexes), (label, indexes)

        walls = []
        for _ in range(5):
            t0 = time.perf_counter()
            list_annotations(run.pk, **filters)
            walls.append((time.perf_counter() - t0) * 1000)
        report.append((label, len(rows), statistics.median(walls), db_ms, sorted(set(indexes))))

    with capsys.disabled():
        print(f"\nannotations.list on a run with {ROWS:,} annotations (PostgreSQL)")
        print(f"{'filter':<30} {'rows':>6} {'list() ms':>10} {'SQL ms':>8}  index")
        for label, count, wall, db_ms, indexes in report:
            print(f"{label:<30} {count:>6} {wall:>10.1f} {db_ms:>8.2f}  {', '.join(indexes)}")
