"""The benchmark: ``.venv/bin/python -m bench [--runs N] [--rounds R] [--db postgres|sqlite|both]
[--quick]``. Writes ``bench/results/<YYYY-MM-DD>.json`` and ``.md`` (``<date>-quick.*`` with
``--quick``, git-ignored) and prints the markdown.

Per database: interleaved rounds of ours / peers (section 1 is the "ours" side of those
rounds), then the in-process counts, the idle-cluster latencies and the burst. See
bench/README.md for what is measured and how.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from datetime import date, datetime
from pathlib import Path
from typing import Any

from . import sections
from .common import Databases, background_load
from .report import (
    environment,
    evaluate_targets,
    render_markdown,
    summarize_conditions,
    summarize_rounds,
)

RESULTS = Path(__file__).resolve().parent / "results"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=None, help="runs per measurement (300)")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds (3)")
    parser.add_argument("--db", choices=["postgres", "sqlite", "both"], default="both")
    parser.add_argument("--quick", action="store_true", help="smoke check: 30 runs, 1 round")
    parser.add_argument("--latency-runs", type=int, default=None, help="idle runs (20)")
    parser.add_argument(
        "--delivery-wait", type=float, default=None, help="s to wait for event delivery (75)"
    )
    parser.add_argument(
        "--bursts", type=int, default=None, help="one-transaction bursts, median reported (3)"
    )
    parser.add_argument("--pgbench-seconds", type=int, default=None, help="per pgbench run (5)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="results directory")
    parser.add_argument(
        "--load",
        choices=["quiet", "loaded", "both"],
        default="both",
        help="rounds without and/or with one busy core started by the bench (both)",
    )
    parser.add_argument(
        "--idle-seconds", type=float, default=None, help="idle-cluster window in s (20)"
    )
    # --- scale section (bench/scale.py, issue 19) ---
    parser.add_argument(
        "--scale",
        action="store_true",
        help="also the scale section: 1M finished + 10k live runs (100k + 1k with --quick)",
    )
    args = parser.parse_args(argv)
    quick = args.quick
    args.runs = args.runs or (30 if quick else 300)
    args.rounds = args.rounds or (1 if quick else 3)
    args.latency_runs = args.latency_runs or (5 if quick else 20)
    args.delivery_wait = (
        args.delivery_wait if args.delivery_wait is not None else (20.0 if quick else 75.0)
    )
    args.pgbench_seconds = args.pgbench_seconds or (2 if quick else 5)
    args.bursts = args.bursts or (1 if quick else 3)
    args.idle_seconds = args.idle_seconds or (5.0 if quick else 20.0)
    return args


def guarded(errors: list[str], label: str, fn: Callable[[], Any]) -> Any:
    """``fn()``, or ``{"error": ...}`` (also appended to ``errors``) if it raises."""
    try:
        return fn()
    except Exception as exc:
        message = f"{label}: {exc!r}"
        errors.append(message)
        print(f"[bench] ERROR {message}\n{traceback.format_exc()}", file=sys.stderr)
        return {"error": repr(exc)}


def log(message: str) -> None:
    print(f"[bench {datetime.now():%H:%M:%S}] {message}", file=sys.stderr, flush=True)


def bench_database(
    dbs: Databases, backend: str, args: argparse.Namespace, errors: list[str]
) -> dict[str, Any]:
    """All sections on one database."""
    n = args.runs
    rounds: list[dict[str, Any]] = []
    conditions = ["quiet", "loaded"] if args.load == "both" else [args.load]
    for r in range(1, args.rounds + 1):
        entry: dict[str, Any] = {"round": r}
        for condition in conditions:
            # quiet results stay at the round's top level (the existing keys); loaded ones
            # go under "loaded", measured with one busy core the bench starts and kills
            target = entry if condition == "quiet" else entry.setdefault("loaded", {})
            peers: list[tuple[str, Callable[[], Any]]] = [
                ("ours", lambda: sections.ours_throughput(dbs, backend, n)),
            ]
            if backend == "postgres":
                peers += [
                    ("dbos_direct", lambda: sections.dbos(dbs, n, "direct")),
                    ("dbos_queue", lambda: sections.dbos(dbs, n, "queue")),
                ]
            peers.append(("django_q2_chain", lambda: sections.django_q2_chain(dbs, backend, n)))
            if backend == "postgres" and condition == "quiet":
                peers += [
                    ("pgbench_1", lambda: sections.pgbench(dbs, 1, args.pgbench_seconds)),
                    ("pgbench_4", lambda: sections.pgbench(dbs, 4, args.pgbench_seconds)),
                ]
            with background_load(condition == "loaded"):
                for name, fn in peers:
                    label = f"{backend} round {r} {condition} {name}"
                    log(f"{backend} round {r}/{args.rounds} ({condition}): {name}")
                    target[name] = guarded(errors, label, fn)
                    if isinstance(target[name], dict) and target[name].get("error"):
                        errors.append(f"{label}: {target[name]['error'][:300]}")
                target["loadavg_1m"] = round(os.getloadavg()[0], 2)
        rounds.append(entry)
    out: dict[str, Any] = {
        "rounds": rounds,
        **summarize_rounds(rounds),
        "conditions": summarize_conditions(rounds),
    }
    log(f"{backend}: in-process counts")
    out["statements"] = guarded(
        errors, f"{backend} statements", lambda: sections.in_process(dbs, backend)
    )
    log(f"{backend}: idle latency ({args.latency_runs} runs)")
    out["latency"] = guarded(
        errors,
        f"{backend} latency",
        lambda: sections.idle_latency(
            dbs, backend, args.latency_runs, pause=0.5, delivery_timeout=args.delivery_wait
        ),
    )
    log(f"{backend}: {args.bursts} bursts of {n}")
    out["burst"] = guarded(
        errors,
        f"{backend} burst",
        lambda: sections.bursts(dbs, backend, n, args.bursts, delivery_timeout=args.delivery_wait),
    )
    log(f"{backend}: idle cluster ({args.idle_seconds} s)")
    out["idle"] = guarded(
        errors,
        f"{backend} idle cluster",
        lambda: sections.idle_cluster(dbs, backend, args.idle_seconds),
    )
    return out


def missing_requirements() -> list[str]:
    """The modules the bench cannot measure without (the ``bench`` extra), not importable
    here. DBOS is in the extra too but optional: its rounds report an error without it."""
    import importlib.util

    return [name for name in ("psutil",) if importlib.util.find_spec(name) is None]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    missing = missing_requirements()
    if missing:
        print(
            f"python -m bench: {', '.join(missing)} is not installed; install the bench "
            "extra first: .venv/bin/pip install -e '.[bench]'",
            file=sys.stderr,
        )
        return 2
    backends = ["postgres", "sqlite"] if args.db == "both" else [args.db]
    started = time.time()
    result: dict[str, Any] = {
        "date": date.today().isoformat(),
        "started_at": datetime.now().isoformat(timespec="seconds"),
        "args": {
            k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "out"
        },
        "environment": environment(),
        "databases": {},
    }
    errors: list[str] = []
    dbs = Databases()
    try:
        for backend in backends:
            result["databases"][backend] = bench_database(dbs, backend, args, errors)
        # --- scale section (bench/scale.py, issue 19): PostgreSQL only ---
        if args.scale:
            from . import scale

            log("postgres: scale section")
            result["scale"] = guarded(
                errors,
                "scale",
                lambda: scale.run(
                    dbs,
                    100_000 if args.quick else 1_000_000,
                    1_000 if args.quick else 10_000,
                    50,
                ),
            )
    finally:
        drop_errors = dbs.drop_all()
        errors += [f"cleanup: {e}" for e in drop_errors]
    result["environment"]["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    result["seconds"] = round(time.time() - started, 1)
    primary = "postgres" if "postgres" in result["databases"] else backends[0]
    ratios = result["databases"][primary].get("ratios", {})
    result["ratio_vs_dbos"] = ratios.get("vs_dbos_direct", {}).get("median")
    result["ratio_vs_django_q2"] = ratios.get("vs_django_q2_chain", {}).get("median")
    result["ratio_database"] = primary
    # per condition (quiet / loaded): medians of rounds on the primary database
    result["ratios_by_condition"] = {
        condition: {
            "ratio_vs_dbos": c.get("ratio_vs_dbos_direct"),
            "ratio_vs_dbos_queue": c.get("ratio_vs_dbos_queue"),
            "ratio_vs_django_q2": c.get("ratio_vs_django_q2_chain"),
            "loadavg_1m_median": c.get("loadavg_1m_median"),
        }
        for condition, c in result["databases"][primary].get("conditions", {}).items()
    }
    result["targets"] = evaluate_targets(result)
    result["errors"] = errors
    markdown = render_markdown(result)
    if "scale" in result:  # the scale section renders itself (bench/scale.py)
        from . import scale

        markdown += "\n" + scale.render_markdown(result["scale"])
    args.out.mkdir(parents=True, exist_ok=True)
    # --quick results get their own name (never overwrite, never to be committed)
    stem = args.out / (result["date"] + ("-quick" if args.quick else ""))
    stem.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    stem.with_suffix(".md").write_text(markdown)
    print(markdown)
    log(f"wrote {stem}.json and {stem}.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
