"""Bounded health checks (issue 20 item 4): the readiness probe, the metrics scrape and
``workflows_health`` each finish within ``HEALTH_TIMEOUT_SECONDS`` however slow the
database is, and say the check timed out (503 ``"reason": "timeout"``, ``workflows_up 0``
with ``workflows_scrape_timed_out 1`` at 200, exit 1).

On PostgreSQL the database is made slow for real: another connection holds an ``ACCESS
EXCLUSIVE`` lock on the runs table (released by a timer after a few seconds, so an unbounded
check fails its time assertion instead of hanging), or the probe's statement sleeps.
"""

from __future__ import annotations

import io
import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import connection
from django.test import Client
from django.urls import reverse

from django_workflows.health import views
from django_workflows.health.checks import evaluate
from django_workflows.health.state import Budget, _BudgetSpent, snapshot
from tests.integration.test_health import parse_exposition
from tests.markers import postgres_only

pytestmark = pytest.mark.django_db

#: The budget the tests set; every bounded check must answer well within BOUND.
BUDGET = 0.5
BOUND = 1.4


@pytest.fixture
def budget(settings: Any) -> None:
    settings.DJANGO_WORKFLOWS = {
        **settings.DJANGO_WORKFLOWS,
        "HEALTH_TIMEOUT_SECONDS": BUDGET,
        "HEALTH_DB_TIMEOUT_SECONDS": 2,
    }


@pytest.fixture
def runs_table_locked() -> Iterator[None]:
    """Another connection holds ``ACCESS EXCLUSIVE`` on ``workflow_runs``: every read of it
    waits. A timer lets go after 2.5 s, so a check without a bound ends (and fails its time
    assertion) instead of waiting forever."""
    import psycopg

    db = connection.settings_dict
    other = psycopg.connect(
        host=db["HOST"], port=db["PORT"] or 5432, user=db["USER"], dbname=db["NAME"]
    )
    other.execute("SET lock_timeout = '2s'")
    other.execute("LOCK TABLE workflow_runs IN ACCESS EXCLUSIVE MODE")
    release = threading.Timer(2.5, other.rollback)
    release.start()
    try:
        yield
    finally:
        release.cancel()
        other.rollback()
        other.close()


def timed(call: Any) -> tuple[Any, float]:
    started = time.monotonic()
    result = call()
    return result, time.monotonic() - started


@postgres_only
def test_readiness_times_out_on_a_locked_table(
    client: Client, budget: None, runs_table_locked: None
) -> None:
    response, elapsed = timed(lambda: client.get(reverse("workflows-health:ready")))
    assert response.status_code == 503
    assert response.json() == {
        "status": "unhealthy",
        "failing": ["database"],
        "reason": "timeout",
        "checks": [{"name": "database", "ok": False}],
    }
    assert elapsed < BOUND


@postgres_only
def test_metrics_time_out_with_200_and_say_so(
    client: Client, budget: None, runs_table_locked: None
) -> None:
    response, elapsed = timed(lambda: client.get(reverse("workflows-health:metrics")))
    assert response.status_code == 200  # Prometheus keeps only a 2xx scrape's samples
    families = parse_exposition(response.content.decode())
    assert families["workflows_up"]["samples"][()] == 0
    assert families["workflows_scrape_timed_out"]["samples"][()] == 1
    assert elapsed < BOUND


@postgres_only
def test_command_times_out_with_exit_1(budget: None, runs_table_locked: None) -> None:
    out = io.StringIO()
    with pytest.raises(CommandError) as caught:
        started = time.monotonic()
        try:
            call_command("workflows_health", "--json", stdout=out)
        finally:
            elapsed = time.monotonic() - started
    assert caught.value.returncode == 1
    assert str(caught.value) == "unhealthy: database"
    doc = json.loads(out.getvalue())
    assert doc["reason"] == "timeout" and doc["failing"] == ["database"]
    assert doc["checks"][0]["detail"] == (
        f"timed out: no answer within {BUDGET:g} s (HEALTH_TIMEOUT_SECONDS)"
    )
    assert elapsed < BOUND


@postgres_only
def test_the_probes_select_is_bounded_too(
    client: Client, budget: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(views, "PROBE_SQL", "SELECT pg_sleep(3)")
    response, elapsed = timed(lambda: client.get(reverse("workflows-health:ready")))
    assert response.status_code == 503 and response.json()["reason"] == "timeout"
    assert elapsed < BOUND


@postgres_only
def test_the_bound_is_transaction_local(client: Client, budget: None) -> None:
    """Nothing of the bound stays on the session (a pooled server connection behind
    PgBouncer in transaction mode would hand it to the next client)."""

    def show() -> str:
        with connection.cursor() as cursor:
            cursor.execute("SHOW statement_timeout")
            return cursor.fetchone()[0]

    before = show()
    assert client.get(reverse("workflows-health:metrics")).status_code == 200
    assert snapshot(statement_timeout_ms=700, timeout_seconds=BUDGET).database_ok
    assert show() == before


def test_a_spent_budget_fails_the_database_check(settings: Any) -> None:
    """Both databases: the budget is checked before every statement (on SQLite, which cannot
    interrupt one, it is the only bound)."""
    snap = snapshot(timeout_seconds=0)
    assert snap.timed_out and not snap.database_ok and snap.database_error == "timeout"
    report = evaluate(snap)
    assert report.failing == ["database"]
    assert report.checks[0].detail == "timed out: no answer within 0 s (HEALTH_TIMEOUT_SECONDS)"
    assert report.to_dict(details=False)["reason"] == "timeout"
    healthy = snapshot(timeout_seconds=30)
    assert healthy.database_ok and not healthy.timed_out
    assert "reason" not in evaluate(healthy).to_dict()


def test_budget_bounds_each_statement_by_what_is_left() -> None:
    assert Budget(None, 2000, postgres=True).bound_ms() == 2000
    assert Budget(None, None, postgres=True).bound_ms() == 0  # no bound at all
    left = Budget(time.monotonic() + 0.25, 2000, postgres=True).bound_ms()
    assert 1 <= left <= 250
    with pytest.raises(_BudgetSpent):
        Budget(time.monotonic() - 0.001, 2000, postgres=False).bound_ms()


def test_command_exit_1_when_the_budget_is_spent(settings: Any) -> None:
    settings.DJANGO_WORKFLOWS = {**settings.DJANGO_WORKFLOWS, "HEALTH_TIMEOUT_SECONDS": 1e-9}
    out = io.StringIO()
    with pytest.raises(CommandError) as caught:
        call_command("workflows_health", stdout=out)
    assert caught.value.returncode == 1
    assert "FAIL  database timed out" in out.getvalue()
