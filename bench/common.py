"""Shared plumbing of the benchmark: fresh databases, the example project's environment,
``manage.py`` subprocesses, a real ``qcluster`` with process-tree CPU/RSS accounting, and
percentiles.

Every database is created here and dropped by :class:`Databases` (``dw_bench_*`` names only);
every cluster is stopped by :class:`Cluster` (SIGTERM to the main pid only, SIGKILL to its
process group if it has not exited after 30 s).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

ROOT = Path(__file__).resolve().parents[1]
PG_ADMIN_URL = os.environ.get("BENCH_PG_ADMIN_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
PG_URL_PREFIX = PG_ADMIN_URL.rsplit("/", 1)[0]


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0..100, linear interpolation); ``None`` for no values."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def median(values: Sequence[float]) -> float | None:
    return percentile(values, 50)


# --- databases -------------------------------------------------------------------------------


class Databases:
    """Creates fresh ``dw_bench_*`` PostgreSQL databases and SQLite files; drops them all in
    :meth:`drop_all` (called from a ``finally`` in ``__main__``)."""

    def __init__(self) -> None:
        self.pg_names: list[str] = []
        self.tmp = Path(tempfile.mkdtemp(prefix="dw-bench-"))

    def _admin(self, sql: str) -> None:
        import psycopg

        with psycopg.connect(PG_ADMIN_URL, autocommit=True) as conn:
            conn.execute(sql)  # type: ignore[arg-type]

    def postgres(self, kind: str = "") -> str:
        """A fresh PostgreSQL database ``dw_bench_<kind>_<hex>``; returns its URL."""
        name = f"dw_bench_{kind + '_' if kind else ''}{uuid.uuid4().hex[:8]}"
        assert name.startswith("dw_bench_")
        self._admin(f'CREATE DATABASE "{name}"')
        self.pg_names.append(name)
        return f"{PG_URL_PREFIX}/{name}"

    def sqlite(self, kind: str = "db") -> str:
        """A fresh SQLite file in this run's temporary directory; returns its URL."""
        return f"sqlite:///{self.tmp / f'{kind}-{uuid.uuid4().hex[:8]}.sqlite3'}"

    def new(self, backend: str, kind: str = "") -> str:
        return self.postgres(kind) if backend == "postgres" else self.sqlite(kind or "db")

    def drop(self, url: str) -> None:
        """Drop one database created here (PostgreSQL) or delete its file (SQLite)."""
        if url.startswith("sqlite:///"):
            path = Path(url.removeprefix("sqlite:///"))
            for suffix in ("", "-wal", "-shm"):
                Path(str(path) + suffix).unlink(missing_ok=True)
            return
        name = url.rsplit("/", 1)[1]
        if name in self.pg_names and name.startswith("dw_bench_"):
            self._admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
            self.pg_names.remove(name)

    def drop_all(self) -> list[str]:
        """Drop every database still present; returns the errors (never raises)."""
        errors = []
        for name in list(self.pg_names):
            try:
                self._admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
                self.pg_names.remove(name)
            except Exception as exc:  # report, keep dropping the others
                errors.append(f"{name}: {exc}")
        shutil.rmtree(self.tmp, ignore_errors=True)
        return errors

    def workdir(self, kind: str) -> Path:
        """A fresh scratch directory (``EXAMPLE_VAR_DIR`` / ``BENCH_DIR`` of one measurement)."""
        path = self.tmp / f"{kind}-{uuid.uuid4().hex[:8]}"
        path.mkdir(parents=True)
        return path


# --- the example project's subprocesses -------------------------------------------------------


def project_env(database_url: str, var_dir: Path, **extra: str) -> dict[str, str]:
    """Environment of ``manage.py`` subprocesses: the example project with the bench app."""
    env = dict(os.environ)
    env.update(
        DATABASE_URL=database_url,
        EXAMPLE_VAR_DIR=str(var_dir),
        BENCH_DIR=str(var_dir),
        DJANGO_SETTINGS_MODULE="example_project.settings",
        EXTRA_INSTALLED_APPS="bench.benchapp",
        Q_WORKERS="2",
        # Production settings: with DEBUG the example project's CursorDebugWrapper records
        # every statement (about 1 ms of CPU per stage, measured in process).
        DJANGO_DEBUG="0",
        # The engine's clusters wake with PostgreSQL NOTIFY (the default since issue 19).
        WORKFLOWS_WAKE_WITH_NOTIFY="1",
        PYTHONUNBUFFERED="1",
        PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
    )
    env.update(extra)
    return env


def manage(env: dict[str, str], *args: str, timeout: float = 600) -> str:
    """Run ``manage.py <args>``; returns stdout. Raises RuntimeError with stderr on failure."""
    done = subprocess.run(
        [sys.executable, "manage.py", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if done.returncode != 0:
        raise RuntimeError(
            f"manage.py {args[0]} failed ({done.returncode}):\n{done.stdout[-2000:]}\n"
            f"{done.stderr[-4000:]}"
        )
    return done.stdout


def shell_json(env: dict[str, str], code: str, *, timeout: float = 600) -> Any:
    """Run ``code`` in ``manage.py shell`` and parse the last line it prints as JSON."""
    out = manage(env, "shell", "-v0", "-c", code, timeout=timeout)
    lines = out.strip().splitlines()
    if not lines:
        raise RuntimeError("shell snippet printed nothing")
    return json.loads(lines[-1])


def migrate(env: dict[str, str]) -> None:
    manage(env, "migrate", "--noinput", "-v0")


# --- the cluster -------------------------------------------------------------------------------


@dataclass
class TreeSample:
    """CPU seconds (user+system) of a process tree and how many processes it had."""

    cpu_seconds: float
    processes: int


@dataclass
class Cluster:
    """One ``manage.py qcluster`` subprocess in its own session, with CPU and RSS accounting.

    CPU is the sum of user+system time of the main process and all its descendants (psutil),
    read by :meth:`cpu_seconds`; RSS of every descendant is sampled every 0.2 s by a thread
    while :meth:`start` ... :meth:`stop` (``peak_worker_rss``).
    """

    env: dict[str, str]
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None
    peak_worker_rss: int = 0
    _log: IO[str] | None = None
    #: (wall time, tree CPU seconds) every 0.2 s while the cluster runs
    cpu_samples: list[tuple[float, float]] = field(default_factory=list)
    _stop_sampler: threading.Event = field(default_factory=threading.Event)
    _sampler: threading.Thread | None = None
    #: wall time the qcluster process was started
    started_at: float = 0.0
    #: ``BENCH_SQL_COUNT_DIR`` of the cluster's processes (None: no statement counting)
    sql_count_dir: Path | None = None
    #: (wall time, statements, health checks of all cluster processes so far) per CPU sample
    statement_samples: list[tuple[float, int, int]] = field(default_factory=list)

    def start(self, workers: int = 2, timeout: float = 60) -> Cluster:
        """Start the cluster and wait until its worker processes exist (plus 1 s to settle)."""
        self._log = open(self.log_path, "a")
        self.started_at = time.time()
        self.proc = subprocess.Popen(
            [sys.executable, "manage.py", "qcluster"],
            cwd=ROOT,
            env=self.env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        deadline = time.monotonic() + timeout
        # main + sentinel + monitor + pusher + workers (django-q2 1.x): wait for >= workers + 3
        while len(self._tree()) < workers + 3:
            if self.proc.poll() is not None:
                raise RuntimeError(f"qcluster exited at start-up:\n{self.log()[-3000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"qcluster did not start in {timeout} s:\n{self.log()[-3000:]}")
            time.sleep(0.1)
        time.sleep(1.0)
        self._sampler = threading.Thread(target=self._sample_rss, daemon=True)
        self._sampler.start()
        return self

    def _tree(self) -> list[Any]:
        import psutil

        if self.proc is None:
            return []
        try:
            main = psutil.Process(self.proc.pid)
            return [main, *main.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def cpu_seconds(self) -> TreeSample:
        """User+system CPU of the whole tree so far (children that exited are not counted)."""
        import psutil

        total = 0.0
        procs = self._tree()
        for p in procs:
            try:
                t = p.cpu_times()
                total += t.user + t.system
            except psutil.NoSuchProcess:
                pass
        return TreeSample(total, len(procs))

    def _sample_rss(self) -> None:
        import psutil

        from .benchapp.sqlcount import read_total

        while True:
            now = time.time()
            self.cpu_samples.append((now, self.cpu_seconds().cpu_seconds))
            if self.sql_count_dir is not None:
                self.statement_samples.append((now, *read_total(self.sql_count_dir)))
            for p in self._tree()[1:]:
                try:
                    self.peak_worker_rss = max(self.peak_worker_rss, p.memory_info().rss)
                except psutil.NoSuchProcess:
                    pass
            if self._stop_sampler.wait(0.2):
                return

    def cpu_between(self, t0: float, t1: float) -> float | None:
        """Tree CPU seconds spent between wall times ``t0`` and ``t1``: the last sample at or
        before ``t0`` to the first at or after ``t1`` (so the window is covered, up to 0.2 s
        more at each end)."""
        samples = list(self.cpu_samples)
        before = [c for t, c in samples if t <= t0]
        after = [c for t, c in samples if t >= t1]
        if not before or not after:
            return None
        return after[0] - before[-1]

    def statements_between(self, t0: float, t1: float) -> tuple[int, int] | None:
        """(statements through the cursor, connection health checks) of all cluster processes
        between wall times ``t0`` and ``t1`` (same sample rule as :meth:`cpu_between`; each
        process writes its counts every 0.25 s, so the ends are known to within 0.25 s + one
        sample)."""
        samples = list(self.statement_samples)
        before = [s for s in samples if s[0] <= t0]
        after = [s for s in samples if s[0] >= t1]
        if not before or not after:
            return None
        return after[0][1] - before[-1][1], after[0][2] - before[-1][2]

    def wait_sample_after(self, t: float, timeout: float = 2) -> None:
        """Block until the sampler has a sample taken after wall time ``t``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.cpu_samples and self.cpu_samples[-1][0] >= t:
                return
            time.sleep(0.05)

    def driver_env(self) -> dict[str, str]:
        """The environment of a driver process for this cluster (``BENCH_CLUSTER_STARTED``)."""
        env = {k: v for k, v in self.env.items() if k != "BENCH_SQL_COUNT_DIR"}
        return {**env, "BENCH_CLUSTER_STARTED": str(self.started_at)}

    def stop(self, timeout: float = 30) -> None:
        """SIGTERM to the main pid only; SIGKILL to the group if it hangs past ``timeout``.
        Idempotent (the bench stops a cluster early to read the server's counters)."""
        self._stop_sampler.set()
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGTERM)
                try:
                    self.proc.wait(timeout=timeout)
                except subprocess.TimeoutExpired:
                    pass
            try:  # leftovers of a hung or stopped cluster (none, normally)
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            self.proc.wait()
        if self._log is not None:
            self._log.close()
            self._log = None

    def log(self) -> str:
        return self.log_path.read_text() if self.log_path.exists() else ""


@contextmanager
def running_cluster(
    env: dict[str, str], var_dir: Path, *, count_statements: bool = False
) -> Iterator[Cluster]:
    """A started cluster that is stopped on exit (also on errors). ``count_statements``: every
    cluster process counts its SQL statements (``BENCH_SQL_COUNT_DIR``, bench/benchapp/
    sqlcount.py) into ``var_dir/sqlcount``, sampled into :attr:`Cluster.statement_samples`."""
    count_dir = None
    if count_statements:
        count_dir = var_dir / "sqlcount"
        count_dir.mkdir(exist_ok=True)
        env = {**env, "BENCH_SQL_COUNT_DIR": str(count_dir)}
    cluster = Cluster(env, var_dir / "qcluster.log", sql_count_dir=count_dir)
    try:
        yield cluster.start(workers=int(env.get("Q_WORKERS", "2")))
    finally:
        cluster.stop()


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    """``fn()`` and its wall time in seconds."""
    t0 = time.perf_counter()
    value = fn()
    return value, time.perf_counter() - t0


#: The background load: one process spinning in pure Python (one busy core), until its parent
#: (the pid it is given) is gone - a bench stopped by a signal runs no ``finally`` and would
#: leave it spinning for good (one did, for 40 minutes). It looks at its parent every 200,000
#: iterations (a few milliseconds).
SPINNER = (
    "import os, sys\n"
    "while os.getppid() == int(sys.argv[1]):\n"
    "    for _ in range(200_000):\n"
    "        pass\n"
)


@contextmanager
def background_load(enabled: bool = True) -> Iterator[subprocess.Popen[bytes] | None]:
    """One busy core while the block runs (a ``python -c`` busy loop started before, killed by
    its pid after); ``enabled=False`` yields None and starts nothing."""
    if not enabled:
        yield None
        return
    proc = subprocess.Popen([sys.executable, "-c", SPINNER, str(os.getpid())])
    try:
        time.sleep(0.5)  # running before the measurement starts
        yield proc
    finally:
        proc.kill()
        proc.wait()
