"""Issue 11 item 2: ``StageFailed`` fails a stage at once, ``retry=`` sets a stage's delivery
limit and back-off, and a FAILED run records ``run.error`` (shown by the CLI, the admin and the
HTTP API). Runs on SQLite and PostgreSQL."""

from __future__ import annotations

import json
from datetime import timedelta
from io import StringIO
from typing import Any

import pytest
from django.core.management import call_command
from django.urls import reverse
from pydantic import BaseModel

from django_workflows import (
    RetryPolicy,
    StageContext,
    StageFailed,
    define_workflow,
    stage,
)
from django_workflows.kernel import ClaimPendingRuns, CreateRun, ReapStaleLeases, delivery
from django_workflows.kernel.hosting import process_available_jobs, run_maintenance_tick
from django_workflows.models import Status, WorkflowJob, WorkflowRun, WorkflowStage
from django_workflows.testing import FakeClock, run_to_completion

pytestmark = pytest.mark.django_db(transaction=True)


class Order(BaseModel):
    skus: list[str]


class Checked(BaseModel):
    count: int


def _validating(calls: list[int], **options: Any) -> Any:
    @stage(id="validate", **options)
    def validate(ctx: StageContext[Order]) -> Checked:
        calls.append(ctx.generation)
        dupes = sorted({s for s in ctx.input.skus if ctx.input.skus.count(s) > 1})
        if dupes:
            raise StageFailed(f"Duplicate SKU {', '.join(dupes)}", error_type="DuplicateSku")
        return Checked(count=len(ctx.input.skus))

    return define_workflow(id="orders", input=Order).pipe(validate).build()


def _failing(calls: list[int], exc: Exception, **options: Any) -> Any:
    @stage(id="flaky", **options)
    def flaky(ctx: StageContext[Order]) -> None:
        calls.append(1)
        raise exc

    return define_workflow(id="flaky", input=Order).pipe(flaky).build()


def _start(kernel: Any, workflow_id: str, skus: list[str]) -> str:
    return str(kernel.dispatch(CreateRun(workflow_id, {"skus": skus})).workflow_run_id)


def _job(run_id: str) -> WorkflowJob:
    return WorkflowJob.objects.get(workflow_run_id=run_id)


def test_stage_failed_fails_the_stage_and_run_at_once_with_run_error(kernel_for: Any) -> None:
    calls: list[int] = []
    kernel = kernel_for(_validating(calls))
    run_id = _start(kernel, "orders", ["A-1", "B-2", "A-1"])
    run = run_to_completion(kernel, run_id)

    assert run.status == Status.FAILED
    assert calls == [0]  # one delivery: no retry, no back-off
    job = _job(run_id)
    assert (job.status, job.attempt, job.max_attempts) == (Status.FAILED, 1, 3)
    record = WorkflowStage.objects.get(run_id=run_id)
    assert record.error_message == "Duplicate SKU A-1"
    assert record.metrics["error_type"] == "DuplicateSku"
    assert "raise StageFailed" in record.metrics["traceback"]
    assert run.error == {
        "stage_id": "validate",
        "message": "Duplicate SKU A-1",
        "error_type": "DuplicateSku",
        "generation": 0,
        "delivery": 1,
    }
    assert run.output is None


def test_a_passing_run_has_no_error(kernel_for: Any) -> None:
    kernel = kernel_for(_validating([]))
    run = run_to_completion(kernel, _start(kernel, "orders", ["A-1"]))
    assert (run.status, run.error, run.output) == (Status.COMPLETED, None, {"count": 1})


def test_stage_failed_retryable_is_retried_like_any_exception(
    kernel_for: Any, clock: FakeClock
) -> None:
    calls: list[int] = []
    kernel = kernel_for(_failing(calls, StageFailed("supplier busy", retryable=True)))
    run_id = _start(kernel, "flaky", [])
    run = run_to_completion(kernel, run_id, advance_seconds=60)

    assert len(calls) == 3  # MAX_ATTEMPTS
    assert run.status == Status.FAILED
    assert run.error["error_type"] == "StageFailed"
    assert (run.error["message"], run.error["delivery"]) == ("supplier busy", 3)


def test_retry_policy_sets_max_attempts_and_back_off_per_stage(
    kernel_for: Any, clock: FakeClock
) -> None:
    """Deliveries 2, 3 and 4 wait 1 s, 2 s and 3 s (base 1 s doubling, capped at 3 s) instead
    of the settings' 2 s, 4 s, ...; the run fails after the 4th delivery."""
    calls: list[int] = []
    policy = RetryPolicy(max_attempts=4, backoff_base_seconds=1, backoff_max_seconds=3)
    kernel = kernel_for(_failing(calls, ConnectionError("supplier down"), retry=policy))
    run_id = _start(kernel, "flaky", [])
    kernel.dispatch(ClaimPendingRuns("claimer"))
    assert _job(run_id).max_attempts == 4

    waits = []
    for delivery_number in (1, 2, 3):
        assert process_available_jobs(kernel, "w").processed == 1
        job = _job(run_id)
        assert (job.status, job.attempt) == (Status.PENDING, delivery_number)
        waits.append((job.next_poll_at - clock.now()).total_seconds())
        clock.advance(waits[-1] - 0.5)
        assert process_available_jobs(kernel, "w").processed == 0  # not due yet
        clock.advance(0.5)
    assert waits == [1.0, 2.0, 3.0]
    assert process_available_jobs(kernel, "w").processed == 1
    run = WorkflowRun.objects.get(pk=run_id)
    assert len(calls) == 4 and run.status == Status.FAILED
    assert run.error == {
        "stage_id": "flaky",
        "message": "ConnectionError: supplier down",
        "error_type": "ConnectionError",
        "generation": 0,
        "delivery": 4,
    }


def test_retry_shorthand_one_means_no_retry(kernel_for: Any) -> None:
    calls: list[int] = []
    kernel = kernel_for(_failing(calls, ConnectionError("down"), retry=1))
    run = run_to_completion(kernel, _start(kernel, "flaky", []), advance_seconds=60)
    assert (len(calls), run.status, run.error["delivery"]) == (1, Status.FAILED, 1)


def test_retry_policy_back_off_without_max_given_uses_the_setting_cap(
    kernel_for: Any, clock: FakeClock, settings: Any
) -> None:
    settings.DJANGO_WORKFLOWS = {**settings.DJANGO_WORKFLOWS, "RETRY_BACKOFF_MAX_SECONDS": 5}
    calls: list[int] = []
    policy = RetryPolicy(max_attempts=2, backoff_base_seconds=10)
    kernel = kernel_for(_failing(calls, ConnectionError("down"), retry=policy))
    run_id = _start(kernel, "flaky", [])
    kernel.dispatch(ClaimPendingRuns("claimer"))
    process_available_jobs(kernel, "w")
    assert _job(run_id).next_poll_at - clock.now() == timedelta(seconds=5)


def test_deliveries_exhausted_records_run_error(kernel_for: Any, clock: FakeClock) -> None:
    """A worker that dies while running the stage (its lease expires) with ``retry=1``: the
    job is given up and the run fails with error_type DeliveriesExhausted."""
    kernel = kernel_for(_failing([], RuntimeError("never runs"), retry=1))
    run_id = _start(kernel, "flaky", [])
    kernel.dispatch(ClaimPendingRuns("claimer"))
    leased = delivery.lease(kernel, "dying-worker")
    assert leased is not None  # ... and the worker dies before executing it
    clock.advance(301)
    kernel.dispatch(ReapStaleLeases(stale_threshold_seconds=300))
    run = WorkflowRun.objects.get(pk=run_id)
    assert run.status == Status.FAILED
    assert run.error["stage_id"] == "flaky"
    assert run.error["error_type"] == "DeliveriesExhausted"
    assert run.error["delivery"] == 1
    assert "delivered 1 times without finishing" in run.error["message"]


def test_rerun_clears_run_error(kernel_for: Any) -> None:
    from django_workflows.kernel import RerunFrom

    kernel = kernel_for(_validating([]))
    run_id = _start(kernel, "orders", ["A", "A"])
    assert run_to_completion(kernel, run_id).error is not None
    kernel.dispatch(RerunFrom(run_id, "validate"))
    assert WorkflowRun.objects.get(pk=run_id).error is None


def test_a_cancelled_run_keeps_its_reason_in_output_and_no_run_error(kernel_for: Any) -> None:
    from django_workflows.kernel import CancelRun

    kernel = kernel_for(_validating([]))
    run_id = _start(kernel, "orders", ["A"])
    kernel.dispatch(CancelRun(run_id, "not needed"))
    run = WorkflowRun.objects.get(pk=run_id)
    assert run.status == Status.CANCELLED and run.error is None
    assert "not needed" in json.dumps(run.output)


# --- shown by the CLI, the admin and the HTTP API --------------------------------------------


def _failed_run(kernel_for: Any) -> str:
    kernel = kernel_for(_validating([]))
    run_id = _start(kernel, "orders", ["A-1", "A-1"])
    run_to_completion(kernel, run_id)
    run_maintenance_tick(kernel, "t")
    return run_id


def test_workflows_status_shows_run_error_and_traceback(kernel_for: Any) -> None:
    run_id = _failed_run(kernel_for)
    out = StringIO()
    call_command("workflows_status", run_id, stdout=out)
    text = out.getvalue()
    assert "error:     stage validate: Duplicate SKU A-1" in text
    assert "(DuplicateSku, generation 0, delivery 1)" in text
    assert "--traceback" in text and "Traceback (most recent call last)" not in text

    out = StringIO()
    call_command("workflows_status", run_id, "--traceback", stdout=out)
    text = out.getvalue()
    assert "traceback:" in text and "Traceback (most recent call last)" in text
    assert "raise StageFailed" in text

    out = StringIO()
    call_command("workflows_status", run_id, "--json", stdout=out)
    document = json.loads(out.getvalue())
    assert document["error_detail"]["error_type"] == "DuplicateSku"
    assert "raise StageFailed" in document["traceback"]


def test_admin_run_page_shows_run_error_at_the_top(kernel_for: Any, admin_client: Any) -> None:
    run_id = _failed_run(kernel_for)
    url = reverse("admin:django_workflows_workflowrun_change", args=[run_id])
    html = admin_client.get(url).content.decode()
    top = html.index('id="dw-run-failure"')
    assert top < html.index('id="dw-stages"')
    assert "stage validate: Duplicate SKU A-1" in html[top:]
    assert '<span class="dw-error-details" id="dw-run-error-details">' in html
    assert "(DuplicateSku, generation 0, delivery 1)" in html
    assert '<details class="dw-traceback"><summary>traceback</summary>' in html


def test_api_run_detail_has_error_detail(kernel_for: Any, admin_user: Any) -> None:
    from rest_framework.test import APIClient

    run_id = _failed_run(kernel_for)
    client = APIClient()
    client.force_authenticate(admin_user)
    body = client.get(f"/api/workflows/runs/{run_id}/").json()
    assert body["error"] == "stage validate: Duplicate SKU A-1"
    assert body["error_detail"] == {
        "stage_id": "validate",
        "message": "Duplicate SKU A-1",
        "error_type": "DuplicateSku",
        "generation": 0,
        "delivery": 1,
    }


def test_example_project_a_prefix_matching_nothing_is_a_final_failure(kernel_for: Any) -> None:
    from example_project.docpipeline.workflows import package_report

    kernel = kernel_for(package_report)
    prefix = "no-such-distribution-zz"
    run_id = kernel.dispatch(CreateRun("package-report", {"name_prefix": prefix})).workflow_run_id
    run = run_to_completion(kernel, run_id)
    assert run.status == Status.FAILED
    assert run.error["error_type"] == "NothingToReport" and prefix in run.error["message"]
    assert _job(str(run_id)).attempt == 1  # not retried


# --- run.error of failures outside a sync stage body -----------------------------------------


class Batch(BaseModel):
    done: bool


def _batch_workflow(check: Any) -> Any:
    from django_workflows import Suspend, define_async_batch_stage

    def submit(ctx: StageContext[Order]) -> Suspend:
        return Suspend(state={"batch_id": "b-1"}, poll_interval_seconds=1)

    return (
        define_workflow(id="batch", input=Order)
        .pipe(define_async_batch_stage(id="batch", execute=submit, check_completion=check))
        .build()
    )


@pytest.mark.parametrize(
    ("raised", "error_type", "message"),
    [
        (None, "BatchFailed", "supplier rejected the batch"),
        (StageFailed("batch had a duplicate", error_type="DuplicateSku"), "DuplicateSku", None),
        (KeyError("items"), "KeyError", "KeyError: 'items'"),
    ],
)
def test_an_async_batch_failure_records_run_error(
    kernel_for: Any, raised: Exception | None, error_type: str, message: str | None
) -> None:
    from django_workflows import CompletionCheck

    def check(state: dict[str, Any], ctx: Any) -> CompletionCheck[Batch]:
        if raised is not None:
            raise raised
        return CompletionCheck.failed("supplier rejected the batch")

    kernel = kernel_for(_batch_workflow(check))
    run = run_to_completion(kernel, _start(kernel, "batch", []), advance_seconds=2)
    assert run.status == Status.FAILED
    expected = message or "batch had a duplicate"
    assert run.error == {
        "stage_id": "batch",
        "message": expected,
        "error_type": error_type,
        "generation": 0,
        "delivery": None,
    }
    assert WorkflowStage.objects.get(run_id=run.pk).error_message == expected


def test_a_run_whose_workflow_is_missing_at_claim_has_run_error_without_stage(
    kernel_for: Any,
) -> None:
    creator = kernel_for(_validating([]))
    run_id = _start(creator, "orders", ["A"])
    kernel_for().dispatch(ClaimPendingRuns("claimer"))  # a process without the workflow
    run = WorkflowRun.objects.get(pk=run_id)
    assert run.status == Status.FAILED
    assert run.error["stage_id"] is None and run.error["error_type"] == "WorkflowNotFound"
    assert run.error["message"] == run.output["error"]["message"]
