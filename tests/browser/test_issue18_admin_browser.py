"""Issue 18's features in the operator admin, in a real browser: Playwright drives Debian's
Chromium (``executable_path=shutil.which("chromium")``; no browser download) against a live
server, with the runs prepared in-process on a fake clock.

One session checks what an operator sees of

1. a conditional stage and a branch: SKIPPED with its reason in the stage table, the skipped
   marker in the Gantt chart;
2. a map stage: its item counts (completed, failed, total) and progress;
3. a ``wait_for_signal`` stage: the waiting reason names the signal; "Send signal" (form,
   confirm) delivers it; once the run is driven the stage is COMPLETED with the payload as the
   run's output and the signals table lists it as consumed;
4. a child workflow: the parent's children table links to the child, whose page links back;
5. a per-key limit: the held run's waiting reason says "held by the limit ...".

Screenshots (``issue18_skipped.png``, ``issue18_gantt_skipped.png``, ``issue18_map.png``,
``issue18_signal_form.png``, ``issue18_children.png``, ``issue18_runs_list.png``) go to
``$DW_SCREENSHOT_DIR`` (default: the test's temporary directory);
``DW_SCREENSHOT_DIR=docs/screenshots`` regenerates the docs' images.

Skipped when the ``playwright`` package or a ``chromium`` binary is missing (``.ci/run``
installs both).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

import pytest
from django.db import connections
from django.urls import reverse
from pydantic import BaseModel

from django_workflows import (
    Condition,
    StageContext,
    StageFailed,
    define_stage,
    define_workflow,
    map_results,
    wait_for_signal,
)
from django_workflows.children import child_workflow
from django_workflows.definition.registry import registry
from django_workflows.kernel import Kernel
from django_workflows.kernel.commands import CreateRun
from django_workflows.models import Status, WorkflowRun
from django_workflows.testing import FakeClock, drive, make_kernel, run_to_completion

pytestmark = pytest.mark.django_db(transaction=True)  # Chromium and page: conftest.py


class Order(BaseModel):
    total: int


class Charge(BaseModel):
    total: int


class Basket(BaseModel):
    skus: list[str]


class Line(BaseModel):
    sku: str


class Priced(BaseModel):
    sku: str
    cents: int


class Approved(BaseModel):
    by: str
    amount: int


class Customer(BaseModel):
    customer_id: str


CLOCK: dict[str, FakeClock] = {}
T = TypeVar("T")


def _takes(seconds: float) -> Any:
    """A stage body passing its input on that "takes" ``seconds`` on the test's fake clock (so
    the Gantt chart has bars to draw beside the skipped markers)."""

    def execute(ctx: StageContext[Any, Any]) -> Any:
        CLOCK["clock"].advance(seconds)
        return Charge(total=ctx.input.total)

    return execute


def _price(ctx: StageContext[Line, Any]) -> Priced:
    if ctx.input.sku.startswith("x"):
        raise StageFailed(f"unknown sku {ctx.input.sku}")
    return Priced(sku=ctx.input.sku, cents=100 * len(ctx.input.sku))


def _by_size(ctx: Any) -> str:
    return "large" if ctx.output("charge").total > 1000 else "small"


def _workflows() -> list[Any]:
    charge = define_stage(id="charge", input=Order, output=Charge, execute=_takes(0.4))
    passthrough = {"input": Charge, "output": Charge, "execute": _takes(0.3)}
    price_line = define_stage(id="price-line", input=Line, output=Priced, execute=_price)
    lines = map_results(price_line)
    inner = (
        define_workflow(id="i18-packing")
        .pipe(wait_for_signal(id="packed", poll_interval_seconds=60))
        .build()
    )
    return [
        define_workflow(id="i18-orders", input=Order)
        .pipe(charge)
        .pipe(
            define_stage(id="review", **passthrough),
            when=Condition(lambda c: c.output("charge").total > 1000, reason="total over 1000"),
        )
        .branch(
            _by_size,
            {
                "small": [define_stage(id="pack-small", **passthrough)],
                "large": [define_stage(id="freight", **passthrough)],
            },
            id="size",
        )
        .pipe(define_stage(id="invoice", input=Charge, output=Charge, execute=_takes(0.2)))
        .build(),
        define_workflow(id="i18-pricing", input=Basket)
        .map(
            price_line,
            over=lambda ctx: [{"sku": s} for s in ctx.input.skus],
            max_concurrency=2,
            on_item_failure="continue",
        )
        .pipe(define_stage(id="sum", input=lines, execute=lambda ctx: len(ctx.input.succeeded())))
        .build(),
        define_workflow(id="i18-invoice")
        .pipe(wait_for_signal(id="approved", payload=Approved, timeout_seconds=3600))
        .build(),
        inner,
        define_workflow(id="i18-shipping")
        .pipe(child_workflow(id="ship", workflow=inner, input=lambda ctx: {}))
        .build(),
        define_workflow(
            id="i18-billing",
            input=Customer,
            concurrency_key=lambda i: i.customer_id,
            max_running_per_key=1,
        )
        .pipe(wait_for_signal(id="paid", poll_interval_seconds=60))
        .build(),
    ]


def _create(kernel: Kernel, workflow_id: str, data: Any = None) -> str:
    return str(
        kernel.dispatch(CreateRun(workflow_id=workflow_id, input=data or {})).workflow_run_id
    )


@pytest.fixture
def world(django_user_model: Any) -> Iterator[dict[str, Any]]:
    """One run per feature, each stopped where an operator would look at it, and an admin."""
    os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"] = "true"  # Playwright's event loop in this thread
    wfs = _workflows()
    for wf in wfs:
        registry.register(wf)
    clock = CLOCK["clock"] = FakeClock(datetime.now(UTC).replace(microsecond=0))
    kernel = make_kernel(*wfs, clock=clock)
    ids: dict[str, str] = {}
    ids["orders"] = _create(kernel, "i18-orders", {"total": 40})
    assert run_to_completion(kernel, ids["orders"]).status == Status.COMPLETED
    ids["pricing"] = _create(kernel, "i18-pricing", {"skus": ["ab", "x1", "abc", "a"]})
    assert run_to_completion(kernel, ids["pricing"]).status == Status.COMPLETED
    ids["invoice"] = _create(kernel, "i18-invoice")
    assert drive(kernel, ids["invoice"], rounds=3, advance_seconds=0).status == Status.RUNNING
    ids["parent"] = _create(kernel, "i18-shipping")
    assert drive(kernel, ids["parent"], rounds=4, advance_seconds=0).status == Status.RUNNING
    child = WorkflowRun.objects.get(parent_run_id=ids["parent"])
    ids["child"] = str(child.pk)
    ids["holder"] = _create(kernel, "i18-billing", {"customer_id": "cust-7"})
    clock.advance(1)
    ids["held"] = _create(kernel, "i18-billing", {"customer_id": "cust-7"})
    drive(kernel, ids["holder"], rounds=2, advance_seconds=0)
    assert WorkflowRun.objects.get(pk=ids["held"]).status == Status.PENDING
    django_user_model.objects.create_superuser("admin", "admin@example.com", "s3cret-pw")
    yield {"kernel": kernel, **ids}
    for wf in wfs:
        registry.unregister(wf.id)
    os.environ.pop("DJANGO_ALLOW_ASYNC_UNSAFE", None)


def _orm(work: Callable[[], T]) -> T:
    """Run database work from the test body while Playwright's event loop runs: Django gives
    that context connections of its own, which its teardown does not see, so close them here
    (PostgreSQL would refuse to drop the test database with them open)."""
    try:
        return work()
    finally:
        connections.close_all()


def _no_sideways_scroll(page: Any, selector: str) -> None:
    """The table fits its module: nothing cut off or scrolling sideways at 1440 px."""
    widths = page.evaluate(
        "(s) => { const t = document.querySelector(s);"
        " return [t.scrollWidth, t.closest('fieldset').clientWidth]; }",
        selector,
    )
    assert widths[0] <= widths[1] + 1, f"{selector} is wider than its box: {widths}"


def test_issue18_features_in_the_admin(
    live_server: Any, log_in: Any, world: dict[str, Any], page: Any, tmp_path: Path
) -> None:
    base = live_server.url
    shots = Path(os.environ.get("DW_SCREENSHOT_DIR") or tmp_path)
    shots.mkdir(parents=True, exist_ok=True)

    def run_page(run_id: str) -> str:
        return base + reverse("admin:django_workflows_workflowrun_change", args=[run_id])

    def stage_row(stage_id: str) -> Any:
        return page.locator("#dw-stages tbody tr").filter(
            has=page.locator("td:first-child strong", has_text=stage_id)
        )

    log_in()

    # 1. a skipped conditional stage and a branch not taken
    page.goto(run_page(world["orders"]))
    review = stage_row("review").inner_text()
    assert "SKIPPED" in review and "condition not met: total over 1000" in review
    assert "when: total over 1000" in review
    freight = stage_row("freight").inner_text()
    assert "SKIPPED" in freight
    assert "branch 'small' of 'size' was chosen; this stage is on 'large'" in freight
    assert "COMPLETED" in stage_row("pack-small").inner_text()
    assert "5 / 5" in page.locator(".field-progress_summary").inner_text()
    _no_sideways_scroll(page, "#dw-stages")
    gantt = page.locator("#dw-gantt")
    skipped = gantt.locator(".dw-gantt-row.dw-gantt-skipped")
    assert {t.strip() for t in skipped.locator(".dw-gantt-label").all_inner_texts()} == {
        "review",
        "freight",
    }
    assert skipped.locator(".dw-gantt-bar.dw-seg-skipped").count() == 2
    marker = skipped.first.locator(".dw-gantt-bar").bounding_box()
    assert marker and marker["width"] >= 2  # visible, though it took no time
    bars = {
        label: gantt.locator(".dw-gantt-row", has_text=label).locator(".dw-gantt-bar").first
        for label in ("charge", "review", "pack-small")
    }
    boxes = {label: bar.bounding_box() for label, bar in bars.items()}
    # the review was skipped when charge completed, before pack-small started
    assert boxes["charge"]["x"] + boxes["charge"]["width"] <= boxes["review"]["x"] + 2
    assert boxes["review"]["x"] <= boxes["pack-small"]["x"] + 2
    assert "skipped" in page.locator(".dw-gantt-legend").inner_text()
    page.locator("#dw-stages-group").screenshot(path=str(shots / "issue18_skipped.png"))
    page.locator("#dw-gantt-group").screenshot(path=str(shots / "issue18_gantt_skipped.png"))

    # 2. a map stage: items completed / failed / total and its progress
    page.goto(run_page(world["pricing"]))
    row = stage_row("price-line")
    text = row.inner_text()
    assert "items 3/4 completed, 1 failed" in text
    assert "map over <lambda>(), max_concurrency 2, on_item_failure continue" in text
    assert row.locator("progress").get_attribute("value") == "100"
    assert "COMPLETED" in text
    _no_sideways_scroll(page, "#dw-stages")
    page.locator("#dw-stages-group").screenshot(path=str(shots / "issue18_map.png"))

    # 3. a run waiting for a signal; the operator sends it
    page.goto(run_page(world["invoice"]))
    assert "waiting for signal 'approved'" in page.locator("#dw-waiting").inner_text()
    page.click("a.dw-signal-link")
    assert page.input_value("#id_name") == "approved"  # the name it waits for
    facts = page.locator("ul.dw-facts").inner_text()
    assert "Stage approved is waiting for signal 'approved'" in facts
    page.fill("#id_payload", '{"by": "alice", "amount": 120}')
    page.fill("#id_key", "mail-4711")
    lefts = {
        round(page.locator(f"#id_{name}").bounding_box()["x"])
        for name in ("name", "payload", "key")
    }
    assert len(lefts) == 1, f"the form's fields are not aligned under their labels: {lefts}"
    page.screenshot(path=str(shots / "issue18_signal_form.png"))
    page.click("#dw-operation-form input[type=submit]")
    assert "Stored signal approved" in page.locator("ul.messagelist").inner_text()
    pending = page.locator("#dw-signals tr.dw-signal-pending")
    assert pending.count() == 1 and "pending" in pending.inner_text()
    # the admin sent it with the real clock, a few seconds past the fake one: jump there
    assert _orm(lambda: drive(world["kernel"], world["invoice"], rounds=3).status) == (
        Status.COMPLETED
    )
    page.goto(run_page(world["invoice"]))
    assert "COMPLETED" in page.locator(".field-status_badge").inner_text()
    assert "COMPLETED" in stage_row("approved").inner_text()
    output = page.locator(".field-output_json").inner_text()
    assert json.loads(output[output.index("{") :]) == {"by": "alice", "amount": 120}
    signal = page.locator("#dw-signals tr.dw-signal").inner_text()
    for part in ("approved", '"alice"', "user:admin", "mail-4711", "by stage approved"):
        assert part in signal, (part, signal)
    assert page.locator("#dw-signals tr.dw-signal-pending").count() == 0
    _no_sideways_scroll(page, "#dw-signals")

    # 4. a parent waiting for its child, and back
    page.goto(run_page(world["parent"]))
    assert "child run" in page.locator("#dw-waiting").inner_text()
    children = page.locator("#dw-children tbody tr.dw-child")
    assert children.count() == 1
    child_text = children.inner_text()
    assert "i18-packing" in child_text and "RUNNING" in child_text and "ship" in child_text
    _no_sideways_scroll(page, "#dw-children")
    page.locator("#dw-family-group").screenshot(path=str(shots / "issue18_children.png"))
    children.locator("a").click()
    page.wait_for_url(run_page(world["child"]))
    assert "waiting for signal 'packed'" in page.locator("#dw-waiting").inner_text()
    parent = page.locator("#dw-parent")
    assert "stage ship" in parent.inner_text()
    parent.locator("a").click()
    page.wait_for_url(run_page(world["parent"]))

    # 5. a run held by a per-key limit
    page.goto(run_page(world["held"]))
    assert "PENDING" in page.locator(".field-status_badge").inner_text()
    assert page.locator("#dw-waiting").inner_text().count("held by the limit") == 1
    assert (
        f"held by the limit max_running_per_key=1 for key 'cust-7' (run {world['holder']} "
        "holds it)" in page.locator("#dw-waiting").inner_text()
    )
    assert "cust-7" in page.locator(".field-concurrency_key").inner_text()

    # the runs list: why each run waits, without scrolling sideways
    page.goto(base + reverse("admin:django_workflows_workflowrun_changelist"))
    held = page.locator("#result_list tbody tr", has_text=world["held"][:8])
    assert "held by the limit max_running_per_key=1 for key 'cust-7'" in held.inner_text()
    listed = page.locator("#result_list").inner_text()
    assert "waiting for signal 'approved'" not in listed  # that run completed
    assert "waiting for signal 'packed'" in listed  # the child
    widths = page.evaluate(
        "() => [document.querySelector('#result_list').scrollWidth,"
        " document.querySelector('.results').clientWidth]"
    )
    assert widths[0] <= widths[1] + 1, f"the runs list scrolls sideways at 1440 px: {widths}"
    page.screenshot(path=str(shots / "issue18_runs_list.png"))
