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
``workflows_runs_finished_window``      ``workflow_id``,           runs finished in the last
                                        ``status``                 ``HEALTH_FINISHED_WINDOW_
                                                                   SECONDS``
``workflows_runs_finished_window_``                                that window
``seconds``
``workflows_stage_duration_window_``    ``workflow_id``,           p50 / p95 / max of the
``seconds``                             ``stage_id``, ``quantile`` durations of stages finished
                                                                   in the window (``quantile``
                                                                   ``0.5``, ``0.95``, ``1``)
``workflows_stage_duration_window_``    ``workflow_id``,           how many durations
``samples``                             ``stage_id``
``workflows_run_duration_window_``      ``workflow_id``,           the same of runs
``seconds``                             ``quantile``
``workflows_run_duration_window_``      ``workflow_id``            how many durations
``samples``
``workflows_job_redeliveries_``          ``workflow_id``,           deliveries beyond the first of
``window``                              ``stage_id``               jobs finished in the window
``workflows_duration_window_``                                     1 when more than 5,000 stages
``truncated``                                                      or runs finished in the window
``workflows_scrape_duration_seconds``                              how long the snapshot took
``workflows_scrape_timed_out``                                     1 when the database did not
                                                                   answer within
                                                                   ``HEALTH_TIMEOUT_SECONDS``
                                                                   (``workflows_up`` is then 0)
======================================  =========================  ==============================

Durations read at most the 5,000 newest stages and the 5,000 newest runs finished in the
window (``DURATION_SAMPLE_LIMIT``; an index range and a LIMIT, however busy the window):
nearest-rank percentiles of those. Redeliveries are ``attempt - 1`` of the jobs finished in
the window: retries, expired leases and graceful releases alike; the engine keeps no durable
per-delivery record to split them (lease losses alone are the OpenTelemetry counter
``workflows.stage.lease_losses``), and writing one would put SQL on the stage path.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable

from .state import DURATION_SAMPLE_LIMIT, DurationState, StateSnapshot

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


def _quantiles(rows: Iterable[DurationState], *, stage: bool) -> list[tuple[dict[str, str], float]]:
    samples: list[tuple[dict[str, str], float]] = []
    for d in rows:
        labels = {"workflow_id": d.workflow_id}
        if stage:
            labels["stage_id"] = d.stage_id
        for q, v in (("0.5", d.p50), ("0.95", d.p95), ("1", d.max)):
            samples.append(({**labels, "quantile": q}, v))
    return samples


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
                ({"workflow_id": f.workflow_id, "status": f.status}, f.count)
                for f in snap.finished_recently
            ],
        )
        w.gauge(
            "workflows_runs_finished_window_seconds",
            "The window of workflows_runs_finished_window, seconds.",
            [({}, snap.finished_window_seconds)],
        )
        note = (
            f'(nearest rank; quantile="1" is the max; of at most the {DURATION_SAMPLE_LIMIT} '
            "newest finished in the window)"
        )
        w.gauge(
            "workflows_stage_duration_window_seconds",
            "Durations of stages finished within the window per workflow and stage, seconds "
            f"{note}.",
            _quantiles(snap.stage_durations, stage=True),
        )
        w.gauge(
            "workflows_stage_duration_window_samples",
            "Stage durations behind workflows_stage_duration_window_seconds.",
            [
                ({"workflow_id": d.workflow_id, "stage_id": d.stage_id}, d.count)
                for d in snap.stage_durations
            ],
        )
        w.gauge(
            "workflows_run_duration_window_seconds",
            f"Durations of runs finished within the window per workflow, seconds {note}.",
            _quantiles(snap.run_durations, stage=False),
        )
        w.gauge(
            "workflows_run_duration_window_samples",
            "Run durations behind workflows_run_duration_window_seconds.",
            [({"workflow_id": d.workflow_id}, d.count) for d in snap.run_durations],
        )
        w.gauge(
            "workflows_job_redeliveries_window",
            "Deliveries beyond the first of the jobs finished within the window, per workflow "
            "and stage (retries after a failure, redeliveries after an expired lease or a "
            "graceful stop; lease losses alone are an OpenTelemetry counter).",
            [
                ({"workflow_id": r.workflow_id, "stage_id": r.stage_id}, r.count)
                for r in snap.redeliveries
            ],
        )
        w.gauge(
            "workflows_duration_window_truncated",
            f"1 when the window held more than {DURATION_SAMPLE_LIMIT} finished stages or runs "
            "(the durations describe the newest only).",
            [({}, 1 if snap.duration_samples_truncated else 0)],
        )
    elapsed = scrape_seconds if scrape_seconds is not None else time.perf_counter() - started
    w.gauge(
        "workflows_scrape_duration_seconds",
        "How long reading the engine's state took, seconds.",
        [({}, round(elapsed, 6))],
    )
    w.gauge(
        "workflows_scrape_timed_out",
        "1 when the engine's database did not answer within HEALTH_TIMEOUT_SECONDS.",
        [({}, 1 if snap.timed_out else 0)],
    )
    return w.text()
