"""Throughput of the engine through real django-q2 workers, as a ratio to raw django-q2 tasks
measured in the same run, on the same database and cluster.

    .venv/bin/python bench/throughput.py                 # SQLite file database
    .venv/bin/python bench/throughput.py --postgres      # a fresh PostgreSQL database

Workloads (each started only after the cluster is up):

* raw: N django-q2 tasks that each insert one row (the floor: one broker round trip + 1 write);
* engine: N runs of ``flaky-demo`` (one stage each, no failures): run.create, claim, job lease,
  three-phase execution with outbox events, job completion and the completing transition.

Prints tasks/s, runs/s and the ratio engine/raw.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

ENGINE = """
import json, sys, time
from django_workflows.kernel import CreateRun
from django_workflows.kernel.runtime import get_kernel
from django_workflows.models import WorkflowRun
n = int(sys.argv[-1])
k = get_kernel()
t0 = time.monotonic()
for i in range(n):
    k.dispatch(CreateRun("flaky-demo", {}, config={"flaky": {"fail_times": 0}}))
t_enq = time.monotonic() - t0
while WorkflowRun.objects.filter(status="COMPLETED").count() < n:
    time.sleep(0.05)
print(json.dumps({"seconds": time.monotonic() - t0, "enqueue_seconds": t_enq}))
"""

RAW = """
import json, sys, time
from django_q.tasks import async_task
from django_workflows.models import WorkflowBlob
n = int(sys.argv[-1])
t0 = time.monotonic()
for i in range(n):
    async_task("bench.throughput.raw_task", f"bench/{i}")
while WorkflowBlob.objects.filter(key__startswith="bench/").count() < n:
    time.sleep(0.05)
print(json.dumps({"seconds": time.monotonic() - t0}))
"""


def raw_task(key: str) -> None:
    """The raw django-q2 workload: one insert."""
    from django.utils import timezone

    from django_workflows.models import WorkflowBlob

    WorkflowBlob.objects.create(key=key, created_at=timezone.now(), data=1)


def manage(env: dict[str, str], *args: str) -> str:
    out = subprocess.run(
        [sys.executable, "manage.py", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--postgres", action="store_true")
    parser.add_argument("-n", type=int, default=200)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="dw-bench-"))
    env = dict(
        os.environ,
        EXAMPLE_VAR_DIR=str(tmp),
        Q_WORKERS=str(args.workers),
        DJANGO_SETTINGS_MODULE="example_project.settings",
    )
    dbname = None
    if args.postgres:
        import psycopg

        dbname = f"dw_bench_{uuid.uuid4().hex[:8]}"
        with psycopg.connect(
            "postgresql://postgres@127.0.0.1:5432/postgres", autocommit=True
        ) as conn:
            conn.execute(f'CREATE DATABASE "{dbname}"')
        env["DATABASE_URL"] = f"postgres://postgres@127.0.0.1:5432/{dbname}"
    else:
        env["DATABASE_URL"] = f"sqlite:///{tmp / 'bench.sqlite3'}"
    manage(env, "migrate", "--noinput", "-v0")
    log = open(tmp / "qcluster.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "manage.py", "qcluster"],
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        time.sleep(2)  # cluster start-up, outside the measured windows
        raw = json.loads(
            manage(env, "shell", "-v0", "-c", RAW.replace("sys.argv[-1]", str(args.n)))
        )
        engine = json.loads(
            manage(env, "shell", "-v0", "-c", ENGINE.replace("sys.argv[-1]", str(args.n)))
        )
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        log.close()
        if dbname:
            import psycopg

            with psycopg.connect(
                "postgresql://postgres@127.0.0.1:5432/postgres", autocommit=True
            ) as conn:
                conn.execute(f'DROP DATABASE IF EXISTS "{dbname}" WITH (FORCE)')
    raw_rate = args.n / raw["seconds"]
    engine_rate = args.n / engine["seconds"]
    backend = "PostgreSQL" if args.postgres else "SQLite"
    print(f"{backend}, {args.workers} workers, n={args.n}")
    print(f"raw django-q2 tasks: {raw_rate:7.1f}/s")
    print(
        f"engine runs (1 stage): {engine_rate:7.1f}/s "
        f"(run.create alone {args.n / engine['enqueue_seconds']:.0f}/s)"
    )
    print(f"ratio engine/raw: {engine_rate / raw_rate:.2f}")


if __name__ == "__main__":
    main()
