"""Dynamic fan-out (issue 18 item 3; docs/fan-out.md): ``.map(stage, over=...)`` runs one job
per item through the one stage path, the fan-in stage receives the outputs in item order."""

from __future__ import annotations

from typing import Any

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from pydantic import BaseModel

from django_workflows.definition import StageContext, StageFailed, define_workflow, stage
from django_workflows.definition.mapping import map_results
from django_workflows.definition.stage import WorkflowDefinitionError
from django_workflows.models import Status, WorkflowAnnotation, WorkflowJob, WorkflowStage
from django_workflows.testing import run_workflow

pytestmark = pytest.mark.django_db


class Numbers(BaseModel):
    numbers: list[int]


class Item(BaseModel):
    n: int


class Squared(BaseModel):
    sq: int


@stage(id="square")
def square(ctx: StageContext[Item]) -> Squared:
    if ctx.input.n < 0:
        raise StageFailed(f"negative: {ctx.input.n}")
    ctx.annotate("test.seen", ctx.input.n)
    return Squared(sq=ctx.input.n * ctx.input.n)


Squares = map_results(square)


class Total(BaseModel):
    total: int
    count: int
    failed: list[int]


@stage(id="total")
def total(ctx: StageContext[Squares]) -> Total:
    return Total(
        total=sum(s.sq for s in ctx.input.succeeded()),
        count=len(ctx.input.items),
        failed=[f.index for f in ctx.input.failures],
    )


def _items(ctx: Any) -> list[dict[str, int]]:
    return [{"n": n} for n in ctx.input.numbers]


def _workflow(wid: str = "squares", **kwargs: Any):
    return (
        define_workflow(id=wid, input=Numbers)
        .map(square, over=_items, **kwargs)
        .pipe(total)
        .build()
    )


def test_fan_in_receives_outputs_in_item_order() -> None:
    wf = _workflow(max_concurrency=3)
    result = run_workflow(wf, {"numbers": [3, 1, 4, 1, 5, 9, 2, 6]})
    assert result.status == "COMPLETED", result
    assert result.output == {"total": 173, "count": 8, "failed": []}
    record = WorkflowStage.objects.get(run_id=result.run_id, stage_id="square")
    assert (record.items_total, record.items_completed, record.items_failed) == (8, 8, 0)
    assert record.progress == 100.0
    jobs = WorkflowJob.objects.filter(workflow_run_id=result.run_id, stage_id="square")
    assert sorted(j.item_index for j in jobs) == list(range(8))
    assert all(j.status == Status.COMPLETED and j.attempt == 1 for j in jobs)
    outputs = [j.item_output["sq"] for j in sorted(jobs, key=lambda j: j.item_index)]
    assert outputs == [9, 1, 16, 1, 25, 81, 4, 36]
    scopes = set(
        WorkflowAnnotation.objects.filter(run_id=result.run_id, key="test.seen").values_list(
            "scope", "scope_id"
        )
    )
    assert scopes == {("item", str(i)) for i in range(8)}


def test_structure_and_fingerprint_only_when_used() -> None:
    wf = _workflow()
    node = wf.structure()["groups"][0][0]
    assert node["map"] == {"over": "_items", "max_concurrency": 10, "on_item_failure": "fail"}
    assert "map" not in wf.structure()["groups"][1][0]
    other = _workflow(max_concurrency=4)
    assert other.version != wf.version


def test_fail_policy_fails_run_and_cancels_held_items() -> None:
    wf = _workflow(max_concurrency=1)
    result = run_workflow(wf, {"numbers": [1, -2, 3, 4]})
    assert result.status == "FAILED"
    record = WorkflowStage.objects.get(run_id=result.run_id, stage_id="square")
    assert record.status == Status.FAILED
    assert "Item 1" in record.error_message and "negative: -2" in record.error_message
    statuses = dict(
        WorkflowJob.objects.filter(workflow_run_id=result.run_id, stage_id="square").values_list(
            "item_index", "status"
        )
    )
    assert statuses == {0: "COMPLETED", 1: "FAILED", 2: "CANCELLED", 3: "CANCELLED"}


def test_continue_policy_collects_failures() -> None:
    wf = _workflow(on_item_failure="continue", max_concurrency=2)
    result = run_workflow(wf, {"numbers": [2, -1, 3, -5]})
    assert result.status == "COMPLETED", result
    assert result.output == {"total": 13, "count": 4, "failed": [1, 3]}
    record = WorkflowStage.objects.get(run_id=result.run_id, stage_id="square")
    assert (record.items_completed, record.items_failed) == (2, 2)


def test_empty_list_completes_at_once() -> None:
    result = run_workflow(_workflow(), {"numbers": []})
    assert result.status == "COMPLETED", result
    assert result.output == {"total": 0, "count": 0, "failed": []}


def test_over_that_raises_fails_the_run_naming_the_stage() -> None:
    def broken(ctx: Any) -> list[Any]:
        raise ValueError("no list today")

    wf = define_workflow(id="broken", input=Numbers).map(square, over=broken).pipe(total).build()
    result = run_workflow(wf, {"numbers": [1]})
    assert result.status == "FAILED"
    assert "no list today" in str(result.error)


def test_item_validated_by_stage_input_model() -> None:
    wf = (
        define_workflow(id="bad-items", input=Numbers)
        .map(square, over=lambda ctx: [{"n": 1}, {"nope": 2}])
        .pipe(total)
        .build()
    )
    result = run_workflow(wf, {"numbers": []})
    assert result.status == "FAILED"


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"over": 3}, "over"),
        ({"over": _items, "max_concurrency": 0}, "max_concurrency"),
        ({"over": _items, "on_item_failure": "ignore"}, "on_item_failure"),
    ],
)
def test_builder_rejects_bad_arguments(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(WorkflowDefinitionError, match=field):
        define_workflow(id="x", input=Numbers).map(square, **kwargs)


def test_builder_requires_map_results_after_a_map() -> None:
    @stage(id="plain")
    def plain(ctx: StageContext[Item]) -> Squared:
        return Squared(sq=1)

    with pytest.raises(WorkflowDefinitionError, match="map_results"):
        define_workflow(id="x", input=Numbers).map(square, over=_items).pipe(plain)
    with pytest.raises(WorkflowDefinitionError, match="map_results"):
        define_workflow(id="y", input=Numbers).pipe(total)


def _statements(n: int) -> int:
    wf = _workflow(wid=f"count-{n}", max_concurrency=5)
    with CaptureQueriesContext(connection) as ctx:
        result = run_workflow(wf, {"numbers": list(range(n))})
    assert result.status == "COMPLETED"
    return len(ctx.captured_queries)


def test_statements_per_item_do_not_grow_with_item_count() -> None:
    _statements(10)  # warm caches (statement shapes, registry)
    s50, s100, s200 = _statements(50), _statements(100), _statements(200)
    first, second = (s100 - s50) / 50, (s200 - s100) / 100
    # The cost of an extra item is the same at 50 and at 200 items (constant statements per
    # item: lease, outcome, promotion); the in-process driver's rounds add a little noise.
    assert second <= first + 0.25, (s50, s100, s200)
    assert second <= 16, second


def _continued_run() -> Any:
    wf = _workflow(wid="shown", on_item_failure="continue", max_concurrency=2)
    result = run_workflow(wf, {"numbers": [2, -1, 3]})
    assert result.status == "COMPLETED"
    return result


@pytest.mark.django_db(transaction=True)  # the version's structure is stored on commit
def test_admin_run_page_shows_map_counts(admin_client: Any) -> None:
    from django.urls import reverse

    result = _continued_run()
    url = reverse("admin:django_workflows_workflowrun_change", args=[str(result.run_id)])
    page = admin_client.get(url).content.decode()
    assert "items 2/3 completed, 1 failed" in page
    assert "map over _items(), max_concurrency 2, on_item_failure continue" in page


def test_api_run_detail_shows_map_counts() -> None:
    from django.contrib.auth.models import User
    from rest_framework.test import APIClient

    result = _continued_run()
    client = APIClient()
    client.force_authenticate(User.objects.create_superuser("root", "r@example.com", "x"))
    body = client.get(f"/api/workflows/runs/{result.run_id}/").json()
    stages = {s["stage_id"]: s for s in body["stages"]}
    assert stages["square"]["items"] == {
        "total": 3,
        "completed": 2,
        "failed": 1,
        "in_flight": [],  # every item settled
    }
    assert stages["total"]["items"] is None
    events = client.get(f"/api/workflows/runs/{result.run_id}/events/").json()
    types = [e["event_type"] if "event_type" in e else e.get("type") for e in events["results"]]
    assert "map:started" in types and "map:item_failed" in types


def test_cli_run_show_prints_map_counts() -> None:
    import io
    import json

    from django.core.management import call_command

    result = _continued_run()
    out = io.StringIO()
    call_command("workflows_status", str(result.run_id), stdout=out)
    assert "items 2/3 completed, 1 failed" in out.getvalue()
    out = io.StringIO()
    call_command("workflows_status", str(result.run_id), "--json", stdout=out)
    stages = {s["stage_id"]: s for s in json.loads(out.getvalue())["stages"]}
    assert stages["square"]["items"] == {
        "total": 3,
        "completed": 2,
        "failed": 1,
        "in_flight": [],  # every item settled
    }


def test_rerun_from_map_stage_recreates_items() -> None:
    from django_workflows.kernel.commands import RerunFrom
    from django_workflows.testing import make_kernel
    from django_workflows.testing.kit import run_to_completion

    wf = _workflow(wid="rerun-map", max_concurrency=2)
    kernel = make_kernel(wf)
    result = run_workflow(wf, {"numbers": [1, 2, 3]}, kernel=kernel)
    assert result.output["total"] == 14
    kernel.dispatch(RerunFrom(workflow_run_id=str(result.run_id), from_stage_id="square"))
    run = run_to_completion(kernel, result.run_id)
    assert run.status == "COMPLETED" and run.output["total"] == 14
    record = WorkflowStage.objects.get(run_id=result.run_id, stage_id="square")
    assert record.generation == 1 and record.items_completed == 3
    jobs = WorkflowJob.objects.filter(workflow_run_id=result.run_id, stage_id="square")
    assert jobs.count() == 6 and jobs.filter(status=Status.COMPLETED).count() == 6


def test_cancel_cancels_held_items() -> None:
    from django_workflows.kernel.commands import CancelRun
    from django_workflows.kernel.hosting import process_available_jobs
    from django_workflows.testing import make_kernel

    wf = _workflow(wid="cancel-map", max_concurrency=1)
    kernel = make_kernel(wf)
    from django_workflows.kernel.commands import CreateRun

    run_id = kernel.dispatch(
        CreateRun(workflow_id=wf.id, input={"numbers": [1, 2, 3, 4]})
    ).workflow_run_id
    process_available_jobs(kernel, "w1", max_jobs=2)  # claim + item 0, item 1
    held = WorkflowJob.objects.filter(workflow_run_id=run_id, status=Status.HELD).count()
    assert held >= 1
    kernel.dispatch(CancelRun(workflow_run_id=run_id, reason="stop"))
    left = WorkflowJob.objects.filter(
        workflow_run_id=run_id, status__in=(Status.HELD, Status.PENDING)
    ).count()
    assert left == 0


def test_ten_thousand_items_are_created_in_batches() -> None:
    from django_workflows.kernel.commands import CreateRun
    from django_workflows.kernel.hosting import process_available_jobs
    from django_workflows.kernel.mapping import INSERT_BATCH
    from django_workflows.testing import make_kernel

    wf = _workflow(wid="ten-thousand", max_concurrency=50)
    kernel = make_kernel(wf)
    run_id = kernel.dispatch(
        CreateRun(workflow_id=wf.id, input={"numbers": list(range(10_000))})
    ).workflow_run_id
    with CaptureQueriesContext(connection) as ctx:
        process_available_jobs(kernel, "w1", max_jobs=1)  # claim, fan out, run item 0
    inserts = [
        q for q in ctx.captured_queries if q["sql"].startswith('INSERT INTO "workflow_jobs"')
    ]
    assert len(inserts) == 10_000 // INSERT_BATCH
    assert len(ctx.captured_queries) < 40 + len(inserts), len(ctx.captured_queries)
    jobs = WorkflowJob.objects.filter(workflow_run_id=run_id, stage_id="square")
    assert jobs.count() == 10_000
    assert jobs.filter(status=Status.HELD).count() == 10_000 - 51  # item 0 promoted one
    record = WorkflowStage.objects.get(run_id=run_id, stage_id="square")
    assert (record.items_total, record.items_completed) == (10_000, 1)


def test_async_batch_items_suspend_and_poll_on_their_own() -> None:
    from django_workflows.definition import CompletionCheck, Suspend, define_async_batch_stage

    polls: dict[int, int] = {}

    def submit(ctx: StageContext[Item]) -> Suspend:
        return Suspend(
            state={"batch_id": f"b{ctx.input.n}", "n": ctx.input.n}, poll_interval_seconds=30
        )

    def check(state: dict[str, Any], ctx: Any) -> CompletionCheck[Any]:
        n = state["n"]
        polls[n] = polls.get(n, 0) + 1
        if n < 0:
            return CompletionCheck.failed(f"batch {n} failed")
        if polls[n] < 1 + n % 3:  # each item needs its own number of polls
            return CompletionCheck.not_ready()
        return CompletionCheck.done({"sq": n * n})

    batch = define_async_batch_stage(
        id="square", input=Item, output=Squared, execute=submit, check_completion=check
    )
    wf = (
        define_workflow(id="batch-map", input=Numbers)
        .map(batch, over=_items, max_concurrency=2, on_item_failure="continue")
        .pipe(total)
        .build()
    )
    result = run_workflow(wf, {"numbers": [1, 2, -3, 4, 5]})
    assert result.status == "COMPLETED", result
    assert result.output == {"total": 46, "count": 5, "failed": [2]}
    assert polls == {1: 2, 2: 3, -3: 1, 4: 2, 5: 3}
    jobs = WorkflowJob.objects.filter(workflow_run_id=result.run_id, stage_id="square")
    assert all(j.attempt == 1 for j in jobs)  # one delivery each; the rest were polls


@pytest.mark.django_db(transaction=True)
@pytest.mark.skipif(connection.vendor != "postgresql", reason="needs PostgreSQL")
def test_lost_acknowledgement_of_an_item_outcome_is_reported_committed(
    kernel_for: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """An item's outcome committed (and leased the next item to this worker), then the
    connection died before the worker heard so: reported committed, the next item delivered at
    its first attempt, every item completed once."""
    import logging

    from django_workflows.kernel import faults
    from django_workflows.kernel.commands import CreateRun
    from django_workflows.kernel.hosting import process_available_jobs

    from .test_connection_resilience import _lose_ack_once

    wf = _workflow(wid="lost-ack-map", max_concurrency=1)
    kernel = kernel_for(wf)
    run_id = kernel.dispatch(
        CreateRun(workflow_id=wf.id, input={"numbers": [1, 2, 3]})
    ).workflow_run_id
    caplog.set_level(logging.WARNING)
    kills = {"n": 0}
    faults.inject("outcome.after_commit", lambda: _lose_ack_once(kills))
    try:
        result = process_available_jobs(kernel, "w", max_jobs=10)
    finally:
        faults.inject("outcome.after_commit", None)
    assert kills["n"] == 1
    assert (result.succeeded, result.failed) == (4, 0)
    messages = [r.getMessage() for r in caplog.records]
    assert any("had committed before the connection was lost" in m for m in messages)
    assert not any("discarded" in m for m in messages), messages
    jobs = WorkflowJob.objects.filter(workflow_run_id=run_id, stage_id="square")
    assert sorted((j.item_index, j.status, j.attempt) for j in jobs) == [
        (0, "COMPLETED", 1),
        (1, "COMPLETED", 1),
        (2, "COMPLETED", 1),
    ]


SEEN: list[Any] = []


@stage(id="report")
def report(ctx: StageContext[Item]) -> Squared:
    ctx.progress(40, f"item {ctx.input.n} half way")
    record = WorkflowStage.objects.get(run_id=ctx.workflow_run_id, stage_id="report")
    SEEN.append(record.items_in_flight())
    return Squared(sq=ctx.input.n)


def test_an_item_reports_its_own_progress_on_its_job() -> None:
    """Each item's ``ctx.progress`` goes to its own job row (fenced by its token), and the map
    stage lists the items in flight with it (admin run page, API ``items.in_flight``)."""
    SEEN.clear()
    fan_in = stage(id="count-reports", input=map_results(report), output=Total)(
        lambda ctx: Total(total=0, count=len(ctx.input.items), failed=[])
    )
    wf = (
        define_workflow(id="reports", input=Numbers)
        .map(report, over=_items, max_concurrency=1)
        .pipe(fan_in)
        .build()
    )
    result = run_workflow(wf, {"numbers": [7, 8]})
    assert result.status == "COMPLETED", result.error
    assert SEEN == [
        [{"index": 0, "progress": 40.0, "message": "item 7 half way"}],
        [{"index": 1, "progress": 40.0, "message": "item 8 half way"}],
    ]
    jobs = WorkflowJob.objects.filter(workflow_run_id=result.run_id, stage_id="report")
    assert sorted(jobs.values_list("item_index", "progress")) == [(0, 40.0), (1, 40.0)]
    record = WorkflowStage.objects.get(run_id=result.run_id, stage_id="report")
    assert record.items_in_flight() == []  # all settled: no query
