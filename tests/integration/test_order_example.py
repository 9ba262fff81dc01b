"""docs/examples/order_workflow.py (issue 18's order workflow) runs in-process: a large order
is reserved line by line, charged, approved and shipped; a small one skips the approval."""

import importlib.util
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "docs" / "examples" / "order_workflow.py"
spec = importlib.util.spec_from_file_location("order_workflow_example", EXAMPLE)
example = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
spec.loader.exec_module(example)  # type: ignore[union-attr]


@pytest.mark.django_db
def test_a_large_order_is_reserved_charged_approved_and_shipped(run_workflow) -> None:
    lines = [{"sku": "A-1", "price": 700}, {"sku": "B-2", "price": 500}]
    approved = {"approved": True, "outcome": "approved", "decided_at": "2026-12-02T00:00:00Z"}
    order = {"order_id": "o-1", "lines": lines}
    result = run_workflow(example.order_workflow, order, overrides={"approval": approved})
    assert result.status == "COMPLETED", result.error
    assert result.output == {"tracking": "parcel-1200"}
    assert result.stages["charge"] == {"total": 1200} and result.skipped == {}


@pytest.mark.django_db
def test_a_small_order_ships_without_approval(run_workflow) -> None:
    order = {"order_id": "o-2", "lines": [{"sku": "A-1", "price": 300}]}
    result = run_workflow(example.order_workflow, order)
    assert result.status == "COMPLETED", result.error
    assert result.output == {"tracking": "parcel-300"}
    assert list(result.skipped) == ["approval"]
