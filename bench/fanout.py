"""Fan-out benchmark (issue 18 item 3): one run mapping N trivial items (default 10,000)
through a real 2-worker cluster, against a django-q2 group of N trivial tasks on the same
cluster configuration; fresh PostgreSQL database per measurement, interleaved rounds, the
load average recorded per round, the result as ratios. Not a timed test.

    .venv/bin/python -m bench.fanout [--items 10000] [--rounds 3] [--db postgres|sqlite]

Prints markdown and writes ``bench/results/<date>-fanout.json``. DBOS is not measured here
(``pip install dbos`` was not available when this was written).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.fanout")
    parser.add_argument("--items", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--db", choices=("postgres", "sqlite"), default="postgres")
    args = parser.parse_args(argv)
    dbs = Databases()
    rounds: list[dict[str, Any]] = []
    try:
        for number in range(1, args.rounds + 1):
            # Interleaved, the order alternating per round, so drift hits both sides alike.
            pair: dict[str, Any] = {"round": number}
            order = (("ours", ours), ("django_q2", django_q2))
            for name, fn in order if number % 2 else order[::-1]:
                print(f"round {number}: {name} ...", file=sys.stderr)
                pair[name] = fn(dbs, args.db, args.items)
            pair["ratio"] = round(pair["ours"]["seconds"] / pair["django_q2"]["seconds"], 2)
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
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{report['date']}-fanout.json").write_text(json.dumps(report, indent=2) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
