"""Stage routing through real django-q2 clusters on one host (issue 8 item 5, scenario (h)),
with the ORM broker and with the Redis broker.

``routed-pipeline`` (``tests/acceptance/crashapp/routing.py``): prep -> embed (queue ``gpu``)
-> report. With only the default cluster running, the runs stop at ``embed`` and
``workflows_status`` says "waiting for a gpu worker"; once a ``gpu`` cluster
(``Q_CLUSTER_NAME=gpu qcluster``) starts, ``embed`` runs there and only there, and the runs
complete. The example pipeline also runs through a real cluster on the Redis broker (the ORM
broker's run is ``test_example_pipeline.py``).

Redis: db 7 of 127.0.0.1:6379 (``ROUTING_REDIS_URL``), flushed before and after each test;
the Redis cases skip with a reason when it is not reachable.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from .harness import (
    Cluster,
    assert_outbox_gap_free,
    assert_outcomes_once,
    assert_runs_completed,
    create_runs,
    executions,
    manage,
    settle_runs,
    shell_json,
    wait_for,
)

pytestmark = [pytest.mark.acceptance]

REDIS_URL = os.environ.get("ROUTING_REDIS_URL", "redis://127.0.0.1:6379/7")

ROUTING_ENV = {
    "EXTRA_INSTALLED_APPS": "tests.acceptance.crashapp",
    "WORKFLOWS_QUEUES": "gpu=gpu",
    "WORKFLOWS_STALE_LEASE_SECONDS": "10",
    "WORKFLOWS_HEARTBEAT_SECONDS": "1",
    "WORKFLOWS_TICK_INTERVAL": "0.2",
    "Q_WORKERS": "2",
}

RUNS = 6


def _redis_or_skip() -> Any:
    try:
        import redis
    except ImportError:
        pytest.skip("the redis package is not installed (pip install -e '.[redis]')")
    client = redis.from_url(REDIS_URL, socket_connect_timeout=2)
    try:
        client.ping()
    except redis.RedisError as exc:
        pytest.skip(f"Redis is not reachable at {REDIS_URL}: {exc}")
    return client


@pytest.fixture(params=["orm", "redis"])
def broker(request: pytest.FixtureRequest) -> Iterator[dict[str, str]]:
    """The broker's environment variables; the Redis db is flushed around the test."""
    if request.param == "orm":
        yield {"Q_BROKER": "orm"}
        return
    client = _redis_or_skip()
    client.flushdb()
    try:
        yield {"Q_BROKER": "redis", "REDIS_URL": REDIS_URL}
    finally:
        client.flushdb()


STAGE_STATES = """
import json
from django_workflows.models import WorkflowJob
ids = {run_ids!r}
print(json.dumps(sorted(
    [str(j.workflow_run_id), j.stage_id, j.status, j.queue]
    for j in WorkflowJob.objects.filter(workflow_run_id__in=ids)
)))
"""

LIVE_QUEUES = """
import json
from django_workflows.kernel import routing
print(json.dumps(sorted(routing.live_queues())))
"""


GPU_QUEUED = """
import json
from django_q.brokers import get_broker
print(json.dumps(get_broker("gpu").queue_size()))
"""


def _jobs(env: dict[str, str], run_ids: list[str]) -> list[list[str]]:
    return shell_json(env, STAGE_STATES.format(run_ids=run_ids))


def _status(env: dict[str, str], run_id: str) -> str:
    done = manage(env, "workflows_status", run_id)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_a_gpu_stage_waits_for_a_gpu_cluster_then_runs_only_there(
    project: Callable[..., dict[str, str]],
    clusters: Callable[..., Cluster],
    broker: dict[str, str],
    tmp_path: Path,
) -> None:
    crash_dir = tmp_path / "crash"
    crash_dir.mkdir()
    env = project(**ROUTING_ENV, **broker, CRASH_DIR=str(crash_dir))
    checks = manage(env, "check")
    assert "W010" not in checks.stderr + checks.stdout  # gpu is mapped
    assert "W011" not in checks.stderr + checks.stdout  # and its cluster defined
    default = clusters(env, log="default.log")
    # Idle workers announce their queues (the post_spawn presence timer; no task ran yet).
    wait_for(lambda: shell_json(env, LIVE_QUEUES) == ["default"], timeout=60, interval=0.3)
    run_ids = create_runs(env, "routed-pipeline", [{"n": i} for i in range(RUNS)])

    # Only the default cluster: every run stops at embed, its gpu job PENDING.
    def stopped_at_gpu() -> bool:
        jobs = _jobs(env, run_ids)
        embeds = [j for j in jobs if j[1] == "embed"]
        return len(embeds) == RUNS and all(j[2] == "PENDING" and j[3] == "gpu" for j in embeds)

    wait_for(stopped_at_gpu, timeout=60, interval=0.3)
    # The gpu wake-ups wait in the gpu cluster's broker queue (ORM list_key / Redis list),
    # capped at max_pending_wakeups although every commit and tick asked for more. With NOTIFY
    # wake-ups (issue 19) the commits' wake-ups are NOTIFYs nobody hears for "gpu" yet, but
    # the tick's re-wakes of jobs ready past WAKE_AFTER_SECONDS still go through the broker.
    queued = wait_for(lambda: shell_json(env, GPU_QUEUED), timeout=30, interval=0.3)
    assert 1 <= queued <= 8, queued
    assert "default" in shell_json(env, LIVE_QUEUES)  # the default workers are alive...
    status = _status(env, run_ids[0])
    assert "waiting:   waiting for a gpu worker" in status, status
    # ...and still running default work: a later run's prep completes, no embed ran.
    later = create_runs(env, "routed-pipeline", [{"n": 99}])
    wait_for(lambda: any(j[1] == "embed" for j in _jobs(env, later)), timeout=60, interval=0.3)
    assert not [e for e in executions(crash_dir) if e["stage"] == "embed"]
    run_ids += later

    gpu = clusters({**env, "Q_CLUSTER_NAME": "gpu"}, log="gpu.log")
    started = time.monotonic()
    runs = settle_runs(env, run_ids, timeout=90)
    settled_s = time.monotonic() - started
    context = f"default log:\n{default.log()[-3000:]}\ngpu log:\n{gpu.log()[-3000:]}"
    assert_runs_completed(runs, context)
    assert_outcomes_once(runs, context)
    assert_outbox_gap_free(runs, context)

    recorded = executions(crash_dir)
    by_stage: dict[str, set[str]] = {}
    for item in recorded:
        by_stage.setdefault(item["stage"], set()).add(item["cluster"])
    assert by_stage == {"prep": {"workflows"}, "embed": {"gpu"}, "report": {"workflows"}}
    pids = {s: {e["pid"] for e in recorded if e["stage"] == s} for s in by_stage}
    assert not pids["embed"] & (pids["prep"] | pids["report"])
    counts: dict[tuple[str, str], int] = {}
    for item in recorded:
        key = (item["run"], item["stage"])
        counts[key] = counts.get(key, 0) + 1
    assert len(counts) == 3 * len(run_ids) and set(counts.values()) == {1}  # each ran once
    for run in runs.values():
        assert run["output"]["clusters"] == ["workflows", "gpu", "workflows"]
    assert "waiting for a" not in _status(env, run_ids[0])
    print(
        f"\n[routing {broker['Q_BROKER']}] {len(run_ids)} runs settled {settled_s:.1f} s "
        "after the gpu cluster started"
    )


def test_example_pipeline_completes_on_the_redis_broker(
    project: Callable[..., dict[str, str]], clusters: Callable[..., Cluster]
) -> None:
    client = _redis_or_skip()
    client.flushdb()
    try:
        env = project(Q_BROKER="redis", REDIS_URL=REDIS_URL)
        running = clusters(env)
        started = time.monotonic()
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
        elapsed = time.monotonic() - started
        assert done.returncode == 0, f"{done.stdout}\n{done.stderr}\n{running.log()[-3000:]}"
        assert "COMPLETED in" in done.stdout
        # The wake-ups really went through Redis: django-q2 kept its cluster stats there and
        # no task ever sat in the ORM broker's table.
        orm_queued = shell_json(
            env,
            "import json\nfrom django_q.models import OrmQ\n"
            "print(json.dumps(OrmQ.objects.count()))",
        )
        assert orm_queued == 0
        assert client.keys("django_q:workflows:*"), "no django-q2 keys in the Redis db"
        state = json.loads(
            manage(
                env,
                "shell",
                "-v0",
                "-c",
                "import json\nfrom django_workflows.models import WorkflowRun\n"
                "print(json.dumps([r.status for r in WorkflowRun.objects.all()]))",
            ).stdout
        )
        assert state == ["COMPLETED"]
        print(f"\n[redis] package-report completed in {elapsed:.1f} s (workflows_run --wait)")
    finally:
        client.flushdb()
