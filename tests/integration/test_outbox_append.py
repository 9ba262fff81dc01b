"""Outbox appends (EV-1..3; issue 19 lever "fold the sequence bump into the outbox insert"):
on PostgreSQL one statement per run reserves the run's sequence numbers and inserts its events;
on SQLite (and for a run whose row is missing) the bump and the insert are two statements. Both
forms must write the same rows, gap-free per run, serialised by the run row.
"""

from __future__ import annotations

import uuid
from datetime import timedelta
from typing import Any

import pytest
from django.db import DatabaseError, connection, transaction
from django.test.utils import CaptureQueriesContext

from django_workflows import define_workflow
from django_workflows.kernel import CreateRun, outbox
from django_workflows.models import OutboxEvent, WorkflowRun
from tests.workflows import Num, add

pytestmark = pytest.mark.django_db(transaction=True)

CONTROL = ("BEGIN", "COMMIT")
#: Columns compared between the two forms (all but the id and the run).
COLUMNS = [
    f.attname
    for f in OutboxEvent._meta.concrete_fields
    if f.attname not in ("id", "workflow_run_id")
]


def _runs(kernel_for: Any, count: int) -> list[str]:
    kernel = kernel_for(define_workflow(id="ob", input=Num).pipe(add(1)).build())
    return [
        str(kernel.dispatch(CreateRun("ob", {"value": i})).workflow_run_id) for i in range(count)
    ]


def _events(run_id: str) -> list[dict[str, Any]]:
    return [
        {"type": "stage:progress", "workflow_run_id": run_id, "progress": 12.5, "note": "é ✓"},
        {"type": "stage:completed", "workflow_run_id": run_id, "output": {"a": [1, None, "x"]}},
        outbox.caused_by({"type": "stage:started", "workflow_run_id": run_id}, "cause-2"),
    ]


def _rows(run_id: str) -> list[dict[str, Any]]:
    return list(
        OutboxEvent.objects.filter(workflow_run_id=run_id).order_by("sequence").values(*COLUMNS)
    )


def _without_run(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for row in rows:
        payload = dict(row["payload"])
        payload.pop("workflow_run_id")
        out.append({**row, "payload": payload})
    return out


def test_the_one_statement_append_writes_the_rows_the_two_statement_append_writes(
    kernel_for: Any, clock: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Run A gets its events by this database's append (one statement on PostgreSQL), run B
    the same events by the two-statement form (bump, then INSERT): the rows are equal column
    by column (sequences, causations, payload JSON, timestamps), and both run rows show the
    bump the same way (``event_sequence``, ``updated_at``; ``version`` kept)."""
    a, b = _runs(kernel_for, 2)
    before = {r.pk: r for r in WorkflowRun.objects.filter(pk__in=[a, b])}
    now = clock.now() + timedelta(seconds=5)
    with transaction.atomic():
        assert outbox.append_events(_events(a), "cause-1", now) == 3
    monkeypatch.setattr(outbox, "_has_writable_ctes", lambda: False)  # the SQLite form
    with transaction.atomic():
        assert outbox.append_events(_events(b), "cause-1", now) == 3

    assert _without_run(_rows(a)[-3:]) == _without_run(_rows(b)[-3:])
    tail = _rows(a)[-3:]
    assert [r["causation_id"] for r in tail] == ["cause-1", "cause-1", "cause-2"]
    assert tail[1]["payload"]["output"] == {"a": [1, None, "x"]}
    assert "_causation_id" not in tail[2]["payload"]
    for run_id in (a, b):
        run = WorkflowRun.objects.get(pk=run_id)
        old = before[uuid.UUID(run_id)]
        assert run.event_sequence == old.event_sequence + 3
        assert (run.updated_at, run.version) == (now, old.version)
        sequences = [r["sequence"] for r in _rows(run_id)]
        assert sequences == list(range(1, len(sequences) + 1))


def test_events_of_several_runs_are_numbered_per_run_and_cost_one_statement_per_run_on_pg(
    kernel_for: Any, clock: Any
) -> None:
    """One call with the events of two runs, interleaved: each run's events are numbered
    after its own last sequence, in the order given; on PostgreSQL one statement per run, on
    SQLite one bump per run and one INSERT of all rows."""
    a, b = _runs(kernel_for, 2)
    start = {r: WorkflowRun.objects.get(pk=r).event_sequence for r in (a, b)}
    mixed = [
        {"type": "t1", "workflow_run_id": a},
        {"type": "t2", "workflow_run_id": b},
        {"type": "t3", "workflow_run_id": a},
    ]
    with CaptureQueriesContext(connection) as queries, transaction.atomic():
        outbox.append_events(mixed, "c", clock.now())
    statements = [q for q in queries.captured_queries if not q["sql"].startswith(CONTROL)]
    assert len(statements) == {"postgresql": 2}.get(connection.vendor, 3)
    assert [(r["event_type"], r["sequence"]) for r in _rows(a)[-2:]] == [
        ("t1", start[a] + 1),
        ("t3", start[a] + 2),
    ]
    assert [(r["event_type"], r["sequence"]) for r in _rows(b)[-1:]] == [("t2", start[b] + 1)]


def test_events_of_a_run_without_a_row_continue_after_its_last_outbox_row(clock: Any) -> None:
    """No run row (deleted by an operator, or a run this database does not hold): the
    statement inserts nothing and the append falls back to the outbox's last sequence of that
    run (serialised by an advisory lock on PostgreSQL), still gap-free."""
    run_id = str(uuid.uuid4())
    with transaction.atomic():
        assert outbox.append_events(
            [{"type": "x", "workflow_run_id": run_id}] * 2, "c", clock.now()
        )
    with CaptureQueriesContext(connection) as queries, transaction.atomic():
        outbox.append_events([{"type": "y", "workflow_run_id": run_id}], "c", clock.now())
    statements = [q for q in queries.captured_queries if not q["sql"].startswith(CONTROL)]
    # PostgreSQL: the one statement (no row), the advisory lock, the last sequence, the
    # INSERT; SQLite: the bump (no row), the last sequence, the INSERT.
    assert len(statements) == {"postgresql": 4}.get(connection.vendor, 3)
    assert [(r["event_type"], r["sequence"]) for r in _rows(run_id)] == [
        ("x", 1),
        ("x", 2),
        ("y", 3),
    ]


def test_the_commit_hooks_run_once_after_a_commit_that_appended(
    kernel_for: Any, clock: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    (run_id,) = _runs(kernel_for, 1)
    calls: list[int] = []
    monkeypatch.setattr(outbox, "committed_hooks", [lambda: calls.append(1)])
    with transaction.atomic():
        outbox.append_events(_events(run_id), "c", clock.now())
        assert calls == []
    assert calls == [1]


def test_an_over_long_value_fails_the_append_instead_of_being_truncated(
    kernel_for: Any, clock: Any
) -> None:
    """The one-statement form casts strings to ``text`` (never to ``varchar(n)``, which would
    truncate silently): an event type longer than the column fails as a plain INSERT does."""
    if connection.vendor != "postgresql":
        pytest.skip("SQLite does not enforce varchar lengths")
    (run_id,) = _runs(kernel_for, 1)
    sequence = WorkflowRun.objects.get(pk=run_id).event_sequence
    with pytest.raises(DatabaseError), transaction.atomic():
        outbox.append_events([{"type": "t" * 65, "workflow_run_id": run_id}], "c", clock.now())
    assert WorkflowRun.objects.get(pk=run_id).event_sequence == sequence
