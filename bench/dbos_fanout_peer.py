"""The DBOS Transact peer of ``bench/fanout.py``, run in its own process (DBOS is a
process-wide singleton):

    python -m bench.dbos_fanout_peer --url postgresql://.../dw_bench_dbosfan_x --items N

One parent workflow enqueues ``N`` child workflows of one trivial step each on a durable queue
(``worker_concurrency=2``, polling every 0.05 s) and sums their results in item order - DBOS's
way to fan out: a queue takes workflows, not bare steps. Prints one JSON line: wall seconds
(from calling the parent to its result) and this process's CPU seconds.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from typing import Any


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", required=True)
    parser.add_argument("--items", type=int, required=True)
    args = parser.parse_args()

    from dbos import DBOS, DBOSConfig

    logging.getLogger("dbos").setLevel(logging.WARNING)
    config: DBOSConfig = {
        "name": "dw-bench-fan",
        "system_database_url": args.url,
        "log_level": "WARNING",
    }
    DBOS(config=config)

    @DBOS.step()
    def item_step(n: int) -> int:
        return n

    @DBOS.workflow()
    def item(n: int) -> int:
        return item_step(n)

    DBOS.launch()
    try:
        queue = DBOS.register_queue(
            "dw_bench_fan_queue", worker_concurrency=2, polling_interval_sec=0.05
        )

        @DBOS.workflow()
        def parent(count: int) -> int:
            handles: list[Any] = [queue.enqueue(item, n) for n in range(count)]
            return sum(h.get_result() for h in handles)

        cpu0, t0 = time.process_time(), time.perf_counter()
        total = parent(args.items)
        seconds = time.perf_counter() - t0
        cpu = time.process_time() - cpu0
    finally:
        DBOS.destroy()
    print(
        json.dumps(
            {
                "items": args.items,
                "ok": total == args.items * (args.items - 1) // 2,
                "seconds": seconds,
                "process_cpu_s": cpu,
            }
        )
    )


if __name__ == "__main__":
    main()
