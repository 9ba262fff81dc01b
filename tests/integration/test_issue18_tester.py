"""Regressions found by trying issue 18's features as a new user (tester): bad inputs that
surfaced as a database error or named the wrong argument."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import BaseModel

from django_workflows import (
    StageContext,
    WorkflowDefinitionError,
    define_workflow,
    map_results,
    stage,
    wait_for_signal,
)
from django_workflows.children import child_workflow
from django_workflows.models import WorkflowJob
from django_workflows.testing import run_workflow


class Item(BaseModel):
    n: float


@stage(id="double")
def double(ctx: StageContext[Item]) -> dict[str, Any]:
    return {"v": ctx.input.n * 2}


@stage(id="collect")
def collect(ctx: StageContext[map_results(double)]) -> dict[str, Any]:  # type: ignore[valid-type]
    return {"n": len(ctx.input.items)}


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("item", "problem"),
    [
        ({"n": float("nan")}, "NaN and Infinity are not JSON"),
        ({"n": 1, "note": "a\x00b"}, "NUL character"),
    ],
)
def test_a_map_item_the_database_cannot_store_fails_the_map_stage_naming_the_item(
    item: dict[str, Any], problem: str
) -> None:
    """Was: the INSERT of the item jobs failed (SQLite: IntegrityError from the JSON CHECK),
    the run FAILED with error_type ClaimFailed and no stage. Now: MapOverFailed on the map
    stage, naming the item's index, and no item job written."""
    flow = (
        define_workflow(id="map-unstorable")
        .map(double, over=lambda ctx: [{"n": 1}, item])
        .pipe(collect)
        .build()
    )
    result = run_workflow(flow)
    assert result.status == "FAILED"
    assert result.error["error_type"] == "MapOverFailed"
    assert result.error["stage_id"] == "double"
    assert "item 1 cannot be stored" in result.error["message"]
    assert problem in result.error["message"]
    assert not WorkflowJob.objects.filter(workflow_run_id=result.run_id, stage_id="double").exists()


@pytest.mark.parametrize(
    ("make", "expected"),
    [
        (
            lambda: wait_for_signal(id="x", payload=dict),
            "wait_for_signal 'x': payload must be a pydantic BaseModel subclass or None",
        ),
        (
            # was: AttributeError ('dict' has no model_validate) from the timeout_output check
            lambda: wait_for_signal(id="x", payload=dict, timeout_seconds=5, on_timeout="complete"),
            "wait_for_signal 'x': payload must be a pydantic BaseModel subclass or None",
        ),
        (
            # was: "signal: 'bad id' is not a valid signal name" (the defaulted signal name)
            lambda: wait_for_signal(id="bad id"),
            "Invalid stage id 'bad id'",
        ),
        (
            lambda: child_workflow(id="c", workflow="x", input=lambda c: {}, output=dict),
            "child_workflow 'c': output must be a pydantic BaseModel subclass or None",
        ),
        (
            lambda: child_workflow(id="c", workflow="x", input=lambda c: {}, stage_input=5),
            "child_workflow 'c': stage_input must be a pydantic BaseModel subclass or None",
        ),
    ],
)
def test_stage_factories_name_the_argument_that_is_not_a_model(make: Any, expected: str) -> None:
    """Was: "Stage 'x': output_model must be ..." (an argument the caller never passed)."""
    with pytest.raises(WorkflowDefinitionError) as caught:
        make()
    assert str(caught.value).startswith(expected)


DEEP_JSON = "[" * 5000 + "]" * 5000  # Python's json parser raises RecursionError on it


@pytest.mark.django_db
def test_the_admin_send_signal_form_rejects_json_nested_too_deeply(admin_client: Any) -> None:
    """Was: a 500 page (RecursionError out of json.loads in the form's clean_payload)."""
    from django.urls import reverse

    from django_workflows.kernel import CreateRun
    from django_workflows.models import WorkflowSignal
    from django_workflows.testing import make_kernel

    flow = define_workflow(id="deep-signal").pipe(wait_for_signal(id="go")).build()
    run_id = make_kernel(flow).dispatch(CreateRun(workflow_id="deep-signal")).workflow_run_id
    url = reverse("admin:django_workflows_workflowrun_signal", args=[run_id])
    response = admin_client.post(url, {"confirm": "yes", "name": "go", "payload": DEEP_JSON})
    assert response.status_code == 200
    assert "not JSON: nested too deeply" in response.content.decode()
    assert not WorkflowSignal.objects.exists()


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (
            ["workflows_signal", "00000000-0000-0000-0000-000000000000", "go", "--payload"],
            "--payload: not JSON: nested too deeply",
        ),
        (["workflows_run", "some-workflow", "--input"], "--input: invalid JSON (nested too deeply"),
    ],
)
def test_commands_reject_json_nested_too_deeply_with_a_command_error(
    argv: list[str], expected: str
) -> None:
    """Was: a RecursionError traceback from json.loads."""
    from django.core.management import call_command
    from django.core.management.base import CommandError

    with pytest.raises(CommandError) as caught:
        call_command(*argv, DEEP_JSON)
    assert str(caught.value).startswith(expected)


@pytest.mark.django_db
def test_a_signal_wait_and_a_child_stage_may_follow_a_stage_that_returns_a_non_object() -> None:
    """Was: both stages had the NoInput model, which rejects a non-object, so placed after a
    stage returning a list or a number they failed the run with a ValidationError (child
    workflows' docs promise "default: any input"). Now their default input is AnyInput."""
    from django_workflows import define_stage

    numbers = define_stage(id="numbers", execute=lambda ctx: [1, 2, 3])
    waits = define_workflow(id="wait-after-list").pipe(numbers).pipe(wait_for_signal(id="go"))
    result = run_workflow(waits.build(), signals=[("go", {"ok": True})])
    assert result.status == "COMPLETED", result.error
    assert result.output == {"ok": True}

    kid = define_workflow(id="kid-of-list").pipe(define_stage(id="k", execute=lambda c: 7))
    seen: list[Any] = []

    def child_input(ctx: Any) -> dict[str, Any]:
        seen.append(ctx.input.root)
        return {}

    parent = (
        define_workflow(id="parent-of-list")
        .pipe(numbers)
        .pipe(child_workflow(id="c", workflow=kid.build(), input=child_input))
        .build()
    )
    result = run_workflow(parent)
    assert result.status == "COMPLETED", result.error
    assert result.output == 7
    assert seen[0] == [1, 2, 3]  # the previous output, as sent
