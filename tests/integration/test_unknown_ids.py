"""An unknown workflow or schedule id names the closest known one, or lists them (issue 17
section 5): ``start_run``, ``CreateRun``, ``workflows_run`` and ``workflows_schedule`` say
"did you mean 'order'?", and nothing is written."""

from __future__ import annotations

import io
from collections.abc import Iterator
from typing import Any

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.utils import timezone

from django_workflows import (
    ScheduleNotFoundError,
    WorkflowNotFoundError,
    define_schedule,
    pause_schedule,
    registry,
    start_run,
)
from django_workflows.kernel.schedules import get_schedule
from django_workflows.models import WorkflowRun, WorkflowSchedule
from tests.workflows import two_stage

pytestmark = pytest.mark.django_db


@pytest.fixture
def order() -> Iterator[Any]:
    workflow = two_stage("uid-order")
    registry.register(workflow)
    registry.register_schedule(
        define_schedule("uid-nightly", workflow, cron="0 2 * * *", input={"value": 1})
    )
    yield workflow
    registry.unregister_schedule("uid-nightly")
    registry.unregister("uid-order")


def test_start_run_of_a_misspelt_workflow_names_the_registered_one(order: Any) -> None:
    with pytest.raises(WorkflowNotFoundError) as info:
        start_run("uid-ordr", {"value": 1})
    message = str(info.value)
    assert message.startswith("Workflow 'uid-ordr' not found in registry; did you mean")
    assert "'uid-order'" in message.split("?")[0]
    assert info.value.workflow_id == "uid-ordr"
    assert not WorkflowRun.objects.exists()


def test_workflows_run_of_a_misspelt_workflow_says_did_you_mean(order: Any) -> None:
    with pytest.raises(CommandError, match=r"did you mean 'uid-order'\?"):
        call_command("workflows_run", "uid-ordr", "--input", '{"value": 1}', stdout=io.StringIO())
    assert not WorkflowRun.objects.exists()


def test_an_unknown_workflow_lists_the_registered_ids_when_few(kernel_for: Any) -> None:
    """A kernel with its own registry lists its own ids (not the process registry's)."""
    from django_workflows.kernel import CreateRun

    kernel = kernel_for(two_stage("alpha"), two_stage("beta"))
    with pytest.raises(WorkflowNotFoundError) as info:
        kernel.dispatch(CreateRun(workflow_id="gamma", input={"value": 1}))
    assert str(info.value) == (
        "Workflow 'gamma' not found in registry (registered workflows: alpha, beta)"
    )


@pytest.mark.django_db(transaction=True)
def test_an_unknown_schedule_names_the_closest_row_or_definition(order: Any) -> None:
    """Rows (an orphaned one too: its definition is gone) and registered definitions are the
    known names; pause/get of a misspelt one says which was meant and changes nothing."""
    now = timezone.now()
    WorkflowSchedule.objects.create(
        name="uid-weekly",
        workflow_id="uid-order",
        created_at=now,
        updated_at=now,
        anchor=now,
        orphaned=True,
    )
    with pytest.raises(ScheduleNotFoundError) as info:
        get_schedule("uid-nigthly")
    assert str(info.value) == (
        "Schedule 'uid-nigthly' not found; did you mean 'uid-nightly'? "
        "(schedules: uid-nightly, uid-weekly)"
    )
    assert info.value.name == "uid-nigthly"
    with pytest.raises(ScheduleNotFoundError, match=r"did you mean 'uid-weekly'\?"):
        pause_schedule("uid-weeky")
    out = io.StringIO()
    with pytest.raises(CommandError, match=r"did you mean 'uid-nightly'\?"):
        call_command("workflows_schedule", "pause", "uid-nightlyy", stdout=out)
    assert WorkflowSchedule.objects.filter(paused=True).count() == 0
