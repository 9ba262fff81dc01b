"""Values a JSON column cannot hold (NaN, Infinity, NUL characters) and out-of-range fields are
rejected with a clear error naming the field, and never reach a transaction where they would
fail on every re-delivery (found by a new-user trial: the run looped forever).
"""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import BaseModel

from django_workflows import StageContext, define_stage, define_workflow
from django_workflows.kernel import ClaimPendingRuns, CreateRun, ExecuteJob, InvalidCommandError
from django_workflows.kernel.errors import InvalidWorkflowConfigError, InvalidWorkflowInputError
from django_workflows.models import IdempotencyKey, Status, WorkflowRun, WorkflowStage

pytestmark = pytest.mark.django_db(transaction=True)


class FloatOut(BaseModel):
    v: float


class Cfg(BaseModel):
    factor: float = 1.0


def _workflow(execute: Any) -> Any:
    return (
        define_workflow(id="bad-values")
        .pipe(define_stage(id="s", execute=execute, output=None, config=Cfg))
        .build()
    )


def _execute(kernel: Any) -> Any:
    run_id = kernel.dispatch(CreateRun("bad-values", {})).workflow_run_id
    kernel.dispatch(ClaimPendingRuns("w"))
    result = kernel.dispatch(
        ExecuteJob(workflow_run_id=run_id, workflow_id="bad-values", stage_id="s")
    )
    return run_id, result


@pytest.mark.parametrize(
    ("returned", "fragment"),
    [
        ({"v": float("nan")}, "NaN"),
        ({"v": float("inf")}, "NaN and Infinity"),
        ({"text": "a\x00b"}, "text contains a NUL character"),
    ],
)
def test_stage_output_that_cannot_be_stored_fails_without_retry(
    kernel_for: Any, returned: Any, fragment: str
) -> None:
    kernel = kernel_for(_workflow(lambda ctx: returned))
    run_id, result = _execute(kernel)
    assert result.outcome == "failed"
    assert result.retryable is False
    assert "cannot be stored" in result.error and fragment in result.error
    stage = WorkflowStage.objects.get(run_id=run_id, stage_id="s")
    assert stage.status == Status.FAILED
    assert stage.output_data is None


def test_stage_error_message_with_nul_is_stored_visibly(kernel_for: Any) -> None:
    def boom(ctx: StageContext[Any, Any]) -> None:
        raise RuntimeError("bad\x00thing")

    kernel = kernel_for(_workflow(boom))
    run_id, result = _execute(kernel)
    assert result.outcome == "failed"
    assert WorkflowStage.objects.get(run_id=run_id).error_message == "RuntimeError: bad\\x00thing"


@pytest.mark.parametrize(
    ("command", "error", "field"),
    [
        (CreateRun("bad-values", {"x": float("nan")}), InvalidWorkflowInputError, "input"),
        (CreateRun("bad-values", {"x": "a\x00"}), InvalidWorkflowInputError, "input"),
        (
            CreateRun("bad-values", {}, config={"s": {"factor": float("inf")}}),
            InvalidWorkflowConfigError,
            "config",
        ),
        (CreateRun("bad-values", {}, priority=2**31), InvalidCommandError, "priority"),
        (CreateRun("bad-values", {}, priority=-(2**31) - 1), InvalidCommandError, "priority"),
        (
            CreateRun("bad-values", {}, metadata={"m": float("nan")}),
            InvalidCommandError,
            "metadata",
        ),
        (
            CreateRun("bad-values", {}, idempotency_key="k" * 256),
            InvalidCommandError,
            "idempotency_key",
        ),
    ],
)
def test_run_create_rejects_unstorable_or_out_of_range_fields(
    kernel_for: Any, command: CreateRun, error: type[Exception], field: str
) -> None:
    kernel = kernel_for(_workflow(lambda ctx: {}))
    with pytest.raises(error) as exc_info:
        kernel.dispatch(command)
    assert exc_info.value.field == field
    assert field.split("_")[0] in str(exc_info.value)
    assert not WorkflowRun.objects.exists()
    assert not IdempotencyKey.objects.exists()


def test_run_create_accepts_priority_bounds_and_marks_replays(kernel_for: Any) -> None:
    kernel = kernel_for(_workflow(lambda ctx: {}))
    first = kernel.dispatch(CreateRun("bad-values", {}, priority=2**31 - 1, idempotency_key="k"))
    again = kernel.dispatch(CreateRun("bad-values", {}, priority=2**31 - 1, idempotency_key="k"))
    assert first.replayed is False
    assert again.replayed is True
    assert again.workflow_run_id == first.workflow_run_id
    assert WorkflowRun.objects.get().priority == 2**31 - 1
