"""Helpers for acceptance tests that drive the example project through real processes.

Every test gets a fresh database (see the ``database_url`` fixture in ``conftest.py``), migrates
it with ``manage.py migrate`` and starts ``manage.py qcluster`` as a subprocess
(:class:`Cluster`). Tests drive and inspect the engine through ``manage.py`` subprocesses:
:func:`manage` for commands, :func:`shell_json` for a Python snippet that prints JSON.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any, TypeVar

ROOT = Path(__file__).resolve().parents[2]

T = TypeVar("T")


def acceptance_env(database_url: str, var_dir: Path, **extra: str) -> dict[str, str]:
    """The environment of the example project's subprocesses.

    Args:
        database_url: ``postgres://...`` or ``sqlite:///...`` (read by example_project.settings).
        var_dir: the project's var directory (reports, the default SQLite file).
        extra: more variables, e.g. ``WORKFLOWS_STALE_LEASE_SECONDS="3"``.
    """
    env = dict(os.environ)
    env.update(
        DATABASE_URL=database_url,
        EXAMPLE_VAR_DIR=str(var_dir),
        DJANGO_SETTINGS_MODULE="example_project.settings",
        Q_WORKERS="2",
        WORKFLOWS_TICK_INTERVAL="0.2",
        PYTHONUNBUFFERED="1",
    )
    env.update(extra)
    return env


def manage(env: dict[str, str], *args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    """Run ``manage.py <args>`` to completion and return the finished process."""
    return subprocess.run(
        [sys.executable, "manage.py", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def shell_json(env: dict[str, str], code: str, *, timeout: float = 180) -> Any:
    """Run ``code`` in ``manage.py shell`` and parse the last line it prints as JSON.

    Raises:
        AssertionError: the snippet failed (its stderr is in the message).
    """
    done = manage(env, "shell", "-v0", "-c", code, timeout=timeout)
    lines = done.stdout.strip().splitlines()
    assert done.returncode == 0 and lines, f"shell failed:\n{done.stdout}\n{done.stderr}"
    return json.loads(lines[-1])


def wait_for(predicate: Callable[[], T], *, timeout: float, interval: float = 0.05) -> T:
    """Poll ``predicate`` until it returns something truthy; return that value.

    Raises:
        TimeoutError: after ``timeout`` seconds.
    """
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"condition not met within {timeout} s")
        time.sleep(interval)


class Cluster:
    """One ``manage.py qcluster`` subprocess in its own session (process group).

    ``stop()`` sends SIGTERM to the main process only (a SIGTERM to the whole group hangs
    qcluster); ``kill()`` sends SIGKILL to the whole group: the main process, its workers, the
    monitor and the pusher die at once, like a machine losing power.
    """

    def __init__(self, env: dict[str, str], log_path: Path) -> None:
        self.env = env
        self.log_path = log_path
        self._log: IO[str] | None = None
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Cluster:
        self._log = open(self.log_path, "a")  # closed in stop() / kill()
        self._log.write(f"--- qcluster start {time.strftime('%H:%M:%S')} ---\n")
        self._log.flush()
        self.proc = subprocess.Popen(
            [sys.executable, "manage.py", "qcluster"],
            cwd=ROOT,
            env=self.env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        return self

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout: float = 30) -> None:
        """SIGTERM to the main process; SIGKILL to the group if it has not exited in time."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.kill()
                return
        self._reap_group()
        self._close()

    def kill(self) -> None:
        """SIGKILL to the whole process group; returns once the main process is gone."""
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        self._close()

    def _reap_group(self) -> None:
        """Leftover children of a stopped cluster (none, normally) are killed."""
        assert self.proc is not None
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def _close(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None

    def log(self) -> str:
        return self.log_path.read_text() if self.log_path.exists() else ""
