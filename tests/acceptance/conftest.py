"""Fixtures of the acceptance tests: a fresh database per test, a migrated project, clusters."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings

from tests.markers import ON_POSTGRES

from .harness import Cluster, acceptance_env, manage


def _pg_url(name: str) -> str:
    db = settings.DATABASES["default"]
    return f"postgres://{db['USER']}@{db['HOST']}:{db['PORT']}/{name}"


@pytest.fixture
def database_url(tmp_path: Path) -> Iterator[str]:
    """A fresh, empty database for the subprocesses, dropped afterwards.

    On the PostgreSQL pass a new database on the same server; otherwise a SQLite file.
    """
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


@pytest.fixture
def project(database_url: str, tmp_path: Path) -> Callable[..., dict[str, str]]:
    """``project(**env)`` -> the environment of a migrated project on the fresh database.

    Keyword arguments are extra environment variables for every subprocess (settings knobs
    such as ``WORKFLOWS_STALE_LEASE_SECONDS``).
    """

    def build(**extra: str) -> dict[str, str]:
        env = acceptance_env(database_url, tmp_path / "var", **extra)
        migrated = manage(env, "migrate", "--noinput", "-v0")
        assert migrated.returncode == 0, migrated.stderr
        return env

    return build


@pytest.fixture
def clusters(tmp_path: Path) -> Iterator[Callable[..., Cluster]]:
    """``clusters(env)`` starts a ``qcluster``; every cluster still running is stopped at the
    end of the test. All clusters of a test share ``tmp_path/qcluster.log``.

    ``clusters(env, *command, log="name.log")`` starts another long-running ``manage.py``
    command the same way (e.g. ``harness.tick_command()``), logging to ``tmp_path/<log>``.
    """
    started: list[Cluster] = []

    def start(env: dict[str, str], *command: str, log: str = "qcluster.log") -> Cluster:
        cluster = Cluster(env, tmp_path / log, command or ("qcluster",)).start()
        started.append(cluster)
        return cluster

    yield start
    for cluster in started:
        cluster.stop()


@pytest.fixture
def cluster(
    project: Callable[..., dict[str, str]],
    clusters: Callable[[dict[str, str]], Cluster],
    tmp_path: Path,
) -> dict[str, Any]:
    """A migrated database and a running ``qcluster`` (stopped with SIGTERM at the end)."""
    env = project()
    running = clusters(env)
    return {"env": env, "proc": running.proc, "var": tmp_path / "var", "log": running.log_path}
