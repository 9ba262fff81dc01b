"""The measurements. Each function sets up what it needs (a fresh database, a real cluster),
measures, tears everything down (also on errors) and returns a JSON-able dict.

``backend`` is ``"postgres"`` or ``"sqlite"``; ``dbs`` is the run's :class:`Databases`.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from .common import (
    PG_ADMIN_URL,
    ROOT,
    Databases,
    migrate,
    percentile,
    project_env,
    running_cluster,
    shell_json,
)
from .pgstats import (
    IDLE_FLUSH_S,
    BackendCpu,
    close_window,
    counter_delta,
    db_counters,
    per_unit,
    pg_cpu_summary,
)

STAGES_PER_RUN = 4
#: django-q2's broker poll (seconds) for the bare-chain peer.
PEER_POLL_SECONDS = "0.2"


@contextmanager
def fresh_project(
    dbs: Databases, backend: str, kind: str, **extra_env: str
) -> Iterator[tuple[dict[str, str], Path]]:
    """A fresh, migrated database and scratch directory; the database is dropped on exit."""
    url = dbs.new(backend, kind)
    var_dir = dbs.workdir(kind)
    env = project_env(url, var_dir, **extra_env)
    try:
        migrate(env)
        yield env, var_dir
    finally:
        dbs.drop(url)


@contextmanager
def backend_cpu(url: str) -> Iterator[BackendCpu | None]:
    """A :class:`BackendCpu` sampler of ``url``'s PostgreSQL database while the block runs
    (None on SQLite)."""
    if url.startswith("sqlite:"):
        yield None
        return
    sampler = BackendCpu(url.rsplit("/", 1)[1]).start()
    try:
        yield sampler
    finally:
        sampler.stop()


def server_metrics(
    data: dict[str, Any],
    sampler: BackendCpu | None,
    t0: float,
    t1: float,
    units: int,
) -> dict[str, Any]:
    """``server_commits`` (pg_stat_database delta: opened by the driver, closed by
    :func:`bench.pgstats.close_window`; per unit) and
    ``pg_cpu`` (backend CPU over [t0, t1], per unit) of one measurement; PostgreSQL only."""
    server = data.get("server")
    out: dict[str, Any] = {"server_commits": per_unit(server, units) if server else None}
    if sampler is not None:
        sampler.wait_sample_after(t1)
        measured = sampler.cpu_between(t0, t1)
        out["pg_cpu"] = pg_cpu_summary(measured, units, (server or {}).get("sessions"))
        if sampler.error:
            out["pg_cpu"] = {"error": sampler.error}
    else:
        out["pg_cpu"] = None
    return out


def _db_url(env: dict[str, str]) -> str:
    return env["DATABASE_URL"]


def _close_server_window(
    data: dict[str, Any], cluster: Any, env: dict[str, str], t_end: float
) -> None:
    """Stop the cluster (its backends flush their counters at exit), then the closing
    ``pg_stat_database`` read of the window the driver opened (PostgreSQL only)."""
    cluster.stop()
    if data.get("server"):
        data["server"] = close_window(data["server"], _db_url(env).rsplit("/", 1)[1], t_end)


def _ms(values: list[float]) -> dict[str, float | None]:
    return {
        "p50_ms": _round(percentile(values, 50)),
        "p95_ms": _round(percentile(values, 95)),
        "max_ms": _round(max(values) if values else None),
        "count": len(values),
    }


def _round(value: float | None, digits: int = 2) -> float | None:
    return None if value is None else round(value, digits)


def _run_metrics(data: dict[str, Any]) -> dict[str, Any]:
    """Rates and latencies from a ``create_and_wait`` result (wall times of one host), and
    the burst's shape (:func:`p50_over_burst`, ``None`` when a run did not complete) beside
    its :func:`steady_rate_value`: for runs created in one transaction (``t_committed`` set)
    ``t0`` counts from the commit and nothing was visible before it; otherwise from the first
    create, the runs created over ``create_seconds``."""
    runs = data["runs"]
    done = [r for r in runs if r["status"] == "COMPLETED" and r["completed_at"]]
    latencies = [(r["completed_at"] - r["created_at"]) * 1000 for r in done]
    last = max((r["completed_at"] for r in done), default=data["t_seen_done"])
    first_create = min((r["created_at"] for r in runs), default=data["t_start"])
    seconds = max(last - data["t_start"], 1e-9)
    create_seconds = data["t_created"] - data["t_start"]
    burst_seconds = last - first_create
    complete = bool(done) and len(done) == len(runs)
    committed = data.get("t_committed")
    origin, spread = (committed, 0.0) if committed else (first_create, create_seconds)
    t0 = min(r["completed_at"] for r in done) - origin if complete else None
    return {
        "runs": len(runs),
        "completed": len(done),
        "not_completed": len(runs) - len(done),
        "timed_out": data["timed_out"],
        "seconds": round(seconds, 3),
        "create_seconds": round(create_seconds, 3),
        "runs_per_s": round(len(done) / seconds, 2),
        "stages_per_s": round(len(done) * STAGES_PER_RUN / seconds, 2),
        "create_to_completed": _ms(latencies),
        "burst_seconds": round(burst_seconds, 3),
        "p50_over_burst": p50_over_burst(latencies, burst_seconds) if complete else None,
        "first_completion_s": round(t0, 3) if t0 is not None else None,
        "steady_rate_value": (
            steady_rate_value(t0, burst_seconds, spread) if t0 is not None else None
        ),
    }


def p50_over_burst(latencies_ms: list[float], burst_seconds: float) -> float | None:
    """The burst's shape: the median run's create -> completed latency ÷ the burst's
    duration (first create -> last completion). Below 0.5 the median run waited less than
    half the burst; about 1.0 would be every run finishing together at the end."""
    p50 = percentile(latencies_ms, 50)
    if not p50 or burst_seconds <= 0:
        return None
    return round(p50 / (burst_seconds * 1000), 3)


def steady_rate_value(
    first_completion_s: float, burst_seconds: float, create_seconds: float = 0.0
) -> float | None:
    """What :func:`p50_over_burst` comes to when runs finish at a steady rate, oldest first:
    ``0.5 + (t0 - C) / (2 D)``. ``t0``: the first run's own latency (for a burst that becomes
    visible at once, from the commit); ``C``: how long the runs took to create, while the
    workers already ran (0 for one transaction); ``D``: the burst's duration. A burst above
    it started slower than it went on; below it, it slowed towards its end
    (docs/howto/benchmarks.md, "Why the one-transaction burst sits at 0.5")."""
    if burst_seconds <= 0:
        return None
    t0 = max(0.0, first_completion_s)
    return round(0.5 + (t0 - max(0.0, create_seconds)) / (2 * burst_seconds), 3)


def ours_throughput(dbs: Databases, backend: str, runs: int) -> dict[str, Any]:
    """Section 1 (and the "ours" side of section 2): ``runs`` bench-4 runs through a real
    2-worker cluster on a fresh database, created as fast as possible from a separate process."""
    with fresh_project(dbs, backend, "ours") as (env, var_dir):
        with (
            running_cluster(env, var_dir, count_statements=True) as cluster,
            backend_cpu(_db_url(env)) as sampler,
        ):
            data = shell_json(
                cluster.driver_env(),
                f"from bench.benchapp.drivers import create_and_wait; create_and_wait({runs})",
            )
            cluster.wait_sample_after(data["t_seen_done"])
            out = _run_metrics(data)
            last = (
                max((r["completed_at"] or 0 for r in data["runs"]), default=0)
                or data["t_seen_done"]
            )
            cpu = cluster.cpu_between(data["t_start"], last)
            stages = out["completed"] * STAGES_PER_RUN
            out["cluster_cpu_ms_per_stage"] = _round(
                cpu * 1000 / stages if cpu and stages else None
            )
            out["peak_worker_rss_mb"] = round(cluster.peak_worker_rss / 2**20, 1)
            counted = cluster.statements_between(data["t_start"], last)
            statements, checks = counted if counted is not None else (None, None)
            out["cluster_statements"] = statements
            out["cluster_health_checks"] = checks
            out["cluster_statements_per_stage"] = _round(
                statements / stages if statements is not None and stages else None
            )
            out["cluster_statements_per_stage_with_checks"] = _round(
                (statements + checks) / stages if statements is not None and stages else None
            )
            _close_server_window(data, cluster, env, data["t_seen_done"])
            out.update(server_metrics(data, sampler, data["t_start"], last, stages))
    out["loadavg_1m"] = round(os.getloadavg()[0], 2)
    return out


def django_q2_chain(dbs: Databases, backend: str, runs: int) -> dict[str, Any]:
    """Section 2 peer: ``runs`` chains of 4 trivial django-q2 tasks through the same cluster
    configuration (2 workers, ORM broker) on a fresh database, with the broker polled every
    0.2 s (django-q2 at its fastest: every task of a chain waits for the pusher's poll; the
    engine's own clusters poll every 1 s on PostgreSQL, their wake-ups being NOTIFYs)."""
    tasks = runs * 4
    with fresh_project(dbs, backend, "djq", Q_POLL=PEER_POLL_SECONDS) as (env, var_dir):
        with running_cluster(env, var_dir) as cluster, backend_cpu(_db_url(env)) as sampler:
            data = shell_json(
                cluster.driver_env(),
                f"from bench.benchapp.drivers import chain_and_wait; chain_and_wait({runs})",
            )
            end = data["t_last_done"] or data["t_seen_done"]
            cluster.wait_sample_after(end)
            cpu = cluster.cpu_between(data["t_start"], end)
            _close_server_window(data, cluster, env, data["t_seen_done"])
            server = server_metrics(data, sampler, data["t_start"], end, tasks)
    seconds = max(end - data["t_start"], 1e-9)
    return {
        **server,
        "chains": runs,
        "tasks": tasks,
        "timed_out": data["timed_out"],
        "seconds": round(seconds, 3),
        "tasks_per_s": round(tasks / seconds, 2),
        "cluster_cpu_ms_per_task": _round(cpu * 1000 / tasks if cpu else None),
        "loadavg_1m": round(os.getloadavg()[0], 2),
    }


def dbos(dbs: Databases, runs: int, mode: str) -> dict[str, Any]:
    """Section 2 peer: DBOS Transact (``bench.dbos_peer``) on its own fresh PostgreSQL
    database; an install or run failure is returned as ``{"error": ...}``, never raised."""
    try:
        import dbos as _dbos  # noqa: F401
    except Exception as exc:
        return {"mode": mode, "error": f"dbos is not importable: {exc!r} (pip install '.[bench]')"}
    url = dbs.postgres("dbos")
    try:
        with backend_cpu(url) as sampler:
            done = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "bench.dbos_peer",
                    "--url",
                    url,
                    *("--runs", str(runs)),
                    "--mode",
                    mode,
                    *("--stats-admin-url", PG_ADMIN_URL),
                ],
                cwd=ROOT,
                capture_output=True,
                text=True,
                timeout=600,
            )
            lines = done.stdout.strip().splitlines()
            if done.returncode != 0 or not lines:
                return {"mode": mode, "error": f"exit {done.returncode}: {done.stderr[-1500:]}"}
            out = json.loads(lines[-1])
            # the peer has exited: its backends have flushed their counters
            out["server"] = close_window(out.get("server"), url.rsplit("/", 1)[1], out["t_end"])
            out.update(server_metrics(out, sampler, out["t_start"], out["t_end"], out["steps"]))
        out.pop("server", None)
        out["steps_per_s"] = round(out["steps_per_s"], 2)
        out["loadavg_1m"] = round(os.getloadavg()[0], 2)
        return out
    except Exception as exc:
        return {"mode": mode, "error": repr(exc)}
    finally:
        dbs.drop(url)


PGBENCH_SCRIPT = "UPDATE bench_counter SET v = v + 1 WHERE id = :client_id + 1;\n"


def pgbench_binary() -> str | None:
    """``pgbench`` on PATH, else the newest one under /usr/lib/postgresql/*/bin."""
    from shutil import which

    found = which("pgbench")
    if found:
        return found
    candidates = sorted(Path("/usr/lib/postgresql").glob("*/bin/pgbench"))
    return str(candidates[-1]) if candidates else None


def pgbench(dbs: Databases, clients: int, seconds: int) -> dict[str, Any]:
    """Section 2 reference: single-row ``UPDATE`` + ``COMMIT`` (autocommit) per transaction on
    a tiny table in a fresh database; each client updates its own row (no lock contention)."""
    binary = pgbench_binary()
    if binary is None:
        return {"clients": clients, "error": "pgbench not found"}
    url = dbs.postgres("pgb")
    try:
        import psycopg

        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute("CREATE TABLE bench_counter (id int PRIMARY KEY, v bigint NOT NULL)")
            conn.execute("INSERT INTO bench_counter SELECT g, 0 FROM generate_series(1, 16) g")
        script = dbs.workdir("pgbench") / "update.sql"
        script.write_text(PGBENCH_SCRIPT)
        done = subprocess.run(
            [
                binary,
                "-n",
                "-T",
                str(seconds),
                "-c",
                str(clients),
                "-j",
                str(min(clients, 2)),
                "-f",
                str(script),
                url,
            ],
            capture_output=True,
            text=True,
            timeout=seconds + 60,
        )
        match = re.search(r"tps = ([0-9.]+)", done.stdout)
        if done.returncode != 0 or not match:
            return {"clients": clients, "error": f"exit {done.returncode}: {done.stderr[-800:]}"}
        return {
            "clients": clients,
            "seconds": seconds,
            "tps": round(float(match.group(1)), 1),
            "loadavg_1m": round(os.getloadavg()[0], 2),
        }
    except Exception as exc:
        return {"clients": clients, "error": repr(exc)}
    finally:
        dbs.drop(url)


def in_process(dbs: Databases, backend: str) -> dict[str, Any]:
    """Section 3: ``bench.inprocess.measure`` on a fresh database (no cluster)."""
    with fresh_project(dbs, backend, "inproc") as (env, _var_dir):
        out = shell_json(env, "from bench.inprocess import measure; measure()")
    out.pop("sample_sql", None)
    return out


def idle_latency(
    dbs: Databases, backend: str, runs: int, *, pause: float, delivery_timeout: float
) -> dict[str, Any]:
    """Section 4 on an idle cluster with the delivery-recording plugin: create→first stage
    started, suspended stage due→checked/resumed, outbox event→plugin delivery."""
    suspend_runs = max(3, runs // 4)
    plugin = "bench.benchapp.plugins.delivery_recorder"
    with fresh_project(dbs, backend, "lat", WORKFLOWS_PLUGINS=plugin) as (env, var_dir):
        with running_cluster(env, var_dir):
            data = shell_json(
                env,
                "from bench.benchapp.drivers import idle_latency; "
                f"idle_latency({runs}, pause={pause}, delivery_timeout={delivery_timeout}, "
                f"suspend_runs={suspend_runs})",
                timeout=600 + delivery_timeout,
            )
    first = [
        (r["first_stage_started_at"] - r["created_at"]) * 1000
        for r in data["runs"]
        if r["first_stage_started_at"] is not None
    ]
    # suspended stage: due (next_poll_at of its stage:suspended event) -> check ran -> resumed
    due: dict[str, float] = {}
    for ev in data["outbox"]:
        if ev["type"] == "stage:suspended" and ev["run"] not in due:
            value = (ev["payload"] or {}).get("next_poll_at")
            if value:
                from datetime import datetime

                due[ev["run"]] = datetime.fromisoformat(value).timestamp()
    checks: dict[str, float] = {}
    for c in data["checks"]:
        checks.setdefault(c["run"], c["checked_at"])
    due_to_check = [(checks[r] - due[r]) * 1000 for r in due if r in checks]
    completed = data["suspend_stage_completed"]
    due_to_resumed = [(completed[r] - due[r]) * 1000 for r in due if completed.get(r)]
    failed = [r for r in data["runs"] + data["suspend_runs"] if r["status"] != "COMPLETED"]
    return {
        "runs": runs,
        "pause_s": pause,
        "create_to_first_stage_started": _ms(first),
        "suspend_runs": suspend_runs,
        "suspended_due_to_check": _ms(due_to_check),
        "suspended_due_to_resumed": _ms(due_to_resumed),
        "event_delivery": delivery_stats(data, delivery_timeout),
        "runs_not_completed": len(failed),
        "loadavg_1m": round(os.getloadavg()[0], 2),
    }


def delivery_stats(
    data: dict[str, Any], wait_s: float, *, committed_at: float | None = None
) -> dict[str, Any]:
    """Event delivery latency, per event, first delivery only: from the moment the event could
    be seen (its transaction's commit) to the plugin's call (wall time recorded in the
    plugin).

    The outbox row's ``created_at`` is the kernel clock *inside* the writing transaction, so
    for a short transaction (a stage's outcome, a run created on its own) it is the commit to
    within milliseconds. ``committed_at``: the wall time a long transaction that wrote events
    committed (the burst's one creation transaction, ``t_committed``, taken by the first of
    its ``on_commit`` callbacks); no event is visible before it, so each event counts from
    ``max(created_at, committed_at)``. Without that, the 300 ``run:created`` events of a burst
    (9 % of its events) carried the length of the creation transaction (0.3-0.6 s) into the
    p95. ``written_*`` keeps the ``created_at``-based figures beside.

    An event not delivered within the wait counts as delivered at ``wait_s`` (a floor, so the
    percentiles are lower bounds when ``undelivered_within_wait`` > 0)."""
    by_id = {ev["event_id"]: ev for ev in data["outbox"]}
    by_seq = {(ev["run"], ev["sequence"]): ev for ev in data["outbox"]}
    from_commit: dict[int, float] = {}
    from_written: dict[int, float] = {}
    for d in data["deliveries"]:
        ev = by_id.get(d.get("event_id")) or by_seq.get((d["run"], d["sequence"]))
        if ev is not None and ev["event_id"] not in from_commit:
            visible = max(ev["created_at"], committed_at or ev["created_at"])
            from_commit[ev["event_id"]] = (d["delivered_at"] - visible) * 1000
            from_written[ev["event_id"]] = (d["delivered_at"] - ev["created_at"]) * 1000
    undelivered = len(data["outbox"]) - len(from_commit)
    floor = [wait_s * 1000] * undelivered
    written = _ms(list(from_written.values()) + floor)
    return {
        **_ms(list(from_commit.values()) + floor),
        **{f"written_{k}": v for k, v in written.items()},
        "events": len(data["outbox"]),
        "undelivered_within_wait": undelivered,
        "wait_s": wait_s,
    }


def burst(dbs: Databases, backend: str, runs: int, *, delivery_timeout: float) -> dict[str, Any]:
    """Section 5: ``runs`` bench-4 runs created in one transaction (visible at once), with the
    delivery plugin (event delivery under a burst)."""
    plugin = "bench.benchapp.plugins.delivery_recorder"
    with fresh_project(dbs, backend, "burst", WORKFLOWS_PLUGINS=plugin) as (env, var_dir):
        with running_cluster(env, var_dir) as cluster, backend_cpu(_db_url(env)) as sampler:
            data = shell_json(
                cluster.driver_env(),
                "from bench.benchapp.drivers import create_and_wait; "
                f"create_and_wait({runs}, one_transaction=True, "
                f"delivery_timeout={delivery_timeout})",
                timeout=600 + delivery_timeout,
            )
            out = _run_metrics(data)
            last = (
                max((r["completed_at"] or 0 for r in data["runs"]), default=0)
                or (data["t_seen_done"])
            )
            _close_server_window(data, cluster, env, data["t_seen_done"])
            out.update(
                server_metrics(
                    data, sampler, data["t_start"], last, out["completed"] * STAGES_PER_RUN
                )
            )
    out["event_delivery"] = delivery_stats(data, delivery_timeout, committed_at=data["t_committed"])
    out["loadavg_1m"] = round(os.getloadavg()[0], 2)
    return out


def bursts(
    dbs: Databases, backend: str, runs: int, count: int, *, delivery_timeout: float
) -> dict[str, Any]:
    """Section 5, ``count`` times (each on a fresh database and cluster): the burst whose
    ``p50_over_burst`` is the (lower) median of them, with every burst's shape, steady-rate
    value and delivery p95 under ``"bursts"``, and the worst delivery p95 (what the delivery
    target reads). A burst that fails is listed with its error; all failing raises the last
    error."""
    results: list[dict[str, Any]] = []
    last_error: Exception | None = None
    for _ in range(count):
        try:
            results.append(burst(dbs, backend, runs, delivery_timeout=delivery_timeout))
        except Exception as exc:  # one failed burst must not hide the others
            last_error = exc
            results.append({"error": repr(exc)})
    ok = [r for r in results if "error" not in r and r.get("p50_over_burst") is not None]
    if not ok:
        if last_error is not None:
            raise last_error
        return {"error": "no burst completed", "bursts": results}
    by_shape = sorted(ok, key=lambda r: r["p50_over_burst"])
    chosen = dict(by_shape[(len(by_shape) - 1) // 2])
    p95s = [_get_p95(r) for r in ok]
    chosen.update(
        {
            "bursts": [
                {
                    "p50_over_burst": r.get("p50_over_burst"),
                    "steady_rate_value": r.get("steady_rate_value"),
                    "first_completion_s": r.get("first_completion_s"),
                    "burst_seconds": r.get("burst_seconds"),
                    "event_delivery_p95_ms": _get_p95(r),
                    "loadavg_1m": r.get("loadavg_1m"),
                    **({"error": r["error"]} if "error" in r else {}),
                }
                for r in results
            ],
            "event_delivery_p95_ms_max": max((p for p in p95s if p is not None), default=None),
        }
    )
    return chosen


def _get_p95(result: dict[str, Any]) -> float | None:
    delivery = result.get("event_delivery")
    return delivery.get("p95_ms") if isinstance(delivery, dict) else None


def idle_cluster(dbs: Databases, backend: str, seconds: float) -> dict[str, Any]:
    """Section 6: a cluster up with no runs for ``seconds`` (from 10.5 s after its start):
    statements/s summed over every cluster process (bench/benchapp/sqlcount.py), the cluster's
    CPU % of one core (a busy-wait shows as tens of %), and on PostgreSQL the server's
    commits/s and backend CPU %."""
    import time

    with fresh_project(dbs, backend, "idle") as (env, var_dir):
        with (
            running_cluster(env, var_dir, count_statements=True) as cluster,
            backend_cpu(_db_url(env)) as sampler,
        ):
            conn = None
            dbname = _db_url(env).rsplit("/", 1)[1]
            if backend == "postgres":
                import psycopg

                conn = psycopg.connect(PG_ADMIN_URL, autocommit=True)
            try:
                # start-up over (and, on PostgreSQL, its idle backends' counters flushed)
                time.sleep(max(2.0, cluster.started_at + IDLE_FLUSH_S - time.time()))
                t0 = time.time()
                before = db_counters(conn, dbname) if conn is not None else None
                time.sleep(seconds)
                t1 = time.time()
                cluster.wait_sample_after(t1)
                after = db_counters(conn, dbname) if conn is not None else None
            finally:
                if conn is not None:
                    conn.close()
            counted = cluster.statements_between(t0, t1)
            cpu = cluster.cpu_between(t0, t1)
            processes = cluster.cpu_seconds().processes
            pg = None
            if sampler is not None:
                sampler.wait_sample_after(t1)
                pg = sampler.cpu_between(t0, t1)
    window = t1 - t0
    out: dict[str, Any] = {
        "seconds": round(window, 2),
        "cluster_processes": processes,
        "statements": counted[0] if counted else None,
        "health_checks": counted[1] if counted else None,
        # every statement a cluster process sends: cursor statements + health checks
        "statements_per_s": _round(sum(counted) / window if counted else None),
        "cursor_statements_per_s": _round(counted[0] / window if counted else None),
        "cluster_cpu_percent": _round(cpu * 100 / window if cpu is not None else None),
        "loadavg_1m": round(os.getloadavg()[0], 2),
    }
    if before is not None and after is not None:
        # both reads lag the backends' flush by up to 1 s alike, so the rate is unbiased
        delta = counter_delta(before, after)
        out["server_commits_per_s"] = _round(delta["xact_commit"] / window)
        out["server"] = delta
    if pg is not None:
        out["pg_cpu_percent"] = _round(pg["cpu_s"] * 100 / window)
    return out
