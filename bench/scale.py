"""Scale section (issue 19): the engine's queries with 1M finished runs and 10k live ones.

``.venv/bin/python -m bench.scale [--finished N] [--live N] [--reps N] [--quick]``
(defaults 1,000,000 / 10,000 / 50; ``--quick`` = 100,000 / 1,000), or ``python -m bench
--scale``. On a fresh PostgreSQL database (``dw_bench_scale_*``, migrated, dropped at the end):

1. **Bulk rows, set-based** (:data:`FINISHED_SQL`, :data:`LIVE_SQL`: ``generate_series`` /
   ``INSERT ... SELECT``): ``finished`` terminal runs (COMPLETED 93 %, FAILED 5 %, CANCELLED 2 %;
   workflows ``scale-etl`` / ``scale-fanout`` / ``scale-batch`` of 3, 4 and 3 stages) with every
   stage record, job row and published outbox event (9 or 11 per run), an annotation on 1 run
   in 10; and ``live`` runs: 20 % PENDING, 30 % RUNNING with a RUNNING job (1 in 30 of those
   with a stale lease and no progress for longer than the stuck threshold), 20 % RUNNING
   fan-outs with a RUNNING and a ready PENDING job (queue ``batch``), 10 % RUNNING with a job
   in retry back-off, 20 % RUNNING with a SUSPENDED stage (half due, half due in an hour). The
   last event of 1 live run in 5 is unpublished (the flush backlog), of 1 in 1,000 a dead letter.
   Then ``VACUUM ANALYZE`` (what autovacuum would have done by then).
2. **Each engine operation as the engine issues it** (:func:`operations`), ``reps`` times, each
   call inside a transaction that is rolled back (so every call sees the same rows): the call's
   wall time, and every statement it sent with its own time (``connection.execute_wrapper``;
   its SQL as sent, parameters interpolated by the driver like ``CaptureQueriesContext``
   shows it). Then ``EXPLAIN (ANALYZE, BUFFERS)`` of each distinct statement of one call,
   replayed in order in a transaction rolled back.
3. **Report**: per operation p50/p95 of the call, statements per call, the slowest statement's
   p50/p95 and its plan (top node, rows, indexes); a flag for a statement p95 >= 50 ms or a
   sequential scan of a table with more than :data:`BIG_TABLE_ROWS` rows. Markdown:
   :func:`render_markdown`; files ``bench/results/<date>-scale.json`` / ``.md``
   (``<date>-scale-quick.*`` with ``--quick``).

The measurement runs in ``manage.py shell`` of the example project (:func:`measure`); the
test ``tests/integration/test_bench_scale_pg.py`` runs :func:`populate` and
:func:`capture` at a tiny size on the test database.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import date, datetime
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from django_workflows import (
    CompletionCheck,
    StageContext,
    Suspend,
    define_async_batch_stage,
    define_stage,
    define_workflow,
)
from django_workflows.definition.registry import WorkflowRegistry

#: A sequential scan of a table with more rows than this is flagged.
BIG_TABLE_ROWS = 10_000
#: The target: p95 of each engine statement below this (ms).
TARGET_P95_MS = 50.0
RESULTS = Path(__file__).resolve().parent / "results"

# --- the workflows the rows belong to ---------------------------------------------------------


class N(BaseModel):
    n: int = 0


def _plus_one(ctx: StageContext[N, Any]) -> N:
    return N(n=ctx.input.n + 1)


def _submit(ctx: StageContext[N, Any]) -> Suspend:
    return Suspend(state={"batch_id": "b"}, poll_interval_seconds=60, max_wait_seconds=86400)


def _never_ready(state: dict[str, Any], ctx: Any) -> CompletionCheck:
    return CompletionCheck.not_ready()


def _stage(stage_id: str, queue: str = "default") -> Any:
    return define_stage(id=stage_id, input=N, output=N, execute=_plus_one, queue=queue)


def workflows() -> list[Any]:
    """``scale-etl`` (extract -> transform -> load), ``scale-fanout`` (a -> [b | c] -> d, c on
    queue ``batch``), ``scale-batch`` (submit -> async-batch wait -> finish)."""
    wait = define_async_batch_stage(
        id="wait", input=N, output=N, execute=_submit, check_completion=_never_ready
    )
    return [
        define_workflow(id="scale-etl", input=N)
        .pipe(_stage("extract"))
        .pipe(_stage("transform"))
        .pipe(_stage("load"))
        .build(),
        define_workflow(id="scale-fanout", input=N)
        .pipe(_stage("a"))
        .parallel([_stage("b"), _stage("c", queue="batch")])
        .pipe(_stage("d"))
        .build(),
        define_workflow(id="scale-batch", input=N)
        .pipe(_stage("submit"))
        .pipe(wait)
        .pipe(_stage("finish"))
        .build(),
    ]


def registry() -> WorkflowRegistry:
    reg = WorkflowRegistry()
    for wf in workflows():
        reg.register(wf)
    return reg


# --- bulk rows --------------------------------------------------------------------------------

#: (workflow_id, stage_id, stage_number, execution_group, queue, is_last) of the three workflows.
LAYOUT_SQL = """
CREATE TEMP TABLE scale_layout (wf text, stage_id text, num int, grp int, queue text, last bool);
INSERT INTO scale_layout VALUES
  ('scale-etl', 'extract', 1, 1, 'default', false),
  ('scale-etl', 'transform', 2, 2, 'default', false),
  ('scale-etl', 'load', 3, 3, 'default', true),
  ('scale-fanout', 'a', 1, 1, 'default', false), ('scale-fanout', 'b', 2, 2, 'default', false),
  ('scale-fanout', 'c', 3, 2, 'batch', false), ('scale-fanout', 'd', 4, 3, 'default', true),
  ('scale-batch', 'submit', 1, 1, 'default', false),
  ('scale-batch', 'wait', 2, 2, 'default', false),
  ('scale-batch', 'finish', 3, 3, 'default', true);
"""

#: Terminal runs 1..%(finished)s (newest first, 2.5 s apart), then their stages, jobs,
#: published events (created, started, started/ended per stage, the run's end) and annotations.
FINISHED_SQL = [
    (
        "finished runs",
        """
INSERT INTO workflow_runs (id, created_at, updated_at, version, workflow_id, workflow_name,
    workflow_type, status, started_at, completed_at, duration_ms, input, output, config,
    total_cost, total_tokens, priority, event_sequence, error, definition_version)
SELECT gen_random_uuid(), t.created, t.created + interval '40 seconds', 5, t.wf, t.wf, 'scale',
    t.st, t.created + interval '1 second', t.created + interval '40 seconds', 39000,
    jsonb_build_object('n', i), CASE WHEN t.st = 'COMPLETED' THEN '{"n": 4}'::jsonb END,
    '{}'::jsonb, 0, 0, 5, CASE WHEN t.wf = 'scale-fanout' THEN 11 ELSE 9 END,
    CASE WHEN t.st = 'FAILED' THEN jsonb_build_object('stage_id', 'last', 'message', 'boom',
        'error_type', 'ValueError', 'generation', 0, 'delivery', 3) END, ''
FROM generate_series(1, %(finished)s) AS i
CROSS JOIN LATERAL (SELECT
    now() - interval '2 hours' - i * interval '2.5 seconds' AS created,
    CASE WHEN i %% 20 = 0 THEN 'FAILED' WHEN i %% 50 = 1 THEN 'CANCELLED' ELSE 'COMPLETED' END
        AS st,
    (ARRAY['scale-etl', 'scale-fanout', 'scale-batch'])[i %% 3 + 1] AS wf) AS t
""",
    ),
    (
        "finished stages",
        """
INSERT INTO workflow_stages (id, created_at, updated_at, version, run_id, stage_id, stage_name,
    stage_number, execution_group, generation, status, started_at, completed_at, duration_ms,
    input_data, output_data, config, metrics, error_message, progress, progress_message,
    skip_reason)
SELECT gen_random_uuid(), r.created_at + l.grp * interval '1 second', r.completed_at, 3, r.id,
    l.stage_id, l.stage_id, l.num, l.grp, 0, x.st, r.created_at + l.grp * interval '1 second',
    r.completed_at, 9000, '{"n": 1}'::jsonb,
    CASE WHEN x.st = 'COMPLETED' THEN '{"n": 2}'::jsonb END, '{}'::jsonb, '{}'::jsonb,
    CASE WHEN x.st = 'FAILED' THEN 'ValueError: boom' END, 100, '', ''
FROM workflow_runs r JOIN scale_layout l ON l.wf = r.workflow_id
CROSS JOIN LATERAL (SELECT CASE WHEN l.last AND r.status <> 'COMPLETED' THEN r.status
    ELSE 'COMPLETED' END AS st) AS x
WHERE r.status IN ('COMPLETED', 'FAILED', 'CANCELLED')
""",
    ),
    (
        "finished jobs",
        """
INSERT INTO workflow_jobs (created_at, updated_at, workflow_run_id, workflow_id, stage_id,
    status, priority, attempt, max_attempts, started_at, completed_at, payload, last_error,
    run_created_at, queue, definition_version)
SELECT r.created_at + l.grp * interval '1 second', r.completed_at, r.id, r.workflow_id,
    l.stage_id, x.st, 5, CASE WHEN x.st = 'FAILED' THEN 3 ELSE 1 END, 3,
    r.created_at + l.grp * interval '1 second', r.completed_at, '{}'::jsonb,
    CASE WHEN x.st = 'FAILED' THEN 'ValueError: boom' END, r.created_at, l.queue, ''
FROM workflow_runs r JOIN scale_layout l ON l.wf = r.workflow_id
CROSS JOIN LATERAL (SELECT CASE WHEN l.last AND r.status <> 'COMPLETED' THEN r.status
    ELSE 'COMPLETED' END AS st) AS x
WHERE r.status IN ('COMPLETED', 'FAILED', 'CANCELLED')
""",
    ),
    (
        "finished events (run)",
        """
INSERT INTO outbox_events (created_at, workflow_run_id, sequence, event_type, payload,
    causation_id, occurred_at, published_at, retry_count, skip_note)
SELECT r.created_at + e.seq * interval '100 milliseconds', r.id, e.seq, e.kind,
    jsonb_build_object('type', e.kind, 'workflow_run_id', r.id::text), 'scale',
    r.created_at + e.seq * interval '100 milliseconds',
    r.created_at + e.seq * interval '100 milliseconds' + interval '50 milliseconds', 0, ''
FROM workflow_runs r CROSS JOIN LATERAL (VALUES (1, 'workflow:created'),
    (2, 'workflow:started'), (r.event_sequence, 'workflow:' || lower(r.status))) AS e(seq, kind)
WHERE r.status IN ('COMPLETED', 'FAILED', 'CANCELLED')
""",
    ),
    (
        "finished events (stages)",
        """
INSERT INTO outbox_events (created_at, workflow_run_id, sequence, event_type, payload,
    causation_id, occurred_at, published_at, retry_count, skip_note)
SELECT r.created_at + (2 * l.num + h) * interval '100 milliseconds', r.id, 2 * l.num + h,
    CASE WHEN h = 1 THEN 'stage:started' WHEN l.last AND r.status = 'FAILED' THEN 'stage:failed'
        WHEN l.last AND r.status = 'CANCELLED' THEN 'stage:cancelled'
        ELSE 'stage:completed' END,
    jsonb_build_object('stage_id', l.stage_id, 'workflow_run_id', r.id::text), 'scale',
    r.created_at + (2 * l.num + h) * interval '100 milliseconds',
    r.created_at + (2 * l.num + h) * interval '100 milliseconds' + interval '50 milliseconds',
    0, ''
FROM workflow_runs r JOIN scale_layout l ON l.wf = r.workflow_id
CROSS JOIN (VALUES (1), (2)) AS half(h)
WHERE r.status IN ('COMPLETED', 'FAILED', 'CANCELLED')
""",
    ),
    (
        "finished annotations",
        """
INSERT INTO workflow_annotations (created_at, run_id, generation, scope, key, value)
SELECT r.completed_at, r.id, 0, 'run', 'customer.tier', '"gold"'::jsonb
FROM workflow_runs r
WHERE r.status IN ('COMPLETED', 'FAILED', 'CANCELLED') AND hashtext(r.id::text) %% 10 = 0
""",
    ),
]

#: Live runs 1..%(live)s (the newest, 0.3 s apart; see the module docstring for the mix).
#: ``%(stuck)s`` seconds: how far back a stuck run's last change (and its stale lease) lies.
LIVE_SQL = [
    (
        "live kinds",
        """
CREATE TEMP TABLE scale_live AS
SELECT i, gen_random_uuid() AS id, now() - i * interval '0.3 seconds' AS created,
    CASE WHEN i %% 10 IN (0, 1) THEN 'pending' WHEN i %% 10 IN (2, 3, 4) THEN 'running'
        WHEN i %% 10 IN (5, 6) THEN 'fanout' WHEN i %% 10 = 7 THEN 'backoff'
        ELSE 'suspended' END AS kind,
    i %% 30 = 2 AS stuck, i %% 20 IN (8, 9) AS due
FROM generate_series(1, %(live)s) AS i;
CREATE TEMP TABLE scale_live_stage (kind text, stage_id text, st text, job text, queue text);
INSERT INTO scale_live_stage VALUES
    ('running', 'extract', 'COMPLETED', 'COMPLETED', 'default'),
    ('running', 'transform', 'RUNNING', 'RUNNING', 'default'),
    ('backoff', 'extract', 'COMPLETED', 'COMPLETED', 'default'),
    ('backoff', 'transform', 'PENDING', 'BACKOFF', 'default'),
    ('fanout', 'a', 'COMPLETED', 'COMPLETED', 'default'),
    ('fanout', 'b', 'RUNNING', 'RUNNING', 'default'),
    ('fanout', 'c', 'PENDING', 'PENDING', 'batch'),
    ('suspended', 'submit', 'COMPLETED', 'COMPLETED', 'default'),
    ('suspended', 'wait', 'SUSPENDED', 'SUSPENDED', 'default');
""",
    ),
    (
        "live runs",
        """
INSERT INTO workflow_runs (id, created_at, updated_at, version, workflow_id, workflow_name,
    workflow_type, status, started_at, input, config, total_cost, total_tokens, priority,
    event_sequence, definition_version)
SELECT v.id, v.created, CASE WHEN v.stuck THEN v.created ELSE v.created + interval '1 second'
    END, 2,
    CASE v.kind WHEN 'fanout' THEN 'scale-fanout' WHEN 'suspended' THEN 'scale-batch'
        ELSE 'scale-etl' END, 'live', 'scale',
    CASE WHEN v.kind = 'pending' THEN 'PENDING' ELSE 'RUNNING' END,
    CASE WHEN v.kind <> 'pending' THEN v.created END, jsonb_build_object('n', v.i),
    '{}'::jsonb, 0, 0, 5, CASE v.kind WHEN 'pending' THEN 1 WHEN 'running' THEN 5
        WHEN 'fanout' THEN 5 ELSE 6 END, ''
FROM (SELECT i, id, kind, due,
    CASE WHEN stuck THEN now() - %(stuck)s * interval '1 second' ELSE created END AS created,
    stuck AND kind = 'running' AS stuck FROM scale_live) AS v
""",
    ),
    (
        "live stages",
        """
INSERT INTO workflow_stages (id, created_at, updated_at, version, run_id, stage_id, stage_name,
    stage_number, execution_group, generation, status, started_at, completed_at, input_data,
    output_data, config, suspended_state, next_poll_at, poll_interval_ms, max_wait_until,
    progress_message, skip_reason)
SELECT gen_random_uuid(), r.created_at, r.updated_at, 2, r.id, s.stage_id, s.stage_id, l.num,
    l.grp, 0, s.st, CASE WHEN s.st <> 'PENDING' THEN r.created_at END,
    CASE WHEN s.st = 'COMPLETED' THEN r.updated_at END, '{"n": 1}'::jsonb,
    CASE WHEN s.st = 'COMPLETED' THEN '{"n": 2}'::jsonb END, '{}'::jsonb,
    CASE WHEN s.st = 'SUSPENDED' THEN '{"batch_id": "b"}'::jsonb END,
    CASE WHEN s.st <> 'SUSPENDED' THEN NULL WHEN v.due
        THEN now() - (v.i %% 600) * interval '1 second' ELSE now() + interval '1 hour' END,
    CASE WHEN s.st = 'SUSPENDED' THEN 60000 END,
    CASE WHEN s.st = 'SUSPENDED' THEN now() + interval '1 day' END, '', ''
FROM scale_live v JOIN workflow_runs r ON r.id = v.id
JOIN scale_live_stage s ON s.kind = v.kind JOIN scale_layout l
    ON l.wf = r.workflow_id AND l.stage_id = s.stage_id
""",
    ),
    (
        "live jobs",
        """
INSERT INTO workflow_jobs (created_at, updated_at, workflow_run_id, workflow_id, stage_id,
    status, priority, attempt, max_attempts, worker_id, locked_at, started_at, completed_at,
    next_poll_at, payload, last_error, run_created_at, queue, definition_version)
SELECT r.created_at, r.updated_at, r.id, r.workflow_id, s.stage_id,
    CASE s.job WHEN 'BACKOFF' THEN 'PENDING' ELSE s.job END, 5,
    CASE WHEN s.job = 'PENDING' THEN 0 ELSE 1 END, 3,
    CASE WHEN s.job = 'RUNNING' THEN 'scale-worker-' || (v.i %% 8) END,
    -- heartbeated leases: fresh for the bench's duration; a stuck run's lease is stale
    CASE WHEN s.job <> 'RUNNING' THEN NULL WHEN r.updated_at = r.created_at THEN r.created_at
        ELSE now() + interval '30 minutes' - (v.i %% 60) * interval '1 second' END,
    CASE WHEN s.job <> 'PENDING' THEN r.created_at END,
    CASE WHEN s.job = 'COMPLETED' THEN r.updated_at END,
    CASE WHEN s.job = 'BACKOFF' THEN now() + interval '1 hour'
        WHEN s.job = 'SUSPENDED' THEN st.next_poll_at END,
    '{}'::jsonb, CASE WHEN s.job = 'BACKOFF' THEN 'TimeoutError: upstream' END, r.created_at,
    s.queue, ''
FROM scale_live v JOIN workflow_runs r ON r.id = v.id
JOIN scale_live_stage s ON s.kind = v.kind
JOIN workflow_stages st ON st.run_id = r.id AND st.stage_id = s.stage_id
""",
    ),
    (
        "live events",
        """
INSERT INTO outbox_events (created_at, workflow_run_id, sequence, event_type, payload,
    causation_id, occurred_at, published_at, retry_count, skip_note, dlq_at, last_error)
SELECT r.created_at + q * interval '100 milliseconds', r.id, q,
    (ARRAY['workflow:created', 'workflow:started', 'stage:started', 'stage:completed',
        'stage:started', 'stage:suspended'])[q],
    jsonb_build_object('workflow_run_id', r.id::text), 'scale',
    r.created_at + q * interval '100 milliseconds',
    CASE WHEN q = r.event_sequence AND v.i %% 5 = 0 THEN NULL
        ELSE r.created_at + q * interval '100 milliseconds' + interval '50 milliseconds' END,
    CASE WHEN q = r.event_sequence AND v.i %% 1000 = 0 THEN 3 ELSE 0 END, '',
    CASE WHEN q = r.event_sequence AND v.i %% 1000 = 0 THEN now() END,
    CASE WHEN q = r.event_sequence AND v.i %% 1000 = 0 THEN 'ConnectionError: sink' END
FROM scale_live v JOIN workflow_runs r ON r.id = v.id
CROSS JOIN LATERAL generate_series(1, r.event_sequence) AS q
""",
    ),
]

TABLES = (
    "workflow_runs",
    "workflow_stages",
    "workflow_jobs",
    "outbox_events",
    "workflow_annotations",
)


def populate(finished: int, live: int, *, log: Callable[[str], None] = lambda _m: None) -> dict:
    """Insert the rows (PostgreSQL, inside or outside a transaction) and ``ANALYZE`` them
    (``VACUUM ANALYZE`` when not in a transaction). Returns ``{"seconds": {step: s},
    "rows": {table: count}}``."""
    from django.db import connection

    from django_workflows.conf import workflow_settings

    stuck = float(workflow_settings.stuck_threshold_seconds) + 3600
    params = {"finished": int(finished), "live": int(live), "stuck": stuck}
    seconds: dict[str, float] = {}
    with connection.cursor() as cursor:
        cursor.execute(
            "SET LOCAL synchronous_commit = off"
            if connection.in_atomic_block
            else "SET synchronous_commit = off"
        )
        cursor.execute("DROP TABLE IF EXISTS scale_layout, scale_live, scale_live_stage")
        cursor.execute(LAYOUT_SQL)
        for label, sql in [*FINISHED_SQL, *LIVE_SQL]:
            t0 = time.perf_counter()
            # Several statements in one: bound on the client (``compose_sql``), as server-side
            # binding (docs/howto/tuning-postgresql.md) refuses parameters in a multi-statement
            # string; without parameters psycopg sends it as one simple query.
            cursor.execute(connection.ops.compose_sql(sql, params))
            seconds[label] = round(time.perf_counter() - t0, 2)
            log(f"{label}: {seconds[label]} s")
        cursor.execute("DROP TABLE scale_layout, scale_live, scale_live_stage")
        t0 = time.perf_counter()
        verb = "ANALYZE" if connection.in_atomic_block else "VACUUM ANALYZE"
        for table in TABLES:
            cursor.execute(f"{verb} {table}")
        seconds["vacuum analyze"] = round(time.perf_counter() - t0, 2)
        rows = {}
        for table in TABLES:
            cursor.execute(f"SELECT count(*) FROM {table}")  # fixed table names
            rows[table] = cursor.fetchone()[0]
    log(f"rows: {rows}")
    return {"seconds": seconds, "rows": rows}


# --- capture ----------------------------------------------------------------------------------

#: Statements that are transaction control, not queries (never explained or ranked).
CONTROL = re.compile(r"^\s*(SAVEPOINT|RELEASE|ROLLBACK|BEGIN|COMMIT|SET\b)", re.I)


@dataclass
class Statement:
    """One statement as sent: ``template`` (the SQL with placeholders: the grouping key),
    ``sql`` (as sent, parameters interpolated) and its time in ms."""

    template: str
    sql: str
    ms: float


@dataclass
class Recorder:
    """A ``connection.execute_wrapper`` that records every statement and its time."""

    statements: list[Statement] = field(default_factory=list)

    def __call__(self, execute: Callable[..., Any], sql: str, params: Any, many: bool, ctx: Any):
        from django.db import connection

        t0 = time.perf_counter()
        try:
            return execute(sql, params, many, ctx)
        finally:
            ms = (time.perf_counter() - t0) * 1000
            try:
                sent = (
                    sql if many else connection.ops.last_executed_query(ctx["cursor"], sql, params)
                )
            except Exception:
                sent = sql
            self.statements.append(Statement(sql, str(sent), ms))


@dataclass
class Operation:
    """One engine operation: ``fn()`` does it as the engine does; ``kind`` ``engine`` (the
    50 ms target applies to each statement) or ``page`` (a whole HTTP request)."""

    name: str
    fn: Callable[[], Any]
    kind: str = "engine"
    note: str = ""


def operations(kernel: Any, client: Any, api_client: Any) -> list[Operation]:
    """The engine's queries at scale, each called as the engine calls it."""
    from django_workflows.conf import workflow_settings
    from django_workflows.kernel import (
        ClaimPendingRuns,
        FlushOutbox,
        PollSuspendedStages,
        ReapStaleLeases,
        ReapStuckRuns,
        flusher,
        supervisor,
    )
    from django_workflows.kernel.stage_path.lease import lease

    def ok(response: Any) -> Any:
        assert response.status_code == 200, (response.status_code, response.content[:300])
        return response

    admin = "/admin/django_workflows/workflowrun/"
    api = "/api/workflows/runs/"
    stale = float(workflow_settings.STALE_LEASE_SECONDS)
    return [
        Operation(
            "lease: next ready job (delivery.lease)",
            lambda: lease(kernel, "scale-bench"),
            note="any queue; the oldest ready PENDING job (queue batch)",
        ),
        Operation(
            "lease: claim a PENDING run (queue default)",
            lambda: lease(kernel, "scale-bench", frozenset({"default"})),
            note="no ready job of the queue (back-off jobs only): claims the oldest PENDING run",
        ),
        Operation(
            "run.claimPending (tick, max_claims=MAX_CLAIMS_PER_TICK)",
            lambda: kernel.dispatch(
                ClaimPendingRuns(
                    "scale-bench", max_claims=int(workflow_settings.MAX_CLAIMS_PER_TICK)
                )
            ),
        ),
        Operation(
            "stage.pollSuspended (poll-due)",
            lambda: kernel.dispatch(
                PollSuspendedStages(max_checks=int(workflow_settings.MAX_SUSPENDED_CHECKS_PER_TICK))
            ),
            note="each due stage is checked (not ready) and rescheduled",
        ),
        Operation(
            "outbox flush (flusher.flush_outbox, 500)",
            lambda: flusher.flush_outbox(kernel, "scale-bench"),
            note="lease, the backlog select, one UPDATE",
        ),
        Operation(
            "outbox.flush (tick, MAX_OUTBOX_FLUSH_PER_TICK)",
            lambda: kernel.dispatch(
                FlushOutbox(max_events=int(workflow_settings.MAX_OUTBOX_FLUSH_PER_TICK))
            ),
        ),
        Operation(
            "supervisor.ticker_needed",
            lambda: supervisor.ticker_needed(kernel.lease_clock),
        ),
        Operation(
            "lease.reapStale (stale-lease reaper)",
            lambda: kernel.dispatch(ReapStaleLeases(stale_threshold_seconds=stale)),
        ),
        Operation(
            "run.reapStuck (stuck-run reaper)",
            lambda: kernel.dispatch(
                ReapStuckRuns(stuck_threshold_seconds=workflow_settings.stuck_threshold_seconds)
            ),
        ),
        Operation("admin: run list", lambda: ok(client.get(admin)), kind="page"),
        Operation(
            "admin: run list ?status=FAILED",
            lambda: ok(client.get(admin + "?status=FAILED")),
            kind="page",
        ),
        Operation(
            "admin: run list ?status=RUNNING",
            lambda: ok(client.get(admin + "?status=RUNNING")),
            kind="page",
        ),
        Operation("API: runs list", lambda: ok(api_client.get(api)), kind="page"),
        Operation(
            "API: runs list ?status=RUNNING",
            lambda: ok(api_client.get(api + "?status=RUNNING")),
            kind="page",
        ),
    ]


@contextmanager
def rolled_back() -> Iterator[None]:
    """A transaction that is always rolled back."""
    from django.db import transaction

    with transaction.atomic():
        yield
        transaction.set_rollback(True)


def _pct(values: list[float], q: float) -> float | None:
    from .common import percentile

    value = percentile(values, q)
    return None if value is None else round(value, 3)


def _explain(sql: str) -> str:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("EXPLAIN (ANALYZE, BUFFERS) " + sql.replace("%", "%%"))
        return "\n".join(row[0] for row in cursor.fetchall())


def table_rows() -> dict[str, int]:
    """``reltuples`` of every table of the database (the planner's row estimates)."""
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT relname, reltuples::bigint FROM pg_class "
            "WHERE relkind = 'r' AND relnamespace = 'public'::regnamespace"
        )
        return {name: int(n) for name, n in cursor.fetchall()}


def plan_summary(plan: str, big_tables: set[str]) -> dict[str, Any]:
    """Top node, its actual rows, indexes used, sequential scans (of big tables), and the
    execution time of an ``EXPLAIN (ANALYZE, BUFFERS)`` text plan."""
    lines = plan.splitlines()
    top = re.sub(r"\s+\(cost=.*", "", lines[0]).strip() if lines else ""
    rows = re.search(r"actual time=\S+ rows=(\d+)", lines[0]) if lines else None
    indexes = sorted(set(re.findall(r"Index (?:Only )?Scan (?:Backward )?using (\w+)", plan)))
    indexes += sorted(set(re.findall(r"Bitmap Index Scan on (\w+)", plan)) - set(indexes))
    seq = sorted(set(re.findall(r"Seq Scan on (\w+)", plan)))
    execution = re.search(r"Execution Time: ([\d.]+) ms", plan)
    return {
        "top": top,
        "rows": int(rows.group(1)) if rows else None,
        "indexes": indexes,
        "seq_scans": seq,
        "big_seq_scans": [t for t in seq if t in big_tables],
        "execution_ms": float(execution.group(1)) if execution else None,
    }


def measure_operation(op: Operation, reps: int, big_tables: set[str]) -> dict[str, Any]:
    """``op`` ``reps`` times (+1 warm-up), each rolled back; then EXPLAIN of one call's
    distinct statements, replayed in order and rolled back."""
    from django.db import connection

    calls: list[float] = []
    per_statement: dict[str, list[float]] = {}
    first_sql: dict[str, str] = {}
    counts: list[int] = []
    last: list[Statement] = []
    for rep in range(reps + 1):
        recorder = Recorder()
        with rolled_back():
            with connection.execute_wrapper(recorder):
                t0 = time.perf_counter()
                op.fn()
                elapsed = (time.perf_counter() - t0) * 1000
        if rep == 0:
            continue  # warm-up: imports, caches, the session
        calls.append(elapsed)
        queries = [s for s in recorder.statements if not CONTROL.match(s.sql)]
        counts.append(len(queries))
        for s in queries:
            per_statement.setdefault(s.template, []).append(s.ms)
            first_sql.setdefault(s.template, s.sql)
        last = queries
    statements = []
    plans: dict[str, dict[str, Any]] = {}
    with rolled_back():
        seen: set[str] = set()
        for s in last:
            if s.template in seen:
                continue
            seen.add(s.template)
            try:
                from django.db import transaction

                with transaction.atomic():  # a failed replay does not end the others
                    plan = _explain(s.sql)
                plans[s.template] = {"plan": plan, **plan_summary(plan, big_tables)}
            except Exception as exc:
                plans[s.template] = {"plan": f"EXPLAIN failed: {exc!r}", "error": repr(exc)}
    for template, times in per_statement.items():
        plan = plans.get(template, {})
        statements.append(
            {
                "sql": first_sql[template][:4000],
                "executions_per_call": round(len(times) / max(1, len(calls)), 2),
                "p50_ms": _pct(times, 50),
                "p95_ms": _pct(times, 95),
                "max_ms": round(max(times), 3),
                **{k: v for k, v in plan.items()},
            }
        )
    statements.sort(key=lambda s: -(s["p95_ms"] or 0))
    slowest = statements[0] if statements else {}
    flags = []
    for s in statements:
        if (s["p95_ms"] or 0) >= TARGET_P95_MS:
            flags.append(f"statement p95 {s['p95_ms']} ms >= {TARGET_P95_MS:g}: {s['sql'][:120]}")
        if s.get("big_seq_scans"):
            flags.append(f"Seq Scan on {', '.join(s['big_seq_scans'])}: {s['sql'][:120]}")
    return {
        "name": op.name,
        "kind": op.kind,
        "note": op.note,
        "reps": len(calls),
        "call_p50_ms": _pct(calls, 50),
        "call_p95_ms": _pct(calls, 95),
        "statements_per_call": round(sum(counts) / max(1, len(counts)), 1),
        "slowest": {
            k: slowest.get(k)
            for k in ("sql", "p50_ms", "p95_ms", "rows", "top", "indexes", "seq_scans")
        },
        "statements": statements,
        "flags": flags,
        "ok": not flags,
    }


def clients() -> tuple[Any, Any]:
    """A test ``Client`` logged in as a superuser (the admin) and one with that user's API
    token (``Authorization: Token ...``, as the API tests do)."""
    from django.contrib.auth import get_user_model
    from django.test import Client
    from rest_framework.authtoken.models import Token

    user_model = get_user_model()
    user = user_model.objects.filter(username="scale-admin").first()
    if user is None:
        user = user_model.objects.create_superuser("scale-admin", "scale@example.com", "pw")
    client = Client()
    client.force_login(user)
    token, _ = Token.objects.get_or_create(user=user)
    api_client = Client(HTTP_AUTHORIZATION=f"Token {token.key}")
    return client, api_client


def vacuum_touched() -> None:
    """``VACUUM`` the tables the rolled-back repetitions left dead row versions in (50 rolled-
    back releases of 334 stale jobs leave 17k dead PENDING index entries that the next
    operation's scans would walk), as autovacuum would soon do; nothing inside a transaction
    (the test)."""
    from django.db import connection

    if connection.in_atomic_block:
        return
    with connection.cursor() as cursor:
        cursor.execute(
            "VACUUM workflow_runs, workflow_stages, workflow_jobs, outbox_events, "
            "workflow_maintenance_leases"
        )


def capture(
    reps: int, *, only: set[str] | None = None, log: Callable[[str], None] = lambda _m: None
) -> list[dict[str, Any]]:
    """Measure every operation (:func:`operations`) on the current database's rows."""
    from django_workflows.kernel import Kernel

    kernel = Kernel(registry=registry())
    client, api_client = clients()
    big = {t for t, n in table_rows().items() if n > BIG_TABLE_ROWS}
    out = []
    for op in operations(kernel, client, api_client):
        if only is not None and op.name not in only:
            continue
        result = measure_operation(op, reps, big)
        result["loadavg_1m"] = round(os.getloadavg()[0], 2)
        vacuum_touched()
        log(
            f"{op.name}: call p50 {result['call_p50_ms']} p95 {result['call_p95_ms']} ms, "
            f"slowest statement p95 {result['slowest'].get('p95_ms')} ms"
            + (f"  FLAGS: {result['flags']}" if result["flags"] else "")
        )
        out.append(result)
    return out


def measure(finished: int, live: int, reps: int) -> None:
    """Inside ``manage.py shell`` on a fresh migrated database: populate, capture, print the
    result as JSON (last line)."""
    from django.db import connection

    def log(message: str) -> None:
        print(f"[scale {datetime.now():%H:%M:%S}] {message}", file=sys.stderr, flush=True)

    started = time.perf_counter()
    generation = populate(finished, live, log=log)
    with connection.cursor() as cursor:
        cursor.execute("SELECT version()")
        server = cursor.fetchone()[0]
        cursor.execute("SELECT pg_database_size(current_database())")
        size = cursor.fetchone()[0]
    results = capture(reps, log=log)
    print(
        json.dumps(
            {
                "finished": finished,
                "live": live,
                "reps": reps,
                "server": server,
                "database_mb": round(size / 2**20),
                "generation": generation,
                "operations": results,
                "seconds": round(time.perf_counter() - started, 1),
            }
        )
    )


# --- orchestration ----------------------------------------------------------------------------


def run(dbs: Any, finished: int, live: int, reps: int) -> dict[str, Any]:
    """The section: a fresh ``dw_bench_scale_*`` database, :func:`measure` in ``manage.py
    shell`` of the example project, the database dropped."""
    from .common import migrate, project_env, shell_json

    url = dbs.postgres("scale")
    var_dir = dbs.workdir("scale")
    env = project_env(url, var_dir, DJANGO_DEBUG="0")
    try:
        migrate(env)
        proc_timeout = 3600
        out = shell_json(
            env,
            f"from bench.scale import measure; measure({int(finished)}, {int(live)}, {int(reps)})",
            timeout=proc_timeout,
        )
    finally:
        dbs.drop(url)
    out["loadavg_1m"] = round(os.getloadavg()[0], 2)
    return out


def _fmt(value: Any) -> str:
    return "-" if value is None else (f"{value:.2f}" if isinstance(value, float) else str(value))


def _plan_brief(statement: dict[str, Any]) -> str:
    """``"Sort; Seq Scan on workflow_stages"`` / ``"Limit; wf_run_claim_id_idx"``."""
    scans = statement.get("seq_scans") or []
    used = ", ".join(statement.get("indexes") or []) or "-"
    return f"{statement.get('top')}; " + (f"Seq Scan on {', '.join(scans)}" if scans else used)


def render_markdown(result: dict[str, Any]) -> str:
    """The scale section as markdown: one table row per operation, the flags, and the plans
    in a collapsible appendix."""
    if result.get("error"):
        return f"## Scale (issue 19)\n\nerror: `{result['error']}`\n"
    ops = result["operations"]
    lines = [
        "## Scale (issue 19): engine queries with "
        f"{result['finished']:,} finished + {result['live']:,} live runs",
        "",
        f"PostgreSQL: {result.get('server', '?').split(' on ')[0]}; database "
        f"{result.get('database_mb')} MB; rows: "
        + ", ".join(f"{t} {n:,}" for t, n in result["generation"]["rows"].items())
        + f"; generated in {sum(result['generation']['seconds'].values()):.0f} s; "
        f"{result['reps']} repetitions per operation, each in a transaction rolled back.",
        "",
        f"Target: every engine statement p95 < {TARGET_P95_MS:g} ms, no Seq Scan on a table of "
        f"more than {BIG_TABLE_ROWS:,} rows. `call` = the whole engine call (or HTTP request: "
        "all its statements, Python and rendering); `slowest` = its slowest statement.",
        "",
        "| operation | call p50 ms | call p95 ms | stmts | slowest p50 ms | slowest p95 ms "
        "| rows | plan top node | indexes | ok |",
        "|---|---:|---:|---:|---:|---:|---:|---|---|---|",
    ]
    for op in ops:
        s = op["slowest"]
        lines.append(
            f"| {op['name']} | {_fmt(op['call_p50_ms'])} | {_fmt(op['call_p95_ms'])} | "
            f"{op['statements_per_call']} | {_fmt(s.get('p50_ms'))} | {_fmt(s.get('p95_ms'))} | "
            f"{_fmt(s.get('rows'))} | {(s.get('top') or '-').replace('|', '/')} | "
            f"{', '.join(s.get('indexes') or []) or '-'} | {'yes' if op['ok'] else '**NO**'} |"
        )
    flags = [f"- {op['name']}: {f}" for op in ops for f in op["flags"]]
    lines += ["", "**Flags:** " + ("none" if not flags else ""), *flags, ""]
    if result.get("before"):
        before = {op["name"]: op for op in result["before"]}
        lines += [
            f"### Before / after ({result.get('before_note') or 'the previous measurement'})",
            "",
            "| operation | call p95 ms before | after | slowest p95 ms before | after "
            "| slowest plan before | after |",
            "|---|---:|---:|---:|---:|---|---|",
        ]
        for op in ops:
            old = before.get(op["name"])
            if old is None:
                continue
            lines.append(
                f"| {op['name']} | {_fmt(old['call_p95_ms'])} | {_fmt(op['call_p95_ms'])} | "
                f"{_fmt(old['slowest'].get('p95_ms'))} | {_fmt(op['slowest'].get('p95_ms'))} | "
                f"{_plan_brief(old['slowest'])} | {_plan_brief(op['slowest'])} |"
            )
        lines.append("")
    lines += [
        "<details><summary>Plans (EXPLAIN (ANALYZE, BUFFERS) of each statement)</summary>",
        "",
    ]
    for op in ops:
        lines += [f"#### {op['name']}", ""]
        for s in op["statements"]:
            lines += [
                f"p50 {_fmt(s['p50_ms'])} ms, p95 {_fmt(s['p95_ms'])} ms, "
                f"{s['executions_per_call']} per call",
                "",
                "```sql",
                s["sql"][:1500],
                "```",
                "```",
                s.get("plan", "(not explained)"),
                "```",
                "",
            ]
    lines += ["</details>", ""]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.scale", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--finished", type=int, default=None, help="terminal runs (1,000,000)")
    parser.add_argument("--live", type=int, default=None, help="live runs (10,000)")
    parser.add_argument("--reps", type=int, default=50, help="repetitions per operation (50)")
    parser.add_argument("--quick", action="store_true", help="100,000 finished, 1,000 live")
    parser.add_argument("--out", type=Path, default=RESULTS, help="results directory")
    parser.add_argument(
        "--before", type=Path, default=None, help="an earlier -scale.json to compare with"
    )
    parser.add_argument("--before-note", default="", help="what changed since --before")
    args = parser.parse_args(argv)
    args.finished = args.finished or (100_000 if args.quick else 1_000_000)
    args.live = args.live or (1_000 if args.quick else 10_000)
    return args


def main(argv: list[str] | None = None) -> int:
    from .common import Databases

    args = parse_args(argv)
    dbs = Databases()
    try:
        result = run(dbs, args.finished, args.live, args.reps)
    finally:
        dbs.drop_all()
    result["date"] = date.today().isoformat()
    if args.before is not None:
        result["before"] = json.loads(args.before.read_text())["operations"]
        result["before_note"] = args.before_note
    markdown = render_markdown(result)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"{result['date']}-scale{'-quick' if args.quick else ''}"
    stem.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    stem.with_suffix(".md").write_text(markdown)
    print(markdown)
    print(f"wrote {stem}.json and {stem}.md", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
