"""The scale section of the benchmark (``bench/scale.py``, issue 19) at a tiny size, so its
harness keeps working: the bulk SQL fills every NOT NULL column of the engine's tables with
rows the engine can act on, every operation is called as the engine calls it, and its
statements are captured and explained (PostgreSQL only: the section reads PostgreSQL plans).
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.markers import ON_POSTGRES

pytestmark = [
    pytest.mark.postgres,
    pytest.mark.django_db,
    pytest.mark.skipif(not ON_POSTGRES, reason="needs PostgreSQL (EXPLAIN ANALYZE plans)"),
]


def test_scale_capture_at_a_tiny_size() -> None:
    from bench import scale
    from django_workflows.models import OutboxEvent, Status, WorkflowJob, WorkflowRun

    generation = scale.populate(200, 20)
    rows = generation["rows"]
    assert rows["workflow_runs"] == 220
    assert rows["workflow_stages"] > 600 and rows["workflow_jobs"] == rows["workflow_stages"]
    # 9 or 11 events per finished run (one event per sequence, gap-free per run)
    assert rows["outbox_events"] >= 200 * 9
    assert WorkflowRun.objects.filter(status=Status.PENDING).count() == 4
    assert WorkflowJob.objects.filter(status=Status.PENDING, queue="batch").count() == 4
    assert OutboxEvent.objects.filter(published_at__isnull=True, dlq_at__isnull=True).exists()

    ops = scale.capture(2)
    by_name: dict[str, Any] = {op["name"]: op for op in ops}
    assert len(by_name) == len(ops) >= 14
    for op in ops:
        assert op["reps"] == 2 and op["call_p95_ms"] is not None, op["name"]
        assert op["statements"], op["name"]
        for s in op["statements"]:
            assert "error" not in s, (op["name"], s["sql"], s.get("plan"))
            assert s["plan"].splitlines()[-1].startswith("Execution Time"), s["plan"]
    # the operations really did their work on the generated rows
    lease = by_name["lease: next ready job (delivery.lease)"]
    assert any("FOR UPDATE" in s["sql"] for s in lease["statements"])
    claim = by_name["lease: claim a PENDING run (queue default)"]
    assert any('INSERT INTO "workflow_jobs"' in s["sql"] for s in claim["statements"])
    poll = by_name["stage.pollSuspended (poll-due)"]
    assert any('UPDATE "workflow_stages"' in s["sql"] for s in poll["statements"])
    flush = by_name["outbox flush (flusher.flush_outbox, 500)"]
    assert any('UPDATE "outbox_events"' in s["sql"] for s in flush["statements"])
    stale = by_name["lease.reapStale (stale-lease reaper)"]
    assert any('UPDATE "workflow_jobs"' in s["sql"] for s in stale["statements"])
    stuck = by_name["run.reapStuck (stuck-run reaper)"]
    assert any('UPDATE "workflow_runs"' in s["sql"] for s in stuck["statements"])
    # everything was rolled back
    assert WorkflowRun.objects.filter(status=Status.PENDING).count() == 4
    markdown = scale.render_markdown(
        {"finished": 200, "live": 20, "reps": 2, "generation": generation, "operations": ops}
    )
    assert "| supervisor.ticker_needed |" in markdown and "<details>" in markdown
