"""Fan-out benchmark (issue 18 item 3): one run mapping N trivial items (default 10,000)
through a real 2-worker cluster, against a django-q2 group of N trivial tasks on the same
cluster configuration; fresh PostgreSQL database per measurement, interleaved rounds, the
load average recorded per round, the result as ratios. Not a timed test.

    .venv/bin/python -m bench.fanout [--items 10000] [--rounds 3] [--db postgres|sqlite] [--dbos]

Prints markdown and writes ``bench/results/<date>-fanout.json``. DBOS Transact is measured
with ``--dbos`` (``bench.dbos_fanout_peer``: one workflow enqueueing N one-step
workflows on a durable queue).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from .common import Databases, median, running_cluster, shell_json
from .sections import fresh_project

RESULTS = Path(__file__).resolve().parent / "results"


def ours(dbs: Databases, backend: str, items: int) -> dict[str, Any]:
    with fresh_project(dbs, backend, "fan") as (env, var_dir):
        with running_cluster(env, var_dir) as cluster:
            data = shell_json(
                env, f"from bench.benchapp.fanout import fanout_and_wait; fanout_and_wait({items})"
            )
            peak = round(cluster.peak_worker_rss / 2**20, 1)
    seconds = data["t_done"] - data["t_start"]
    return {
        "seconds": round(seconds, 2),
        "items_per_s": round(items / seconds, 1),
        "status": data["status"],
        "ok": data["ok"],
        "timed_out": data["timed_out"],
        "peak_worker_rss_mb": peak,
        "loadavg_1m": round(os.getloadavg()[0], 2),
    }


def django_q2(dbs: Databases, backend: str, items: int) -> dict[str, Any]:
    with fresh_project(dbs, backend, "fanq") as (env, var_dir):
        with running_cluster(env, var_dir) as cluster:
            data = shell_json(
                env, f"from bench.benchapp.fanout import group_and_wait; group_and_wait({items})"
            )
            peak = round(cluster.peak_worker_rss / 2**20, 1)
    seconds = data["t_done"] - data["t_start"]
    return {
        "seconds": round(seconds, 2),
        "enqueue_seconds": round(data["t_enqueued"] - data["t_start"], 2),
        "items_per_s": round(items / seconds, 1),
        "timed_out": data["timed_out"],
        "peak_worker_rss_mb": peak,
        "loadavg_1m": round(os.getloadavg()[0], 2),
    }


def dbos_peer(dbs: Databases, backend: str, items: int) -> dict[str, Any]:
    """DBOS Transact (``bench.dbos_fanout_peer``) on its own fresh PostgreSQL database; a
    failure is returned as ``{"error": ...}``, never raised."""
    try:
        import dbos as _dbos  # noqa: F401
    except Exception as exc:
        return {"error": f"dbos is not importable: {exc!r}"}
    url = dbs.postgres("dbosfan")
    try:
        done = subprocess.run(
            [sys.executable, "-m", "bench.dbos_fanout_peer", "--url", url, "--items", str(items)],
            cwd=Path(__file__).resolve().parents[1],
            capture_output=True,
            text=True,
            timeout=1800,
        )
        lines = done.stdout.strip().splitlines()
        if done.returncode != 0 or not lines:
            return {"error": f"exit {done.returncode}: {done.stderr[-1500:]}"}
        out = json.loads(lines[-1])
        out["seconds"] = round(out["seconds"], 2)
        out["loadavg_1m"] = round(os.getloadavg()[0], 2)
        return out
    except Exception as exc:
        return {"error": repr(exc)}
    finally:
        dbs.drop(url)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.fanout")
    parser.add_argument("--items", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--db", choices=("postgres", "sqlite"), default="postgres")
    parser.add_argument("--dbos", action="store_true", help="also measure the DBOS peer (PG)")
    args = parser.parse_args(argv)
    dbs = Databases()
    rounds: list[dict[str, Any]] = []
    try:
        for number in range(1, args.rounds + 1):
            # Interleaved, the order alternating per round, so drift hits both sides alike.
            pair: dict[str, Any] = {"round": number}
            order: tuple[tuple[str, Any], ...] = (("ours", ours), ("django_q2", django_q2))
            if args.dbos:
                order += (("dbos", dbos_peer),)
            for name, fn in order if number % 2 else order[::-1]:
                print(f"round {number}: {name} ...", file=sys.stderr)
                pair[name] = fn(dbs, args.db, args.items)
            pair["ratio"] = round(pair["ours"]["seconds"] / pair["django_q2"]["seconds"], 2)
            if "seconds" in pair.get("dbos", {}):
                pair["ratio_dbos"] = round(pair["ours"]["seconds"] / pair["dbos"]["seconds"], 2)
            rounds.append(pair)
    finally:
        dbs.drop_all()
    ratio = median([r["ratio"] for r in rounds])
    report = {
        "date": dt.date.today().isoformat(),
        "items": args.items,
        "db": args.db,
        "workers": 2,
        "rounds": rounds,
        "median_ratio_ours_over_django_q2": ratio,
    }
    lines = [
        f"# Fan-out: one run of {args.items} mapped items vs a django-q2 group "
        f"({args.db}, 2 workers)",
        "",
        "| round | ours s | django-q2 s | ratio (ours/q2) | ours peak worker RSS MB | load 1m |",
        "|---|---|---|---|---|---|",
    ]
    for r in rounds:
        lines.append(
            f"| {r['round']} | {r['ours']['seconds']} | {r['django_q2']['seconds']} | {r['ratio']} "
            f"| {r['ours']['peak_worker_rss_mb']} | {r['ours']['loadavg_1m']} |"
        )
    lines += ["", f"Median ratio: {ratio} (ours / django-q2 wall time; lower is better)."]
    dbos_ratios = [r["ratio_dbos"] for r in rounds if "ratio_dbos" in r]
    if dbos_ratios:
        report["median_ratio_ours_over_dbos"] = median(dbos_ratios)
        seconds = ", ".join(str(r["dbos"]["seconds"]) for r in rounds if "ratio_dbos" in r)
        lines.append(
            f"DBOS (one workflow enqueueing {args.items} one-step workflows on a durable queue, "
            f"worker_concurrency 2): {seconds} s; median ratio ours / DBOS "
            f"{report['median_ratio_ours_over_dbos']}."
        )
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{report['date']}-fanout.json").write_text(json.dumps(report, indent=2) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
