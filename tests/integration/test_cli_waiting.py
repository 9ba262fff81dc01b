"""The CLI says what a run waits for (issue 17 section 5): ``workflows_status`` (text and
``--json``) and ``workflows_run --wait`` give the admin's and the API's waiting reasons, with
the command that unblocks them; a released stage (RUNNING 62%, its job back in the queue) or
one whose worker stopped renewing its lease, with no worker live, says it waits for a worker
instead of looking busy."""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.utils import timezone

from django_workflows import define_workflow
from django_workflows.approval import approval_stage
from django_workflows.definition.registry import registry
from django_workflows.kernel import routing
from django_workflows.kernel.hosting import process_available_jobs, run_maintenance_tick
from django_workflows.kernel.runtime import get_kernel
from django_workflows.management.commands import workflows_run
from django_workflows.models import Status, WorkflowJob, WorkflowRun, WorkflowStage
from django_workflows.runs import start_run
from tests.workflows import Num, add, two_stage

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def _workflows() -> Iterator[None]:
    registry.register(two_stage("cli-wait"))
    registry.register(
        define_workflow(id="cli-approve", input=Num)
        .pipe(add(1, stage_id="draft"))
        .pipe(approval_stage(id="review", poll_interval_seconds=60))
        .build()
    )
    yield
    registry.unregister("cli-wait")
    registry.unregister("cli-approve")


def status(run_id: str, *args: str) -> str:
    out = io.StringIO()
    call_command("workflows_status", run_id, *args, stdout=out)
    return out.getvalue()


def status_json(run_id: str) -> dict[str, Any]:
    return json.loads(status(run_id, "--json"))


def waiting_lines(text: str) -> list[str]:
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("  waiting:"))
    out = [lines[start][len("  waiting:") :].strip()]
    for line in lines[start + 1 :]:
        if not line.startswith("           "):
            break
        out.append(line.strip())
    return out


def claimed(workflow_id: str = "cli-wait") -> str:
    run_id = start_run(workflow_id, {"value": 1})
    run_maintenance_tick(get_kernel(), "cli-test")
    return run_id


def test_an_approval_names_the_command_that_decides_it() -> None:
    run_id = start_run("cli-approve", {"value": 1})
    kernel = get_kernel()
    for _ in range(5):
        run_maintenance_tick(kernel, "cli-test")
        process_available_jobs(kernel, "cli-test", max_jobs=10)
    assert WorkflowStage.objects.get(run_id=run_id, stage_id="review").status == Status.SUSPENDED
    command = (
        f"python manage.py workflows_approve {run_id} --stage review "
        f"(or workflows_reject {run_id} --stage review --reason ...)"
    )
    assert waiting_lines(status(run_id)) == [
        f"waiting for an approval decision (stage review; run: {command})"
    ]
    (item,) = status_json(run_id)["waiting"]
    assert item == {
        "reason": "approval",
        "stage_id": "review",
        "message": "waiting for an approval decision",
        "command": command,
        "at": item["at"],
    }
    assert item["at"] is not None  # the next check of the decision


def test_a_pending_run_with_no_worker_live_says_it_waits_for_a_worker() -> None:
    run_id = start_run("cli-wait", {"value": 1})
    assert waiting_lines(status(run_id)) == [
        "waiting for a worker: no worker is live to claim the run (run: python manage.py qcluster)"
    ]
    # With a worker live the tick will claim it: that is what it waits for.
    routing.announce("worker-h-1-a", ["default"], registry=get_kernel().registry)
    (item,) = status_json(run_id)["waiting"]
    assert (item["reason"], item["command"]) == ("claim", None)


def test_a_released_stage_with_no_worker_live_waits_for_a_worker_not_running() -> None:
    """The stage record says RUNNING 62% (a worker died mid-stage and the lease was
    released): the job is back in the queue and no worker is live."""
    run_id = claimed()
    WorkflowStage.objects.filter(run_id=run_id, stage_id="add-1").update(
        status=Status.RUNNING, progress=62.0, started_at=timezone.now()
    )
    WorkflowJob.objects.filter(workflow_run_id=run_id).update(attempt=1)
    text = status(run_id)
    assert waiting_lines(text) == [
        "waiting for a default worker (stage add-1; run: python manage.py qcluster)"
    ]
    (line,) = [s for s in text.splitlines() if " add-1 " in s and "RUNNING" in s]
    assert "62%" in line and line.endswith("(waiting for a default worker)")
    doc = status_json(run_id)
    assert [(w["reason"], w["stage_id"]) for w in doc["waiting"]] == [("no_worker", "add-1")]
    assert doc["waiting_for_worker"] == ["default"]  # the older keys stay


def test_a_stage_whose_worker_stopped_renewing_its_lease_is_not_busy() -> None:
    run_id = claimed()
    WorkflowStage.objects.filter(run_id=run_id).update(status=Status.RUNNING, progress=62.0)
    job = WorkflowJob.objects.get(workflow_run_id=run_id)
    job.status, job.worker_id, job.attempt = Status.RUNNING, "worker-gone-7-abcdef", 1
    job.locked_at = timezone.now() - timedelta(seconds=200)
    job.save()
    (item,) = status_json(run_id)["waiting"]
    assert item["reason"] == "stale_lease"
    assert item["message"].startswith(
        "waiting for a worker: worker-gone-7-abcdef stopped renewing the lease "
    )
    assert "the stage is taken again when the lease is 300 s old" in item["message"]
    assert item["message"].endswith("by a default worker, and none is live")
    assert item["command"] == "python manage.py qcluster"
    # A lease renewed just now: a worker is executing the stage.
    WorkflowJob.objects.filter(pk=job.pk).update(locked_at=timezone.now())
    (item,) = status_json(run_id)["waiting"]
    assert (item["reason"], item["message"]) == (
        "executing",
        "worker worker-gone-7-abcdef is executing the stage",
    )


def test_a_terminal_run_waits_for_nothing() -> None:
    run_id = start_run("cli-wait", {"value": 1})
    WorkflowRun.objects.filter(pk=run_id).update(status=Status.COMPLETED)
    assert "waiting:" not in status(run_id)
    assert status_json(run_id)["waiting"] == []


class FakeTime:
    """``time`` for ``workflows_run``: ``sleep`` advances ``monotonic`` (no real waiting)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def test_run_wait_says_what_the_run_waits_for(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(workflows_run, "time", FakeTime())
    out = io.StringIO()
    with pytest.raises(CommandError) as info:
        call_command(
            "workflows_run",
            "cli-wait",
            "--input",
            '{"value": 1}',
            "--wait",
            "--timeout",
            "2",
            stdout=out,
        )
    waited = "waiting for a worker: no worker is live to claim the run"
    lines = [line for line in out.getvalue().splitlines() if "waiting:" in line]
    assert lines == [f"  waiting: {waited} (run: python manage.py qcluster)"]  # once, not per poll
    assert str(info.value).endswith(
        f"still PENDING after 2 s: {waited} (run: python manage.py qcluster)"
    )
