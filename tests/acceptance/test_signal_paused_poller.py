"""A signal sent while the process that polls the receiving stage is frozen (issue 18 item 4).

``signal-pipeline`` (``crashapp/workflows.py``): approved (``wait_for_signal``) -> book. A
qcluster executes the stages (its supervisor threads do not tick) and ticker A
and ticker B (``workflows_tick --loop`` both) poll the suspended stage. When ``approved``
waits, the test freezes ticker A with SIGSTOP, sends the signal twice with ``manage.py
workflows_signal`` (the same ``--key``: the second is a duplicate) and keeps A frozen well
past the maintenance lease (``STALE_LEASE_SECONDS`` = 3 s) before SIGCONT. Whoever polls,
the signal is consumed exactly once: one signal row, consumed by ``approved``; one
``signal:received``; one ``stage:completed`` per stage; the stage output and the run output
are the payload; the outbox is gap-free. PostgreSQL only (about 40 s with the migrate).
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.markers import ON_POSTGRES

from .harness import (
    Cluster,
    assert_outbox_gap_free,
    assert_outcomes_once,
    assert_runs_completed,
    create_runs,
    manage,
    settle_runs,
    shell_json,
    tick_command,
    wait_for,
)

pytestmark = [
    pytest.mark.acceptance,
    pytest.mark.skipif(not ON_POSTGRES, reason="the signal acceptance test runs on PostgreSQL"),
]

STALE_LEASE_SECONDS = 3
PAUSE_SECONDS = 6
PAYLOAD = {"by": "alice", "amount": 42}

ENV = {
    "EXTRA_INSTALLED_APPS": "tests.acceptance.crashapp",
    "WORKFLOWS_STALE_LEASE_SECONDS": str(STALE_LEASE_SECONDS),
    "WORKFLOWS_HEARTBEAT_SECONDS": "1",
    "WORKFLOWS_TICK_INTERVAL": "0.2",
    "WORKFLOWS_SUPERVISOR_TICKS": "0",
    "Q_WORKERS": "2",
}

STAGE_STATUS = """
import json
from django_workflows.models import WorkflowStage
rows = WorkflowStage.objects.filter(run_id={run_id!r}).values_list("stage_id", "status")
print(json.dumps(dict(rows)))
"""

SIGNALS = """
import json
from django_workflows.models import OutboxEvent, WorkflowSignal
rows = [
    {{"name": s.name, "payload": s.payload, "key": s.idempotency_key, "actor": s.actor,
      "consumed": s.consumed_at is not None, "stage": s.consumed_stage_id,
      "generation": s.consumed_generation}}
    for s in WorkflowSignal.objects.filter(run_id={run_id!r}).order_by("id")
]
received = OutboxEvent.objects.filter(
    workflow_run_id={run_id!r}, event_type="signal:received"
).count()
print(json.dumps({{"rows": rows, "received": received}}))
"""


def test_a_signal_sent_while_the_poller_is_frozen_is_consumed_once(
    project: Callable[..., dict[str, str]], clusters: Callable[..., Cluster], tmp_path: Path
) -> None:
    env = project(**ENV, CRASH_DIR=str(tmp_path))
    cluster = clusters(env)
    ticker_a = clusters(env, *tick_command(), log="ticker-a.log")
    ticker_b = clusters(env, *tick_command(), log="ticker-b.log")
    started = time.monotonic()
    [run_id] = create_runs(env, "signal-pipeline", [{}])

    def stages() -> dict[str, str]:
        return shell_json(env, STAGE_STATUS.format(run_id=run_id))

    def context() -> str:
        return (
            f"run {run_id}\n--- qcluster ---\n{cluster.log()[-3000:]}\n"
            f"--- ticker A ---\n{ticker_a.log()[-1500:]}"
        )

    try:
        wait_for(lambda: stages().get("approved") == "SUSPENDED", timeout=40, interval=0.3)
    except TimeoutError:
        pytest.fail(f"approved never suspended\n{context()}")
    assert ticker_a.proc is not None
    paused_pid = ticker_a.proc.pid
    os.kill(paused_pid, signal.SIGSTOP)
    paused_at = time.monotonic()
    try:
        argv = ("workflows_signal", run_id, "approved", "--payload", json.dumps(PAYLOAD))
        first = manage(env, *argv, "--key", "mail-1", "--actor", "user:alice")
        again = manage(env, *argv, "--key", "mail-1")
        assert first.returncode == 0 and first.stdout.startswith("stored signal "), first
        assert again.returncode == 0 and again.stdout.startswith("duplicate: key"), again
        time.sleep(max(0.0, paused_at + PAUSE_SECONDS - time.monotonic()))
        during_pause = stages()
    finally:
        os.kill(paused_pid, signal.SIGCONT)
    resumed = time.monotonic() - started
    runs = settle_runs(env, [run_id], timeout=30)
    settled = time.monotonic() - started
    signals = shell_json(env, SIGNALS.format(run_id=run_id))
    run = runs[run_id]
    where = (
        f"{json.dumps(run)}\nsignals {signals}\nduring pause {during_pause}\n{context()}\n"
        f"--- ticker B ---\n{ticker_b.log()[-1500:]}"
    )
    print(
        f"stages while ticker A was frozen: {during_pause}; froze at "
        f"{paused_at - started:.1f} s, resumed at {resumed:.1f} s, settled at {settled:.1f} s"
    )
    assert_runs_completed(runs, where)
    assert_outcomes_once(runs, where)
    assert_outbox_gap_free(runs, where)
    assert signals == {
        "rows": [
            {
                "name": "approved",
                "payload": PAYLOAD,
                "key": "mail-1",
                "actor": "user:alice",
                "consumed": True,
                "stage": "approved",
                "generation": 0,
            }
        ],
        "received": 1,
    }, where
    assert run["outputs"]["approved"] == PAYLOAD, where
    assert run["outputs"]["book"] == PAYLOAD and run["output"] == PAYLOAD, where
    assert not [e for e in run["events"] if e[1] in ("stage:failed", "workflow:failed")], where
    assert all(job[1] == "COMPLETED" for job in run["jobs"]), where
