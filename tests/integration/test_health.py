"""Health (issue 20 items 2 and 4): the state snapshot, each check failing and passing,
``workflows_health``'s output and exit codes, the liveness / readiness / metrics views and
the Prometheus text they serve (parsed here by a small parser of the 0.0.4 format).

Rows are written directly (jobs, presence, leases, outbox events) with times relative to the
database's clock, which the snapshot judges them by.
"""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
import time
import uuid
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import OperationalError, connections
from django.test import Client
from django.urls import reverse

from django_workflows.definition.registry import WorkflowRegistry
from django_workflows.health import state as state_module
from django_workflows.health.checks import evaluate
from django_workflows.health.prometheus import escape_label
from django_workflows.health.state import deploy_version, snapshot
from django_workflows.kernel.versions import deploy_lease_name
from django_workflows.models import (
    MaintenanceLease,
    OutboxEvent,
    Status,
    WorkflowJob,
    WorkflowRun,
    WorkflowSchedule,
    WorkflowStage,
    WorkflowWorkerVersions,
)
from tests.markers import ON_POSTGRES
from tests.workflows import two_stage

pytestmark = pytest.mark.django_db

ROOT = Path(__file__).resolve().parents[2]


def db_now() -> datetime:
    """The database's clock (the lease clock the snapshot judges by)."""
    from django.utils import timezone

    from django_workflows.kernel.runtime import get_kernel

    clock = get_kernel().lease_clock
    return clock.read() if clock.uses_database else timezone.now()


def run(
    status: str = Status.RUNNING, workflow: str = "wf", age: float = 0.0, **fields: Any
) -> WorkflowRun:
    now = db_now()
    return WorkflowRun.objects.create(
        created_at=now - timedelta(seconds=age),
        updated_at=now,
        workflow_id=workflow,
        workflow_name=workflow,
        workflow_type="t",
        status=status,
        **fields,
    )


def job(
    queue: str = "default", status: str = Status.PENDING, age: float = 0.0, **fields: Any
) -> WorkflowJob:
    now = db_now()
    return WorkflowJob.objects.create(
        created_at=now - timedelta(seconds=age),
        updated_at=now,
        workflow_run_id=uuid.uuid4(),
        workflow_id="wf",
        stage_id="s",
        status=status,
        queue=queue,
        run_created_at=now,
        **fields,
    )


def worker(
    worker_id: str,
    queues: list[str],
    versions: dict[str, list[str]] | None = None,
    ttl: float = 60.0,
) -> None:
    from django_workflows.kernel.routing import _presence_name

    expires = db_now() + timedelta(seconds=ttl)
    for queue in queues:
        MaintenanceLease.objects.create(
            name=_presence_name(queue, worker_id), owner=worker_id, expires_at=expires
        )
    if versions is not None:
        WorkflowWorkerVersions.objects.create(
            worker_id=worker_id, versions=versions, expires_at=expires
        )


def ticker(owner: str, ttl: float = 10.0, name: str = "ticker") -> None:
    MaintenanceLease.objects.create(
        name=name, owner=owner, expires_at=db_now() + timedelta(seconds=ttl)
    )


def event(
    age: float = 0.0, run_id: uuid.UUID | None = None, seq: int = 1, **fields: Any
) -> OutboxEvent:
    now = db_now()
    return OutboxEvent.objects.create(
        created_at=now - timedelta(seconds=age),
        workflow_run_id=run_id or uuid.uuid4(),
        sequence=seq,
        event_type="workflow:created",
        payload={},
        causation_id="c",
        occurred_at=now,
        **fields,
    )


def healthy_cluster() -> None:
    """A live default worker holding the ticker lease, nothing else."""
    worker("worker-a", ["default"], {"wf": ["1"]})
    ticker("worker-a-ticker")


def checks_by_name(report: Any) -> dict[str, Any]:
    return {c.name: c for c in report.checks}


# --- the snapshot -------------------------------------------------------------------------


def test_snapshot_counts_jobs_workers_outbox_and_runs() -> None:
    run(Status.RUNNING)
    run(Status.PENDING)
    run(Status.COMPLETED, completed_at=db_now())
    job("default", age=30)
    job("default", age=5)
    job("default", Status.RUNNING)
    job("gpu", Status.PENDING, age=100, next_poll_at=db_now() + timedelta(hours=1))  # back-off
    job("gpu", Status.PENDING, age=300, next_poll_at=db_now() - timedelta(seconds=20))
    job("default", Status.COMPLETED, age=999)
    worker("worker-a", ["default", "gpu"], {"wf": ["1"]})
    worker("worker-b", ["default"], {"wf": ["1"]})
    worker("worker-c", ["gpu"], {"wf": ["2"]})
    worker("worker-gone", ["gpu"], {"wf": ["2"]}, ttl=-5)
    event(age=40)
    event(age=400, published_at=db_now())  # published: not undelivered

    snap = snapshot()
    assert snap.database_ok
    queues = {q.queue: q for q in snap.queues}
    assert (queues["default"].ready, queues["default"].running) == (2, 1)
    assert 29 <= queues["default"].oldest_ready_age_seconds < 40
    # The back-off job is not ready; the one whose back-off ended 20 s ago is ready since then.
    assert queues["gpu"].ready == 1
    assert 19 <= queues["gpu"].oldest_ready_age_seconds < 30
    v1, v2 = deploy_version({"wf": ["1"]}), deploy_version({"wf": ["2"]})
    assert sorted((w.queue, w.version, w.count) for w in snap.workers) == sorted(
        [("default", v1, 2), ("gpu", v1, 1), ("gpu", v2, 1)]
    )
    assert snap.workers_for("gpu") == 2
    assert snap.runs_by_status == {"PENDING": 1, "RUNNING": 1}
    assert snap.outbox_undelivered == 1
    assert 39 <= snap.outbox_lag_seconds < 50
    assert snap.dead_letters == 0
    assert snap.schedule_lag_seconds is None
    assert [(f.workflow_id, f.status, f.count) for f in snap.finished_recently] == [
        ("wf", "COMPLETED", 1)
    ]


def test_deploy_version_is_the_ticker_lease_digest() -> None:
    registry = WorkflowRegistry()
    registry.register(two_stage())
    from django_workflows.kernel.versions import runnable_map

    name = deploy_lease_name("ticker", registry)
    assert name == f"ticker@{deploy_version(runnable_map(registry))}"
    assert deploy_version({}) == "" and deploy_version(None) == ""


def test_schedule_lag_counts_the_most_overdue_unpaused_schedule() -> None:
    now = db_now()

    def schedule(name: str, fire: datetime, paused: bool = False) -> None:
        WorkflowSchedule.objects.create(
            name=name,
            created_at=now,
            updated_at=now,
            workflow_id="wf",
            every_seconds=60,
            anchor=now,
            next_fire_at=fire,
            next_scheduled_at=fire,
            paused=paused,
        )

    schedule("later", now + timedelta(minutes=5))
    assert snapshot().schedule_lag_seconds == 0.0
    schedule("late", now - timedelta(seconds=90))
    schedule("paused", now - timedelta(hours=3), paused=True)
    lag = snapshot().schedule_lag_seconds
    assert lag is not None and 89 <= lag < 100


def test_a_database_error_gives_a_snapshot_that_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(clock: Any) -> Any:
        raise OperationalError("connection refused")

    monkeypatch.setattr(state_module, "_read", boom)
    snap = snapshot()
    assert not snap.database_ok and snap.database_error == "OperationalError"
    report = evaluate(snap)
    assert report.failing == ["database"]


def test_cached_snapshot_is_reused_while_young(django_assert_num_queries: Any) -> None:
    from django_workflows.health.state import cached_snapshot, forget_cached_snapshot

    forget_cached_snapshot()
    first = cached_snapshot(max_age_seconds=60)
    with django_assert_num_queries(0):
        assert cached_snapshot(max_age_seconds=60) is first
    assert cached_snapshot(max_age_seconds=0) is not first
    forget_cached_snapshot()


# --- the checks ---------------------------------------------------------------------------


def test_a_healthy_cluster_passes_every_check() -> None:
    healthy_cluster()
    run(Status.RUNNING)
    report = evaluate(snapshot())
    assert report.healthy, report.to_dict()
    assert list(checks_by_name(report)) == [
        "database",
        "ticker",
        "workers:default",
        "outbox",
        "dead_letters",
    ]
    assert checks_by_name(report)["ticker"].value == "worker-a-ticker"


def test_ticker_check_fails_with_live_runs_and_an_expired_lease() -> None:
    worker("worker-a", ["default"], {"wf": ["1"]})
    ticker("worker-a-ticker", ttl=-60)  # expired a minute ago
    assert checks_by_name(evaluate(snapshot()))["ticker"].ok  # no live run: not needed
    run(Status.PENDING, age=120)
    snap = snapshot()
    assert not snap.ticker_live and 59 <= snap.ticker_missing_seconds < 70
    check = checks_by_name(evaluate(snap))["ticker"]
    assert not check.ok and "no live worker holds the ticker lease" in check.detail
    assert check.threshold == 26.0  # 2 x (TICKER_LEASE_SECONDS 10 + SUPERVISOR_INTERVAL 3)
    # Lapsed only 5 s ago: a takeover is due, not a failure yet.
    MaintenanceLease.objects.filter(name="ticker").update(
        expires_at=db_now() - timedelta(seconds=5)
    )
    check = checks_by_name(evaluate(snapshot()))["ticker"]
    assert check.ok and check.detail.startswith("starting")


def test_ticker_check_gives_a_new_run_time_for_a_ticker_to_start() -> None:
    healthy_cluster()
    MaintenanceLease.objects.filter(name="ticker").delete()  # released: the cluster was idle
    run(Status.PENDING)  # created just now
    assert checks_by_name(evaluate(snapshot()))["ticker"].ok
    WorkflowRun.objects.update(created_at=db_now() - timedelta(seconds=300))
    snap = snapshot()
    assert 299 <= snap.ticker_missing_seconds < 310
    assert not checks_by_name(evaluate(snap))["ticker"].ok


def test_ticker_check_fails_when_the_holders_process_is_gone() -> None:
    run(Status.RUNNING, age=600)
    # The lease is unexpired, but the process's advertised versions expired.
    worker("worker-a", [], {"wf": ["1"]}, ttl=-120)
    ticker("worker-a-ticker@x", name="ticker@abc")
    snap = snapshot()
    assert snap.ticker_holder == "worker-a-ticker@x" and snap.ticker_live  # no versions row
    MaintenanceLease.objects.filter(name="ticker@abc").update(owner="worker-a-ticker")
    snap = snapshot()
    assert snap.ticker_holder == "worker-a-ticker" and not snap.ticker_live
    assert 119 <= snap.ticker_missing_seconds < 130
    check = checks_by_name(evaluate(snap))["ticker"]
    assert not check.ok and "whose worker process is gone" in check.detail


def test_ticker_check_passes_when_supervisor_ticks_are_off(settings: Any) -> None:
    run(Status.RUNNING)
    settings.DJANGO_WORKFLOWS = {**settings.DJANGO_WORKFLOWS, "SUPERVISOR_TICKS": False}
    assert checks_by_name(evaluate(snapshot()))["ticker"].ok


def test_workers_check_fails_for_a_queue_without_a_live_worker(settings: Any) -> None:
    settings.DJANGO_WORKFLOWS = {**settings.DJANGO_WORKFLOWS, "QUEUES": {"gpu": "gpu"}}
    healthy_cluster()
    snap = snapshot()
    assert [(q.queue, q.ready, q.oldest_ready_age_seconds) for q in snap.queues] == [
        ("default", 0, None),
        ("gpu", 0, None),  # a configured queue is reported with nothing in it
    ]
    report = evaluate(snap)
    assert report.failing == ["workers:gpu"]
    assert checks_by_name(report)["workers:gpu"].detail == "no live worker serves queue 'gpu'"
    worker("worker-g", ["gpu"], {"wf": ["1"]})
    assert evaluate(snapshot()).healthy
    # Only the queues asked for.
    assert [c.name for c in evaluate(snapshot(), queues=["ocr"]).checks if "workers" in c.name] == [
        "workers:ocr"
    ]


def test_outbox_check_fails_past_the_lag_threshold() -> None:
    healthy_cluster()
    event(age=120)
    assert checks_by_name(evaluate(snapshot()))["outbox"].ok  # default bound 300 s
    report = evaluate(snapshot(), max_outbox_lag_seconds=60)
    assert report.failing == ["outbox"]
    assert checks_by_name(report)["outbox"].threshold == 60
    assert evaluate(snapshot(), max_outbox_lag_seconds=None).healthy


def test_dead_letters_fail_the_check_and_hold_back_their_runs_events() -> None:
    healthy_cluster()
    blocked_run = uuid.uuid4()
    event(age=5000, run_id=blocked_run, seq=1, dlq_at=db_now())
    event(age=4000, run_id=blocked_run, seq=2)  # behind the dead letter
    event(age=10)
    snap = snapshot()
    assert (snap.dead_letters, snap.outbox_undelivered, snap.outbox_blocked) == (1, 2, 1)
    # The lag is the deliverable backlog's: the blocked event waits for an operator.
    assert snap.outbox_lag_seconds is not None and snap.outbox_lag_seconds < 60
    report = evaluate(snap)
    assert report.failing == ["dead_letters"]
    assert evaluate(snap, max_dead_letters=1).healthy
    # A skipped dead letter (published_at set) no longer counts.
    OutboxEvent.objects.filter(dlq_at__isnull=False).update(
        published_at=db_now(), skipped_at=db_now()
    )
    assert snapshot().dead_letters == 0


# --- the command --------------------------------------------------------------------------


def test_command_healthy_exit_0_human_and_json() -> None:
    healthy_cluster()
    out = io.StringIO()
    call_command("workflows_health", stdout=out)
    lines = out.getvalue().splitlines()
    assert lines[-1] == "healthy"
    assert re.match(r"ok\s+database\s+reachable", lines[0])
    out = io.StringIO()
    call_command("workflows_health", "--json", stdout=out)
    doc = json.loads(out.getvalue())
    assert doc["status"] == "healthy" and doc["failing"] == []
    assert {c["name"] for c in doc["checks"]} >= {"database", "ticker", "workers:default"}


def test_command_unhealthy_exit_1_names_the_checks() -> None:
    healthy_cluster()
    event(age=100)
    out = io.StringIO()
    with pytest.raises(CommandError) as caught:
        call_command(
            "workflows_health",
            "--max-outbox-lag-seconds",
            "50",
            "--queue",
            "gpu",
            "--queue",
            "default",
            stdout=out,
        )
    assert caught.value.returncode == 1
    assert str(caught.value) == "unhealthy: workers:gpu, outbox"
    assert "FAIL  workers:gpu" in out.getvalue()
    out = io.StringIO()
    with pytest.raises(CommandError):
        call_command(
            "workflows_health",
            "--json",
            "--max-dead-letters",
            "0",
            "--max-outbox-lag-seconds",
            "1",
            stdout=out,
        )
    assert json.loads(out.getvalue())["failing"] == ["outbox"]


def test_command_liveness_reads_nothing(django_assert_num_queries: Any) -> None:
    out = io.StringIO()
    with django_assert_num_queries(0):
        call_command("workflows_health", "--liveness", "--json", stdout=out)
    assert json.loads(out.getvalue()) == {"status": "live"}


@pytest.mark.parametrize(
    "args",
    [["--max-dead-letters", "-1"], ["--max-outbox-lag-seconds", "soon"], ["--bogus"]],
)
def test_command_bad_usage_exits_2(args: list[str]) -> None:
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "example_project.settings"}
    done = subprocess.run(
        [sys.executable, "manage.py", "workflows_health", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr and "error:" in done.stderr


# --- the views ----------------------------------------------------------------------------


def test_liveness_needs_no_database(client: Client, django_assert_num_queries: Any) -> None:
    with django_assert_num_queries(0):
        response = client.get(reverse("workflows-health:live"))
    assert response.status_code == 200 and response.json() == {"status": "live"}


def test_readiness_200_when_healthy_and_503_naming_failing_checks(
    client: Client, settings: Any
) -> None:
    healthy_cluster()
    response = client.get(reverse("workflows-health:ready"))
    assert response.status_code == 200
    body = response.json()
    assert body["status"] == "healthy"
    # Anonymous: names and ok only.
    assert all(set(c) == {"name", "ok"} for c in body["checks"])
    settings.DJANGO_WORKFLOWS = {**settings.DJANGO_WORKFLOWS, "QUEUES": {"gpu": "gpu"}}
    response = client.get(reverse("workflows-health:ready"))
    assert response.status_code == 503
    assert response.json()["failing"] == ["workers:gpu"]
    # ?queue= narrows the queues that need a worker.
    assert client.get(reverse("workflows-health:ready") + "?queue=default").status_code == 200


def test_readiness_details_need_the_token(client: Client, settings: Any) -> None:
    settings.DJANGO_WORKFLOWS = {**settings.DJANGO_WORKFLOWS, "HEALTH_TOKEN": "s3cret"}
    healthy_cluster()
    url = reverse("workflows-health:ready")
    anonymous = client.get(url).json()
    assert "taken_at" not in anonymous
    wrong = client.get(url, HTTP_AUTHORIZATION="Bearer nope").json()
    assert "taken_at" not in wrong
    detailed = client.get(url, HTTP_AUTHORIZATION="Bearer s3cret").json()
    assert "taken_at" in detailed
    assert {"name", "ok", "value", "threshold", "detail"} <= set(detailed["checks"][0])


def test_readiness_503_without_a_trace_when_the_database_fails(
    client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    def boom(clock: Any) -> Any:
        raise OperationalError("server closed the connection unexpectedly")

    monkeypatch.setattr(state_module, "_read", boom)
    response = client.get(reverse("workflows-health:ready"))
    assert response.status_code == 503
    assert response.json() == {
        "status": "unhealthy",
        "failing": ["database"],
        "checks": [{"name": "database", "ok": False}],
    }
    assert b"Traceback" not in response.content and b"server closed" not in response.content


@pytest.mark.skipif(not ON_POSTGRES, reason="a PostgreSQL port to refuse")
def test_readiness_503_quickly_when_postgresql_is_unreachable(client: Client) -> None:
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        closed_port = s.getsockname()[1]
    settings_dict = connections["default"].settings_dict
    port = settings_dict["PORT"]
    settings_dict["PORT"] = str(closed_port)  # only the probe's fresh connection reads it
    try:
        started = time.monotonic()
        response = client.get(reverse("workflows-health:ready"))
        elapsed = time.monotonic() - started
        scrape = client.get(reverse("workflows-health:metrics"))
    finally:
        settings_dict["PORT"] = port
    assert scrape.status_code == 200  # Prometheus keeps only a 2xx scrape's samples
    assert parse_exposition(scrape.content.decode())["workflows_up"]["samples"][()] == 0
    assert response.status_code == 503
    assert response.json()["failing"] == ["database"]
    assert elapsed < 3.0


def test_readiness_never_shows_an_unexpected_error(
    client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    from django_workflows.health import views

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("bug with secrets")

    monkeypatch.setattr(views, "evaluate", broken)
    response = client.get(reverse("workflows-health:ready"))
    assert response.status_code == 503
    assert response.json()["failing"] == ["error"]
    assert b"secrets" not in response.content


# --- the metrics --------------------------------------------------------------------------

_SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>.*)\})? (?P<value>\S+)$")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"(?:,|$)')


def parse_exposition(text: str) -> dict[str, dict[str, Any]]:
    """A strict little parser of the 0.0.4 text format: ``{family: {"type", "help",
    "samples": {labels tuple: value}}}``; raises AssertionError on any malformed line, a
    sample before its family's TYPE, or a family declared twice."""
    assert text.endswith("\n")
    families: dict[str, dict[str, Any]] = {}
    current: str | None = None
    for line in text.splitlines():
        if line.startswith("# HELP "):
            name, _, help_text = line[7:].partition(" ")
            assert name not in families, f"family {name} twice"
            families[name] = {"help": help_text, "type": None, "samples": {}}
            current = name
        elif line.startswith("# TYPE "):
            name, _, kind = line[7:].partition(" ")
            assert name == current and kind in {
                "gauge",
                "counter",
                "histogram",
                "summary",
                "untyped",
            }
            families[name]["type"] = kind
        else:
            m = _SAMPLE.match(line)
            assert m, f"bad line {line!r}"
            assert m["name"] == current and families[current]["type"], line
            labels_text = m["labels"] or ""
            labels = tuple(
                (k, v.encode().decode("unicode_escape")) for k, v in _LABEL.findall(labels_text)
            )
            assert (
                "".join(f'{k}="{escape_label(v)}",' for k, v in labels).rstrip(",") == labels_text
            ), line
            value = float(m["value"])
            families[current]["samples"][labels] = value
    return families


def test_metrics_text_parses_and_carries_the_snapshot(client: Client) -> None:
    healthy_cluster()
    worker('worker-"odd"\\', ["gpu"], {"wf": ["2"]})
    run(Status.RUNNING)
    run(Status.FAILED, workflow="flaky", completed_at=db_now())
    job("default", age=12)
    job("gpu", Status.RUNNING)
    event(age=7)
    event(age=70, seq=3, dlq_at=db_now())
    response = client.get(reverse("workflows-health:metrics"))
    assert response.status_code == 200
    assert response["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"
    families = parse_exposition(response.content.decode())
    assert all(f["type"] == "gauge" for f in families.values())

    def value(name: str, **labels: str) -> float:
        return families[name]["samples"][tuple(labels.items())]

    assert value("workflows_up") == 1
    assert value("workflows_queue_ready_jobs", queue="default") == 1
    assert value("workflows_queue_running_jobs", queue="gpu") == 1
    assert 11 <= value("workflows_queue_oldest_ready_age_seconds", queue="default") < 30
    v1 = deploy_version({"wf": ["1"]})
    assert value("workflows_workers", queue="default", version=v1) == 1
    assert value("workflows_outbox_undelivered") == 1
    assert value("workflows_dead_letters") == 1
    assert 6 <= value("workflows_outbox_lag_seconds") < 30
    assert value("workflows_ticker_live", holder="worker-a-ticker") == 1
    assert value("workflows_runs", status="RUNNING") == 1
    assert value("workflows_runs_finished_window", workflow_id="flaky", status="FAILED") == 1
    # One label name for a workflow across every family of the exposition.
    names = {k for fam in families.values() for labels in fam["samples"] for k, _ in labels}
    assert "workflow_id" in names and "workflow" not in names
    assert "workflows_schedule_lag_seconds" in families  # declared, no sample
    assert families["workflows_schedule_lag_seconds"]["samples"] == {}


def test_metrics_token(client: Client, settings: Any) -> None:
    settings.DJANGO_WORKFLOWS = {**settings.DJANGO_WORKFLOWS, "HEALTH_TOKEN": "s3cret"}
    url = reverse("workflows-health:metrics")
    response = client.get(url)
    assert response.status_code == 401 and response["WWW-Authenticate"].startswith("Bearer")
    assert client.get(url, HTTP_AUTHORIZATION="Bearer s3cret").status_code == 200


def test_metrics_say_workflows_up_0_with_200_when_the_database_fails(
    client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Prometheus drops the body of a non-2xx scrape: the sample an alert needs comes with 200."""

    def boom(clock: Any) -> Any:
        raise OperationalError("down")

    monkeypatch.setattr(state_module, "_read", boom)
    response = client.get(reverse("workflows-health:metrics"))
    assert response.status_code == 200
    families = parse_exposition(response.content.decode())
    assert families["workflows_up"]["samples"][()] == 0


def test_a_non_ascii_token_is_refused_not_a_500(client: Client, settings: Any) -> None:
    settings.DJANGO_WORKFLOWS = {**settings.DJANGO_WORKFLOWS, "HEALTH_TOKEN": "s3cret"}
    for name in ("metrics", "ready"):
        url = reverse(f"workflows-health:{name}")
        response = client.get(url, HTTP_AUTHORIZATION="Bearer s3crét")
        assert response.status_code in (401, 200, 503), name  # refused or numbers hidden
        assert response.status_code != 500
    assert (
        client.get(
            reverse("workflows-health:metrics"), HTTP_AUTHORIZATION="Bearer s3crét"
        ).status_code
        == 401
    )


def test_views_accept_get_only(client: Client) -> None:
    assert client.post(reverse("workflows-health:ready")).status_code == 405


@pytest.mark.skipif(not ON_POSTGRES, reason="statement_timeout is PostgreSQL's")
def test_statement_timeout_bounds_the_reads_and_is_put_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def show() -> str:
        with connections["default"].cursor() as cursor:
            cursor.execute("SHOW statement_timeout")
            return cursor.fetchone()[0]

    before = show()
    assert snapshot(statement_timeout_ms=1500).database_ok
    assert show() == before

    real_read = state_module._read

    def slow(clock: Any) -> Any:
        with connections["default"].cursor() as cursor:
            cursor.execute("SELECT pg_sleep(2)")
        return real_read(clock)

    monkeypatch.setattr(state_module, "_read", slow)
    started = time.monotonic()
    snap = snapshot(statement_timeout_ms=100)
    assert not snap.database_ok and snap.database_error == "timeout" and snap.timed_out
    assert time.monotonic() - started < 1.5
    assert show() == before


def test_system_check_e040_names_bad_health_settings(settings: Any) -> None:
    from django_workflows.checks import check_health_settings

    assert check_health_settings() == []
    settings.DJANGO_WORKFLOWS = {
        **settings.DJANGO_WORKFLOWS,
        "HEALTH_MAX_OUTBOX_LAG_SECONDS": "5 minutes",
        "HEALTH_MAX_DEAD_LETTERS": -1,
        "HEALTH_DB_TIMEOUT_SECONDS": 0,
        "HEALTH_TIMEOUT_SECONDS": float("inf"),
        "HEALTH_TOKEN": "",
    }
    messages = check_health_settings()
    assert {m.id for m in messages} == {"django_workflows.E040"}
    assert [m.msg.split("'")[1] for m in messages] == [
        "HEALTH_MAX_OUTBOX_LAG_SECONDS",
        "HEALTH_MAX_DEAD_LETTERS",
        "HEALTH_DB_TIMEOUT_SECONDS",
        "HEALTH_TIMEOUT_SECONDS",
        "HEALTH_TOKEN",
    ]


def test_a_staff_session_sees_details_and_metrics(admin_client: Client, settings: Any) -> None:
    settings.DJANGO_WORKFLOWS = {**settings.DJANGO_WORKFLOWS, "HEALTH_TOKEN": "s3cret"}
    healthy_cluster()
    assert "taken_at" in admin_client.get(reverse("workflows-health:ready")).json()
    assert admin_client.get(reverse("workflows-health:metrics")).status_code == 200


def test_label_values_are_escaped_and_parse_back() -> None:
    from django.utils import timezone

    from django_workflows.health.prometheus import render
    from django_workflows.health.state import QueueState, StateSnapshot

    odd = 'gpu "a"\\b\nc'
    snap = StateSnapshot(
        taken_at=timezone.now(),
        database_ok=True,
        queues=[QueueState(odd, 3, 1, 2.5)],
        workers=[],
        outbox_undelivered=0,
        outbox_lag_seconds=None,
        dead_letters=0,
        schedule_lag_seconds=None,
        ticker_holder=None,
        ticker_live=False,
        runs_by_status={"PENDING": 0, "RUNNING": 0},
    )
    text = render(snap, scrape_seconds=0.001)
    assert 'queue="gpu \\"a\\"\\\\b\\nc"' in text
    families = parse_exposition(text)
    assert families["workflows_queue_ready_jobs"]["samples"] == {(("queue", odd),): 3.0}
    assert families["workflows_queue_oldest_ready_age_seconds"]["samples"][(("queue", odd),)] == 2.5


def finished_stage(parent: WorkflowRun, stage_id: str, ms: int, ago: float) -> None:
    """A stage of ``parent`` that finished ``ago`` seconds ago (database clock) after ``ms``."""
    now = db_now()
    WorkflowStage.objects.create(
        run=parent,
        created_at=now,
        updated_at=now,
        stage_id=stage_id,
        stage_name=stage_id,
        stage_number=parent.stages.count(),
        execution_group=0,
        status=Status.COMPLETED,
        completed_at=now - timedelta(seconds=ago),
        duration_ms=ms,
    )


def test_durations_of_stages_and_runs_finished_in_the_window(client: Client, settings: Any) -> None:
    settings.DJANGO_WORKFLOWS = {**settings.DJANGO_WORKFLOWS, "HEALTH_FINISHED_WINDOW_SECONDS": 60}
    odd = 'wf "x"\\y\nz'
    r1 = run(Status.COMPLETED, workflow=odd, completed_at=db_now(), duration_ms=4000)
    run(Status.FAILED, workflow=odd, completed_at=db_now() - timedelta(seconds=5), duration_ms=2000)
    run(
        Status.COMPLETED,
        workflow=odd,
        completed_at=db_now() - timedelta(seconds=600),
        duration_ms=9,
    )
    run(Status.RUNNING, workflow=odd, duration_ms=None)
    # 20 "fetch" stages of 1..20 s in the window: p50 = 10th smallest, p95 = 19th, max 20.
    runs = [run(Status.COMPLETED, workflow="other") for _ in range(20)]
    for i, parent in enumerate(runs, start=1):
        finished_stage(parent, "fetch", i * 1000, ago=i)
    finished_stage(r1, "fetch", 999_000, ago=600)  # outside the window
    finished_stage(r1, 'st"1', 250, ago=1)
    response = client.get(reverse("workflows-health:metrics"))
    families = parse_exposition(response.content.decode())
    stage = families["workflows_stage_duration_window_seconds"]
    assert stage["type"] == "gauge" and "5000 newest" in stage["help"]
    assert stage["samples"] == {
        (("workflow_id", "other"), ("stage_id", "fetch"), ("quantile", "0.5")): 10.0,
        (("workflow_id", "other"), ("stage_id", "fetch"), ("quantile", "0.95")): 19.0,
        (("workflow_id", "other"), ("stage_id", "fetch"), ("quantile", "1")): 20.0,
        (("workflow_id", odd), ("stage_id", 'st"1'), ("quantile", "0.5")): 0.25,
        (("workflow_id", odd), ("stage_id", 'st"1'), ("quantile", "0.95")): 0.25,
        (("workflow_id", odd), ("stage_id", 'st"1'), ("quantile", "1")): 0.25,
    }
    assert families["workflows_stage_duration_window_samples"]["samples"] == {
        (("workflow_id", "other"), ("stage_id", "fetch")): 20.0,
        (("workflow_id", odd), ("stage_id", 'st"1')): 1.0,
    }
    # Runs: the two of ``odd`` in the window (2 s, 4 s); the "other" runs have no duration.
    assert families["workflows_run_duration_window_seconds"]["samples"] == {
        (("workflow_id", odd), ("quantile", "0.5")): 2.0,
        (("workflow_id", odd), ("quantile", "0.95")): 4.0,
        (("workflow_id", odd), ("quantile", "1")): 4.0,
    }
    assert families["workflows_run_duration_window_samples"]["samples"] == {
        (("workflow_id", odd),): 2.0
    }
    assert families["workflows_duration_window_truncated"]["samples"] == {(): 0.0}


def test_durations_read_at_most_the_newest_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(state_module, "DURATION_SAMPLE_LIMIT", 3)
    for i in range(5):
        run(
            Status.COMPLETED,
            completed_at=db_now() - timedelta(seconds=i),
            duration_ms=(i + 1) * 1000,
        )
    snap = snapshot()
    # The 3 newest: 1, 2, 3 s.
    assert snap.run_durations == [state_module.DurationState("wf", "", 3, 2.0, 3.0, 3.0)]
    assert snap.duration_samples_truncated


def test_empty_database_declares_the_duration_families_without_samples(client: Client) -> None:
    families = parse_exposition(client.get(reverse("workflows-health:metrics")).content.decode())
    for name in (
        "workflows_stage_duration_window_seconds",
        "workflows_stage_duration_window_samples",
        "workflows_run_duration_window_seconds",
        "workflows_run_duration_window_samples",
        "workflows_job_redeliveries_window",
    ):
        assert families[name]["type"] == "gauge" and families[name]["help"]
        assert families[name]["samples"] == {}


def test_redeliveries_of_jobs_finished_in_the_window(client: Client) -> None:
    now = db_now()

    def finished(
        stage_id: str, attempt: int, ago: float | None, status: str = Status.COMPLETED
    ) -> None:
        done = None if ago is None else now - timedelta(seconds=ago)
        made = job(status=status, attempt=attempt, completed_at=done)
        WorkflowJob.objects.filter(pk=made.pk).update(stage_id=stage_id)

    finished("fetch", 3, 0)  # 2 deliveries beyond the first
    finished("fetch", 2, 5, Status.FAILED)
    finished("fetch", 1, 0)  # its first delivery only
    finished('p"q', 4, 0)
    finished("old", 9, 600)  # outside the window
    finished("live", 5, None, Status.RUNNING)  # not finished: not counted yet
    families = parse_exposition(client.get(reverse("workflows-health:metrics")).content.decode())
    assert families["workflows_job_redeliveries_window"]["samples"] == {
        (("workflow_id", "wf"), ("stage_id", "fetch")): 3.0,
        (("workflow_id", "wf"), ("stage_id", 'p"q')): 3.0,
    }
