"""docs/examples/order_workflow.py (issue 11's order workflow in the new style) runs in-process:
the happy path with its decision annotation, and a duplicate SKU that fails the run at once
with ``run.error`` set (no retry). Runs on SQLite and PostgreSQL."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from django_workflows.conventions import Decision
from django_workflows.kernel import CreateRun
from django_workflows.models import Status, WorkflowJob, WorkflowStage
from django_workflows.testing import FakeClock, make_kernel, run_to_completion

pytestmark = pytest.mark.django_db(transaction=True)

EXAMPLE = Path(__file__).resolve().parents[2] / "docs" / "examples" / "order_workflow.py"


@pytest.fixture(scope="module")
def example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("order_workflow_example", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _run(example: ModuleType, clock: FakeClock, skus: list[str]) -> tuple[Any, Any]:
    kernel = make_kernel(example.order_workflow, clock=clock)
    order = {"order_id": "o-1", "skus": skus, "country": "FR"}
    run_id = kernel.dispatch(CreateRun("order", order)).workflow_run_id
    return kernel, run_to_completion(kernel, run_id, advance_seconds=60)


def test_types_come_from_the_annotations(example: ModuleType) -> None:
    confirm = example.order_workflow.get_stage("confirm")
    assert confirm.input_model is example.Checked
    assert confirm.output_model is example.Confirmation
    assert example.order_workflow.get_stage("reserve-stock").retry.max_attempts == 5
    assert example.order_workflow.describe_groups() == [
        "validate",
        "[reserve-stock | price-shipping]",
        "confirm",
    ]


def test_an_order_is_confirmed_with_a_decision(example: ModuleType, clock: FakeClock) -> None:
    kernel, run = _run(example, clock, ["A-1", "B-2"])
    assert run.status == Status.COMPLETED, run.error
    assert run.output == {"order_id": "o-1", "total_cents": 2000 + 1499}
    assert run.error is None
    decisions = kernel.annotations.list(run.pk, key=Decision.outcome.key)
    assert [(a.value, a.scope_id) for a in decisions] == [("confirmed", "confirm")]
    assert (
        WorkflowJob.objects.get(workflow_run_id=run.pk, stage_id="reserve-stock").max_attempts == 5
    )


def test_a_duplicate_sku_fails_at_once_with_run_error(
    example: ModuleType, clock: FakeClock
) -> None:
    started = clock.now()
    _, run = _run(example, clock, ["A-1", "B-2", "A-1"])
    assert run.status == Status.FAILED
    assert run.error == {
        "stage_id": "validate",
        "message": "Duplicate SKU A-1",
        "error_type": "DuplicateSku",
        "generation": 0,
        "delivery": 1,
    }
    job = WorkflowJob.objects.get(workflow_run_id=run.pk)
    assert (job.status, job.attempt) == (Status.FAILED, 1)  # one delivery, no retry
    assert run.completed_at == started  # no back-off waited: the clock never had to move
    assert list(WorkflowStage.objects.filter(run=run).values_list("stage_id", flat=True)) == [
        "validate"
    ]
