"""A test network of several "hosts" and a PostgreSQL instance, built from Linux network
namespaces, for the multi-host real-process tests (issue 8).

Layout (``TAG`` = ``dwh<pid of pytest>``, ``N`` = a free private subnet ``10.231.N.0/24``)::

    root namespace: bridge TAGbr, 10.231.N.1  (pytest and its manage.py shells live here)
      |-- veth TAGdb  <-> eth0 in netns TAG-db, 10.231.N.2: the PostgreSQL the test started
      |-- veth TAGh1  <-> eth0 in netns TAG-h1, 10.231.N.11: one qcluster
      |-- veth TAGh2  <-> eth0 in netns TAG-h2, 10.231.N.12: one qcluster
      `-- ...

Inside a namespace ``127.0.0.1`` is that namespace's own loopback, so a host reaches nothing
but the addresses above: its qcluster uses the PostgreSQL of the lab and django-q2's ORM
broker. :meth:`Host.cut` takes the host's link down on the bridge side (both directions are
cut: packets are dropped silently, TCP connections stay open and resume after
:meth:`Host.restore`, as on a real network partition).

Everything is torn down by :meth:`Lab.close` (PostgreSQL, every process left in a namespace,
the namespaces, the veths and the bridge), which the fixtures call in their finalizers; a lab
left behind by a pytest that was killed is removed the next time a lab is built.
"""

from __future__ import annotations

import contextlib
import glob
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tests.acceptance.harness import Cluster, wait_for

PREFIX = "dwh"
DB_PORT = 5432


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed: {done.stderr.strip()}")
    return done


def unavailable_reason() -> str | None:
    """Why a lab cannot be built on this machine (``None`` if it can): not root, no
    ``ip netns``, no ``initdb``/``pg_ctl``, no ``postgres`` user or ``runuser``.
    """
    if os.geteuid() != 0:
        return "needs root (network namespaces)"
    if shutil.which("ip") is None:
        return "needs iproute2 (`ip`)"
    probe = f"{PREFIX}probe{os.getpid()}"
    if _ip("netns", "add", probe, check=False).returncode != 0:
        return "`ip netns add` is not permitted here"
    _ip("netns", "del", probe, check=False)
    if postgres_bindir() is None:
        return "needs PostgreSQL server binaries (initdb, pg_ctl)"
    if shutil.which("runuser") is None:
        return "needs runuser (initdb refuses root)"
    try:
        import pwd

        pwd.getpwnam("postgres")
    except KeyError:
        return "needs a `postgres` system user (initdb refuses root)"
    return None


def postgres_bindir() -> str | None:
    """The directory of ``initdb`` and ``pg_ctl``: on PATH, else the newest
    ``/usr/lib/postgresql/*/bin``."""
    initdb = shutil.which("initdb")
    if initdb and shutil.which("pg_ctl"):
        return str(Path(initdb).parent)
    found = sorted(
        glob.glob("/usr/lib/postgresql/*/bin/initdb"),
        key=lambda p: int(re.sub(r"\D", "", p.split("/")[4]) or 0),
    )
    return str(Path(found[-1]).parent) if found else None


def remove_leftovers() -> None:
    """Tear down labs of pytest processes that are gone (killed before their finalizers)."""
    names = _ip("netns", "list", check=False).stdout.split()
    for name in names:
        match = re.fullmatch(rf"{PREFIX}(\d+)-\w+", name)
        if not match or _alive(int(match.group(1))):
            continue
        _kill_namespace_processes(name)
        _ip("netns", "del", name, check=False)
    for line in _ip("-o", "link", "show", check=False).stdout.splitlines():
        match = re.search(rf"\d+: ({PREFIX}(\d+)\w*)[@:]", line)
        if match and not _alive(int(match.group(2))):
            _ip("link", "del", match.group(1), check=False)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_namespace_processes(ns: str) -> None:
    pids = _ip("netns", "pids", ns, check=False).stdout.split()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)


def _free_subnet() -> int:
    """A third octet ``N`` such that no route of the machine touches ``10.231.N.0/24``."""
    routes = _ip("-4", "route", "show", "table", "all", check=False).stdout
    start = 100 + os.getpid() % 150
    for offset in range(150):
        n = 100 + (start - 100 + offset) % 150
        if f"10.231.{n}." not in routes:
            return n
    raise RuntimeError("no free 10.231.N.0/24 subnet")


class Postgres:
    """A PostgreSQL instance in its own data folder, run by the ``postgres`` user inside the
    database namespace, listening on ``address:5432`` (trust auth for the lab's subnet).
    Tuned for tests: no fsync, no synchronous commit, 300 connections.
    """

    def __init__(self, ns: str, address: str, subnet: str, bindir: str) -> None:
        self.ns = ns
        self.address = address
        self.subnet = subnet
        self.bindir = bindir
        self.root = Path(tempfile.mkdtemp(prefix="dw_hosts_pg_"))
        self.data = self.root / "data"
        self.logfile = self.root / "postgres.log"

    def _as_postgres(self, *cmd: str, timeout: float = 120) -> None:
        done = subprocess.run(
            ["ip", "netns", "exec", self.ns, "runuser", "-u", "postgres", "--", *cmd],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=timeout,
        )
        if done.returncode != 0:
            tail = self.logfile.read_text()[-2000:] if self.logfile.exists() else ""
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stdout}\n{tail}")

    def init(self) -> None:
        shutil.chown(self.root, "postgres", "postgres")
        os.chmod(self.root, 0o700)
        self._as_postgres(
            f"{self.bindir}/initdb", "-D", str(self.data), "-A", "trust", "-U", "postgres",
            "-E", "UTF8", "--no-sync", "--no-instructions",
        )  # fmt: skip
        with open(self.data / "postgresql.conf", "a") as conf:
            conf.write(
                f"\nlisten_addresses = '{self.address}'\nport = {DB_PORT}\n"
                f"unix_socket_directories = '{self.root}'\n"
                "max_connections = 300\nfsync = off\nsynchronous_commit = off\n"
                "full_page_writes = off\nshared_buffers = 64MB\n"
                "log_min_messages = warning\nlog_connections = off\n"
            )
        with open(self.data / "pg_hba.conf", "a") as hba:
            hba.write(f"\nhost all all {self.subnet} trust\n")

    def pg_ctl(self, *args: str) -> None:
        self._as_postgres(f"{self.bindir}/pg_ctl", "-D", str(self.data), *args)

    def start(self) -> None:
        self.pg_ctl("start", "-w", "-t", "60", "-l", str(self.logfile))

    def restart(self) -> None:
        """``pg_ctl restart -m fast``: every connection is cut, the server is back when this
        returns."""
        self.pg_ctl("restart", "-m", "fast", "-w", "-t", "60", "-l", str(self.logfile))

    def running(self) -> bool:
        return (self.data / "postmaster.pid").exists()

    def stop(self) -> None:
        if self.running():
            with contextlib.suppress(Exception):
                self.pg_ctl("stop", "-m", "immediate", "-w", "-t", "30")

    def url(self, dbname: str) -> str:
        return f"postgres://postgres@{self.address}:{DB_PORT}/{dbname}"

    def connect(self, dbname: str = "postgres") -> Any:
        import psycopg

        return psycopg.connect(
            f"postgresql://postgres@{self.address}:{DB_PORT}/{dbname}",
            autocommit=True,
            connect_timeout=10,
        )

    def cleanup(self) -> None:
        self.stop()
        shutil.rmtree(self.root, ignore_errors=True)


class Host:
    """One machine of the lab: a network namespace with its address, and the ``qcluster``
    (at most one at a time) running in it.

    Every cluster started here is remembered (:attr:`pgids`): a stage execution recorded with
    a process group id tells the test which host ran it.
    """

    def __init__(self, lab: Lab, name: str, address: str) -> None:
        self.lab = lab
        self.name = name
        self.ns = f"{lab.tag}-{name}"
        self.link = f"{lab.tag}{name}"  # the bridge-side end of the host's veth pair
        self.address = address
        self.cluster: Cluster | None = None
        self.pgids: list[int] = []
        #: When (``time.time()``) each cluster (by process group) was sent its SIGTERM.
        self.stop_sent: dict[int, float] = {}
        self.starts = 0

    def start(self, env: dict[str, str], log_dir: Path) -> Cluster:
        """Start ``manage.py qcluster`` in this host's namespace (its own process group)."""
        assert self.cluster is None or not self.cluster.running, f"{self.name} already runs"
        self.starts += 1
        log = log_dir / f"{self.name}-{self.starts}.log"
        self.cluster = Cluster(env, log, prefix=("ip", "netns", "exec", self.ns)).start()
        assert self.cluster.proc is not None
        self.pgids.append(self.cluster.proc.pid)
        return self.cluster

    def wait_ready(self, timeout: float = 90) -> None:
        """Wait until the cluster logged ``Q Cluster ... running.`` (needs Q_LOG_LEVEL=INFO)."""
        cluster = self.cluster
        assert cluster is not None

        def ready() -> bool:
            if not cluster.running:
                raise AssertionError(f"{self.name}'s qcluster exited:\n{cluster.log()[-3000:]}")
            return "running." in cluster.log()

        try:
            wait_for(ready, timeout=timeout, interval=0.1)
        except TimeoutError:
            raise AssertionError(
                f"{self.name}'s qcluster not ready in {timeout} s:\n{cluster.log()[-3000:]}"
            ) from None

    @property
    def pid(self) -> int:
        """The main pid (= process group id) of the current cluster."""
        assert self.cluster is not None and self.cluster.proc is not None
        return self.cluster.proc.pid

    def terminate(self) -> float:
        """SIGTERM to the cluster's main process only; returns the time it was sent
        (``time.time()``). Wait with :meth:`wait_exit`."""
        assert self.cluster is not None and self.cluster.proc is not None
        sent = time.time()
        self.stop_sent[self.cluster.proc.pid] = sent
        self.cluster.proc.send_signal(signal.SIGTERM)
        return sent

    def wait_exit(self, timeout: float) -> bool:
        """Wait for the main process to exit; ``False`` (and a group SIGKILL) past ``timeout``."""
        assert self.cluster is not None and self.cluster.proc is not None
        try:
            self.cluster.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.cluster.kill()
            return False
        self.cluster.stop()  # reaps leftovers, closes the log
        return True

    def stop(self, timeout: float = 60) -> None:
        """SIGTERM to the main process and wait (SIGKILL to the group past ``timeout``)."""
        cluster = self.cluster
        if cluster is not None and cluster.proc is not None:
            if cluster.running:
                self.stop_sent.setdefault(cluster.proc.pid, time.time())
            cluster.stop(timeout=timeout)

    def kill(self) -> float:
        """SIGKILL to the cluster's whole process group (the host loses power); returns when."""
        assert self.cluster is not None
        killed = time.time()
        self.cluster.kill()
        return killed

    def cut(self) -> None:
        """Cut the host's link in both directions (its veth down on the bridge side)."""
        _ip("link", "set", self.link, "down")

    def restore(self) -> None:
        _ip("link", "set", self.link, "up")

    def log(self) -> str:
        return self.cluster.log() if self.cluster is not None else ""


class Lab:
    """The bridge, the database namespace with its PostgreSQL, and ``hosts`` host namespaces.

    Build with :meth:`open` (it cleans up after itself if any step fails) and tear down with
    :meth:`close`.
    """

    def __init__(self, hosts: int) -> None:
        self.tag = f"{PREFIX}{os.getpid()}"
        self.n = _free_subnet()
        self.subnet = f"10.231.{self.n}.0/24"
        self.gateway = f"10.231.{self.n}.1"
        self.bridge = f"{self.tag}br"
        self.namespaces: list[str] = []
        self.hosts = [Host(self, f"h{i + 1}", f"10.231.{self.n}.{11 + i}") for i in range(hosts)]
        self.db_ns = f"{self.tag}-db"
        self.db_address = f"10.231.{self.n}.2"
        bindir = postgres_bindir()
        assert bindir is not None
        self.pg = Postgres(self.db_ns, self.db_address, self.subnet, bindir)

    @classmethod
    def open(cls, hosts: int = 3) -> Lab:
        remove_leftovers()
        lab = cls(hosts)
        try:
            lab._build()
        except BaseException:
            lab.close()
            raise
        return lab

    def _build(self) -> None:
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        self._add_namespace(self.db_ns, f"{self.tag}db", self.db_address)
        for host in self.hosts:
            self._add_namespace(host.ns, host.link, host.address)
        self.pg.init()
        self.pg.start()

    def _add_namespace(self, ns: str, link: str, address: str) -> None:
        _ip("netns", "add", ns)
        self.namespaces.append(ns)
        _ip("link", "add", link, "type", "veth", "peer", "name", "eth0", "netns", ns)
        _ip("link", "set", link, "master", self.bridge, "up")
        _ip("-n", ns, "addr", "add", f"{address}/24", "dev", "eth0")
        _ip("-n", ns, "link", "set", "eth0", "up")
        _ip("-n", ns, "link", "set", "lo", "up")

    def close(self) -> None:
        """Stop every cluster and PostgreSQL, kill what is left in the namespaces, delete the
        namespaces (their veths go with them) and the bridge. Never raises."""
        for host in self.hosts:
            with contextlib.suppress(Exception):
                host.restore()
            with contextlib.suppress(Exception):
                host.stop(timeout=20)
        with contextlib.suppress(Exception):
            self.pg.cleanup()
        for ns in self.namespaces:
            _kill_namespace_processes(ns)
            _ip("netns", "del", ns, check=False)
        _ip("link", "del", self.bridge, check=False)

    # --- databases --------------------------------------------------------------------------

    @contextlib.contextmanager
    def database(self, template: str | None) -> Iterator[str]:
        """A fresh database (copied from ``template`` if given) for one test; dropped after."""
        name = f"dw_{os.urandom(4).hex()}"
        with self.pg.connect() as conn:
            if template:
                conn.execute(f'CREATE DATABASE "{name}" TEMPLATE "{template}"')
            else:
                conn.execute(f'CREATE DATABASE "{name}"')
        try:
            yield name
        finally:
            with contextlib.suppress(Exception):
                self.ensure_db_running()
                with self.pg.connect() as conn:
                    conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    def ensure_db_running(self) -> None:
        try:
            self.pg.connect().close()
        except Exception:
            self.pg.start()

    def terminate_host_backends(self, dbname: str) -> int:
        """``pg_terminate_backend`` of every connection to ``dbname`` that comes from a host
        (not the test's own, which come from the bridge address); how many were terminated."""
        with self.pg.connect() as conn:
            rows = conn.execute(
                "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) FROM pg_stat_activity"
                " WHERE datname = %s AND pid <> pg_backend_pid()"
                " AND client_addr IS NOT NULL AND client_addr <> %s::inet",
                (dbname, self.gateway),
            ).fetchone()
        return int(rows[0] or 0)

    def host_of(self, pgid: int) -> Host | None:
        """The host whose cluster had process group ``pgid``."""
        return next((h for h in self.hosts if pgid in h.pgids), None)
