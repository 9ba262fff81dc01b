"""Migration 0012 (issue 17 section 3): the rerun counter ``attempt`` of stage records and
annotations becomes ``generation`` with its data kept, the annotation index is renamed, and a
stored ``run.error`` document's ``"attempt"`` member becomes ``"generation"`` (``"delivery"``
stays). Runs on both databases; the schema is migrated back to 0011 and forward again.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import pytest
from django.db import connection
from django.db.migrations.executor import MigrationExecutor

APP = "django_workflows"
BEFORE = [(APP, "0011_definition_versions")]
AFTER = [(APP, "0012_generation")]

pytestmark = pytest.mark.django_db(transaction=True)


def _migrate(targets: list[tuple[str, str]]) -> Any:
    executor = MigrationExecutor(connection)
    executor.loader.build_graph()
    executor.migrate(targets)
    return executor.loader.project_state(targets).apps


@pytest.fixture
def old_apps() -> Iterator[Any]:
    latest = MigrationExecutor(connection).loader.graph.leaf_nodes(APP)
    try:
        yield _migrate(BEFORE)
    finally:
        _migrate(latest)


def _index_names(table: str) -> set[str]:
    with connection.cursor() as cursor:
        return set(connection.introspection.get_constraints(cursor, table))


def test_generation_keeps_the_rerun_counters_and_rewrites_run_error(old_apps: Any) -> None:
    now = datetime(2026, 12, 1, tzinfo=UTC)
    Run = old_apps.get_model(APP, "WorkflowRun")
    Stage = old_apps.get_model(APP, "WorkflowStage")
    Annotation = old_apps.get_model(APP, "WorkflowAnnotation")
    Job = old_apps.get_model(APP, "WorkflowJob")
    run_fields: dict[str, Any] = {
        "created_at": now,
        "updated_at": now,
        "workflow_id": "w",
        "workflow_name": "w",
        "workflow_type": "w",
        "status": "FAILED",
    }
    failed = Run.objects.create(
        id=uuid.uuid4(),
        error={
            "stage_id": "s",
            "message": "boom",
            "error_type": "StageFailed",
            "attempt": 2,
            "delivery": 3,
        },
        **run_fields,
    )
    plain = Run.objects.create(id=uuid.uuid4(), error=None, **run_fields)
    stage = Stage.objects.create(
        id=uuid.uuid4(),
        created_at=now,
        updated_at=now,
        run=failed,
        stage_id="s",
        stage_name="s",
        stage_number=1,
        execution_group=1,
        attempt=2,
        status="FAILED",
    )
    Annotation.objects.create(
        created_at=now, run=failed, stage_record=stage, attempt=2, key="acme.k", value=1
    )
    Job.objects.create(
        created_at=now,
        updated_at=now,
        run_created_at=now,
        workflow_run_id=failed.pk,
        workflow_id="w",
        stage_id="s",
        attempt=3,
        max_attempts=3,
        status="FAILED",
    )
    assert "wf_ann_run_attempt_idx" in _index_names("workflow_annotations")

    new_apps = _migrate(AFTER)

    assert new_apps.get_model(APP, "WorkflowStage").objects.get().generation == 2
    assert new_apps.get_model(APP, "WorkflowAnnotation").objects.get().generation == 2
    assert new_apps.get_model(APP, "WorkflowJob").objects.get().attempt == 3  # a delivery count
    runs = new_apps.get_model(APP, "WorkflowRun").objects
    assert runs.get(pk=failed.pk).error == {
        "stage_id": "s",
        "message": "boom",
        "error_type": "StageFailed",
        "generation": 2,
        "delivery": 3,
    }
    assert runs.get(pk=plain.pk).error is None
    names = _index_names("workflow_annotations")
    assert "wf_ann_run_generation_idx" in names and "wf_ann_run_attempt_idx" not in names

    # and back: the old names and the old run.error member return
    old = _migrate(BEFORE)
    assert old.get_model(APP, "WorkflowStage").objects.get().attempt == 2
    assert old.get_model(APP, "WorkflowRun").objects.get(pk=failed.pk).error["attempt"] == 2
