"""Section 3: statements, commits and CPU per stage, counted in one process (deterministic).

Run inside the example project on a fresh, migrated database (``manage.py shell -c``, see
``bench.sections``). One warm-up run of ``bench-4`` is driven first (imports, caches, parsed
plans), then one measured run as one worker drives it.

How it counts (the same on PostgreSQL and SQLite):

* **statements**: every SQL statement sent through Django's cursor, counted by a
  ``connection.execute_wrapper``, *excluding* transaction control (``BEGIN IMMEDIATE`` and
  savepoints, which only SQLite sends through the cursor; reported as ``control_statements``).
  ``captured_queries`` is Django's own ``CaptureQueriesContext`` count, which also lists
  Django's driver-level ``BEGIN``/``COMMIT`` (Django >= 4.2 logs them).
* **commits**: Django commits an ``atomic`` block by calling ``connection.commit()`` on the
  driver connection, never by sending ``COMMIT`` through the cursor, so counting ``COMMIT``
  statements finds nothing. We count (a) calls of ``connection.commit`` (patched on the
  connection object for the measurement: the outermost ``atomic`` exits and any explicit
  commit), plus (b) write statements (INSERT/UPDATE/DELETE/``SELECT ... FOR UPDATE`` excluded)
  executed in autocommit mode, i.e. outside any atomic block (each one is its own committed
  transaction), plus (c) any literal ``COMMIT`` statement. Read-only autocommit statements are
  reported separately as ``autocommit_reads`` (they are transactions too, but commit nothing).
* **CPU**: ``time.process_time()`` around each job (this process only: on PostgreSQL the
  backend's CPU is not included; on SQLite the database engine runs in this process).

The engine API used is kept in :func:`drive_one_run`, the only function that needs adapting
when the kernel API changes; it raises (never skips) when an import or a call fails.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from django.db import connection
from django.test.utils import CaptureQueriesContext

WRITE_PREFIXES = ("INSERT", "UPDATE", "DELETE", "REPLACE")
#: transaction control sent through the cursor (SQLite's ``BEGIN IMMEDIATE``, savepoints)
CONTROL_PREFIXES = ("BEGIN", "SAVEPOINT", "RELEASE", "ROLLBACK", "START TRANSACTION")


@dataclass
class Counter:
    """Statements and commits seen while :attr:`active`."""

    active: bool = False
    statements: int = 0
    control_statements: int = 0
    commits: int = 0
    commit_statements: int = 0
    autocommit_writes: int = 0
    autocommit_reads: int = 0
    sql: list[str] = field(default_factory=list)

    def wrapper(self, execute: Callable[..., Any], sql: str, params: Any, many: bool, ctx: Any):
        if self.active:
            head = sql.lstrip().upper()
            self.sql.append(sql[:160])
            if head.startswith("COMMIT"):
                self.commit_statements += 1
                self.control_statements += 1
            elif head.startswith(CONTROL_PREFIXES):
                self.control_statements += 1
            else:
                self.statements += 1
            is_control = head.startswith((*CONTROL_PREFIXES, "COMMIT"))
            if not is_control and not connection.in_atomic_block:
                if head.startswith(WRITE_PREFIXES):
                    self.autocommit_writes += 1
                else:
                    self.autocommit_reads += 1
        return execute(sql, params, many, ctx)

    def snapshot(self) -> dict[str, int]:
        return {
            "statements": self.statements,
            "control_statements": self.control_statements,
            "commits": self.commits + self.commit_statements + self.autocommit_writes,
            "atomic_commits": self.commits,
            "autocommit_writes": self.autocommit_writes,
            "autocommit_reads": self.autocommit_reads,
        }


def drive_one_run(step: Callable[[str, Callable[[], Any]], None]) -> dict[str, Any]:
    """Drive one ``bench-4`` run through the kernel in process, as one worker does: CreateRun,
    then one ``process_available_jobs`` call that claims the run, delivers its four stages
    (continuing the run from each outcome transaction) and ends with the empty lease an idle
    worker makes.

    ``step(name, fn)`` runs ``fn`` as one measured step named ``name`` ("create", "work").
    Kernel-API dependent: adapt here after a kernel rewrite.
    """
    from django_workflows.kernel import CreateRun
    from django_workflows.kernel.hosting import process_available_jobs
    from django_workflows.models import WorkflowRun
    from django_workflows.testing import make_kernel

    from .benchapp.workflows import BENCH_4

    kernel = make_kernel(BENCH_4)
    box: dict[str, Any] = {}

    def create() -> None:
        box["run_id"] = kernel.dispatch(CreateRun("bench-4", {"n": 1})).workflow_run_id

    def work() -> None:
        box["jobs"] = process_available_jobs(kernel, "bench-worker", max_jobs=20).processed

    step("create", create)
    step("work", work)
    run = WorkflowRun.objects.get(pk=box["run_id"])
    if run.status != "COMPLETED" or box["jobs"] != 4:
        raise RuntimeError(
            f"in-process run ended {run.status} after {box['jobs']} jobs; expected COMPLETED, 4"
        )
    return {"jobs": box["jobs"]}


def measure() -> None:
    """Warm up, then count one run step by step; prints one JSON line."""
    drive_one_run(lambda name, fn: fn())  # warm-up
    counter = Counter()
    steps: list[dict[str, Any]] = []
    connection.ensure_connection()
    original_commit = connection.commit

    def counting_commit() -> None:
        if counter.active:
            counter.commits += 1
        original_commit()

    connection.commit = counting_commit  # type: ignore[method-assign]

    def step(name: str, fn: Callable[[], Any]) -> None:
        before = counter.snapshot()
        with CaptureQueriesContext(connection) as captured:
            counter.active = True
            cpu0, wall0 = time.process_time(), time.perf_counter()
            try:
                fn()
            finally:
                cpu1, wall1 = time.process_time(), time.perf_counter()
                counter.active = False
        after = counter.snapshot()
        steps.append(
            {
                "step": name,
                **{k: after[k] - before[k] for k in after},
                "captured_queries": len(captured.captured_queries),
                # Django logs its own BEGIN/COMMIT/ROLLBACK into the captured list (4.2+):
                # an independent count of driver-level commits
                "captured_commits": sum(q["sql"] == "COMMIT" for q in captured.captured_queries),
                "captured_begins": sum(q["sql"] == "BEGIN" for q in captured.captured_queries),
                "cpu_ms": (cpu1 - cpu0) * 1000,
                "wall_ms": (wall1 - wall0) * 1000,
            }
        )

    try:
        with connection.execute_wrapper(counter.wrapper):
            info = drive_one_run(step)
    finally:
        connection.commit = original_commit  # type: ignore[method-assign]
    # the worker's step: claim, four stages and the empty lease that ends its loop
    stage_steps = [s for s in steps if s["step"] == "work"]
    stages = 4
    total = {k: sum(s[k] for s in steps) for k in ("statements", "commits", "cpu_ms")}
    hot = {k: sum(s[k] for s in stage_steps) for k in ("statements", "commits", "cpu_ms")}
    print(
        json.dumps(
            {
                "vendor": connection.vendor,
                "stages": stages,
                "jobs": info["jobs"],
                "steps": steps,
                "per_stage_hot_path": {k: v / stages for k, v in hot.items()},
                "per_stage_whole_run": {k: v / stages for k, v in total.items()},
                "sample_sql": counter.sql[:80],
            }
        )
    )
