"""Issue 19 lever "insert the continued stage's record RUNNING": the stage record of the job a
transaction leases to its own worker (the claimed run's first stage, the run's next stage in
an outcome transaction) is inserted RUNNING instead of inserted PENDING and then updated.
Everything the admin, the API and the event stream read must be as before: compared here
row by row, after every transaction of a run, with the old two-statement form.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime
from typing import Any

import pytest
from django.db import connection, transaction
from django.test.utils import CaptureQueriesContext

from django_workflows.kernel import CreateRun, delivery
from django_workflows.kernel.handlers import base, run_claim_pending
from django_workflows.kernel.handlers.base import OpenedStages, enqueue_stage_jobs
from django_workflows.kernel.stage_path import transition
from django_workflows.kernel.store import create_missing_stages
from django_workflows.kernel.versions import ensure_stored
from django_workflows.models import OutboxEvent, Status, WorkflowJob, WorkflowRun, WorkflowStage
from django_workflows.testing import FakeClock, make_kernel
from django_workflows.transport.inline import RecordingTransport
from tests.integration.test_stage_path import diamond

pytestmark = pytest.mark.django_db(transaction=True)

T0 = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)
UUIDISH = re.compile(r"[0-9a-f]{8}-?[0-9a-f]{4}-?[0-9a-f]{4}-?[0-9a-f]{4}-?[0-9a-f]{12}")


def _old_open_stages(queue: Any, run: Any, nodes: Any, **kw: Any) -> OpenedStages:
    """The form before issue 19: records inserted PENDING, then the jobs; begin starts the
    leased job's record with an UPDATE."""
    records = create_missing_stages(
        run, nodes, generation=kw["generation"], now=kw["now"], records=kw.get("records")
    )
    jobs = enqueue_stage_jobs(
        queue,
        run,
        records,
        workflow=kw["workflow"],
        reserve_for=kw.get("reserve_for"),
        serves=kw.get("serves"),
    )
    return OpenedStages(records, jobs, None)


def _snapshot(run_id: Any) -> dict[str, Any]:
    """Every row of the run the admin/API/events read, ids and causation ids by first
    appearance (they are random per run)."""
    names: dict[str, str] = {}

    def norm(value: Any) -> Any:
        text = repr(value)
        return UUIDISH.sub(lambda m: names.setdefault(m.group(0), f"<id{len(names)}>"), text)

    def rows(qs: Any, drop: tuple[str, ...]) -> list[Any]:
        return [norm({k: v for k, v in r.items() if k not in drop}) for r in qs.values()]

    return {
        "run": rows(WorkflowRun.objects.filter(pk=run_id), ("id",)),
        "stages": rows(
            WorkflowStage.objects.filter(run_id=run_id).order_by("stage_number"), ("id", "run_id")
        ),
        "jobs": rows(
            WorkflowJob.objects.filter(workflow_run_id=run_id).order_by("stage_id"),
            ("id", "workflow_run_id"),
        ),
        "events": rows(
            OutboxEvent.objects.filter(workflow_run_id=run_id).order_by("sequence"),
            ("id", "workflow_run_id"),
        ),
    }


def _drive(steps: list[dict[str, Any]]) -> int:
    """A diamond run step by step (claim+lease, then each outcome with its continuation or, for
    b, the lease of the parallel sibling c in the same commit), the clock one second further
    at every step; a snapshot after each transaction. Returns the statements of the run."""
    clock = FakeClock(T0)
    kernel = make_kernel(diamond(), clock=clock, transport=RecordingTransport())
    with transaction.atomic():  # the definition version stored once, outside the count
        ensure_stored(kernel.registry.get("diamond"), clock.now())
    with CaptureQueriesContext(connection) as queries:
        run_id = kernel.dispatch(CreateRun("diamond", {"value": 0})).workflow_run_id
        clock.advance(1)
        current = delivery.lease(kernel, "w")
        steps.append(_snapshot(run_id))
        while current is not None:
            clock.advance(1)
            outcome, services = delivery.execute(kernel, current)
            clock.advance(1)
            following = delivery.commit_outcome(kernel, current, outcome, services, "w")
            steps.append(_snapshot(run_id))
            current = following.next
            if current is None:
                clock.advance(1)
                current = delivery.lease(kernel, "w")
                steps.append(_snapshot(run_id))
    run = WorkflowRun.objects.get(pk=run_id)
    assert (run.status, run.output) == (Status.COMPLETED, {"value": 112})
    return len(queries.captured_queries)


def test_a_stage_record_inserted_running_is_the_row_the_insert_and_update_left(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The same diamond run twice, on the same fake clock: once as the engine runs it now,
    once with the old form (insert PENDING, then UPDATE to RUNNING in begin). After every
    transaction the run, its stage records (status, ``started_at``, ``version``,
    ``updated_at``, ...), jobs and events are equal; the new form sends three statements fewer
    (the claimed run's first stage, and the two continued stages a -> b, c -> d)."""
    new_steps: list[dict[str, Any]] = []
    new_statements = _drive(new_steps)
    monkeypatch.setattr(transition, "open_stages", _old_open_stages)
    monkeypatch.setattr(run_claim_pending, "open_stages", _old_open_stages)
    old_steps: list[dict[str, Any]] = []
    old_statements = _drive(old_steps)

    assert len(new_steps) == len(old_steps) == 6
    for new, old in zip(new_steps, old_steps, strict=True):
        assert new == old
    assert old_statements - new_statements == 3
    started = WorkflowStage.objects.filter(stage_id="a").order_by("created_at").last()
    assert started is not None and started.version == 3  # inserted 2 (as started), completed 3


def test_a_record_that_already_existed_is_started_by_an_update(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Only a record inserted by the same transaction is inserted RUNNING: when the leased
    job's record already existed (kept as it was, EC-3), open_stages reports none started and
    begin updates it as before."""
    seen: list[Any] = []
    real = base.open_stages

    def spy(*args: Any, **kwargs: Any) -> OpenedStages:
        opened = real(*args, **kwargs)
        seen.append(opened.started)
        return opened

    monkeypatch.setattr(transition, "open_stages", spy)
    monkeypatch.setattr(run_claim_pending, "open_stages", spy)
    clock = FakeClock(T0)
    kernel = make_kernel(diamond(), clock=clock, transport=RecordingTransport())
    run_id = kernel.dispatch(CreateRun("diamond", {"value": 0})).workflow_run_id
    # a record of stage a left by an earlier claim whose run went back to PENDING
    WorkflowStage.objects.create(
        run_id=run_id,
        stage_id="a",
        stage_name="a",
        stage_number=1,
        execution_group=1,
        status=Status.PENDING,
        created_at=T0,
        updated_at=T0,
    )
    clock.advance(1)
    leased = delivery.lease(kernel, "w")
    assert leased is not None and leased.node.stage.id == "a"
    assert seen == [None]
    record = WorkflowStage.objects.get(run_id=run_id, stage_id="a")
    assert (record.status, record.started_at, record.version) == (Status.RUNNING, clock.now(), 2)
