"""The events long poll returns as soon as an event committed elsewhere exists: by another
process (a separate Python with its own database connection) or another thread."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from django.db import connection

from django_workflows import annotate_run, start_run
from tests.markers import ON_POSTGRES

from .conftest import API

pytestmark = pytest.mark.django_db(transaction=True)

ROOT = Path(__file__).resolve().parents[2]

CHILD = """
import os, sys, time
import django
django.setup()
from django_workflows import annotate_run
print("ready", flush=True)
sys.stdin.readline()
time.sleep(0.5)
annotate_run(sys.argv[1], {"acme.ping": 1}, emit_event=True)
print(time.time(), flush=True)
"""


def _child_env() -> dict[str, str] | None:
    settings = connection.settings_dict
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "example_project.settings"}
    env["DJANGO_WORKFLOWS_CHILD"] = "1"
    if ON_POSTGRES:
        user, host, port = settings["USER"], settings["HOST"], settings["PORT"]
        env["DATABASE_URL"] = f"postgres://{user}@{host}:{port}/{settings['NAME']}"
        return env
    name = str(settings["NAME"])
    if "memory" in name or name == ":memory:":
        return None  # an in-memory test database: only threads can see it
    env["DATABASE_URL"] = f"sqlite:///{name}"
    return env


def _last_sequence(api: Any, run_id: str) -> int:
    return api.get(f"{API}runs/{run_id}/events/").json()["next_after"]


def test_long_poll_sees_an_event_committed_by_another_process(api: Any) -> None:
    env = _child_env()
    if env is None:
        pytest.skip("the SQLite test database is in memory (set TEST_SQLITE_NAME to a file)")
    run_id = start_run("api-two-stage", {"value": 1})
    after = _last_sequence(api, run_id)
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, run_id],
        cwd=ROOT,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None and child.stdin is not None
        assert child.stdout.readline().strip() == "ready"
        child.stdin.write("go\n")
        child.stdin.flush()
        started = time.monotonic()
        response = api.get(f"{API}runs/{run_id}/events/", {"after": after, "wait": 10})
        returned = time.time()
        committed = float(child.stdout.readline())
    finally:
        child.wait(timeout=30)
    body = response.json()
    assert [e["event_type"] for e in body["results"]] == ["annotation:created"]
    assert body["next_after"] == after + 1
    latency = returned - committed
    print(f"long poll latency after the other process committed: {latency * 1000:.0f} ms")
    assert latency < 1.0
    assert time.monotonic() - started < 5


def test_long_poll_sees_an_event_committed_by_another_thread(api: Any) -> None:
    run_id = start_run("api-two-stage", {"value": 1})
    after = _last_sequence(api, run_id)
    committed: list[float] = []

    def writer() -> None:
        try:
            time.sleep(0.4)
            annotate_run(run_id, {"acme.ping": 1}, emit_event=True)
            committed.append(time.time())
        finally:
            connection.close()

    thread = threading.Thread(target=writer)
    thread.start()
    response = api.get(f"{API}runs/{run_id}/events/", {"after": after, "wait": 10})
    returned = time.time()
    thread.join()
    assert [e["event_type"] for e in response.json()["results"]] == ["annotation:created"]
    assert returned - committed[0] < 1.0
