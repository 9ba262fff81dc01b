"""A stage stopped by django-q2's ``timeout`` fails naming that timeout (issue 8 item 6).

django-q2 1.11 raises ``TimeoutException`` (a ``SystemExit``) in the task by SIGALRM once
``Q_CLUSTER["timeout"]`` has passed, and its guard kills the worker process about 3 s later.
``sleepy-pipeline``'s stage sleeps 6 s on its first delivery under a 2 s timeout: the failure
must commit through the fenced outcome transaction before the kill, with a message naming the
timeout (not, three lease expiries later, "delivered 3 times ... worker crash"), and the retry
policy re-delivers the stage, which then completes. Runs on SQLite and PostgreSQL in ~15 s.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from .harness import (
    Cluster,
    assert_outbox_gap_free,
    assert_runs_completed,
    create_runs,
    settle_runs,
    shell_json,
    tick_command,
)

pytestmark = [pytest.mark.acceptance]

FAILURES = """
import json
from django_workflows.models import OutboxEvent
events = {{
    e.event_type: e for e in OutboxEvent.objects.filter(
        workflow_run_id={run_id!r}, payload__stage_id="sleepy"
    ).order_by("sequence")
}}
started = OutboxEvent.objects.filter(
    workflow_run_id={run_id!r}, event_type="stage:started"
).order_by("sequence").first()
failed = OutboxEvent.objects.filter(
    workflow_run_id={run_id!r}, event_type="stage:failed"
).order_by("sequence")
print(json.dumps({{
    "errors": [e.payload.get("error") for e in failed],
    "seconds": [(e.created_at - started.created_at).total_seconds() for e in failed],
}}))
"""


def test_a_stage_past_the_django_q2_timeout_fails_with_a_message_naming_it(
    project: Callable[..., dict[str, str]],
    clusters: Callable[..., Cluster],
    tmp_path: Path,
) -> None:
    crash_dir = tmp_path / "crash"
    crash_dir.mkdir()
    env = project(
        EXTRA_INSTALLED_APPS="tests.acceptance.crashapp",
        CRASH_DIR=str(crash_dir),
        CONN_STAGE_SECONDS="6",
        Q_TIMEOUT="2",
        Q_RETRY="8",
        Q_WORKERS="2",
        WORKFLOWS_STALE_LEASE_SECONDS="30",
        WORKFLOWS_HEARTBEAT_SECONDS="1",
        WORKFLOWS_TICKER_RUN_SECONDS="1",
    )
    cluster = clusters(env)
    ticker = clusters(env, *tick_command(), log="ticker.log")
    [run_id] = create_runs(env, "sleepy-pipeline", [{"n": 0}])
    runs = settle_runs(env, [run_id], timeout=60)
    failures = shell_json(env, FAILURES.format(run_id=run_id))
    context = (
        f"{runs}\n{failures}\n--- qcluster ---\n{cluster.log()[-4000:]}\n{ticker.log()[-800:]}"
    )
    assert_runs_completed(runs, context)
    assert_outbox_gap_free(runs, context)
    # Delivery 1 failed (the timeout), delivery 2 completed: no outcome of either twice.
    events = [(e[1], e[2]) for e in runs[run_id]["events"]]
    assert events.count(("stage:failed", "sleepy")) == 1, context
    assert events.count(("stage:completed", "sleepy")) == 1, context
    assert events[-1] == ("workflow:completed", None), context
    [error] = failures["errors"]
    assert "stopped by django-q2's timeout (Q_CLUSTER['timeout'] = 2 s)" in error, context
    # Committed at the alarm, before the guard's kill (~3 s later): with a 30 s lease, the
    # old path would have left the job RUNNING and failed it only after lease expiries.
    [job] = runs[run_id]["jobs"]
    assert job[2] == 2, context  # one timed-out delivery, one that completed
    print("django-q2 timeout:", failures)
