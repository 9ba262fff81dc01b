"""Retention (issue 20 part 1): the policy, ``prune``, ``workflows_prune`` and the supervisor's
retention duty, on SQLite and PostgreSQL."""

from __future__ import annotations

import json
import threading
import uuid
from datetime import datetime, timedelta
from io import StringIO
from typing import Any

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import connection

from django_workflows.checks import check_retention
from django_workflows.kernel import CreateRun, Kernel
from django_workflows.models import (
    IdempotencyKey,
    MaintenanceLease,
    OutboxEvent,
    WorkflowAnnotation,
    WorkflowBlob,
    WorkflowJob,
    WorkflowLog,
    WorkflowRun,
    WorkflowSignal,
    WorkflowStage,
)
from django_workflows.retention import (
    RETENTION_LEASE,
    RetentionDuty,
    RetentionPolicyError,
    parse_policy,
    prune,
)
from django_workflows.testing import FakeClock, run_to_completion
from tests.workflows import two_stage

pytestmark = pytest.mark.django_db(transaction=True)

POLICY = {"DEFAULT_DAYS": {"COMPLETED": 30, "FAILED": 90, "CANCELLED": 30}}


@pytest.fixture
def retention(settings: Any) -> Any:
    base = dict(settings.DJANGO_WORKFLOWS)

    def set_(value: Any, **more: Any) -> None:
        settings.DJANGO_WORKFLOWS = {**base, "RETENTION": value, **more}

    return set_


def make_run(
    now: datetime,
    *,
    status: str = "COMPLETED",
    days_ago: float | None = 40,
    workflow_id: str = "etl",
    parent: uuid.UUID | None = None,
    event: str = "published",
) -> uuid.UUID:
    """A run with one of every dependent row: stage, job, log, annotation, signal, blob, and
    two events (the second ``published``, ``waiting``, ``dead`` or ``skipped``)."""
    done = None if days_ago is None else now - timedelta(days=days_ago)
    run = WorkflowRun.objects.create(
        created_at=(done or now) - timedelta(minutes=1),
        updated_at=done or now,
        workflow_id=workflow_id,
        workflow_name=workflow_id,
        workflow_type=workflow_id,
        status=status,
        completed_at=done,
        parent_run_id=parent,
        event_sequence=2,
    )
    stage = WorkflowStage.objects.create(
        created_at=run.created_at,
        updated_at=run.updated_at,
        run=run,
        stage_id="a",
        stage_name="a",
        stage_number=1,
        execution_group=1,
        status="COMPLETED",
    )
    WorkflowJob.objects.create(
        created_at=run.created_at,
        updated_at=run.updated_at,
        workflow_run_id=run.pk,
        workflow_id=workflow_id,
        stage_id="a",
        status="COMPLETED",
    )
    WorkflowLog.objects.create(
        created_at=run.created_at, run=run, stage=stage, level="INFO", message="hi"
    )
    WorkflowAnnotation.objects.create(
        created_at=run.created_at, run=run, stage_record=stage, key="k", value=1
    )
    WorkflowSignal.objects.create(
        created_at=run.created_at, run=run, name="go", consumed_by=stage, consumed_at=run.updated_at
    )
    WorkflowBlob.objects.create(
        key=f"workflow-v2/{workflow_id}/{run.pk}/a/output.json",
        created_at=run.created_at,
        run_id=run.pk,
        stage_id="a",
        data=1,
    )
    at = run.created_at
    OutboxEvent.objects.create(
        created_at=at,
        workflow_run_id=run.pk,
        sequence=1,
        event_type="workflow:created",
        payload={},
        causation_id="t",
        occurred_at=at,
        published_at=at,
    )
    second: dict[str, Any] = {
        "published": {"published_at": at},
        "waiting": {},
        "dead": {"dlq_at": at},
        "skipped": {"dlq_at": at, "skipped_at": at, "published_at": at},
    }[event]
    OutboxEvent.objects.create(
        created_at=at,
        workflow_run_id=run.pk,
        sequence=2,
        event_type="workflow:completed",
        payload={},
        causation_id="t",
        occurred_at=at,
        **second,
    )
    return run.pk


def rows_of(run_id: uuid.UUID) -> dict[str, int]:
    return {
        "runs": WorkflowRun.objects.filter(pk=run_id).count(),
        "stages": WorkflowStage.objects.filter(run_id=run_id).count(),
        "jobs": WorkflowJob.objects.filter(workflow_run_id=run_id).count(),
        "logs": WorkflowLog.objects.filter(run_id=run_id).count(),
        "annotations": WorkflowAnnotation.objects.filter(run_id=run_id).count(),
        "signals": WorkflowSignal.objects.filter(run_id=run_id).count(),
        "blobs": WorkflowBlob.objects.filter(run_id=run_id).count(),
        "events": OutboxEvent.objects.filter(workflow_run_id=run_id).count(),
    }


FULL = {
    "runs": 1,
    "stages": 1,
    "jobs": 1,
    "logs": 1,
    "annotations": 1,
    "signals": 1,
    "blobs": 1,
    "events": 2,
}
GONE = dict.fromkeys(FULL, 0)


@pytest.fixture
def kernel(kernel_for: Any) -> Kernel:
    return kernel_for(two_stage())


# --- the policy ------------------------------------------------------------------------------


def test_policy_per_workflow_over_default() -> None:
    pol = parse_policy(
        {
            "DEFAULT_DAYS": {"COMPLETED": 30, "FAILED": 90},
            "WORKFLOW_DAYS": {"etl": {"COMPLETED": 7}, "audit": {"COMPLETED": None}},
        }
    )
    assert pol is not None
    assert pol.days_for("etl", "COMPLETED") == 7
    assert pol.days_for("etl", "FAILED") == 90  # inherited
    assert pol.days_for("audit", "COMPLETED") is None  # kept forever
    assert pol.days_for("other", "CANCELLED") is None  # not named: forever
    assert parse_policy(None) is None


@pytest.mark.parametrize(
    ("value", "names"),
    [
        ([], "RETENTION must be None or a dict"),
        ({"DAYS": {}}, "unknown keys DAYS"),
        ({"DEFAULT_DAYS": {"RUNNING": 3}}, "['DEFAULT_DAYS'] names 'RUNNING'"),
        ({"DEFAULT_DAYS": {"COMPLETED": -1}}, "['DEFAULT_DAYS']['COMPLETED'] must be"),
        ({"DEFAULT_DAYS": {"COMPLETED": 1_000_000}}, "from 0 to 365000"),
        ({"DEFAULT_DAYS": {"COMPLETED": "30"}}, "['DEFAULT_DAYS']['COMPLETED'] must be"),
        ({"DEFAULT_DAYS": {"COMPLETED": True}}, "['DEFAULT_DAYS']['COMPLETED'] must be"),
        (
            {"WORKFLOW_DAYS": {"etl": {"FAILED": float("inf")}}},
            "['WORKFLOW_DAYS']['etl']['FAILED'] must be",
        ),
        ({"WORKFLOW_DAYS": {"etl": 7}}, "['WORKFLOW_DAYS']['etl'] must be a dict"),
        ({"WORKFLOW_DAYS": [1]}, "['WORKFLOW_DAYS'] must be a dict"),
        ({"DJANGO_Q_TASK_DAYS": "x"}, "['DJANGO_Q_TASK_DAYS'] must be"),
    ],
)
def test_bad_policy_is_named(value: Any, names: str, retention: Any) -> None:
    with pytest.raises(RetentionPolicyError) as exc:
        parse_policy(value)
    assert names in str(exc.value)
    retention(value)
    [error] = check_retention()
    assert error.id == "django_workflows.E033" and names in error.msg


@pytest.mark.parametrize(
    ("more", "names"),
    [
        ({"RETENTION_BATCH_SIZE": 0}, "RETENTION_BATCH_SIZE"),
        ({"RETENTION_INTERVAL_SECONDS": -5}, "RETENTION_INTERVAL_SECONDS"),
    ],
)
def test_bad_batch_and_interval_are_named(more: Any, names: str, retention: Any) -> None:
    retention(POLICY, **more)
    [error] = check_retention()
    assert names in error.msg
    retention(POLICY)
    assert check_retention() == []


# --- prune -----------------------------------------------------------------------------------


def test_each_status_and_cutoff_edge(kernel: Kernel, clock: FakeClock) -> None:
    now = clock.now()
    pol = parse_policy(POLICY)
    old_completed = make_run(now, status="COMPLETED", days_ago=30.01)
    edge_completed = make_run(now, status="COMPLETED", days_ago=30)  # exactly 30 days: kept
    young_failed = make_run(now, status="FAILED", days_ago=89)
    old_failed = make_run(now, status="FAILED", days_ago=91)
    old_cancelled = make_run(now, status="CANCELLED", days_ago=31)
    report = prune(kernel=kernel, pol=pol)
    assert rows_of(old_completed) == GONE
    assert rows_of(old_failed) == GONE
    assert rows_of(old_cancelled) == GONE
    assert rows_of(edge_completed) == FULL
    assert rows_of(young_failed) == FULL
    assert report.runs == {"etl": {"COMPLETED": 1, "FAILED": 1, "CANCELLED": 1}}
    assert report.rows["runs"] == 3 and report.rows["outbox_events"] == 6
    assert report.complete


def test_per_workflow_policy(kernel: Kernel, clock: FakeClock) -> None:
    now = clock.now()
    pol = parse_policy(
        {
            "DEFAULT_DAYS": {"COMPLETED": 30},
            "WORKFLOW_DAYS": {"fast": {"COMPLETED": 7}, "audit": {"COMPLETED": None}},
        }
    )
    fast = make_run(now, days_ago=8, workflow_id="fast")
    etl = make_run(now, days_ago=8, workflow_id="etl")
    audit = make_run(now, days_ago=400, workflow_id="audit")
    etl_old = make_run(now, days_ago=31, workflow_id="etl")
    report = prune(kernel=kernel, pol=pol)
    assert rows_of(fast) == GONE and rows_of(etl_old) == GONE
    assert rows_of(etl) == FULL and rows_of(audit) == FULL
    assert report.runs == {"fast": {"COMPLETED": 1}, "etl": {"COMPLETED": 1}}
    # --workflow: only that workflow (its own age)
    young_fast = make_run(now, days_ago=7.5, workflow_id="fast")
    other = make_run(now, days_ago=31, workflow_id="etl")
    assert prune(kernel=kernel, pol=pol, workflow_id="fast").runs_total == 1
    assert rows_of(young_fast) == GONE and rows_of(other) == FULL


def test_live_runs_are_never_touched(kernel: Kernel, clock: FakeClock) -> None:
    now = clock.now()
    live = [make_run(now, status=s, days_ago=None) for s in ("PENDING", "RUNNING", "SUSPENDED")]
    # A live run that once completed long ago (a rerun made it RUNNING again).
    rerun = make_run(now, status="RUNNING", days_ago=100)
    report = prune(
        kernel=kernel,
        pol=parse_policy({"DEFAULT_DAYS": dict.fromkeys(("COMPLETED", "FAILED", "CANCELLED"), 0)}),
    )
    assert report.runs_total == 0
    for run_id in [*live, rerun]:
        assert rows_of(run_id) == FULL


@pytest.mark.parametrize("event", ["waiting", "dead"])
def test_undelivered_events_keep_the_run(kernel: Kernel, clock: FakeClock, event: str) -> None:
    now = clock.now()
    kept = make_run(now, event=event)
    skipped = make_run(now, event="skipped")  # an operator skipped its dead letter: prunable
    pol = parse_policy(POLICY)
    dry = prune(kernel=kernel, pol=pol, dry_run=True)
    assert dry.kept == {"undelivered": 1, "live_family": 0}
    report = prune(kernel=kernel, pol=pol)
    assert rows_of(kept) == FULL
    assert rows_of(skipped) == GONE
    assert report.kept["undelivered"] == 1 and report.runs_total == 1


def test_parent_and_child(kernel: Kernel, clock: FakeClock) -> None:
    now = clock.now()
    pol = parse_policy(POLICY)
    live_parent = make_run(now, status="RUNNING", days_ago=None)
    child_of_live = make_run(now, parent=live_parent)  # old, done, but its parent is live
    parent_of_live = make_run(now)
    live_child = make_run(now, status="SUSPENDED", days_ago=None, parent=parent_of_live)
    done_parent = make_run(now)
    done_child = make_run(now, parent=done_parent)
    dry = prune(kernel=kernel, pol=pol, dry_run=True)
    assert dry.kept["live_family"] == 2 and dry.runs_total == 2
    report = prune(kernel=kernel, pol=pol)
    assert rows_of(child_of_live) == FULL and rows_of(parent_of_live) == FULL
    assert rows_of(live_parent) == FULL and rows_of(live_child) == FULL
    assert rows_of(done_parent) == GONE and rows_of(done_child) == GONE
    assert report.kept["live_family"] == 2


def test_dry_run_changes_nothing(kernel: Kernel, clock: FakeClock) -> None:
    now = clock.now()
    ids = [
        make_run(now, workflow_id=w, status=s)
        for w in ("a", "b")
        for s in ("COMPLETED", "CANCELLED")
    ]
    before = {i: rows_of(i) for i in ids}
    report = prune(kernel=kernel, pol=parse_policy(POLICY), dry_run=True)
    assert report.runs == {
        "a": {"COMPLETED": 1, "CANCELLED": 1},
        "b": {"COMPLETED": 1, "CANCELLED": 1},
    }
    assert report.rows == {} and report.batches == 0
    assert {i: rows_of(i) for i in ids} == before


def test_batches_max_runs_stop_and_resume(kernel: Kernel, clock: FakeClock) -> None:
    now = clock.now()
    ids = [make_run(now, days_ago=40 + i / 100) for i in range(7)]
    pol = parse_policy(POLICY)
    seen: list[int] = []
    first = prune(
        pause_seconds=0.01,
        kernel=kernel,
        pol=pol,
        batch_size=2,
        max_runs=3,
        progress=lambda r: seen.append(r.runs_total),
    )
    assert first.runs_total == 4 and first.batches == 2 and not first.complete
    assert seen == [2, 4]
    # oldest first
    assert [rows_of(i)["runs"] for i in ids] == [1, 1, 1, 0, 0, 0, 0]
    stop = threading.Event()
    stop.set()
    stopped = prune(kernel=kernel, pol=pol, batch_size=2, stop=stop)
    assert stopped.runs_total == 0 and not stopped.complete
    rest = prune(kernel=kernel, pol=pol, batch_size=2)  # resumes: nothing to remember
    assert rest.runs_total == 3 and rest.batches == 2 and rest.complete
    assert WorkflowRun.objects.count() == 0


def test_a_real_finished_run_leaves_no_row(kernel: Kernel, clock: FakeClock) -> None:
    res = kernel.dispatch(CreateRun(workflow_id="two-stage", input={"value": 1}))
    run = run_to_completion(kernel, res.workflow_run_id)
    assert run.status == "COMPLETED"
    run_id = run.pk
    assert WorkflowStage.objects.filter(run_id=run_id).exists()
    assert OutboxEvent.objects.filter(workflow_run_id=run_id).exists()
    assert WorkflowBlob.objects.filter(run_id=run_id).exists()
    pol = parse_policy({"DEFAULT_DAYS": {"COMPLETED": 1}})
    assert prune(kernel=kernel, pol=pol).runs_total == 0  # too young
    clock.advance(86400 + 1)
    assert prune(kernel=kernel, pol=pol).runs_total == 1
    assert set(rows_of(run_id).values()) == {0}


def test_side_tables_by_age(kernel: Kernel, clock: FakeClock) -> None:
    from django_q.models import Task

    now = clock.now()
    for i, days in enumerate((10, 3)):
        IdempotencyKey.objects.create(
            created_at=now - timedelta(days=days),
            key=f"k{i}",
            command_type="run.create",
            state="completed",
        )
        Task.objects.create(
            id=f"t{i}",
            name=f"t{i}",
            func="f",
            started=now,
            success=True,
            stopped=now - timedelta(days=days),
        )
    pol = parse_policy({"DJANGO_Q_TASK_DAYS": 7, "IDEMPOTENCY_KEY_DAYS": 5})
    dry = prune(kernel=kernel, pol=pol, dry_run=True)
    assert (dry.django_q_tasks, dry.idempotency_keys) == (1, 1)
    assert Task.objects.count() == 2
    report = prune(kernel=kernel, pol=pol)
    assert (report.django_q_tasks, report.idempotency_keys) == (1, 1)
    assert list(Task.objects.values_list("name", flat=True)) == ["t1"]
    assert list(IdempotencyKey.objects.values_list("key", flat=True)) == ["k1"]


@pytest.mark.skipif("connection.vendor != 'postgresql'")
def test_locked_run_is_skipped_not_waited_for(kernel: Kernel, clock: FakeClock) -> None:
    """A run another transaction holds (a rerun about to make it RUNNING) is skipped at once
    and pruned by a later call."""
    import psycopg
    from django.conf import settings as dj

    now = clock.now()
    held, free = make_run(now), make_run(now)
    db = dj.DATABASES["default"]
    other = psycopg.connect(
        host=db["HOST"],
        port=db["PORT"] or 5432,
        user=db["USER"],
        dbname=connection.settings_dict["NAME"],
    )
    try:
        other.execute("SELECT 1 FROM workflow_runs WHERE id = %s FOR UPDATE", [held])
        report = prune(kernel=kernel, pol=parse_policy(POLICY))
        assert report.runs_total == 1 and report.skipped_locked == 1
        assert rows_of(free) == GONE and rows_of(held) == FULL
        # The holder makes it RUNNING again (a rerun) and commits: never pruned.
        other.execute("UPDATE workflow_runs SET status = 'RUNNING' WHERE id = %s", [held])
        other.commit()
    finally:
        other.close()
    assert prune(kernel=kernel, pol=parse_policy(POLICY)).runs_total == 0
    assert rows_of(held) == FULL


def _other_connection() -> Any:
    import psycopg
    from django.conf import settings as dj

    db = dj.DATABASES["default"]
    return psycopg.connect(
        host=db["HOST"],
        port=db["PORT"] or 5432,
        user=db["USER"],
        dbname=connection.settings_dict["NAME"],
    )


@pytest.mark.skipif("connection.vendor != 'postgresql'")
@pytest.mark.parametrize("rerun", ["child", "parent"])
def test_a_relative_made_live_by_an_open_rerun_keeps_the_run(
    kernel: Kernel, clock: FakeClock, rerun: str
) -> None:
    """A rerun locks only its own run's row. While it has made the child (or the parent)
    RUNNING but not committed, the prune batch must not read the relative's old, terminal
    status and delete the other run of the family: it skips the family, and once the rerun
    commits the live relative keeps it for good. The other connection's transaction is the
    ordering (no sleeps): it holds its lock for the whole prune call."""
    now = clock.now()
    parent = make_run(now)
    child = make_run(now, parent=parent)
    other_family = make_run(now)
    other_child = make_run(now, parent=other_family)
    live, kept = (child, parent) if rerun == "child" else (parent, child)
    other = _other_connection()
    try:
        # The rerun of `live` (lock_run, then the RUNNING update), not yet committed.
        other.execute("SELECT 1 FROM workflow_runs WHERE id = %s FOR UPDATE", [live])
        other.execute(
            "UPDATE workflow_runs SET status = 'RUNNING', completed_at = NULL WHERE id = %s",
            [live],
        )
        report = prune(kernel=kernel, pol=parse_policy(POLICY))
        assert rows_of(kept) == FULL, "a run was deleted while its relative was being rerun"
        assert rows_of(live) == FULL
        assert rows_of(other_family) == GONE and rows_of(other_child) == GONE
        assert report.runs_total == 2 and report.skipped_locked >= 1
        other.commit()
    finally:
        other.close()
    again = prune(kernel=kernel, pol=parse_policy(POLICY))
    assert again.runs_total == 0 and again.kept["live_family"] == 1
    assert rows_of(kept) == FULL and rows_of(live) == FULL


@pytest.mark.skipif("connection.vendor != 'postgresql'")
def test_a_rerun_after_the_batch_locked_the_family_waits_for_it(
    kernel: Kernel, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The other order: the batch share-locks the child first; the child's rerun (its row
    lock) then waits until the batch commits, so the batch never reads a status that changes
    under it. Ordered by an event set inside the batch's transaction, after the locks."""
    from django_workflows import retention

    now = clock.now()
    parent = make_run(now)
    child = make_run(now, days_ago=1, parent=parent)  # finished, not aged out yet
    locked = threading.Event()
    real = retention._lock_family

    def lock_family_then_signal(ids: list[Any]) -> list[Any]:
        out = real(ids)
        locked.set()
        return out

    monkeypatch.setattr(retention, "_lock_family", lock_family_then_signal)
    other = _other_connection()
    outcome: dict[str, Any] = {}

    def rerun_child() -> None:
        assert locked.wait(10)
        # lock_timeout: the batch commits within milliseconds; a wait this long means the
        # rerun is blocked by something else.
        other.execute("SET lock_timeout = '10s'")
        cur = other.execute("SELECT status FROM workflow_runs WHERE id = %s FOR UPDATE", [child])
        outcome["seen"] = cur.fetchone()[0]
        outcome["parent"] = other.execute(
            "SELECT count(*) FROM workflow_runs WHERE id = %s", [parent]
        ).fetchone()[0]
        other.rollback()

    thread = threading.Thread(target=rerun_child)
    thread.start()
    try:
        report = prune(kernel=kernel, pol=parse_policy(POLICY))
    finally:
        thread.join(15)
        other.close()
    assert report.runs_total == 1 and rows_of(child) == FULL
    # The rerun got the child's row only after the batch committed: its parent was gone by
    # then (as after any earlier prune), and it never ran beside a batch that read it live.
    assert outcome == {"seen": "COMPLETED", "parent": 0}


# --- the command -----------------------------------------------------------------------------


def test_command_json_and_dry_run(retention: Any) -> None:
    from django.utils import timezone

    now = timezone.now()
    old = make_run(now, workflow_id="etl")
    kept = make_run(now, workflow_id="etl", event="dead")
    retention(POLICY)
    out = StringIO()
    call_command("workflows_prune", "--dry-run", "--json", stdout=out)
    doc = json.loads(out.getvalue())
    assert doc["dry_run"] is True and doc["runs"] == {"etl": {"COMPLETED": 1}}
    assert doc["kept"] == {"undelivered": 1, "live_family": 0}
    assert rows_of(old) == FULL
    out = StringIO()
    call_command("workflows_prune", "--batch-size", "10", "--no-progress", stdout=out)
    assert "deleted 1 runs" in out.getvalue()
    assert "1 with undelivered events" in out.getvalue()
    assert rows_of(old) == GONE and rows_of(kept) == FULL


def test_command_errors(retention: Any) -> None:
    with pytest.raises(CommandError, match="RETENTION'] is not set"):
        call_command("workflows_prune")
    retention({"DEFAULT_DAYS": {"DONE": 1}})
    with pytest.raises(CommandError, match="names 'DONE'"):
        call_command("workflows_prune")
    retention(POLICY)
    with pytest.raises(CommandError, match="--batch-size: must be >= 1"):
        call_command("workflows_prune", "--batch-size", "0")
    with pytest.raises(CommandError, match="--pause: must be >= 0 seconds"):
        call_command("workflows_prune", "--pause", "-1")


# --- the supervisor's duty -------------------------------------------------------------------


def test_duty_prunes_one_batch_per_cycle_under_its_lease(
    kernel: Kernel, clock: FakeClock, retention: Any
) -> None:
    now = clock.now()
    for i in range(5):
        make_run(now, days_ago=40 + i)
    retention(
        POLICY,
        RETENTION_BATCH_SIZE=2,
        RETENTION_INTERVAL_SECONDS=3600,
        SUPERVISOR_INTERVAL_SECONDS=3,
    )
    duty = RetentionDuty(lambda: kernel, "me", background=False)
    # Another process holds the lease: nothing is pruned, look again after the interval.
    MaintenanceLease.objects.create(
        name=RETENTION_LEASE, owner="other", expires_at=now + timedelta(hours=1)
    )
    assert duty.run(0.0) == 3600
    assert WorkflowRun.objects.count() == 5
    MaintenanceLease.objects.all().delete()
    assert duty.run(1.0) == 3599  # not due yet
    duty.poke()
    assert duty.run(10.0) == 3  # a full batch: due again soon
    assert WorkflowRun.objects.count() == 3
    assert not MaintenanceLease.objects.exists()  # given up after the cycle
    assert duty.run(13.0) == 3
    assert duty.run(16.0) == 3600  # the last one: the walk ended
    assert WorkflowRun.objects.count() == 0 and duty.pruned == 5


def test_duty_idle_without_policy(kernel: Kernel, clock: FakeClock) -> None:
    make_run(clock.now())
    duty = RetentionDuty(lambda: kernel, "me", background=False)
    assert duty.run(0.0) == 60.0
    assert WorkflowRun.objects.count() == 1
    duty.stop()
    assert duty.run(1.0) == 60.0


def test_an_external_blob_store_is_told_after_the_commit(kernel: Kernel, clock: FakeClock) -> None:
    told: list[Any] = []

    class External:
        def delete_run_blobs(self, runs: list[tuple[Any, str]]) -> None:
            # called after the batch committed: the run rows are gone already
            assert not WorkflowRun.objects.filter(pk__in=[r for r, _ in runs]).exists()
            told.extend(runs)

    kernel.blobs = External()  # type: ignore[assignment]
    run_id = make_run(clock.now(), workflow_id="etl")
    assert prune(kernel=kernel, pol=parse_policy(POLICY)).runs_total == 1
    assert told == [(run_id, "etl")]


class _Tty(StringIO):
    def isatty(self) -> bool:
        return True


def test_command_progress_on_a_terminal(retention: Any) -> None:
    from django.utils import timezone

    now = timezone.now()
    for _ in range(3):
        make_run(now)
    retention(POLICY)
    err = _Tty()
    call_command("workflows_prune", "--batch-size", "2", stdout=StringIO(), stderr=err)
    assert "\rpruned 2/3 runs (66%)" in err.getvalue()
    assert "\rpruned 3/3 runs (100%)" in err.getvalue()
    quiet = _Tty()
    make_run(now)
    call_command("workflows_prune", "--no-progress", stdout=StringIO(), stderr=quiet)
    assert quiet.getvalue() == ""


def test_command_interrupted_exits_3(retention: Any, monkeypatch: Any) -> None:
    from django.utils import timezone

    from django_workflows.management.commands import workflows_prune as command
    from django_workflows.retention import PruneReport

    run_id = make_run(timezone.now())
    retention(POLICY)

    def interrupted(**kwargs: Any) -> PruneReport:  # a SIGINT arrives during the first batch
        kwargs["stop"].set()
        return prune(**{**kwargs, "stop": kwargs["stop"]})

    monkeypatch.setattr(command, "prune", interrupted)
    out, err = StringIO(), StringIO()
    with pytest.raises(SystemExit) as exc:
        call_command("workflows_prune", "--json", stdout=out, stderr=err)
    assert exc.value.code == 3
    assert json.loads(out.getvalue())["complete"] is False
    assert "run workflows_prune again" in err.getvalue()
    assert rows_of(run_id) == FULL  # stopped before its batch


def test_every_worker_process_supervisor_has_the_duty() -> None:
    from django_workflows.transport import django_q

    supervisor = django_q.ensure_supervisor()
    try:
        assert [d for d in supervisor.duties if isinstance(d, RetentionDuty)]
    finally:
        supervisor.halt()


def test_duty_cycles_in_its_own_thread(kernel: Kernel, clock: FakeClock, retention: Any) -> None:
    now = clock.now()
    for i in range(3):
        make_run(now, days_ago=40 + i)
    retention(POLICY, RETENTION_BATCH_SIZE=2, SUPERVISOR_INTERVAL_SECONDS=3)
    duty = RetentionDuty(lambda: kernel, "me")
    assert duty.run(0.0) == 1.0  # started; the supervisor thread is free at once
    duty.join(30)
    assert WorkflowRun.objects.count() == 1 and duty.pruned == 2
    assert duty.run(1.0) == 3.0  # a full batch: due again in SUPERVISOR_INTERVAL_SECONDS
    assert duty.run(4.0) == 1.0  # the next cycle started
    duty.join(30)
    assert WorkflowRun.objects.count() == 0
    assert duty.run(5.0) == 3599.0  # the backlog is gone: the interval


def test_live_statuses_are_every_run_status_but_the_terminal_ones() -> None:
    """The family check names the live statuses (an index scan); a new run status must be
    added there, or a run whose relative has it could be pruned."""
    from django_workflows.models import TERMINAL_RUN_STATUSES, Status
    from django_workflows.retention import LIVE_RUN_STATUSES

    stage_or_job_only = {Status.SKIPPED, Status.HELD}
    assert set(Status.values) - TERMINAL_RUN_STATUSES - stage_or_job_only == set(LIVE_RUN_STATUSES)


def test_another_apps_relation_to_runs_is_honoured(
    kernel: Kernel, clock: FakeClock, monkeypatch: Any
) -> None:
    """A project's own ``ForeignKey`` to runs: ``PROTECT`` keeps the referenced run (the raw
    deletes would otherwise leave a dangling reference that PostgreSQL refuses at commit,
    failing every batch for good); the other runs of the batch still go. Stood in for by the
    annotations' relation, as a project's model with ``on_delete=PROTECT``."""
    from types import SimpleNamespace

    from django.db.models import PROTECT

    from django_workflows import retention as module

    now = clock.now()
    referenced = make_run(now)
    free = make_run(now)
    WorkflowAnnotation.objects.filter(run_id=free).delete()
    protecting = SimpleNamespace(
        many_to_many=False,
        on_delete=PROTECT,
        related_model=WorkflowAnnotation,
        field=WorkflowAnnotation._meta.get_field("run"),
    )
    monkeypatch.setattr(module, "other_relations", lambda: [protecting])
    report = prune(kernel=kernel, pol=parse_policy(POLICY))
    assert WorkflowRun.objects.filter(pk=referenced).exists()
    assert rows_of(referenced)["annotations"] == 1
    assert not WorkflowRun.objects.filter(pk=free).exists()
    assert report.runs == {"etl": {"COMPLETED": 1}}
    assert report.kept["referenced"] == 1


def test_the_engines_own_relations_are_not_other_relations() -> None:
    from django_workflows.retention import other_relations

    assert other_relations() == []  # the example project refers to runs from nowhere else
