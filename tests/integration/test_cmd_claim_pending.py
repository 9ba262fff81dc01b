"""``run.claimPending`` against the database (SPEC §4.2; catalogue A.2; Part I item 2)."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

import pytest

from django_workflows import define_workflow
from django_workflows.definition import Workflow
from django_workflows.kernel import ClaimPendingRuns, CreateRun, Kernel
from django_workflows.kernel.commands import FlushOutbox
from django_workflows.kernel.handlers import run_claim_pending
from django_workflows.models import (
    OutboxEvent,
    Status,
    WorkflowJob,
    WorkflowLog,
    WorkflowRun,
    WorkflowStage,
)
from django_workflows.testing import CollectingSink, FakeClock
from tests.workflows import Num, add, two_stage

pytestmark = pytest.mark.django_db(transaction=True)

KernelFor = Callable[..., Kernel]


def _parallel_first() -> Workflow:
    return (
        define_workflow(id="fan-out", input=Num)
        .parallel([add(1, "left"), add(2, "right")])
        .pipe(add(3, "join"))
        .build()
    )


def _create(kernel: Kernel, workflow_id: str = "two-stage", **kwargs: Any) -> uuid.UUID:
    kwargs.setdefault("input", {"value": 1})
    res = kernel.dispatch(CreateRun(workflow_id=workflow_id, **kwargs))
    return uuid.UUID(res.workflow_run_id)


def _outbox_types(run_id: uuid.UUID) -> list[str]:
    return list(
        OutboxEvent.objects.filter(workflow_run_id=run_id)
        .order_by("sequence")
        .values_list("event_type", flat=True)
    )


def _orphan_record(run_id: uuid.UUID, stage_id: str, status: str, now: Any) -> WorkflowStage:
    """A group-1 record left behind by an interrupted earlier claim (EC-3)."""
    return WorkflowStage.objects.create(
        created_at=now,
        updated_at=now,
        run_id=run_id,
        stage_id=stage_id,
        stage_name=stage_id,
        stage_number=1,
        execution_group=1,
        status=status,
    )


def test_claim_pending_claims_run_and_enqueues_first_stage(
    kernel_for: KernelFor, clock: FakeClock, sink: CollectingSink
) -> None:
    """K-CP-1, K-CP-4, K-CP-6, SM-30, WF-45: the run is RUNNING with ``started_at``; one PENDING
    group-1 record (generation 0, config slice); one PENDING job with the run's priority and the
    whole config map; ``workflow:started`` follows ``workflow:created``.
    """
    kernel = kernel_for(two_stage())
    run_id = _create(kernel, priority=7)
    clock.advance(3)

    result = kernel.dispatch(ClaimPendingRuns(worker_id="w-1"))

    assert len(result.claimed) == 1
    claimed = result.claimed[0]
    assert claimed.workflow_run_id == str(run_id)
    assert claimed.workflow_id == "two-stage"
    assert len(claimed.job_ids) == 1

    run = WorkflowRun.objects.get(pk=run_id)
    assert run.status == Status.RUNNING
    assert run.started_at == clock.now()
    assert run.version > 1

    stages = list(WorkflowStage.objects.filter(run_id=run_id))
    assert [(s.stage_id, s.status, s.generation, s.execution_group) for s in stages] == [
        ("add-1", Status.PENDING, 0, 1)
    ]
    assert stages[0].config == {}

    job = WorkflowJob.objects.get()
    assert job.pk == claimed.job_ids[0]
    assert (job.workflow_run_id, job.workflow_id, job.stage_id) == (run_id, "two-stage", "add-1")
    assert (job.status, job.attempt, job.priority) == (Status.PENDING, 0, 7)
    assert job.payload == {"config": run.config}

    assert _outbox_types(run_id) == ["workflow:created", "workflow:started"]
    kernel.dispatch(FlushOutbox())
    assert sink.types(run_id).count("workflow:started") == 1


def test_claim_pending_returns_empty_when_nothing_is_pending(kernel_for: KernelFor) -> None:
    """K-CP-1: no PENDING run -> no claims, no writes."""
    kernel = kernel_for(two_stage())
    assert kernel.dispatch(ClaimPendingRuns(worker_id="w-1")).claimed == []
    assert WorkflowJob.objects.count() == 0
    assert OutboxEvent.objects.count() == 0


def test_claim_pending_respects_max_claims(kernel_for: KernelFor, clock: FakeClock) -> None:
    """K-CP-1, DM-33: 5 pending, ``max_claims=2`` -> 2 claimed (highest priority, then oldest);
    the other 3 stay PENDING.
    """
    kernel = kernel_for(two_stage())
    ids = []
    for priority in (1, 5, 9, 5, 1):
        ids.append(_create(kernel, priority=priority))
        clock.advance(1)

    result = kernel.dispatch(ClaimPendingRuns(worker_id="w-1", max_claims=2))

    assert [c.workflow_run_id for c in result.claimed] == [str(ids[2]), str(ids[1])]
    assert WorkflowRun.objects.filter(status=Status.RUNNING).count() == 2
    assert set(WorkflowRun.objects.filter(status=Status.PENDING).values_list("pk", flat=True)) == {
        ids[0],
        ids[3],
        ids[4],
    }
    assert WorkflowJob.objects.count() == 2


def test_the_claim_statement_starts_the_run_it_locks(
    kernel_for: KernelFor, clock: FakeClock
) -> None:
    """Issue 19, DM-33: with ``start_at`` (no keyed workflow registered) the claim makes the
    run RUNNING - started and updated at that time, version bumped - in the one statement
    that locks it, highest priority then oldest first; the next claim takes the next PENDING
    run; with none left it returns ``None`` and writes nothing."""
    from django.db import connection, transaction
    from django.test.utils import CaptureQueriesContext

    from django_workflows.kernel.locking import claim_next_pending_run

    kernel = kernel_for(two_stage())
    older = _create(kernel)
    clock.advance(1)
    newer = _create(kernel)
    clock.advance(1)
    urgent = _create(kernel, priority=9)
    version = WorkflowRun.objects.get(pk=older).version
    start = clock.advance(5)
    claimed = []
    for _ in range(3):
        with transaction.atomic(), CaptureQueriesContext(connection) as queries:
            run = claim_next_pending_run(start_at=start)
        assert run is not None
        assert len(queries.captured_queries) == 1
        assert queries.captured_queries[0]["sql"].startswith("UPDATE")
        assert (run.status, run.started_at, run.updated_at) == (Status.RUNNING, start, start)
        claimed.append(run.pk)
    assert claimed == [urgent, older, newer]
    stored = WorkflowRun.objects.get(pk=older)
    assert (stored.status, stored.started_at, stored.version) == (
        Status.RUNNING,
        start,
        version + 1,
    )
    with transaction.atomic():
        assert claim_next_pending_run(start_at=start) is None


def test_a_claim_among_keyed_workflows_starts_the_run_only_once_its_key_is_checked(
    kernel_for: KernelFor, clock: FakeClock
) -> None:
    """With a keyed workflow registered, the claim returns the run still PENDING and locked
    (its key is checked under its lock first, issue 18 item 6); ``run.claimPending`` then
    starts it: one ``workflow:started``, RUNNING at the claim's time."""
    from django.db import transaction

    from django_workflows.kernel.limits import claim_next_allowed_run
    from django_workflows.kernel.locking import claim_next_pending_run

    keyed = (
        define_workflow(
            id="keyed",
            input=Num,
            concurrency_key=lambda i: str(i.value),
            max_running_per_key=1,
        )
        .pipe(add(1, "only"))
        .build()
    )
    kernel = kernel_for(two_stage(), keyed)
    run_id = _create(kernel)
    with transaction.atomic():
        run = claim_next_allowed_run(
            kernel.registry, None, claim=claim_next_pending_run, start_at=clock.now()
        )
        assert run is not None and run.pk == run_id and run.status == Status.PENDING
        transaction.set_rollback(True)
    start = clock.advance(2)
    assert [
        c.workflow_run_id for c in kernel.dispatch(ClaimPendingRuns(worker_id="w")).claimed
    ] == [str(run_id)]
    stored = WorkflowRun.objects.get(pk=run_id)
    assert (stored.status, stored.started_at) == (Status.RUNNING, start)
    assert _outbox_types(run_id).count("workflow:started") == 1


def test_claim_pending_fails_run_of_missing_workflow(
    kernel_for: KernelFor, clock: FakeClock, sink: CollectingSink
) -> None:
    """K-CP-2: the run is FAILED with ``completed_at`` and ``output.error`` = WORKFLOW_NOT_FOUND
    (message, worker id); an ERROR log; one ``workflow:failed``; it is not in ``claimed``.
    """
    creator = kernel_for(two_stage())
    run_id = _create(creator)
    claimer = kernel_for()  # a worker whose registry lacks "two-stage"
    clock.advance(2)

    result = claimer.dispatch(ClaimPendingRuns(worker_id="w-9"))

    assert result.claimed == []
    run = WorkflowRun.objects.get(pk=run_id)
    assert run.status == Status.FAILED
    assert run.completed_at == clock.now()
    error = run.output["error"]
    assert error["code"] == "WORKFLOW_NOT_FOUND"
    assert error["worker_id"] == "w-9"
    assert "not found in registry" in error["message"]
    log = WorkflowLog.objects.get(run_id=run_id)
    assert log.level == "ERROR"
    assert log.metadata == {"worker_id": "w-9", "code": "WORKFLOW_NOT_FOUND"}
    assert WorkflowStage.objects.count() == 0
    assert WorkflowJob.objects.count() == 0

    claimer.dispatch(FlushOutbox())
    assert sink.types(run_id) == ["workflow:created", "workflow:failed"]
    assert sink.events[-1]["error"] == error["message"]


def test_claim_pending_enqueues_every_stage_of_a_parallel_first_group(
    kernel_for: KernelFor,
) -> None:
    """K-CP-4: a parallel group 1 gets one record and one job per stage."""
    kernel = kernel_for(_parallel_first())
    run_id = _create(kernel, workflow_id="fan-out")

    result = kernel.dispatch(ClaimPendingRuns(worker_id="w-1"))

    assert len(result.claimed[0].job_ids) == 2
    assert sorted(WorkflowJob.objects.values_list("stage_id", flat=True)) == ["left", "right"]
    records = WorkflowStage.objects.filter(run_id=run_id).order_by("stage_number")
    assert [(r.stage_id, r.execution_group, r.status) for r in records] == [
        ("left", 1, Status.PENDING),
        ("right", 1, Status.PENDING),
    ]


def test_claim_pending_upserts_an_orphaned_pending_record(
    kernel_for: KernelFor, clock: FakeClock
) -> None:
    """K-CP-4, EC-3: a PENDING record left by an interrupted claim is kept (still one record,
    PENDING) and gets a job.
    """
    kernel = kernel_for(two_stage())
    run_id = _create(kernel)
    orphan = _orphan_record(run_id, "add-1", Status.PENDING, clock.now())

    result = kernel.dispatch(ClaimPendingRuns(worker_id="w-1"))

    assert len(result.claimed) == 1
    records = list(WorkflowStage.objects.filter(run_id=run_id))
    assert [(r.pk, r.status) for r in records] == [(orphan.pk, Status.PENDING)]
    assert result.claimed[0].job_ids == list(WorkflowJob.objects.values_list("pk", flat=True))
    assert len(result.claimed[0].job_ids) == 1


@pytest.mark.parametrize("status", [Status.RUNNING, Status.COMPLETED, Status.SUSPENDED])
def test_claim_pending_skips_jobs_for_records_not_pending(
    kernel_for: KernelFor, clock: FakeClock, status: str
) -> None:
    """K-CP-4: an existing RUNNING/COMPLETED/SUSPENDED record gets no job; the run is still
    claimed (with no job ids) and the record keeps its status.
    """
    kernel = kernel_for(two_stage())
    run_id = _create(kernel)
    orphan = _orphan_record(run_id, "add-1", status, clock.now())

    result = kernel.dispatch(ClaimPendingRuns(worker_id="w-1"))

    assert [(c.workflow_run_id, c.job_ids) for c in result.claimed] == [(str(run_id), [])]
    orphan.refresh_from_db()
    assert orphan.status == status
    assert WorkflowStage.objects.filter(run_id=run_id).count() == 1
    assert WorkflowJob.objects.count() == 0
    assert WorkflowRun.objects.get(pk=run_id).status == Status.RUNNING


def _break_claim_of(monkeypatch: pytest.MonkeyPatch, victim: uuid.UUID, how: str) -> None:
    """Make group-1 preparation of ``victim`` fail after it wrote its records.

    ``python``: a plain exception. ``database``: a real unique-constraint violation from the
    database, which on PostgreSQL aborts the transaction unless a savepoint isolates it (EC-26).
    """
    real = run_claim_pending.open_stages  # the group's records and jobs (issue 19)

    def open_stages(queue: Any, run: WorkflowRun, nodes: Any, **kwargs: Any) -> Any:
        opened = real(queue, run, nodes, **kwargs)
        if run.pk != victim:
            return opened
        records = opened.records
        if how == "python":
            raise RuntimeError("stage store exploded")
        duplicate = WorkflowStage(
            created_at=kwargs["now"],
            updated_at=kwargs["now"],
            run_id=run.pk,
            stage_id=records[0].stage_id,
            stage_name="dup",
            stage_number=1,
            execution_group=1,
        )
        WorkflowStage.objects.bulk_create([duplicate])  # (run, stage_id) is unique
        return opened

    monkeypatch.setattr(run_claim_pending, "open_stages", open_stages)


@pytest.mark.parametrize("how", ["python", "database"])
def test_claim_pending_isolates_a_failing_run(
    kernel_for: KernelFor,
    clock: FakeClock,
    sink: CollectingSink,
    monkeypatch: pytest.MonkeyPatch,
    how: str,
) -> None:
    """K-CP-5, EC-19, EC-26, Part I item 2: one run whose preparation raises is FAILED with
    CLAIM_FAILED (message, worker id) and ``workflow:failed``; its partial writes are rolled
    back (no records, no jobs); the runs before and after it are claimed normally.
    """
    kernel = kernel_for(two_stage())
    first = _create(kernel)
    clock.advance(1)
    victim = _create(kernel)
    clock.advance(1)
    last = _create(kernel)
    _break_claim_of(monkeypatch, victim, how)

    result = kernel.dispatch(ClaimPendingRuns(worker_id="w-7"))

    assert [c.workflow_run_id for c in result.claimed] == [str(first), str(last)]
    assert all(len(c.job_ids) == 1 for c in result.claimed)
    statuses = dict(WorkflowRun.objects.values_list("pk", "status"))
    assert statuses == {first: Status.RUNNING, victim: Status.FAILED, last: Status.RUNNING}
    failed = WorkflowRun.objects.get(pk=victim)
    assert failed.completed_at == clock.now()
    assert failed.output["error"]["code"] == "CLAIM_FAILED"
    assert failed.output["error"]["worker_id"] == "w-7"
    expected = "RuntimeError" if how == "python" else "IntegrityError"
    assert expected in failed.output["error"]["message"]
    assert WorkflowStage.objects.filter(run_id=victim).count() == 0
    assert WorkflowJob.objects.filter(workflow_run_id=victim).count() == 0
    assert WorkflowLog.objects.get(run_id=victim).metadata == {
        "worker_id": "w-7",
        "code": "CLAIM_FAILED",
    }
    for ok in (first, last):
        assert WorkflowStage.objects.filter(run_id=ok, status=Status.PENDING).count() == 1
        assert WorkflowJob.objects.filter(workflow_run_id=ok).count() == 1

    kernel.dispatch(FlushOutbox())
    assert sink.types(victim) == ["workflow:created", "workflow:failed"]
    assert sink.types(first) == ["workflow:created", "workflow:started"]
    assert sink.types(last) == ["workflow:created", "workflow:started"]
