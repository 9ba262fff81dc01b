"""The DBOS Transact peer, run in its own process (DBOS is a process-wide singleton):

    python -m bench.dbos_peer --url postgresql://.../dw_bench_dbos_x --runs N --mode direct|queue

The workflow mirrors ``bench-4``: step ``a``, then steps ``b`` and ``c``, then step ``d``, all
trivial. DBOS runs the steps of one workflow one after another (parallelism comes from running
workflows concurrently), so each workflow is 4 checkpointed steps.

* ``direct``: 2 threads each call the workflow function directly, ``N/2`` times.
* ``queue``: ``N`` workflows are enqueued on a durable queue with ``worker_concurrency=2``
  (polling interval 0.05 s, so polling does not cap the rate), then awaited.

Prints one JSON line: wall seconds, workflows, steps, steps/s and this process's CPU seconds.
"""

from __future__ import annotations

import argparse
import json
import logging
import threading
import time
from typing import Any

STEPS_PER_WORKFLOW = 4


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", required=True)
    parser.add_argument("--runs", type=int, required=True)
    parser.add_argument("--mode", choices=["direct", "queue"], required=True)
    parser.add_argument(
        "--stats-admin-url",
        default=None,
        help="read pg_stat_database of --url's database from this admin URL around the window",
    )
    args = parser.parse_args()

    import dbos
    from dbos import DBOS, DBOSConfig

    logging.getLogger("dbos").setLevel(logging.WARNING)
    config: DBOSConfig = {
        "name": "dw-bench",
        "system_database_url": args.url,
        "log_level": "WARNING",
    }
    DBOS(config=config)

    @DBOS.step()
    def step_a(n: int) -> int:
        return n + 1

    @DBOS.step()
    def step_b(n: int) -> int:
        return n + 1

    @DBOS.step()
    def step_c(n: int) -> int:
        return n + 2

    @DBOS.step()
    def step_d(b: int, c: int) -> int:
        return b + c

    @DBOS.workflow()
    def bench_4(n: int) -> int:
        a = step_a(n)
        return step_d(step_b(a), step_c(a))

    DBOS.launch()
    burst: dict[str, Any] = {}
    try:
        queue = DBOS.register_queue(
            "dw_bench_queue", worker_concurrency=2, polling_interval_sec=0.05
        )
        for i in range(2):  # warm-up (connections, first-call paths), not measured
            bench_4(-1 - i)
        dbname, before = args.url.rsplit("/", 1)[1].split("?")[0], None
        if args.stats_admin_url:
            # opening read of pg_stat_database (bench/pgstats.py): after the warm-up's idle
            # backends have flushed; the closing read is the bench's, once we have exited
            import psycopg

            from bench.pgstats import IDLE_FLUSH_S, db_counters

            time.sleep(IDLE_FLUSH_S)
            with psycopg.connect(args.stats_admin_url, autocommit=True) as stats_conn:
                before = db_counters(stats_conn, dbname)
        cpu0, t0, t0_wall = time.process_time(), time.perf_counter(), time.time()
        if args.mode == "direct":
            per_thread = [args.runs // 2, args.runs - args.runs // 2]
            errors: list[BaseException] = []

            def worker(count: int, offset: int) -> None:
                try:
                    for i in range(count):
                        bench_4(offset + i)
                except BaseException as exc:  # reported below
                    errors.append(exc)

            threads = [
                threading.Thread(target=worker, args=(per_thread[k], k * args.runs))
                for k in range(2)
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            if errors:
                raise errors[0]
        else:
            handles: list[Any] = [queue.enqueue(bench_4, i) for i in range(args.runs)]
            for h in handles:
                h.get_result()
        seconds = time.perf_counter() - t0
        cpu, t1_wall = time.process_time() - cpu0, time.time()
        if args.mode == "queue":
            burst = _burst_shape(args.url, [h.get_workflow_id() for h in handles])
        # the shape's read is one transaction on the measured database, inside the window
        own = int(burst.pop("burst_shape_read_xacts", 0))
        server = {"before": before, "driver_xacts": 0, "own_xacts": own} if before else None
    finally:
        DBOS.destroy()
    steps = args.runs * STEPS_PER_WORKFLOW
    print(
        json.dumps(
            {
                "mode": args.mode,
                "dbos_version": getattr(dbos, "__version__", None) or _version(),
                "workflows": args.runs,
                "steps": steps,
                "seconds": seconds,
                "steps_per_s": steps / seconds,
                "workflows_per_s": args.runs / seconds,
                "process_cpu_ms_per_step": cpu * 1000 / steps,
                "server": server,
                "t_start": t0_wall,
                "t_end": t1_wall,
                **burst,
            }
        )
    )


def _burst_shape(url: str, workflow_ids: list[str]) -> dict[str, Any]:
    """The queue mode's burst shape, as section 1 measures ours: each workflow's enqueue ->
    completion (``workflow_status.created_at`` -> ``completed_at``, epoch ms written by DBOS
    itself), the median of those ÷ the burst's duration (first enqueue -> last completion),
    and the steady-rate value ``0.5 + (t0 - C) / (2 D)`` (``t0`` the first enqueued
    workflow's latency, ``C`` first -> last enqueue; bench/sections.py
    ``steady_rate_value``). ``{}`` if DBOS's status table cannot be read (another version)
    or a workflow did not succeed."""
    import psycopg

    from bench.sections import p50_over_burst, steady_rate_value

    try:
        with psycopg.connect(url.split("?")[0], autocommit=True) as conn:
            rows = conn.execute(
                "SELECT created_at, COALESCE(completed_at, updated_at) FROM dbos.workflow_status "
                "WHERE workflow_uuid = ANY(%s) AND status = 'SUCCESS' ORDER BY created_at",
                (workflow_ids,),
            ).fetchall()
    except psycopg.Error:
        return {}
    if not rows or len(rows) != len(workflow_ids):
        return {"burst_shape_read_xacts": 1}
    burst_s = (max(done for _, done in rows) - rows[0][0]) / 1000
    t0_s, create_s = (rows[0][1] - rows[0][0]) / 1000, (rows[-1][0] - rows[0][0]) / 1000
    return {
        "burst_shape_read_xacts": 1,
        "burst_seconds": burst_s,
        "create_seconds": create_s,
        "p50_over_burst": p50_over_burst([float(done - start) for start, done in rows], burst_s),
        "steady_rate_value": steady_rate_value(t0_s, burst_s, create_s),
    }


def _version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("dbos")
    except PackageNotFoundError:
        return None


if __name__ == "__main__":
    main()
