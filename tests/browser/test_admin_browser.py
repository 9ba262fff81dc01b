"""The operator admin in a real browser (issue 10): Playwright drives Debian's Chromium
(``executable_path=shutil.which("chromium")``; no browser download) against a live server.

Logs in, opens the runs list, a completed run's page and its Gantt chart, cancels a running run
with a reason, reruns a failed run from a stage, approves a waiting approval and skips a dead
letter, asserting what each page shows afterwards. Screenshots of the list, the run page and the
Gantt chart are written to ``$DW_SCREENSHOT_DIR`` (default: the test's temporary directory);
``DW_SCREENSHOT_DIR=docs/screenshots`` regenerates the README's images.

Skipped when the ``playwright`` package or a ``chromium`` binary is missing (``.ci/run``
installs both).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from django.urls import reverse

from django_workflows import StageContext, define_stage, define_workflow
from django_workflows.approval import approval_stage
from django_workflows.definition.registry import registry
from django_workflows.kernel import Kernel
from django_workflows.kernel.commands import ClaimPendingRuns, CreateRun, FlushOutbox
from django_workflows.kernel.hosting import process_available_jobs, run_maintenance_tick
from django_workflows.models import OutboxEvent, Status, WorkflowRun
from django_workflows.testing import CollectingSink, FakeClock, make_kernel, run_to_completion

pytestmark = pytest.mark.django_db(transaction=True)  # Chromium and page: conftest.py

CLOCK: dict[str, FakeClock] = {}


def _takes(seconds: float) -> Any:
    """A stage body that "takes" ``seconds`` on the test's fake clock."""

    def execute(ctx: StageContext[Any, Any]) -> dict[str, Any]:
        CLOCK["clock"].advance(seconds)
        ctx.progress(50, "half way")
        CLOCK["clock"].advance(seconds)
        return {"ok": True}

    return execute


def _boom(ctx: StageContext[Any, Any]) -> dict[str, Any]:
    CLOCK["clock"].advance(0.4)
    raise RuntimeError("the upstream API answered 503")


def _workflows() -> list[Any]:
    from django_workflows.definition.results import CompletionCheck, Suspend

    def submit(ctx: StageContext[Any, Any]) -> Suspend:
        CLOCK["clock"].advance(0.3)
        return Suspend(state={"batch_id": "b-7"}, poll_interval_seconds=2)

    def check(state: dict[str, Any], ctx: Any) -> CompletionCheck:
        return CompletionCheck(ready=True, output={"batch": state["batch_id"]})

    from django_workflows.definition.stage import define_async_batch_stage

    batch = define_async_batch_stage(id="embed-batch", execute=submit, check_completion=check)
    return [
        define_workflow(id="doc-pipeline", name="Document pipeline")
        .pipe(define_stage(id="fetch", execute=_takes(0.6)))
        .parallel(
            [
                define_stage(id="ocr", execute=_takes(1.1)),
                define_stage(id="language", execute=_takes(0.35)),
            ]
        )
        .pipe(batch)
        .pipe(define_stage(id="publish", execute=_takes(0.2)))
        .build(),
        define_workflow(id="flaky-import")
        .pipe(define_stage(id="download", execute=_takes(0.5)))
        .pipe(define_stage(id="import", execute=_boom))
        .build(),
        define_workflow(id="needs-approval")
        .pipe(define_stage(id="draft", execute=_takes(0.2)))
        .pipe(approval_stage(id="review", poll_interval_seconds=2, allowed_approvers=["admin"]))
        .build(),
    ]


def _as_if_two_workers(run_id: str, first: str, second: str) -> None:
    """In-process the parallel stages run one after the other on the fake clock; two workers
    run them at once. Move ``second``'s events (and record) to ``first``'s start, as two
    workers would have written them."""
    from django.utils.dateparse import parse_datetime

    from django_workflows.models import WorkflowStage

    def events(stage_id: str) -> list[OutboxEvent]:
        return [
            e
            for e in OutboxEvent.objects.filter(workflow_run_id=run_id).order_by("sequence")
            if isinstance(e.payload, dict) and e.payload.get("stage_id") == stage_id
        ]

    start = {
        sid: next(e.occurred_at for e in events(sid) if e.event_type == "stage:started")
        for sid in (first, second)
    }
    delta = start[second] - start[first]
    for event in events(second):
        at = parse_datetime(event.payload["timestamp"]) - delta
        event.payload["timestamp"] = at.isoformat()
        OutboxEvent.objects.filter(pk=event.pk).update(
            payload=event.payload, occurred_at=event.occurred_at - delta
        )
    record = WorkflowStage.objects.get(run_id=run_id, stage_id=second)
    WorkflowStage.objects.filter(pk=record.pk).update(
        started_at=record.started_at - delta, completed_at=record.completed_at - delta
    )


def _create(kernel: Kernel, workflow_id: str) -> str:
    return str(kernel.dispatch(CreateRun(workflow_id=workflow_id)).workflow_run_id)


@pytest.fixture
def world(django_user_model: Any) -> Iterator[dict[str, Any]]:
    """A completed, a running, a failed and a waiting run, a dead letter, and an admin."""
    os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"] = "true"  # Playwright's event loop in this thread
    wfs = _workflows()
    for wf in wfs:
        registry.register(wf)
    clock = CLOCK["clock"] = FakeClock(datetime.now(UTC).replace(microsecond=0))
    sink = CollectingSink(max_retries=1)
    kernel = make_kernel(*wfs, clock=clock, event_sink=sink)
    completed = _create(kernel, "doc-pipeline")
    run_to_completion(kernel, completed, advance_seconds=2.5)
    _as_if_two_workers(completed, "ocr", "language")
    failed = _create(kernel, "flaky-import")
    run_to_completion(kernel, failed, advance_seconds=30)
    waiting = _create(kernel, "needs-approval")
    for _ in range(2):
        run_maintenance_tick(kernel, "w")
        process_available_jobs(kernel, "w", max_jobs=10)
        clock.advance(3)
    running = _create(kernel, "doc-pipeline")
    kernel.dispatch(ClaimPendingRuns(worker_id="w", max_claims=10))
    sink.fail_with = RuntimeError("webhook endpoint returned 410 Gone")
    kernel.dispatch(FlushOutbox(max_events=1000))
    sink.fail_with = None
    dead = OutboxEvent.objects.filter(dlq_at__isnull=False, published_at__isnull=True).first()
    assert dead is not None
    assert WorkflowRun.objects.get(pk=failed).status == Status.FAILED
    django_user_model.objects.create_superuser("admin", "admin@example.com", "s3cret-pw")
    yield {
        "completed": completed,
        "failed": failed,
        "waiting": waiting,
        "running": running,
        "dead": dead.pk,
    }
    for wf in wfs:
        registry.unregister(wf.id)
    os.environ.pop("DJANGO_ALLOW_ASYNC_UNSAFE", None)


def _messages(page: Any) -> str:
    return page.locator("ul.messagelist").inner_text()


def test_operator_session_in_chromium(
    live_server: Any, log_in: Any, world: dict[str, Any], page: Any, tmp_path: Path
) -> None:
    base = live_server.url
    SHOTS = Path(os.environ.get("DW_SCREENSHOT_DIR") or tmp_path)
    SHOTS.mkdir(parents=True, exist_ok=True)

    def run_page(run_id: str) -> str:
        return base + reverse("admin:django_workflows_workflowrun_change", args=[run_id])

    # log in
    log_in()

    # the runs list: every run, why each waits, key columns visible at 1440 px
    page.goto(base + reverse("admin:django_workflows_workflowrun_changelist"))
    table = page.locator("#result_list")
    assert table.locator("tbody tr").count() == 4
    text = table.inner_text()
    assert "waiting for an approval decision by one of admin" in text
    assert "stage import: RuntimeError: the upstream API answered 503" in text
    scroll = page.evaluate(
        "() => { const t = document.querySelector('#result_list');"
        " return [t.scrollWidth, document.querySelector('.results').clientWidth]; }"
    )
    page.screenshot(path=str(SHOTS / "changelist.png"))
    assert scroll[0] <= scroll[1] + 1, f"the list scrolls sideways at 1440 px: {scroll}"
    for name in ("workflowjob", "outboxevent", "workflowlog", "workflowannotation"):
        page.goto(base + reverse(f"admin:django_workflows_{name}_changelist"))
        widths = page.evaluate(
            "() => { const t = document.querySelector('#result_list');"
            " return t ? [t.scrollWidth, document.querySelector('.results').clientWidth]"
            " : [0, 0]; }"
        )
        assert widths[0] <= widths[1] + 1, f"{name} scrolls sideways at 1440 px: {widths}"

    # a completed run: stages, Gantt chart with parallel and suspended stages
    page.goto(run_page(world["completed"]))
    assert page.locator("#dw-stages tbody tr").count() == 5
    gantt = page.locator("#dw-gantt")
    assert gantt.locator(".dw-gantt-bar").count() >= 6
    assert gantt.locator(".dw-gantt-bar.dw-seg-suspended").count() == 1
    labels = gantt.locator(".dw-gantt-label").all_inner_texts()
    assert {"ocr", "language", "embed-batch", "publish"} <= set(labels)
    ocr = gantt.locator(".dw-gantt-row", has_text="ocr").locator(".dw-gantt-bar").first
    lang = gantt.locator(".dw-gantt-row", has_text="language").locator(".dw-gantt-bar").first
    ocr_box, lang_box = ocr.bounding_box(), lang.bounding_box()
    assert ocr_box and lang_box and abs(ocr_box["x"] - lang_box["x"]) < 2  # side by side
    assert re.search(r"\d\d:\d\d:\d\d\.\d{3} → .* \(2,200 ms\)", ocr.get_attribute("title") or "")
    page.screenshot(path=str(SHOTS / "run_page.png"), full_page=True)
    page.locator("#dw-gantt-group").screenshot(path=str(SHOTS / "gantt.png"))

    # cancel a running run with a reason
    page.goto(run_page(world["running"]))
    page.click("a.dw-cancel-link")
    page.fill("#id_reason", "duplicate upload")
    page.click("#dw-operation-form input[type=submit]")
    assert "Cancelled 1 run." in _messages(page)
    assert "CANCELLED" in page.locator(".field-status_badge").inner_text()

    # rerun a failed run from a stage
    page.goto(run_page(world["failed"]))
    assert "The run failed:" in page.locator("#dw-run-failure").inner_text()
    page.click("a.dw-rerun-link")
    page.select_option("#id_from_stage_id", "import")
    page.fill("#id_reason", "upstream is back")
    page.screenshot(path=str(SHOTS / "rerun_confirmation.png"))
    page.click("#dw-operation-form input[type=submit]")
    assert "Rerunning run" in _messages(page)
    assert "RUNNING" in page.locator(".field-status_badge").inner_text()
    reruns = page.locator("#dw-reruns").inner_text()
    assert "import" in reruns and "user:admin" in reruns and "upstream is back" in reruns

    # approve a waiting approval
    page.goto(run_page(world["waiting"]))
    assert "waiting for an approval decision" in page.locator("#dw-waiting").inner_text()
    page.click("a.dw-decide-link")
    page.check("input[name=outcome][value=approved]")
    page.fill("#id_comment", "looks good")
    page.click("#dw-operation-form input[type=submit]")
    assert "Approved stage review as admin" in _messages(page)

    # skip a dead letter
    page.goto(base + reverse("admin:django_workflows_outboxevent_change", args=[world["dead"]]))
    page.click("a.dw-skip-link")
    page.fill("#id_note", "endpoint retired")
    page.click("#dw-operation-form input[type=submit]")
    assert f"Skipped #{world['dead']}" in _messages(page)
    assert "skipped" in page.locator(".field-delivery").inner_text()
