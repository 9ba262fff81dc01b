"""OpenTelemetry traces and metrics, and the structured log fields (issue 20 items 2, 3, 6),
recorded with the SDK's in-memory exporter and reader through
:func:`django_workflows.telemetry.use_providers`.
"""

from __future__ import annotations

import io
import json
import logging
from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from django_workflows import StageContext, define_stage, define_workflow, telemetry
from django_workflows.kernel import (
    CancelRun,
    ClaimPendingRuns,
    CreateRun,
    FlushOutbox,
    ReapStaleLeases,
    delivery,
)
from django_workflows.kernel.hosting import process_available_jobs
from django_workflows.logging import JsonFormatter
from django_workflows.models import Status, WorkflowRun
from django_workflows.signals import send_signal
from django_workflows.testing import FakeClock, drive, run_to_completion
from tests.integration.test_child_workflows import orders
from tests.integration.test_signals import _flow
from tests.workflows import Num, add

pytestmark = pytest.mark.django_db(transaction=True)

STALE = 300.0


@pytest.fixture
def otel() -> Any:
    spans = InMemorySpanExporter()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(spans))
    reader = InMemoryMetricReader()
    telemetry.use_providers(tracer_provider, MeterProvider(metric_readers=[reader]))
    yield spans, reader, tracer_provider.get_tracer("test")
    telemetry.use_providers(None, None)


def _named(spans: Any, name: str) -> list[Any]:
    return [s for s in spans.get_finished_spans() if s.name == name]


def _points(reader: Any) -> dict[str, list[Any]]:
    data = reader.get_metrics_data()
    out: dict[str, list[Any]] = {}
    for rm in data.resource_metrics if data else []:
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                out.setdefault(m.name, []).extend(m.data.data_points)
    return out


def _sum(points: dict[str, list[Any]], name: str, **attrs: Any) -> float:
    return sum(
        p.value
        for p in points.get(name, [])
        if all(p.attributes.get(k) == v for k, v in attrs.items())
    )


# --- traces ---------------------------------------------------------------------------------


def test_one_trace_from_the_request_through_stages_a_child_run_and_delivery(
    kernel_for: Any, otel: Any
) -> None:
    spans, _, tracer = otel
    kernel = kernel_for(orders)
    with tracer.start_as_current_span("POST /orders") as request:
        run_id = kernel.dispatch(CreateRun("orders", {"order_id": "A1"})).workflow_run_id
    run = run_to_completion(kernel, run_id, advance_seconds=None)
    assert run.status == Status.COMPLETED
    trace_id = request.get_span_context().trace_id

    creates = _named(spans, "workflow.create")
    assert len(creates) == 2  # the parent run, then the child run started by stage "ship"
    parent_create = next(s for s in creates if s.attributes["workflow.run_id"] == str(run_id))
    assert parent_create.parent.span_id == request.get_span_context().span_id
    stored = WorkflowRun.objects.get(pk=run_id).trace_context
    assert stored["traceparent"].split("-")[2] == format(parent_create.context.span_id, "016x")

    stages = [s for s in spans.get_finished_spans() if s.name.startswith("workflow.stage ")]
    by_stage = {s.attributes["workflow.stage_id"]: s for s in stages}
    assert {"validate", "ship", "pack"} <= set(by_stage)
    for name in ("validate", "ship"):  # the parent's stages: children of its create span
        assert by_stage[name].parent.span_id == parent_create.context.span_id
    child_create = next(s for s in creates if s is not parent_create)
    # the child run is created in the outcome of "ship": its create span nests there
    outcome_of_ship = next(
        s
        for s in _named(spans, "workflow.outcome")
        if s.parent.span_id == by_stage["ship"].context.span_id
    )
    assert child_create.parent.span_id == outcome_of_ship.context.span_id
    assert by_stage["pack"].parent.span_id == child_create.context.span_id
    for stage in stages:
        steps = {
            s.name
            for s in spans.get_finished_spans()
            if s.parent and s.parent.span_id == stage.context.span_id
        }
        assert {"workflow.lease", "workflow.execute", "workflow.outcome"} <= steps
    delivered = _named(spans, "workflow.deliver")
    assert {s.attributes["workflow.event_type"] for s in delivered} >= {
        "workflow:created",
        "workflow:completed",
    }
    everything = spans.get_finished_spans()
    assert {s.context.trace_id for s in everything} == {trace_id}


class _Broken:
    """A span processor that raises where the SDK does not catch: on start or on end."""

    def __init__(self, when: str) -> None:
        self.when = when

    def on_start(self, span: Any, parent_context: Any = None) -> None:
        if self.when == "start":
            raise RuntimeError("processor broke on start")

    def on_end(self, span: Any) -> None:
        if self.when == "end":
            raise RuntimeError("processor broke on end")

    def shutdown(self) -> None:
        pass

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


@pytest.mark.parametrize("when", ["start", "end"])
def test_a_failing_span_processor_never_fails_a_stage_or_a_delivery(
    kernel_for: Any, sink: Any, when: str
) -> None:
    """The SDK lets a span processor's exception reach the caller: the engine's hooks log it
    and go on, so every stage runs, the run completes and its events are delivered."""
    from django_workflows.kernel import FlushOutbox

    provider = TracerProvider()
    provider.add_span_processor(_Broken(when))
    telemetry.use_providers(provider, None)
    try:
        kernel = kernel_for(orders)
        run_id = kernel.dispatch(CreateRun("orders", {"order_id": "B2"})).workflow_run_id
        run = run_to_completion(kernel, run_id, advance_seconds=None)
        kernel.dispatch(FlushOutbox(100))
    finally:
        telemetry.use_providers(None, None)
    assert run.status == Status.COMPLETED
    assert WorkflowRun.objects.get(pk=run_id).status == Status.COMPLETED
    types = [e["type"] for e in sink.events if e.get("workflow_run_id") == str(run_id)]
    assert "workflow:completed" in types


def test_a_signal_joins_the_run_trace_and_links_to_its_sender(
    kernel_for: Any, clock: FakeClock, otel: Any
) -> None:
    spans, _, tracer = otel
    kernel = kernel_for(_flow(poll_interval_seconds=3600))
    with tracer.start_as_current_span("create") as created:
        run_id = kernel.dispatch(CreateRun(workflow_id="sig")).workflow_run_id
    drive(kernel, run_id, rounds=3, advance_seconds=0)
    with tracer.start_as_current_span("POST /signals") as sender:
        send_signal(run_id, "approved", {"by": "bob"}, kernel=kernel)
    assert drive(kernel, run_id, rounds=3, advance_seconds=0).status == Status.COMPLETED

    (signal,) = _named(spans, "workflow.signal")
    run_trace = created.get_span_context().trace_id
    assert signal.context.trace_id == run_trace != sender.get_span_context().trace_id
    assert [link.context.span_id for link in signal.links] == [sender.get_span_context().span_id]
    after = next(s for s in spans.get_finished_spans() if s.name == "workflow.stage after")
    assert after.context.trace_id == run_trace


def test_nothing_is_recorded_with_the_setting_off(
    kernel_for: Any, otel: Any, settings: Any
) -> None:
    spans, reader, _ = otel
    settings.DJANGO_WORKFLOWS = {**settings.DJANGO_WORKFLOWS, "TELEMETRY": False}
    kernel = kernel_for(define_workflow(id="off").pipe(add(1)).build())
    run_id = kernel.dispatch(CreateRun("off", {"value": 1})).workflow_run_id
    assert run_to_completion(kernel, run_id).status == Status.COMPLETED
    assert spans.get_finished_spans() == ()
    assert WorkflowRun.objects.get(pk=run_id).trace_context is None
    assert not _points(reader)


# --- metrics --------------------------------------------------------------------------------


def _flaky(stage_id: str, fail_first: int) -> Any:
    calls = {"n": 0}

    def execute(ctx: StageContext[Num, Any]) -> Num:
        calls["n"] += 1
        if calls["n"] <= fail_first:
            raise RuntimeError(f"delivery {calls['n']} fails")
        return Num(value=ctx.input.value + 1)

    return define_stage(id=stage_id, input=Num, output=Num, execute=execute, retry=3)


def test_metrics_after_a_retry_a_lease_loss_and_a_dead_letter(
    kernel_for: Any, clock: FakeClock, sink: Any, otel: Any, caplog: Any
) -> None:
    _, reader, _ = otel
    retried = define_workflow(id="retried", input=Num).pipe(_flaky("s", 1)).build()
    lost = {"n": 0}

    def paused(ctx: StageContext[Num, Any]) -> Num:
        # the first delivery "pauses" past its lease: another worker takes the job over
        lost["n"] += 1
        if lost["n"] == 1:
            clock.advance(STALE + 1)
            kernel.dispatch(ReapStaleLeases(stale_threshold_seconds=STALE))
            process_available_jobs(kernel, "live-worker", max_jobs=5)
        return Num(value=lost["n"])

    paused_wf = (
        define_workflow(id="paused", input=Num)
        .pipe(define_stage(id="p", input=Num, output=Num, execute=paused))
        .build()
    )
    once = (
        define_workflow(id="once", input=Num)
        .pipe(define_stage(id="o", input=Num, output=Num, execute=lambda c: c.input, retry=1))
        .build()
    )
    kernel = kernel_for(retried, paused_wf, once)

    run_id = kernel.dispatch(CreateRun("retried", {"value": 0})).workflow_run_id
    assert run_to_completion(kernel, run_id, advance_seconds=None).status == Status.COMPLETED

    caplog.set_level(logging.WARNING, logger="django_workflows")
    paused_id = kernel.dispatch(CreateRun("paused", {"value": 0})).workflow_run_id
    kernel.dispatch(ClaimPendingRuns("claimer"))
    first = delivery.lease(kernel, "paused-worker")
    assert first is not None and str(first.run.pk) == str(paused_id)
    assert delivery.deliver(kernel, first, None).outcome == "discarded"
    discard = next(r for r in caplog.records if "discarded" in r.getMessage())
    assert (discard.run_id, discard.stage_id, discard.delivery, discard.generation) == (
        str(paused_id),
        "p",
        1,
        0,
    )

    once_id = kernel.dispatch(CreateRun("once", {"value": 0})).workflow_run_id
    kernel.dispatch(ClaimPendingRuns("claimer"))
    assert delivery.lease(kernel, "dies") is not None  # never comes back
    clock.advance(STALE + 1)
    kernel.dispatch(ReapStaleLeases(stale_threshold_seconds=STALE))
    assert WorkflowRun.objects.get(pk=once_id).status == Status.FAILED

    sink.fail_with = RuntimeError("plugin down")
    sink_max = sink.max_retries
    for _ in range(sink_max):
        kernel.dispatch(FlushOutbox(max_events=500))

    points = _points(reader)
    assert _sum(points, "workflows.stage.retries", workflow_id="retried", stage_id="s") == 1
    assert _sum(points, "workflows.lease.losses", workflow_id="paused", stage_id="p") == 1
    assert _sum(points, "workflows.jobs.dead_letters", workflow_id="once", stage_id="o") == 1
    assert _sum(points, "workflows.outbox.dead_letters") >= 1
    durations = Counter(
        (p.attributes["workflow_id"], p.attributes["outcome"], p.attributes["queue"])
        for p in points["workflows.stage.duration"]
        for _ in range(p.count)
    )
    assert durations[("retried", "failed", "default")] == 1
    assert durations[("retried", "completed", "default")] == 1
    assert durations[("paused", "discarded", "default")] == 1
    assert durations[("paused", "completed", "default")] == 1
    runs = {
        (p.attributes["workflow_id"], p.attributes["outcome"]): p.count
        for p in points["workflows.run.duration"]
    }
    assert runs[("retried", "completed")] == 1 and runs[("paused", "completed")] == 1
    assert runs[("once", "failed")] == 1  # failed by the give-up of its job


def test_a_cancelled_run_records_its_duration_once_started(kernel_for: Any, otel: Any) -> None:
    _, reader, _ = otel
    kernel = kernel_for(define_workflow(id="cancelled").pipe(add(1)).build())
    never_started = kernel.dispatch(CreateRun("cancelled", {"value": 1})).workflow_run_id
    kernel.dispatch(CancelRun(never_started))
    started = kernel.dispatch(CreateRun("cancelled", {"value": 1})).workflow_run_id
    kernel.dispatch(ClaimPendingRuns("claimer"))
    kernel.dispatch(CancelRun(started))
    runs = [(p.attributes["outcome"], p.count) for p in _points(reader)["workflows.run.duration"]]
    assert runs == [("cancelled", 1)]  # the PENDING one never started: no duration


@dataclass(frozen=True)
class QueueState:
    queue: str
    ready: int
    running: int
    oldest_ready_age_seconds: float | None


@dataclass(frozen=True)
class WorkerState:
    queue: str
    version: str
    count: int


@dataclass(frozen=True)
class StateSnapshot:
    """The shape of ``django_workflows.health.state.StateSnapshot`` (built by another branch)."""

    taken_at: datetime
    database_ok: bool
    queues: list[QueueState] = field(default_factory=list)
    workers: list[WorkerState] = field(default_factory=list)
    outbox_undelivered: int = 0
    outbox_lag_seconds: float | None = None
    dead_letters: int = 0
    schedule_lag_seconds: float | None = None
    ticker_holder: str | None = None
    ticker_live: bool = False


def test_state_gauges_observe_one_snapshot_per_collection() -> None:
    reader = InMemoryMetricReader()
    meter = MeterProvider(metric_readers=[reader]).get_meter("test")
    taken: list[int] = []

    def snapshot() -> StateSnapshot:
        taken.append(1)
        return StateSnapshot(
            taken_at=datetime.now(UTC),
            database_ok=True,
            queues=[QueueState("default", 4, 1, 12.5), QueueState("gpu", 0, 0, None)],
            workers=[WorkerState("default", "v1", 2), WorkerState("gpu", "v2", 1)],
            outbox_undelivered=7,
            outbox_lag_seconds=1.5,
            dead_letters=3,
            schedule_lag_seconds=None,
            ticker_holder="w1",
            ticker_live=True,
        )

    telemetry.register_state_gauges(meter, snapshot)
    points = _points(reader)
    assert len(taken) == 1
    ready = {p.attributes["queue"]: p.value for p in points["workflows.queue.ready"]}
    assert ready == {"default": 4, "gpu": 0}
    age = {p.attributes["queue"]: p.value for p in points["workflows.queue.oldest_ready_age"]}
    assert age == {"default": 12.5}  # no age for an empty queue
    workers = {
        (p.attributes["queue"], p.attributes["version"]): p.value
        for p in points["workflows.workers"]
    }
    assert workers == {("default", "v1"): 2, ("gpu", "v2"): 1}
    assert [p.value for p in points["workflows.outbox.undelivered"]] == [7]
    assert [p.value for p in points["workflows.outbox.lag"]] == [1.5]
    assert [p.value for p in points["workflows.outbox.dead_letter_backlog"]] == [3]
    assert "workflows.schedule.lag" not in points
    assert [p.value for p in points["workflows.database.up"]] == [1]
    assert [p.value for p in points["workflows.ticker.live"]] == [1]


def test_state_gauges_read_the_health_snapshot_by_default(kernel_for: Any) -> None:
    from django_workflows.health import state

    reader = InMemoryMetricReader()
    meter = MeterProvider(metric_readers=[reader]).get_meter("test")
    kernel = kernel_for(define_workflow(id="gauged").pipe(add(1)).build())
    for _ in range(2):
        kernel.dispatch(CreateRun("gauged", {"value": 1}))
    kernel.dispatch(ClaimPendingRuns("claimer"))  # two ready jobs of queue "default"
    expected = {q.queue: q.ready for q in state.snapshot().queues}
    assert expected.get("default") == 2

    state.register_gauges(meter)  # the health snapshot: the database's state
    points = _points(reader)
    ready = {p.attributes["queue"]: p.value for p in points["workflows.queue.ready"]}
    assert ready == expected
    assert [p.value for p in points["workflows.database.up"]] == [1]


# --- JSON log lines -------------------------------------------------------------------------


def test_json_lines_of_a_delivery_carry_its_fields(kernel_for: Any) -> None:
    def noisy(ctx: StageContext[Num, Any]) -> Num:
        logging.getLogger("django_workflows.worker").warning("inside %s", "the stage")
        try:
            raise ValueError("shown")
        except ValueError:
            logging.getLogger("django_workflows.worker").exception("with a traceback")
        return ctx.input

    wf = (
        define_workflow(id="noisy", input=Num)
        .pipe(define_stage(id="n", input=Num, output=Num, execute=noisy))
        .build()
    )
    kernel = kernel_for(wf)
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter())
    engine = logging.getLogger("django_workflows")
    engine.addHandler(handler)
    try:
        run_id = kernel.dispatch(CreateRun("noisy", {"value": 1})).workflow_run_id
        assert run_to_completion(kernel, run_id).status == Status.COMPLETED
        logging.getLogger("django_workflows.outbox").warning("outside a delivery")
    finally:
        engine.removeHandler(handler)
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    inside, traced, outside = lines
    assert inside == {
        "time": inside["time"],
        "level": "WARNING",
        "logger": "django_workflows.worker",
        "message": "inside the stage",
        "run_id": str(run_id),
        "stage_id": "n",
        "delivery": 1,
        "generation": 0,
    }
    assert datetime.fromisoformat(inside["time"]).tzinfo is not None
    assert "ValueError: shown" in traced["exc_info"] and traced["stage_id"] == "n"
    assert outside["run_id"] is None and outside["delivery"] is None


def test_heartbeat_thread_lines_carry_the_fields_of_their_delivery(caplog: Any) -> None:
    """The heartbeat thread has no delivery context of its own: a beat's lines carry the
    fields of the delivery that made it."""
    from django_workflows.kernel.heartbeat import Heartbeat
    from django_workflows.logging import delivery_context

    with delivery_context("r-1", "s", 2, 1):
        beat = Heartbeat(kernel=None, job_id=7, interval_seconds=30.0, attempt=2)  # type: ignore[arg-type]
    beat.watch(1.0, lambda: None)
    beat.deadline = 0.0
    caplog.set_level(logging.WARNING, logger="django_workflows")
    assert beat.check_deadline(1.0) is False  # deadline passed: timed out, in its grace
    (line,) = [r for r in caplog.records if "passed its timeout" in r.getMessage()]
    assert (line.run_id, line.stage_id, line.delivery, line.generation) == ("r-1", "s", 2, 1)


def test_tracing_adds_no_statement_to_the_stage_path(kernel_for: Any, otel: Any) -> None:
    """The stage spans' parent comes from the run row the lease already reads."""
    from django.db import connection

    from tests.integration.test_query_counts import STATEMENTS_PER_STAGE, _last_stage_statements

    assert _last_stage_statements(kernel_for, 3) == STATEMENTS_PER_STAGE[connection.vendor]
    spans, _, _ = otel
    stage = next(s for s in spans.get_finished_spans() if s.name == "workflow.stage s2")
    create = next(s for s in spans.get_finished_spans() if s.name == "workflow.create")
    assert stage.parent.span_id == create.context.span_id


def test_a_global_provider_set_later_is_used(monkeypatch: Any) -> None:
    """Unconfigured, the hooks ask the API at most every RECHECK_SECONDS; once a global
    provider is configured it is used (and kept)."""
    from opentelemetry import trace

    telemetry.use_providers(None, None)
    provider: Any = trace.ProxyTracerProvider()
    monkeypatch.setattr(telemetry.otel_trace, "get_tracer_provider", lambda: provider)
    assert telemetry.tracer() is None
    provider = TracerProvider()
    assert telemetry.tracer() is None  # the unconfigured answer is kept for a while
    monkeypatch.setattr(telemetry, "RECHECK_SECONDS", 0.0)
    telemetry._global["tracer"] = (None, 0.0)
    assert telemetry.tracer() is not None
    provider = None
    assert telemetry.tracer() is not None  # kept for good
    telemetry.use_providers(None, None)


def test_a_run_that_ends_with_its_last_map_item_records_its_duration(
    kernel_for: Any, otel: Any
) -> None:
    from tests.integration.test_mapping import Numbers, _items, square

    wf = define_workflow(id="mapped", input=Numbers).map(square, over=_items).build()
    kernel = kernel_for(wf)
    run_id = kernel.dispatch(CreateRun("mapped", {"numbers": [1, 2, 3]})).workflow_run_id
    assert run_to_completion(kernel, run_id).status == Status.COMPLETED
    _, reader, _ = otel
    points = _points(reader)
    runs = [p for p in points["workflows.run.duration"] if p.attributes["workflow_id"] == "mapped"]
    assert [(p.attributes["outcome"], p.count) for p in runs] == [("completed", 1)]
    items = [
        p for p in points["workflows.stage.duration"] if p.attributes["workflow_id"] == "mapped"
    ]
    assert sum(p.count for p in items) == 3


def test_every_engine_logger_gets_the_field_filter() -> None:
    """A new ``getLogger("django_workflows...")`` in the source must be in ENGINE_LOGGERS (so
    it has the filter even when its module is imported after the app is ready)."""
    import re
    from pathlib import Path

    from django_workflows import logging as wf_logging

    source = Path(wf_logging.__file__).parent
    names = {
        m.group(1)
        for path in source.rglob("*.py")
        for m in re.finditer(r'getLogger\("(django_workflows[\w.]*)"\)', path.read_text())
    }
    assert names and names <= set(wf_logging.ENGINE_LOGGERS)
    for name in wf_logging.ENGINE_LOGGERS:
        assert any(isinstance(f, wf_logging.ContextFilter) for f in logging.getLogger(name).filters)
