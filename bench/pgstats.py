"""Server-side counters of one round's PostgreSQL database, read from outside the engine.

* ``pg_stat_database`` of one database (``xact_commit``, ``xact_rollback``, ``sessions``,
  ``active_time``) over a measured window, read through a connection to the *admin* database
  (``BENCH_PG_ADMIN_URL``, normally ``postgres``): the reader's own transactions count against
  the admin database, not the round's (where a reader is connected to the round database
  itself, its own transactions are subtracted: ``own_xacts``). PostgreSQL (>= 15) flushes a
  backend's counters at most once per second while it works and, once it is idle, only after
  10 s (``PGSTAT_IDLE_INTERVAL``), or at backend exit. So the opening read (by the driver,
  bench/benchapp/drivers.py) waits until the cluster has been up :data:`IDLE_FLUSH_S`, and
  the closing read (:func:`close_window`, by the bench) is taken after the cluster and the
  driver have exited and no backend of the database is left: every count is flushed.
* :class:`BackendCpu` - user+system CPU of the backends serving one database: every
  :data:`SAMPLE_INTERVAL_S` the pids of ``pg_stat_activity`` for that ``datname`` are listed
  and ``/proc/<pid>/stat`` (utime+stime, clock ticks) is read for each, keyed by (pid, start
  time). A window's CPU = for each backend, its last value seen by the end sample minus its
  value at the start sample (0 for a backend first seen later). Error: a backend that exits
  loses its CPU after its last sample (< one interval of work), one that lives entirely
  between two samples is not seen at all (``sessions`` of ``pg_stat_database`` minus the new
  backends seen gives their count); the postmaster's ``cutime+cstime`` (CPU of every reaped
  backend, all databases) bounds the first error from above.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from .common import PG_ADMIN_URL

#: seconds after which an idle backend has flushed its counters (PGSTAT_IDLE_INTERVAL + margin)
IDLE_FLUSH_S = 10.5
#: seconds between two samples of the backends' CPU
SAMPLE_INTERVAL_S = 0.1
_TICK = os.sysconf("SC_CLK_TCK")
COUNTERS = ("xact_commit", "xact_rollback", "sessions", "active_time")


def db_counters(conn: Any, dbname: str) -> dict[str, float]:
    """``pg_stat_database`` counters of ``dbname`` (``active_time`` in ms) plus wall time."""
    row = conn.execute(
        "SELECT xact_commit, xact_rollback, sessions, active_time FROM pg_stat_database "
        "WHERE datname = %s",
        (dbname,),
    ).fetchone()
    out: dict[str, float] = {"t": time.time()}
    for key, value in zip(COUNTERS, row or (None,) * 4, strict=True):
        out[key] = float(value or 0)
    return out


def counter_delta(
    before: dict[str, float], after: dict[str, float], *, own_xacts: int = 0, driver_xacts: int = 0
) -> dict[str, Any]:
    """The delta of two :func:`db_counters` reads; ``own_xacts`` (the reader's transactions in
    this database) and ``driver_xacts`` (the bench driver's polling transactions) are
    subtracted from ``xact_commit``."""
    commits = after["xact_commit"] - before["xact_commit"]
    return {
        "xact_commit_raw": int(commits),
        "xact_commit": int(commits - own_xacts - driver_xacts),
        "xact_rollback": int(after["xact_rollback"] - before["xact_rollback"]),
        "sessions": int(after["sessions"] - before["sessions"]),
        "active_ms": round(after["active_time"] - before["active_time"], 1),
        "subtracted_reader_xacts": own_xacts,
        "subtracted_driver_xacts": driver_xacts,
        "window_s": round(after["t"] - before["t"], 3),
    }


def per_unit(delta: dict[str, Any] | None, units: int) -> dict[str, Any] | None:
    """``delta`` plus per-unit commits, rollbacks and active ms (``units``: stages, tasks or
    steps)."""
    if not delta or not units:
        return delta
    return {
        **delta,
        "units": units,
        "commits_per_unit": round(delta["xact_commit"] / units, 3),
        "rollbacks_per_unit": round(delta["xact_rollback"] / units, 3),
        "active_ms_per_unit": round(delta["active_ms"] / units, 3),
    }


def wait_no_backends(conn: Any, dbname: str, timeout: float = 15) -> bool:
    """Block until no backend serves ``dbname`` (each flushed its counters at exit)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = %s", (dbname,)
        ).fetchone()
        if not row or not row[0]:
            return True
        time.sleep(0.05)
    return False


def close_window(
    opening: dict[str, Any] | None, dbname: str, t_end: float
) -> dict[str, Any] | None:
    """The closing read of a window the driver opened (``opening`` = its ``server`` record:
    ``before``, ``driver_xacts``, ``own_xacts``), to be called once the cluster and the driver
    have exited; ``t_end`` = when the last run was seen terminal (the tail after it, idle
    cluster work and the shutdown, is included and reported as ``tail_s``)."""
    if not opening:
        return None
    import psycopg

    with psycopg.connect(PG_ADMIN_URL, autocommit=True) as conn:
        flushed = wait_no_backends(conn, dbname)
        after = db_counters(conn, dbname)
    out = counter_delta(
        opening["before"],
        after,
        own_xacts=opening.get("own_xacts", 0),
        driver_xacts=opening.get("driver_xacts", 0),
    )
    out["all_backends_exited"] = flushed
    out["tail_s"] = round(after["t"] - t_end, 3)
    return out


def _proc_cpu(pid: int) -> tuple[int, float] | None:
    """(start time in ticks, user+system CPU seconds) of ``pid``, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    # fields[0] is field 3 (state): utime=14, stime=15, cutime=16, cstime=17, starttime=22
    return int(fields[19]), (int(fields[11]) + int(fields[12])) / _TICK


def _proc_children_cpu(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[13]) + int(fields[14])) / _TICK


@dataclass
class BackendCpu:
    """Samples the CPU of ``dbname``'s backends every :data:`SAMPLE_INTERVAL_S` in a thread
    (``start`` ... ``stop``); see the module docstring for the method and its error."""

    dbname: str
    #: (wall time, {(pid, start ticks): cpu seconds}, postmaster reaped-children cpu seconds)
    samples: list[tuple[float, dict[tuple[int, int], float], float | None]] = field(
        default_factory=list
    )
    error: str | None = None
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _postmaster: int | None = None

    def start(self) -> BackendCpu:
        self._thread = threading.Thread(target=self._run, name="bench-pgcpu", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        import psycopg

        try:
            with psycopg.connect(PG_ADMIN_URL, autocommit=True) as conn:
                while True:
                    pids = [
                        r[0]
                        for r in conn.execute(
                            "SELECT pid FROM pg_stat_activity WHERE datname = %s",
                            (self.dbname,),
                        ).fetchall()
                    ]
                    if self._postmaster is None and pids:
                        self._postmaster = _ppid(pids[0])
                    now: dict[tuple[int, int], float] = {}
                    for pid in pids:
                        got = _proc_cpu(pid)
                        if got is not None:
                            now[(pid, got[0])] = got[1]
                    reaped = _proc_children_cpu(self._postmaster) if self._postmaster else None
                    self.samples.append((time.time(), now, reaped))
                    if self._stop.wait(SAMPLE_INTERVAL_S):
                        return
        except Exception as exc:  # reported with the result, never raised into the round
            self.error = repr(exc)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def wait_sample_after(self, t: float, timeout: float = 2) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not self._stop.is_set():
            if self.samples and self.samples[-1][0] >= t:
                return
            time.sleep(0.02)

    def cpu_between(self, t0: float, t1: float) -> dict[str, Any] | None:
        """CPU seconds of the database's backends between wall times ``t0`` and ``t1`` (last
        sample at or before ``t0`` to the first at or after ``t1``) and the error indicators."""
        samples = list(self.samples)
        start = [i for i, s in enumerate(samples) if s[0] <= t0]
        end = [i for i, s in enumerate(samples) if s[0] >= t1]
        if not start or not end:
            return None
        i0, i1 = start[-1], end[0]
        base = samples[i0][1]
        last: dict[tuple[int, int], float] = {}
        for _, cpus, _reaped in samples[i0 : i1 + 1]:
            last.update(cpus)
        cpu = sum(value - base.get(key, 0.0) for key, value in last.items())
        final = samples[i1][1]
        exited = [k for k in last if k not in final]
        r0, r1 = samples[i0][2], samples[i1][2]
        return {
            "cpu_s": cpu,
            "backends_seen": len(last),
            "backends_new": sum(1 for k in last if k not in base),
            "backends_exited": len(exited),
            "samples": i1 - i0 + 1,
            "reaped_cpu_all_databases_s": (r1 - r0) if r0 is not None and r1 is not None else None,
        }


def _ppid(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except OSError:
        return None


def pg_cpu_summary(
    measured: dict[str, Any] | None, units: int, sessions: int | None
) -> dict[str, Any] | None:
    """The per-unit report of :meth:`BackendCpu.cpu_between` (``sessions``: pg_stat_database
    sessions started in the window, to count backends never sampled)."""
    if not measured or not units:
        return measured
    out = dict(measured)
    out["cpu_ms_per_unit"] = round(measured["cpu_s"] * 1000 / units, 3)
    if sessions is not None:
        out["sessions_not_sampled"] = max(0, sessions - measured["backends_new"])
    reaped = measured.get("reaped_cpu_all_databases_s")
    if reaped is not None:
        out["reaped_cpu_all_databases_ms_per_unit"] = round(reaped * 1000 / units, 3)
    out["cpu_s"] = round(measured["cpu_s"], 4)
    return out
