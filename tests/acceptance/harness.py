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
        Q_POLL="0.2",
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
    """One ``manage.py qcluster`` subprocess (or another long-running ``command``, such as
    :func:`tick_command`) in its own session (process group).

    ``stop()`` sends SIGTERM to the main process only (a SIGTERM to the whole group hangs
    qcluster); ``kill()`` sends SIGKILL to the whole group: the main process, its workers, the
    monitor and the pusher die at once, like a machine losing power.

    ``prefix`` is put before ``python manage.py``: a command that execs it, such as
    ``("ip", "netns", "exec", "ns1")`` (the multi-host tests), so the process started is still
    the cluster's main process and the leader of its group.
    """

    def __init__(
        self,
        env: dict[str, str],
        log_path: Path,
        command: tuple[str, ...] = ("qcluster",),
        prefix: tuple[str, ...] = (),
    ) -> None:
        self.env = env
        self.log_path = log_path
        self.command = command
        self.prefix = prefix
        self._log: IO[str] | None = None
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Cluster:
        self._log = open(self.log_path, "a")  # closed in stop() / kill()
        self._log.write(f"--- {' '.join(self.command)} start {time.strftime('%H:%M:%S')} ---\n")
        self._log.flush()
        self.proc = subprocess.Popen(
            [*self.prefix, sys.executable, "manage.py", *self.command],
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


# --- fault tests: several processes, settling many runs, shared assertions ----------------------

#: Variables only the process under test should see (the kernel's fault injection).
FAULT_VARS = ("WORKFLOWS_CRASH_AT", "WORKFLOWS_CRASH_ONCE_FILE")


def without(env: dict[str, str], *names: str) -> dict[str, str]:
    """A copy of ``env`` without ``names`` (default: the fault-injection variables)."""
    drop = set(names or FAULT_VARS)
    return {k: v for k, v in env.items() if k not in drop}


def tick_command(interval: float = 0.2) -> tuple[str, ...]:
    """``manage.py`` arguments of a maintenance-tick loop (stale leases, wake-ups, outbox).

    Some fault tests run one beside their clusters so lease expiry is noticed within a
    fraction of a second of a 0.2 s interval; clusters also tick on their own (every worker
    process's supervisor thread competes for the ``ticker`` lease).
    """
    return ("workflows_tick", "--loop", "--interval", str(interval))


CREATE_RUNS = """
import json
from django_workflows.kernel.commands import CreateRun
from django_workflows.kernel.runtime import get_kernel
kernel = get_kernel()
print(json.dumps([
    kernel.dispatch(CreateRun({workflow_id!r}, data)).workflow_run_id for data in {inputs!r}
]))
"""


def create_runs(env: dict[str, str], workflow_id: str, inputs: list[dict[str, Any]]) -> list[str]:
    """Create one run of ``workflow_id`` per input (in one ``manage.py shell``); their ids."""
    return shell_json(without(env), CREATE_RUNS.format(workflow_id=workflow_id, inputs=inputs))


RUNS_STATE = """
import json, time
from django_workflows.models import (
    OutboxEvent, WorkflowBlob, WorkflowJob, WorkflowLog, WorkflowRun, WorkflowStage,
)
ids = {run_ids!r}
terminal = ("COMPLETED", "FAILED", "CANCELLED")
deadline = time.monotonic() + {timeout}
while time.monotonic() < deadline:
    live = WorkflowRun.objects.filter(pk__in=ids).exclude(status__in=terminal).count()
    unpublished = OutboxEvent.objects.filter(workflow_run_id__in=ids, published_at=None).count()
    if not live and not unpublished:
        break
    time.sleep(0.2)
runs = {{}}
for run in WorkflowRun.objects.filter(pk__in=ids):
    blobs = dict(
        WorkflowBlob.objects.filter(run_id=run.pk, key__endswith="/output.json")
        .values_list("key", "data")
    )
    runs[str(run.pk)] = {{
        "status": run.status,
        "error": run.error_message if hasattr(run, "error_message") else None,
        "output": run.output,
        "stages": {{
            s.stage_id: s.status for s in WorkflowStage.objects.filter(run_id=run.pk)
        }},
        "outputs": {{key.split("/")[-2]: data for key, data in blobs.items()}},
        "jobs": sorted(
            [j.stage_id, j.status, j.attempt, j.last_error or ""]
            for j in WorkflowJob.objects.filter(workflow_run_id=run.pk)
        ),
        "events": [
            [e.sequence, e.event_type, e.payload.get("stage_id"), e.published_at is not None]
            for e in OutboxEvent.objects.filter(workflow_run_id=run.pk).order_by("sequence")
        ],
        "logs": [
            [log.level, log.message]
            for log in WorkflowLog.objects.filter(run_id=run.pk, level__in=["WARN", "ERROR"])
        ],
    }}
print(json.dumps(runs, default=str))
"""


def settle_runs(
    env: dict[str, str], run_ids: list[str], *, timeout: float = 45
) -> dict[str, dict[str, Any]]:
    """Wait (up to ``timeout`` s) until every run is terminal and its outbox is published, then
    return each run's state: ``status``, ``output``, ``stages`` (id -> status), ``outputs``
    (stage id -> stored output blob), ``jobs``, ``events`` (``[sequence, type, stage_id,
    published]``) and WARN/ERROR ``logs``. Runs still live at the deadline are returned as
    they are (the assertions then say what is wrong).
    """
    return shell_json(
        without(env), RUNS_STATE.format(run_ids=run_ids, timeout=timeout), timeout=timeout + 120
    )


def run_state(env: dict[str, str], run_id: str) -> dict[str, Any]:
    """One run's state now (no waiting), as in :func:`settle_runs`."""
    return settle_runs(env, [run_id], timeout=0)[run_id]


def assert_runs_completed(runs: dict[str, dict[str, Any]], context: str = "") -> None:
    """Every run COMPLETED, and every stage record of it COMPLETED."""
    bad = {
        rid: (r["status"], r["stages"], r["jobs"], r["logs"][-3:])
        for rid, r in runs.items()
        if r["status"] != "COMPLETED" or set(r["stages"].values()) != {"COMPLETED"}
    }
    assert not bad, f"{len(bad)} of {len(runs)} runs did not complete: {bad}\n{context}"


def assert_outbox_gap_free(runs: dict[str, dict[str, Any]], context: str = "") -> None:
    """Each run's outbox sequences are 1..n without gaps or duplicates, all published (EV-3)."""
    for rid, run in runs.items():
        sequences = [e[0] for e in run["events"]]
        assert sequences == list(range(1, len(sequences) + 1)), (
            f"run {rid}: outbox sequences {sequences}\n{context}"
        )
        unpublished = [e for e in run["events"] if not e[3]]
        assert not unpublished, f"run {rid}: unpublished events {unpublished}\n{context}"


def assert_outcomes_once(runs: dict[str, dict[str, Any]], context: str = "") -> None:
    """Each stage record has exactly one outcome: one ``stage:completed`` per COMPLETED stage,
    none for other stages, and no ``stage:failed`` or ``workflow:failed`` beside a completion.
    A run that COMPLETED has exactly one ``workflow:completed``, as its last event.
    """
    for rid, run in runs.items():
        events = [(e[1], e[2]) for e in run["events"]]
        where = f"run {rid}: {run['stages']} events {events}\n{context}"
        for stage_id, status in run["stages"].items():
            completed = events.count(("stage:completed", stage_id))
            assert completed == (1 if status == "COMPLETED" else 0), (
                f"{stage_id} ({status}) has {completed} stage:completed: {where}"
            )
            if status == "COMPLETED":
                assert ("stage:failed", stage_id) not in events, where
        if run["status"] == "COMPLETED":
            assert [t for t, _ in events].count("workflow:completed") == 1, where
            assert events[-1] == ("workflow:completed", None), where
            assert "workflow:failed" not in [t for t, _ in events], where


def executions(crash_dir: Path) -> list[dict[str, Any]]:
    """Every recorded execution of a crash-app stage body (``executions.jsonl``), in order."""
    path = crash_dir / "executions.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines()]


def assert_executed_once(
    crash_dir: Path, runs: dict[str, dict[str, Any]], context: str = ""
) -> None:
    """Every stage of every run executed exactly once (no second delivery ran its body)."""
    seen: dict[tuple[str, str], list[int]] = {}
    for item in executions(crash_dir):
        seen.setdefault((item["run"], item["stage"]), []).append(item["pid"])
    expected = {(rid, sid) for rid, run in runs.items() for sid in run["stages"]}
    twice = {f"{rid[:8]}/{sid}": pids for (rid, sid), pids in seen.items() if len(pids) > 1}
    missing = sorted(f"{rid[:8]}/{sid}" for rid, sid in expected - set(seen))
    total = sum(len(p) for p in seen.values())
    assert not twice and not missing, (
        f"{total} executions for {len(expected)} stages; executed more than once (pids): "
        f"{twice}; never executed: {missing}\n{context}"
    )
