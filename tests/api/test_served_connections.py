"""The documented way to serve the API leaves no database connection behind (issue 17 §4).

Serves the example project with gunicorn and the web process's settings
(``example_project.settings_web``: ``CONN_MAX_AGE = 0``) against the test database, sends 50
concurrent clients at it, and counts the server's sessions in ``pg_stat_activity`` once every
response is in: none may outlive its request. ``SERVER=runserver SETTINGS=example_project.settings``
(the old way) leaves one connection per finished request thread - 50.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import quote

import pytest
from django.db import connection

from tests.markers import ON_POSTGRES

pytestmark = [
    pytest.mark.postgres,
    pytest.mark.skipif(not ON_POSTGRES, reason="needs PostgreSQL (pg_stat_activity)"),
    pytest.mark.django_db,
]

ROOT = Path(__file__).resolve().parents[2]
CLIENTS = 50
REQUESTS_PER_CLIENT = 4


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _database_url() -> str:
    s = connection.settings_dict
    return f"postgres://{quote(s['USER'])}@{s['HOST']}:{s['PORT']}/{quote(s['NAME'])}"


def _sessions(name: str) -> int:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = %s AND pid <> pg_backend_pid()",
            [name],
        )
        return int(cursor.fetchone()[0])


def _wait_until(predicate: object, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return True
        time.sleep(0.05)
    return bool(predicate())  # type: ignore[operator]


def _get(url: str, token: str | None = "0" * 40) -> int:
    headers = {"Authorization": f"Token {token}"} if token else {}
    request = urllib.request.Request(url, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)


@pytest.fixture
def served() -> Iterator[str]:
    """The documented server: gunicorn + example_project.settings_web on a free port."""
    port = _free_port()
    server = os.environ.get("SERVER", "gunicorn")
    settings_module = os.environ.get("SETTINGS", "example_project.settings_web")
    env = {
        **os.environ,
        "DATABASE_URL": _database_url(),
        "DJANGO_SETTINGS_MODULE": settings_module,
        "PYTHONPATH": str(ROOT),
    }
    if server == "runserver":
        argv = [sys.executable, "manage.py", "runserver", "--noreload", f"127.0.0.1:{port}"]
        env.pop("DJANGO_SETTINGS_MODULE")
        argv += [f"--settings={settings_module}"]
    else:
        gunicorn = str(Path(sys.executable).with_name("gunicorn"))
        argv = [gunicorn, "example_project.wsgi", "--workers", "2", "--threads", "8"]
        argv += ["--bind", f"127.0.0.1:{port}", "--log-level", "warning"]
    process = subprocess.Popen(argv, cwd=ROOT, env=env)
    base = f"http://127.0.0.1:{port}/api/workflows/"
    try:
        up = _wait_until(lambda: _reachable(base), 60)
        assert up, f"{server} did not come up on port {port}"
        yield base
    finally:
        process.terminate()
        process.wait(timeout=30)


def _reachable(base: str) -> bool:
    try:
        return _get(f"{base}schema/", token=None) == 200
    except OSError:
        return False


def test_no_connection_outlives_its_request(served: str) -> None:
    name = connection.settings_dict["NAME"]
    urls = [f"{served}runs/"] * (CLIENTS * REQUESTS_PER_CLIENT)
    with ThreadPoolExecutor(max_workers=CLIENTS) as pool:
        statuses = list(pool.map(_get, urls))
    # a bogus token is looked up in the database: every request used a connection
    assert set(statuses) == {401}, sorted(set(statuses))
    assert _wait_until(lambda: _sessions(name) == 0, 10), (
        f"{_sessions(name)} connection(s) of the server are still open after every response"
    )
