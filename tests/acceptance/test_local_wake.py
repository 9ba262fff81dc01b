"""An idle worker process wakes itself on its own host (issue 19), PostgreSQL with NOTIFY.

With ``WAKE_WITH_NOTIFY`` a commit that makes work sends a ``NOTIFY``; the listener thread of
an idle worker process puts one ``work`` task straight into its own cluster's task queue
(``transport.django_q._wake_locally``) instead of a broker row another host's pusher could
take. Here the cluster's broker poll is 30 s, so a wake-up through the broker would wait for
it: every run still completes within seconds, and django-q2's ``OrmQ`` table never got a row.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.markers import ON_POSTGRES

from .harness import (
    Cluster,
    assert_runs_completed,
    create_runs,
    settle_runs,
    shell_json,
    wait_for,
)

pytestmark = [
    pytest.mark.acceptance,
    pytest.mark.skipif(not ON_POSTGRES, reason="NOTIFY wake-ups are PostgreSQL's"),
]

LOCAL_ENV = {
    "EXTRA_INSTALLED_APPS": "tests.acceptance.crashapp",
    "WORKFLOWS_WAKE_WITH_NOTIFY": "1",
    # A broker wake-up would wait up to 30 s for the pusher's next poll.
    "Q_POLL": "30",
    "Q_WORKERS": "2",
}

LIVE_QUEUES = """
import json
from django_workflows.kernel import routing
print(json.dumps(sorted(routing.live_queues())))
"""

#: Rows ever inserted into django-q2's ORM broker table, once every backend of the database
#: has exited (PostgreSQL flushes a backend's table counters when it exits).
BROKER_INSERTS = """
import json, time
from django.db import connection
with connection.cursor() as cursor:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        cursor.execute(
            "SELECT count(*) FROM pg_stat_activity"
            " WHERE datname = current_database() AND pid <> pg_backend_pid()"
        )
        if cursor.fetchone()[0] == 0:
            break
        time.sleep(0.1)
    cursor.execute("SELECT pg_stat_clear_snapshot()")
    cursor.execute("SELECT n_tup_ins FROM pg_stat_user_tables WHERE relname = 'django_q_ormq'")
    print(json.dumps(cursor.fetchone()[0]))
"""


def test_idle_workers_wake_through_their_own_task_queue(
    project: Callable[..., dict[str, str]], clusters: Callable[..., Cluster], tmp_path: Path
) -> None:
    crash_dir = tmp_path / "crash"
    crash_dir.mkdir()
    env = project(**LOCAL_ENV, CRASH_DIR=str(crash_dir))
    cluster = clusters(env)
    wait_for(lambda: shell_json(env, LIVE_QUEUES) == ["default"], timeout=60, interval=0.3)
    # The cluster is idle: no work task runs (a listener that connects with nothing waiting
    # wakes nobody), so this run's first wake-up is an idle process's.
    started = time.monotonic()
    [run_id] = create_runs(env, "fault-pipeline", [{"n": 0}])
    runs = settle_runs(env, [run_id], timeout=20)
    seconds = time.monotonic() - started
    assert_runs_completed(runs, cluster.log()[-3000:])
    cluster.stop()
    assert shell_json(env, BROKER_INSERTS) == 0, (seconds, cluster.log()[-3000:])
