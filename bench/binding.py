"""Client-side vs server-side binding (and prepared statements) on PostgreSQL, in process.

Interleaved A/B of the stage path with different ``DATABASES["default"]["OPTIONS"]``: every
round runs every variant once (the order rotates from round to round), each variant on a new
connection, ``--warmup`` runs first (imports, psycopg's prepare counts, PostgreSQL's plan
cache), then ``--runs`` runs of ``bench-4`` driven by the kernel in this process exactly as
section 3 drives one (:func:`bench.inprocess.drive_one_run`: CreateRun, then one
``process_available_jobs`` call: claim, four stages, the idle worker's empty lease).

Per variant and round it reports, per stage (divided by runs x 4):

* ``pg_cpu_ms``: user+system CPU of this connection's PostgreSQL backend
  (``pg_backend_pid()``, ``/proc/<pid>/stat``; clock ticks, 10 ms resolution, so a round
  needs a few hundred runs);
* ``client_cpu_ms``: ``time.process_time()`` of this process (Django, psycopg, the kernel);
* ``wall_ms``: wall time of the loop;
* ``prepared``: statements prepared on the server at the end (``pg_prepared_statements``).

Run inside the example project on a migrated PostgreSQL database, without DEBUG::

    DJANGO_DEBUG=0 EXTRA_INSTALLED_APPS=bench.benchapp DATABASE_URL=postgres://.../db \\
        .venv/bin/python manage.py shell -v0 -c \\
        "from bench.binding import main; main(runs=200, rounds=4)"

It prints one JSON line per variant and round as it goes (to stderr) and, last, one JSON line
with every measurement and the medians per variant, with ratios to ``client`` (the default).
Compare only variants of the same rounds (ratios, not lone absolute times), and note the load
average printed with each round.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from typing import Any

from django.db import connection

from .inprocess import drive_one_run

_TICK = os.sysconf("SC_CLK_TCK")

#: variant name -> OPTIONS added to the project's (None: remove the key)
VARIANTS: dict[str, dict[str, Any]] = {
    "client": {"server_side_binding": None, "prepare_threshold": None},
    "server": {"server_side_binding": True, "prepare_threshold": None},
    "server-prep0": {"server_side_binding": True, "prepare_threshold": 0},
    "server-prep1": {"server_side_binding": True, "prepare_threshold": 1},
    "server-prep5": {"server_side_binding": True, "prepare_threshold": 5},
}


def _backend_cpu_s(pid: int) -> float:
    """utime+stime of process ``pid`` in seconds."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK


def use_variant(name: str, base_options: dict[str, Any]) -> None:
    """Reconnect ``default`` with ``base_options`` plus the variant's OPTIONS."""
    connection.close()
    options = dict(base_options)
    for key, value in VARIANTS[name].items():
        if value is None:
            options.pop(key, None)
        else:
            options[key] = value
    connection.settings_dict["OPTIONS"] = options
    # cached on the features object from the settings of the first connection
    connection.features.__dict__.pop("uses_server_side_binding", None)
    connection.ensure_connection()


def measure_variant(name: str, base_options: dict[str, Any], runs: int, warmup: int) -> dict:
    """One variant on a fresh connection: ``warmup`` runs, then ``runs`` measured runs."""
    use_variant(name, base_options)
    noop = lambda _name, fn: fn()  # noqa: E731
    for _ in range(warmup):
        drive_one_run(noop)
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        pid = cursor.fetchone()[0]
    load0 = os.getloadavg()[0]
    pg0, cpu0, wall0 = _backend_cpu_s(pid), time.process_time(), time.perf_counter()
    for _ in range(runs):
        drive_one_run(noop)
    pg1, cpu1, wall1 = _backend_cpu_s(pid), time.process_time(), time.perf_counter()
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM pg_prepared_statements")
        prepared = cursor.fetchone()[0]
    stages = runs * 4
    return {
        "variant": name,
        "runs": runs,
        "pg_cpu_ms": round((pg1 - pg0) * 1000 / stages, 3),
        "client_cpu_ms": round((cpu1 - cpu0) * 1000 / stages, 3),
        "wall_ms": round((wall1 - wall0) * 1000 / stages, 3),
        "prepared": prepared,
        "loadavg_1m": round((load0 + os.getloadavg()[0]) / 2, 2),
    }


def main(
    runs: int = 200, rounds: int = 4, warmup: int = 10, variants: list[str] | None = None
) -> dict[str, Any]:
    """Interleave ``variants`` (default all of :data:`VARIANTS`) over ``rounds`` rounds.

    Returns (and prints as the last line) ``{"rows": [...], "median": {variant: {...}},
    "ratio_to_client": {variant: {...}}}``; the ratios are medians of per-round ratios.
    """
    if connection.vendor != "postgresql":
        raise RuntimeError("bench.binding measures PostgreSQL only")
    names = list(variants or VARIANTS)
    base = dict(connection.settings_dict["OPTIONS"])
    for key in ("server_side_binding", "prepare_threshold"):
        base.pop(key, None)
    rows: list[dict[str, Any]] = []
    try:
        for r in range(rounds):
            order = names[r % len(names) :] + names[: r % len(names)]
            for name in order:
                row = {"round": r + 1, **measure_variant(name, base, runs, warmup)}
                rows.append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)
    finally:
        connection.close()
        connection.settings_dict["OPTIONS"] = base
        connection.features.__dict__.pop("uses_server_side_binding", None)
    keys = ("pg_cpu_ms", "client_cpu_ms", "wall_ms")
    median = {
        n: {k: statistics.median(x[k] for x in rows if x["variant"] == n) for k in keys}
        for n in names
    }
    ratios: dict[str, dict[str, float]] = {}
    if "client" in names:
        by_round = {(x["round"], x["variant"]): x for x in rows}
        for n in names:
            ratios[n] = {
                k: round(
                    statistics.median(
                        by_round[(r + 1, n)][k] / by_round[(r + 1, "client")][k]
                        for r in range(rounds)
                        if by_round[(r + 1, "client")][k]
                    ),
                    3,
                )
                for k in keys
            }
    out = {"rows": rows, "median": median, "ratio_to_client": ratios}
    print(json.dumps(out))
    return out
