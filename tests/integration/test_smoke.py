from __future__ import annotations

import pytest

from django_workflows.kernel import CreateRun
from django_workflows.models import Status
from django_workflows.testing import run_to_completion
from tests.workflows import async_stage, two_stage

pytestmark = pytest.mark.django_db(transaction=True)


def test_two_stage_run_completes(kernel_for, sink):
    kernel = kernel_for(two_stage())
    res = kernel.dispatch(CreateRun(workflow_id="two-stage", input={"value": 1}))
    run = run_to_completion(kernel, res.workflow_run_id)
    assert run.status == Status.COMPLETED
    assert run.output == {"value": 12}
    assert sink.types(run.pk) == [
        "workflow:created",
        "workflow:started",
        "stage:started",
        "stage:completed",
        "stage:started",
        "stage:completed",
        "workflow:completed",
    ]


def test_async_stage_suspends_and_resumes(kernel_for, clock):
    from django_workflows import define_workflow
    from tests.workflows import add

    wf = define_workflow(id="with-batch").pipe(async_stage(ready_after=2)).pipe(add(1)).build()
    kernel = kernel_for(wf)
    res = kernel.dispatch(CreateRun(workflow_id="with-batch", input={}))
    run = run_to_completion(kernel, res.workflow_run_id, advance_seconds=5)
    assert run.status == Status.COMPLETED
    assert run.output == {"value": 100}
