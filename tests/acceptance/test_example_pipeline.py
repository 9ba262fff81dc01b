"""End to end: the example pipeline through real django-q2 worker processes.

Each test gets its own database (a SQLite file, or a fresh PostgreSQL database on the
PostgreSQL pass), migrates it, starts ``manage.py qcluster`` as a subprocess, and runs the
``package-report`` workflow with ``manage.py workflows_run --wait``: the real CLI, real workers,
a real suspension (the dependency graph is computed by a django-q2 background task) and resume.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from .harness import manage

pytestmark = pytest.mark.acceptance

INSPECT = """
import json
from django_workflows.models import OutboxEvent, WorkflowRun, WorkflowJob
run = WorkflowRun.objects.get()
print(json.dumps({
    "status": run.status,
    "output": run.output,
    "stages": {s.stage_id: s.status for s in run.stages.all()},
    "jobs": sorted(j.status for j in WorkflowJob.objects.filter(workflow_run_id=run.pk)),
    "events": [
        [e.sequence, e.event_type, e.payload.get("stage_id")]
        for e in OutboxEvent.objects.filter(workflow_run_id=run.pk).order_by("sequence")
    ],
}))
"""


def test_example_pipeline_completes_through_real_workers(cluster: dict[str, Any]) -> None:
    """The demo's README command path: workflows_run --wait against a live cluster."""
    env = cluster["env"]
    done = manage(
        env,
        "workflows_run",
        "package-report",
        "--input",
        '{"limit": 12}',
        "--wait",
        "--timeout",
        "120",
        "--poll-interval",
        "0.2",
    )
    log = cluster["log"].read_text()
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}\n--- qcluster ---\n{log}"
    assert "dependency-graph       SUSPENDED" in done.stdout  # live progress showed the wait
    assert "COMPLETED in" in done.stdout

    state = json.loads(manage(env, "shell", "-v0", "-c", INSPECT).stdout)
    assert state["status"] == "COMPLETED"
    assert set(state["stages"].values()) == {"COMPLETED"}
    assert len(state["stages"]) == 5
    assert state["jobs"] == ["COMPLETED"] * 5

    events = state["events"]
    assert [e[0] for e in events] == list(range(1, len(events) + 1))  # gap-free, in order
    types = [(e[1], e[2]) for e in events]
    assert types[:2] == [("workflow:created", None), ("workflow:started", None)]
    assert types[-1] == ("workflow:completed", None)

    def at(kind: str, stage: str) -> int:
        return types.index((kind, stage))

    for sid in ("discover", "parse-metadata", "text-stats", "dependency-graph", "report"):
        assert at("stage:started", sid) < at("stage:completed", sid)
    for sid in ("parse-metadata", "text-stats"):
        assert at("stage:completed", "discover") < at("stage:started", sid)
        assert at("stage:completed", sid) < at("stage:started", "dependency-graph")
    assert (
        at("stage:started", "dependency-graph")
        < at("stage:suspended", "dependency-graph")
        < at("workflow:suspended", "dependency-graph")
        < at("stage:completed", "dependency-graph")
        < at("stage:started", "report")
    )

    output = state["output"]
    assert output["packages"] == 12
    report = Path(output["report_path"])
    assert report.parent == cluster["var"] / "reports"
    text = report.read_text()
    assert text.startswith("# Installed Python distributions")
    assert f"{output['packages']} distributions" in text
