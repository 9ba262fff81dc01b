"""End to end: the example pipeline through real django-q2 worker processes.

Each test gets its own database (a SQLite file, or a fresh PostgreSQL database on the
PostgreSQL pass), migrates it, starts ``manage.py qcluster`` as a subprocess, and runs the
``package-report`` workflow with ``manage.py workflows_run --wait``: the real CLI, real workers,
a real suspension (the dependency graph is computed by a django-q2 background task) and resume.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings

from tests.markers import ON_POSTGRES

pytestmark = pytest.mark.acceptance

ROOT = Path(__file__).resolve().parents[2]

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


def _pg_url(name: str) -> str:
    db = settings.DATABASES["default"]
    return f"postgres://{db['USER']}@{db['HOST']}:{db['PORT']}/{name}"


@pytest.fixture
def database_url(tmp_path: Path) -> Iterator[str]:
    """A fresh, empty database for the subprocesses, dropped afterwards."""
    if not ON_POSTGRES:
        yield f"sqlite:///{tmp_path / 'acceptance.sqlite3'}"
        return
    import psycopg

    db = settings.DATABASES["default"]
    name = f"dw_acceptance_{uuid.uuid4().hex[:8]}"
    admin = f"postgresql://{db['USER']}@{db['HOST']}:{db['PORT']}/postgres"
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield _pg_url(name)
    finally:
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def _env(database_url: str, var_dir: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        DATABASE_URL=database_url,
        EXAMPLE_VAR_DIR=str(var_dir),
        DJANGO_SETTINGS_MODULE="example_project.settings",
        Q_WORKERS="2",
        WORKFLOWS_TICK_INTERVAL="0.2",
        PYTHONUNBUFFERED="1",
    )
    return env


def _manage(env: dict[str, str], *args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "manage.py", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture
def cluster(database_url: str, tmp_path: Path) -> Iterator[dict[str, Any]]:
    """A migrated database and a running ``qcluster``; stopped with SIGTERM to its main process."""
    env = _env(database_url, tmp_path / "var")
    migrated = _manage(env, "migrate", "--noinput", "-v0")
    assert migrated.returncode == 0, migrated.stderr
    log = open(tmp_path / "qcluster.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "manage.py", "qcluster"],
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        yield {"env": env, "proc": proc, "var": tmp_path / "var", "log": tmp_path / "qcluster.log"}
    finally:
        proc.send_signal(signal.SIGTERM)  # the main process only: a group SIGTERM hangs it
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def test_example_pipeline_completes_through_real_workers(cluster: dict[str, Any]) -> None:
    """The demo's README command path: workflows_run --wait against a live cluster."""
    env = cluster["env"]
    done = _manage(
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

    state = json.loads(_manage(env, "shell", "-v0", "-c", INSPECT).stdout)
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
