"""The Prometheus text exposition of a :class:`~.state.StateSnapshot` (format 0.0.4, written
by hand: no dependency; issue 20 item 2).

Every metric is a gauge read from the tables at scrape time (nothing is kept in process, so
every replica of the web tier reports the same numbers and a restart loses nothing):

======================================  =========================  ==============================
metric                                  labels                     meaning
======================================  =========================  ==============================
``workflows_up``                                                   1 when the database answered
``workflows_queue_ready_jobs``          ``queue``                  ready jobs (PENDING, back-off
                                                                   passed)
``workflows_queue_running_jobs``        ``queue``                  RUNNING jobs
``workflows_queue_oldest_ready_age_``   ``queue``                  age of the oldest ready job
``seconds``                                                        (0 when none is ready)
``workflows_workers``                   ``queue``, ``version``     live worker processes
``workflows_outbox_undelivered``                                   undelivered outbox events
``workflows_outbox_blocked``                                       ... held back behind a dead
                                                                   letter
``workflows_outbox_lag_seconds``                                   age of the oldest deliverable
                                                                   one (0: none)
``workflows_dead_letters``                                         dead letters
``workflows_schedule_lag_seconds``                                 most overdue schedule (absent
                                                                   without unpaused schedules)
``workflows_ticker_live``               ``holder``                 1 when a live worker holds the
                                                                   ticker lease
``workflows_runs``                      ``status``                 live runs (PENDING, RUNNING)
``workflows_runs_finished_window``      ``workflow``, ``status``   runs finished in the last
                                                                   ``HEALTH_FINISHED_WINDOW_
                                                                   SECONDS``
``workflows_runs_finished_window_``                                that window
``seconds``
``workflows_scrape_duration_seconds``                              how long the snapshot took
======================================  =========================  ==============================

Rates of finished runs are gauges over a moving window, not counters: a durable counter would
need a write on the stage path. ``rate()`` does not apply; divide by the window instead.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable

from .state import StateSnapshot

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def escape_label(value: str) -> str:
    """A label value escaped for the text format (backslash, double quote, newline)."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def format_value(value: float) -> str:
    """A sample value: integers without a fraction, ``NaN``, ``+Inf``, ``-Inf``."""
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, int):
        return str(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


class _Writer:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def gauge(
        self,
        name: str,
        help_text: str,
        samples: Iterable[tuple[dict[str, str], float]],
    ) -> None:
        self.lines.append(f"# HELP {name} {help_text}")
        self.lines.append(f"# TYPE {name} gauge")
        for labels, value in samples:
            if labels:
                body = ",".join(f'{k}="{escape_label(str(v))}"' for k, v in labels.items())
                self.lines.append(f"{name}{{{body}}} {format_value(value)}")
            else:
                self.lines.append(f"{name} {format_value(value)}")

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"


def render(snap: StateSnapshot, *, scrape_seconds: float | None = None) -> str:
    """The exposition text of ``snap`` (every metric family above; a family without samples
    keeps its ``# HELP`` and ``# TYPE`` lines). ``scrape_seconds``: the snapshot's duration
    (default: measured since the call, which is ~0 for a snapshot already taken)."""
    started = time.perf_counter()
    w = _Writer()
    w.gauge(
        "workflows_up",
        "1 when the engine's database answered the scrape.",
        [({}, 1 if snap.database_ok else 0)],
    )
    if snap.database_ok:
        w.gauge(
            "workflows_queue_ready_jobs",
            "Ready jobs per queue (PENDING, retry back-off passed).",
            [({"queue": q.queue}, q.ready) for q in snap.queues],
        )
        w.gauge(
            "workflows_queue_running_jobs",
            "RUNNING jobs per queue.",
            [({"queue": q.queue}, q.running) for q in snap.queues],
        )
        w.gauge(
            "workflows_queue_oldest_ready_age_seconds",
            "Age of the oldest ready job per queue (0 when none is ready), seconds.",
            [({"queue": q.queue}, q.oldest_ready_age_seconds or 0.0) for q in snap.queues],
        )
        w.gauge(
            "workflows_workers",
            "Live worker processes per queue and deploy version.",
            [({"queue": x.queue, "version": x.version}, x.count) for x in snap.workers],
        )
        w.gauge(
            "workflows_outbox_undelivered",
            "Outbox events neither published nor dead-lettered.",
            [({}, snap.outbox_undelivered)],
        )
        w.gauge(
            "workflows_outbox_blocked",
            "Undelivered outbox events held back behind a dead letter of their run.",
            [({}, snap.outbox_blocked)],
        )
        w.gauge(
            "workflows_outbox_lag_seconds",
            "Age of the oldest deliverable undelivered outbox event (0: none), seconds.",
            [({}, snap.outbox_lag_seconds or 0.0)],
        )
        w.gauge(
            "workflows_dead_letters",
            "Dead-lettered outbox events waiting for an operator.",
            [({}, snap.dead_letters)],
        )
        w.gauge(
            "workflows_schedule_lag_seconds",
            "How long past its fire time the most overdue unpaused schedule is, seconds.",
            [] if snap.schedule_lag_seconds is None else [({}, snap.schedule_lag_seconds)],
        )
        w.gauge(
            "workflows_ticker_live",
            "1 when a live worker process holds the ticker lease.",
            [({"holder": snap.ticker_holder or ""}, 1 if snap.ticker_live else 0)],
        )
        w.gauge(
            "workflows_runs",
            "Live runs by status.",
            [({"status": s}, n) for s, n in sorted(snap.runs_by_status.items())],
        )
        w.gauge(
            "workflows_runs_finished_window",
            "Runs finished within the window, per workflow and terminal status.",
            [
                ({"workflow": f.workflow_id, "status": f.status}, f.count)
                for f in snap.finished_recently
            ],
        )
        w.gauge(
            "workflows_runs_finished_window_seconds",
            "The window of workflows_runs_finished_window, seconds.",
            [({}, snap.finished_window_seconds)],
        )
    elapsed = scrape_seconds if scrape_seconds is not None else time.perf_counter() - started
    w.gauge(
        "workflows_scrape_duration_seconds",
        "How long reading the engine's state took, seconds.",
        [({}, round(elapsed, 6))],
    )
    return w.text()
