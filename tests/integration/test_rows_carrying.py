"""``rows.update(carrying=...)``: writes built but not sent ride in another update's statement
(issue 19: a completed stage's record and output blob go with its job's settling UPDATE)."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from typing import Any

import pytest
from django.db import connection, transaction
from django.test.utils import CaptureQueriesContext

from django_workflows.blobs import DatabaseBlobStore
from django_workflows.kernel import rows
from django_workflows.models import Status, WorkflowBlob, WorkflowJob, WorkflowRun

pytestmark = pytest.mark.django_db(transaction=True)

NOW = datetime(2026, 1, 1, tzinfo=UTC)


def _run() -> WorkflowRun:
    return WorkflowRun.objects.create(
        id=uuid.uuid4(),
        created_at=NOW,
        updated_at=NOW,
        workflow_id="w",
        workflow_name="w",
        workflow_type="w",
        status=Status.RUNNING,
    )


def _job(run: WorkflowRun) -> WorkflowJob:
    return WorkflowJob.objects.create(
        created_at=NOW,
        updated_at=NOW,
        workflow_run_id=run.pk,
        workflow_id="w",
        stage_id="s",
        status=Status.RUNNING,
        attempt=1,
    )


def _carried(run: WorkflowRun, key: str) -> list[rows.Write]:
    blob = rows.new(WorkflowBlob, key=key, data={"v": 1}, created_at=NOW, run_id=str(run.pk))
    return [
        rows.insert_write([blob]),
        rows.update_write(WorkflowRun, run.pk, {"total_tokens": 7}),
    ]


def _settle(job: WorkflowJob, attempt: int, carrying: list[rows.Write]) -> int:
    return rows.update(
        WorkflowJob,
        job.pk,
        {"status": Status.COMPLETED},
        where={"status": Status.RUNNING, "attempt": attempt},
        carrying=carrying,
    )


def test_carried_writes_take_effect_with_the_update_in_one_statement_on_postgresql() -> None:
    run = _run()
    job = _job(run)
    with CaptureQueriesContext(connection) as queries:
        with transaction.atomic():
            assert _settle(job, 1, _carried(run, "k1")) == 1
    sent = [q["sql"] for q in queries.captured_queries if q["sql"] not in ("BEGIN", "COMMIT")]
    sent = [s for s in sent if not s.startswith("BEGIN")]
    if connection.vendor == "postgresql":
        assert len(sent) == 1 and sent[0].startswith("WITH carried_0 AS (INSERT")
    else:  # one by one, in order, then the update
        assert [s.split()[0] for s in sent] == ["INSERT", "UPDATE", "UPDATE"]
    assert WorkflowJob.objects.get(pk=job.pk).status == Status.COMPLETED
    assert WorkflowBlob.objects.get(key="k1").data == {"v": 1}
    assert WorkflowRun.objects.get(pk=run.pk).total_tokens == 7


def test_the_row_count_is_the_update_s_own_and_a_failed_fence_is_rolled_back_by_its_caller() -> (
    None
):
    """The carried writes happen whatever the fence finds; the stage path rolls its
    transaction back when the fence matched nothing, and with it what rode along."""
    run = _run()
    job = _job(run)

    class Fenced(Exception):
        pass

    with pytest.raises(Fenced):
        with transaction.atomic():
            if _settle(job, 2, _carried(run, "k2")) == 0:  # attempt 2: not this delivery's
                assert WorkflowBlob.objects.filter(key="k2").exists()  # it did ride along
                raise Fenced
    assert not WorkflowBlob.objects.filter(key="k2").exists()
    assert WorkflowRun.objects.get(pk=run.pk).total_tokens == 0
    assert WorkflowJob.objects.get(pk=job.pk).status == Status.RUNNING


def test_insert_write_refuses_what_only_insert_can_do() -> None:
    with pytest.raises(ValueError, match="at least one"):
        rows.insert_write([])
    job = rows.new(WorkflowJob, workflow_id="w", stage_id="s", created_at=NOW, updated_at=NOW)
    with pytest.raises(ValueError, match="auto primary key"):
        rows.insert_write([job])


def test_a_blob_store_overriding_put_many_gets_every_write_through_it() -> None:
    """A subclass of the database blob store that overrides ``put_many`` gives no statement
    (``put_many_write`` is ``None``), so the stage path calls its ``put_many``."""
    seen: list[Any] = []

    class Hooked(DatabaseBlobStore):
        def put_many(self, items: Any, **kwargs: Any) -> None:
            seen.append(list(items))
            super().put_many(seen[-1], **kwargs)

    assert Hooked().put_many_write([("k", 1)]) is None
    plain = DatabaseBlobStore().put_many_write([("k", 1)], run_id=None, stage_id="s")
    assert isinstance(plain, rows.Write) and plain.sql.startswith("INSERT INTO")
