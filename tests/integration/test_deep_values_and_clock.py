"""Issue 8 item 6: deeply nested values fail with a clear, final error instead of wedging a
job; the system check warns when django-q2's timeout is unset; ``FakeClock`` keeps UTC."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any
from zoneinfo import ZoneInfo

import pytest
from django.core import checks

from django_workflows import (
    CompletionCheck,
    StageContext,
    StageResult,
    Suspend,
    define_async_batch_stage,
    define_stage,
    define_workflow,
)
from django_workflows.kernel import CreateRun, InvalidWorkflowInputError
from django_workflows.models import Status, WorkflowJob, WorkflowRun, WorkflowStage
from django_workflows.testing import FakeClock, run_to_completion

DEPTH = 10_000


def nested(depth: int) -> Any:
    value: Any = 1
    for _ in range(depth):
        value = {"a": value}
    return value


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("where", ["artifact", "metric", "output", "suspend state"])
def test_a_stage_returning_a_deeply_nested_value_fails_at_once_with_the_cause(
    kernel_for: Any, where: str
) -> None:
    def execute(ctx: StageContext[Any, Any]) -> Any:
        if where == "suspend state":
            return Suspend(state={"batch_id": "b", "tree": nested(DEPTH)})
        if where == "artifact":
            return StageResult(output={"ok": 1}, artifacts={"tree": nested(DEPTH)})
        if where == "metric":
            return StageResult(output={"ok": 1}, metrics={"tree": nested(DEPTH)})
        return nested(DEPTH)

    if where == "suspend state":
        node = define_async_batch_stage(
            id="s", execute=execute, check_completion=lambda state, ctx: CompletionCheck.done({})
        )
    else:
        node = define_stage(id="s", execute=execute)
    wf = define_workflow(id="deep").pipe(node).build()
    kernel = kernel_for(wf)
    run_id = kernel.dispatch(CreateRun("deep", {})).workflow_run_id

    run = run_to_completion(kernel, run_id, max_rounds=5)

    assert run.status == Status.FAILED
    stage = WorkflowStage.objects.get(run_id=run_id)
    assert "nested too deeply" in (stage.error_message or "")
    job = WorkflowJob.objects.get(workflow_run_id=run_id)
    assert (job.status, job.attempt) == (Status.FAILED, 1)  # final: not retried, not wedged


@pytest.mark.django_db
def test_a_deeply_nested_run_input_is_a_clear_input_error(kernel_for: Any) -> None:
    kernel = kernel_for(define_workflow(id="any").pipe(define_stage(id="s", execute=dict)).build())
    with pytest.raises(InvalidWorkflowInputError, match="nested too deeply"):
        kernel.dispatch(CreateRun("any", nested(DEPTH)))
    assert WorkflowRun.objects.count() == 0


def test_system_check_warns_when_the_django_q2_timeout_is_unset(settings: Any) -> None:
    settings.Q_CLUSTER = {"name": "x", "orm": "default", "retry": 60}
    found = [m for m in checks.run_checks() if m.id == "django_workflows.W001"]
    assert found and "timeout" in found[0].msg and "60 s" in found[0].msg


def test_fake_clock_keeps_utc_across_a_dst_change() -> None:
    berlin = ZoneInfo("Europe/Berlin")
    start = datetime(2026, 10, 25, 1, 30, tzinfo=berlin)  # 30 min before clocks fall back
    clock = FakeClock(start)
    assert clock.now().tzinfo is UTC and clock.now() == start
    clock.advance(3600)
    assert clock.now() - start == timedelta(hours=1)  # elapsed time, never backwards
    with pytest.raises(ValueError, match="zone-aware"):
        FakeClock(datetime(2026, 1, 1))
