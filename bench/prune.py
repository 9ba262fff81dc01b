"""Retention under load (issue 20 part 1): pruning N finished runs while a real cluster runs
the stage workload.

``python -m bench.prune [--finished N] [--runs R] [--rounds K] [--batch-size B]``:

1. a fresh PostgreSQL database ``dw_bench_prune_*``; ``N`` finished runs (default 1,000,000)
   with their stages, jobs, published events and annotations, seeded by :mod:`bench.scale`'s
   bulk SQL (the runs finished 2 hours to ~N*2.5 s ago);
2. a real 2-worker ``qcluster`` (no retention duty: ``RETENTION`` unset in its environment);
3. ``K`` interleaved rounds, each: ``R`` ``bench-4`` runs created and driven to completion
   alone (the baseline), then ``R`` more while ``manage.py workflows_prune`` (policy: every
   terminal run older than 1 hour) runs in another process, stopped with SIGINT once the
   workload is done (it stops between batches and prints its ``--json`` report);
4. every workload run is checked: COMPLETED, its 4 stages COMPLETED, every event published;
   the number of runs left is checked against what the prune reports deleted.

Reports per round: stages/s without and with the prune beside it (and their ratio), the
prune's deletion rate (runs/s, rows/s), the 1-minute load average; writes
``bench/results/<date>-prune[-<N>].json`` and ``.md``. The machine may be shared: the load
average says how busy it was.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from .common import ROOT, Databases, median, migrate, project_env, running_cluster, shell_json
from .sections import STAGES_PER_RUN, _run_metrics

RESULTS = ROOT / "bench" / "results"
#: every terminal run that finished more than an hour ago (the seeded ones; never the
#: workload's own runs)
POLICY = {"DEFAULT_DAYS": {"COMPLETED": 1 / 24, "FAILED": 1 / 24, "CANCELLED": 1 / 24}}


def _log(msg: str) -> None:
    print(f"[prune {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def seed(env: dict[str, str], finished: int) -> dict[str, Any]:
    return shell_json(
        env,
        "import json; from bench.scale import populate; "
        f"print(json.dumps(populate({int(finished)}, 0)))",
        timeout=7200,
    )


def workload(env: dict[str, str], runs: int) -> dict[str, Any]:
    """``runs`` bench-4 runs created and driven to completion (:func:`_run_metrics`, plus
    ``t_start``: when the first was created, wall time)."""
    data = shell_json(
        env, f"from bench.benchapp.drivers import create_and_wait; create_and_wait({runs})"
    )
    return {**_run_metrics(data), "t_start": data["t_start"]}


def check_workload(env: dict[str, str], since: float) -> dict[str, Any]:
    """Every bench-4 run created since ``since``: its status, stages and events."""
    code = f"""
import json
from datetime import datetime, UTC
from django.db.models import Count, Q
from django_workflows.models import WorkflowRun, WorkflowStage, OutboxEvent
since = datetime.fromtimestamp({since}, UTC)
runs = WorkflowRun.objects.filter(workflow_id="bench-4", created_at__gte=since)
ids = list(runs.values_list("pk", flat=True))
print(json.dumps({{
    "runs": len(ids),
    "not_completed": runs.exclude(status="COMPLETED").count(),
    "stages_completed": WorkflowStage.objects.filter(run_id__in=ids, status="COMPLETED").count(),
    "events": OutboxEvent.objects.filter(workflow_run_id__in=ids).count(),
    "events_unpublished": OutboxEvent.objects.filter(
        workflow_run_id__in=ids, published_at__isnull=True).count(),
}}))
"""
    return shell_json(env, code)


def count_runs(env: dict[str, str]) -> int:
    code = (
        "import json; from django_workflows.models import WorkflowRun; "
        "print(json.dumps(WorkflowRun.objects.count()))"
    )
    return int(shell_json(env, code))


class Pruner:
    """``manage.py workflows_prune --json`` in a subprocess, stopped with SIGINT."""

    def __init__(self, env: dict[str, str], batch_size: int, pause: float = 0.0) -> None:
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "manage.py",
                "workflows_prune",
                "--json",
                "--no-progress",
                "--batch-size",
                str(batch_size),
                "--pause",
                str(pause),
            ],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.t0 = time.time()

    def stop(self, timeout: float = 120) -> dict[str, Any]:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        out, err = self.proc.communicate(timeout=timeout)
        wall = time.time() - self.t0
        if self.proc.returncode not in (0, 3):
            raise RuntimeError(f"workflows_prune exited {self.proc.returncode}:\n{err[-3000:]}")
        report = json.loads(out.strip().splitlines()[-1])
        rows = sum(report["rows"].values())
        return {
            "exit": self.proc.returncode,
            "runs_deleted": report["runs_total"],
            "rows_deleted": rows,
            "batches": report["batches"],
            "skipped_locked": report["skipped_locked"],
            "seconds": report["seconds"],
            "wall_seconds": round(wall, 2),
            "runs_per_s": report["runs_per_second"],
            "rows_per_s": round(rows / report["seconds"], 1) if report["seconds"] else None,
            "complete": report["complete"],
        }


def run(
    finished: int,
    runs: int,
    rounds: int,
    batch_size: int,
    database: str | None = None,
    pause: float = 0.0,
) -> dict[str, Any]:
    """The measurement; ``database``: a database seeded by an earlier, interrupted run
    (``dw_bench_prune_*``, kept afterwards) instead of a fresh one."""
    dbs = Databases()
    out: dict[str, Any] = {
        "finished": finished,
        "runs_per_workload": runs,
        "rounds": [],
        "batch_size": batch_size,
        "pause_seconds": pause,
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "cpus": os.cpu_count(),
    }
    try:
        url = database or dbs.postgres("prune")
        var_dir = dbs.workdir("prune")
        env = project_env(url, var_dir)
        prune_env = {**env, "WORKFLOWS_RETENTION": json.dumps(POLICY)}
        migrate(env)
        if database:
            out["finished"] = count_runs(env)
            out["seed"] = {
                "reused": url.rsplit("/", 1)[1],
                "rows": {"workflow_runs": out["finished"]},
            }
            out["seed_seconds"] = None
            _log(f"reusing {url}: {out['finished']:,} runs")
        else:
            _log(f"seeding {finished:,} finished runs")
            t0 = time.perf_counter()
            out["seed"] = seed(env, finished)
            out["seed_seconds"] = round(time.perf_counter() - t0, 1)
            _log(f"seeded in {out['seed_seconds']} s: {out['seed']['rows']}")
        with running_cluster(env, var_dir) as cluster:
            workload(cluster.driver_env(), min(runs, 50))  # warm-up
            for r in range(rounds):
                alone = workload(cluster.driver_env(), runs)
                alone["loadavg_1m"] = round(os.getloadavg()[0], 2)
                before = count_runs(env)
                pruner = Pruner(prune_env, batch_size, pause)
                time.sleep(1.0)  # the prune is deleting before the workload starts
                during = workload(cluster.driver_env(), runs)
                during["loadavg_1m"] = round(os.getloadavg()[0], 2)
                during["check"] = check_workload(env, during["t_start"] - 0.5)
                prune = pruner.stop()
                after = count_runs(env)
                prune["runs_left"] = after
                prune["runs_before"] = before
                ratio = (
                    round(during["stages_per_s"] / alone["stages_per_s"], 3)
                    if alone["stages_per_s"]
                    else None
                )
                row = {
                    "round": r + 1,
                    "alone": alone,
                    "with_prune": during,
                    "prune": prune,
                    "stages_per_s_ratio": ratio,
                }
                out["rounds"].append(row)
                _log(
                    f"round {r + 1}: {alone['stages_per_s']} stages/s alone, "
                    f"{during['stages_per_s']} with prune (x{ratio}); prune "
                    f"{prune['runs_per_s']} runs/s, {prune['runs_deleted']} runs; "
                    f"check {during['check']}"
                )
                if prune["complete"]:
                    break  # nothing left to prune
        out["summary"] = summarize(out["rounds"])
    finally:
        errors = dbs.drop_all()
        if errors:
            _log(f"could not drop: {errors}")
    return out


def summarize(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    def med(values: list[Any]) -> float | None:
        values = [v for v in values if v is not None]
        value = median(values)
        return None if value is None else round(value, 3)

    lost = [
        r["round"]
        for r in rounds
        if r["with_prune"]["check"]["not_completed"]
        or r["with_prune"]["check"]["events_unpublished"]
        or r["with_prune"]["check"]["stages_completed"]
        != r["with_prune"]["check"]["runs"] * STAGES_PER_RUN
    ]
    return {
        "stages_per_s_alone": med([r["alone"]["stages_per_s"] for r in rounds]),
        "stages_per_s_with_prune": med([r["with_prune"]["stages_per_s"] for r in rounds]),
        "stages_per_s_ratio": med([r["stages_per_s_ratio"] for r in rounds]),
        "prune_runs_per_s": med([r["prune"]["runs_per_s"] for r in rounds]),
        "prune_rows_per_s": med([r["prune"]["rows_per_s"] for r in rounds]),
        "runs_deleted": sum(r["prune"]["runs_deleted"] for r in rounds),
        "rounds_with_a_live_run_damaged": lost,
    }


def render_markdown(result: dict[str, Any]) -> str:
    s = result["summary"]
    lines = [
        f"## Retention under load (issue 20): pruning {result['finished']:,} finished runs",
        "",
        f"{result['date']}, PostgreSQL, a real 2-worker qcluster, {result['cpus']} CPUs "
        "(a machine shared with other sessions: see the load averages). "
        f"Workload: {result['runs_per_workload']} `bench-4` runs per phase; prune: "
        f"`workflows_prune --batch-size {result['batch_size']} --pause "
        f"{result.get('pause_seconds', 0)}` in its own process, every "
        f"terminal run older than 1 hour. Seeding: {result['seed_seconds']} s "
        f"({result['seed']}).",
        "",
        f"- stages/s alone (median): **{s['stages_per_s_alone']}**; with the prune beside it: "
        f"**{s['stages_per_s_with_prune']}**; ratio **{s['stages_per_s_ratio']}**",
        f"- deletion rate while the workers run (median): **{s['prune_runs_per_s']} runs/s** "
        f"({s['prune_rows_per_s']} rows/s); {s['runs_deleted']:,} runs deleted in all",
        f"- live runs damaged: {s['rounds_with_a_live_run_damaged'] or 'none'} (every "
        "workload run COMPLETED with its 4 stages and every event published)",
        "",
        "| round | stages/s alone | load | stages/s with prune | load | ratio | prune runs/s "
        "| rows/s | runs deleted | batches | skipped locked | runs left |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rounds"]:
        a, w, p = r["alone"], r["with_prune"], r["prune"]
        lines.append(
            f"| {r['round']} | {a['stages_per_s']} | {a['loadavg_1m']} | {w['stages_per_s']} "
            f"| {w['loadavg_1m']} | {r['stages_per_s_ratio']} | {p['runs_per_s']} "
            f"| {p['rows_per_s']} | {p['runs_deleted']:,} | {p['batches']} "
            f"| {p['skipped_locked']} | {p['runs_left']:,} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.prune", description=__doc__)
    parser.add_argument("--finished", type=int, default=1_000_000, help="seeded finished runs")
    parser.add_argument("--runs", type=int, default=300, help="bench-4 runs per phase (300)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds (3)")
    parser.add_argument("--batch-size", type=int, default=500, help="prune batch size (500)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="results directory")
    parser.add_argument("--pause", type=float, default=0.0, help="prune --pause (0)")
    parser.add_argument(
        "--database",
        default=None,
        help="URL of a dw_bench_prune_* database seeded by an interrupted run: reused, kept",
    )
    args = parser.parse_args(argv)
    result = run(args.finished, args.runs, args.rounds, args.batch_size, args.database, args.pause)
    suffix = "" if args.finished == 1_000_000 and not args.database else f"-{args.finished}"
    if args.database:
        suffix = "-reused"
    if args.pause:
        suffix += f"-pause{args.pause:g}"
    stem = f"{datetime.now(UTC).date().isoformat()}-prune{suffix}"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{stem}.json").write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
    markdown = render_markdown(result)
    (args.out / f"{stem}.md").write_text(markdown)
    print(markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
