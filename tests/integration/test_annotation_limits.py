"""Annotation inputs both databases can store, within size limits, with convention types
checked however the key is written (found by a user trial: NUL characters raised a raw
database error on PostgreSQL, a 5 MB payload was accepted, and ``{"decision.confidence":
"high"}`` was stored through the API).
"""

from __future__ import annotations

from typing import Any

import pytest

from django_workflows.annotations import MAX_PAYLOAD_BYTES, MAX_VALUE_BYTES
from django_workflows.kernel import CreateRun, InvalidCommandError
from django_workflows.models import OutboxEvent, WorkflowAnnotation
from tests.workflows import two_stage

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def attach(kernel_for: Any) -> Any:
    kernel = kernel_for(two_stage())
    run_id = kernel.dispatch(CreateRun("two-stage", {"value": 1})).workflow_run_id

    def call(attributes: dict[str, Any], **kwargs: Any) -> Any:
        return kernel.annotations.attach(run_id, attributes, **kwargs)

    return call


@pytest.mark.parametrize(
    ("attributes", "kwargs", "field", "fragment"),
    [
        ({"acme.note": "a\x00b"}, {}, "acme.note", "NUL"),
        ({"acme.note": "ok"}, {"payload": {"x": "a\x00"}}, "payload", "NUL"),
        ({"acme.note": "ok"}, {"actor": {"kind": "user", "id": "a\x00"}}, "actor.id", "NUL"),
        ({"acme.note": "ok"}, {"idempotency_key": "k\x00"}, "idempotency_key", "NUL"),
        ({"acme.big": "x" * MAX_VALUE_BYTES}, {}, "acme.big", "allowed"),
        ({"acme.note": "ok"}, {"payload": "y" * MAX_PAYLOAD_BYTES}, "payload", "allowed"),
        ({"decision.confidence": "high"}, {}, "decision.confidence", "float"),
        ({"approval.approvers": "bob"}, {}, "approval.approvers", "list"),
    ],
)
def test_attach_rejects_unstorable_oversized_or_mistyped_values(
    attach: Any, attributes: dict[str, Any], kwargs: dict[str, Any], field: str, fragment: str
) -> None:
    """AN-21 inputs are validated before anything is written (AN-51 types, storable JSON)."""
    with pytest.raises(InvalidCommandError) as exc_info:
        attach(attributes, emit_event=True, **kwargs)
    assert exc_info.value.field is not None and exc_info.value.field.endswith(field)
    assert fragment in str(exc_info.value)
    assert not WorkflowAnnotation.objects.exists()
    assert not OutboxEvent.objects.filter(event_type="annotation:created").exists()


def test_attach_accepts_well_typed_convention_keys_written_as_strings(attach: Any) -> None:
    attach({"decision.confidence": 0.8, "approval.approvers": ["bob"]})
    stored = dict(WorkflowAnnotation.objects.values_list("key", "value"))
    assert stored == {"decision.confidence": 0.8, "approval.approvers": ["bob"]}
