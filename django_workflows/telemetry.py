"""OpenTelemetry traces and metrics of the engine (issue 20 items 2 and 3; optional extra).

Install with ``pip install django-workflows[otel]`` (``opentelemetry-api``) and configure an
SDK (``opentelemetry-sdk``, an exporter) as for any application. Without
``opentelemetry`` importable nothing of it is imported and every hook here is a no-op; with it
installed, ``DJANGO_WORKFLOWS["TELEMETRY"] = False`` turns the hooks off. Spans and
instruments are only made once a real provider is set (the API's default proxy providers
mean "not configured": nothing is recorded, nothing is looked up).

**Traces.** ``run.create`` opens the span ``workflow.create`` (a child of the caller's current
span: the web request, a stage that starts a child run) and stores its W3C trace context
(``{"traceparent": ..., "tracestate": ...}``) on the run (``WorkflowRun.trace_context``).
Every delivery of a stage is a span ``workflow.stage <stage_id>`` whose *parent* is that
context, read from the run row the lease transaction already loads (no statement added), with
the children ``workflow.lease``, ``workflow.execute`` (current while the stage body runs: the
body's own spans, and the ``workflow.create`` of a child run, nest under it) and
``workflow.outcome``. A signal (``workflow.signal``) and each outbox event handed to the event
sink (``workflow.deliver``) are children of the run's context too, so one trace shows the run
end to end; ``workflow.signal`` links to the sender's span.

Parents rather than links: a link-only design makes every delivery a trace of its own, and a
backend then shows the run as scattered traces joined only by link lists; parenting keeps
the run one tree at the price of long traces for long-lived runs (a trace id that lives as
long as the run).

**Metrics** (meter ``django_workflows``), recorded in the process where they happen:

* ``workflows.stage.duration`` (histogram, s; ``workflow_id``, ``stage_id``, ``queue``,
  ``outcome``): one delivery's execution and outcome;
* ``workflows.run.duration`` (histogram, s; ``workflow_id``, ``outcome``): a run that ended
  (completed, failed, cancelled) in a stage's outcome, a give-up or a cancel, from its start;
* ``workflows.stage.retries`` (counter; ``workflow_id``, ``stage_id``, ``queue``): failed
  deliveries put back for another;
* ``workflows.lease.losses`` (counter; same): deliveries whose outcome was discarded because
  their lease had been taken over;
* ``workflows.jobs.dead_letters`` (counter; ``workflow_id``, ``stage_id``, ``queue``,
  ``reason``): jobs given up (deliveries used up, queue timeout);
* ``workflows.outbox.dead_letters`` (counter; ``event_type``): outbox events dead-lettered;
* the database-state gauges of :func:`register_state_gauges`.

Tests (and applications that do not set the global providers) point the hooks at providers
of their own with :func:`use_providers`.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import TYPE_CHECKING, Any

from django.core.signals import setting_changed
from django.dispatch import receiver

from .conf import workflow_settings
from .logging import delivery_context

try:  # guarded once: without the extra nothing below touches opentelemetry
    from opentelemetry import context as otel_context
    from opentelemetry import metrics as otel_metrics
    from opentelemetry import trace as otel_trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
except ImportError:  # pragma: no cover - exercised by a subprocess test
    otel_trace = None  # type: ignore[assignment]
    otel_metrics = None  # type: ignore[assignment]
    otel_context = None  # type: ignore[assignment]

if TYPE_CHECKING:
    from .kernel.stage_path import Delivery, Outcome

#: Whether ``opentelemetry-api`` is importable.
AVAILABLE = otel_trace is not None
#: Instrumentation scope of the engine's tracer and meter.
SCOPE = "django_workflows"

_tracer_provider: Any = None
_meter_provider: Any = None
_tracers: dict[int, Any] = {}
_instruments: dict[int, dict[str, Any]] = {}
_propagator: Any = TraceContextTextMapPropagator() if AVAILABLE else None


def use_providers(tracer_provider: Any = None, meter_provider: Any = None) -> None:
    """Record spans with ``tracer_provider`` and metrics with ``meter_provider`` instead of
    the global ones (``None``: the global provider again). The global providers can be set
    once per process; tests and embedders use this instead.
    """
    global _tracer_provider, _meter_provider
    _tracer_provider = tracer_provider
    _meter_provider = meter_provider
    _tracers.clear()
    _instruments.clear()
    _global.update(tracer=(None, 0.0), meters=(None, 0.0))


_enabled: bool | None = None


def enabled() -> bool:
    """``opentelemetry`` is importable and ``DJANGO_WORKFLOWS["TELEMETRY"]`` is true (read
    once, again after a ``setting_changed`` of ``DJANGO_WORKFLOWS``).
    """
    global _enabled
    if _enabled is None:
        _enabled = AVAILABLE and bool(workflow_settings.TELEMETRY)
    return _enabled


@receiver(setting_changed)
def _reload(*, setting: str, **kwargs: Any) -> None:
    global _enabled
    if setting == "DJANGO_WORKFLOWS":
        _enabled = None


#: While no global provider is configured, how long (seconds) that answer is kept before the
#: API is asked again: the hooks then cost a clock read; a provider set later is used within
#: this long. A configured global provider is kept for good (the API sets it once).
RECHECK_SECONDS = 1.0
_global: dict[str, tuple[Any, float]] = {"tracer": (None, 0.0), "meters": (None, 0.0)}


def _configured(kind: str, get_provider: Callable[[], Any], unset: Callable[[Any], bool]) -> Any:
    """The global provider of ``kind`` once configured, else ``None`` (asked again at most
    every :data:`RECHECK_SECONDS`).
    """
    provider, until = _global[kind]
    if provider is not None:
        return provider
    now = time.monotonic()
    if now < until:
        return None
    provider = get_provider()
    if unset(provider):
        _global[kind] = (None, now + RECHECK_SECONDS)
        return None
    _global[kind] = (provider, 0.0)
    return provider


def _no_tracer_provider(provider: Any) -> bool:
    return isinstance(provider, (otel_trace.ProxyTracerProvider, otel_trace.NoOpTracerProvider))


def _no_meter_provider(provider: Any) -> bool:
    return isinstance(provider, otel_metrics.NoOpMeterProvider) or (
        type(provider).__name__ == "_ProxyMeterProvider"
    )


def tracer() -> Any:
    """The engine's tracer, or ``None`` when telemetry is off or no tracer provider is
    configured (the API's proxy/no-op provider).
    """
    if not enabled():
        return None
    provider = _tracer_provider or _configured(
        "tracer", otel_trace.get_tracer_provider, _no_tracer_provider
    )
    if provider is None:
        return None
    found = _tracers.get(id(provider))
    if found is None:
        found = _tracers[id(provider)] = provider.get_tracer(SCOPE)
    return found


def _meters() -> dict[str, Any] | None:
    """The engine's instruments (created once per meter provider), or ``None`` when
    telemetry is off or no meter provider is configured.
    """
    if not enabled():
        return None
    provider = _meter_provider or _configured(
        "meters", otel_metrics.get_meter_provider, _no_meter_provider
    )
    if provider is None:
        return None
    found = _instruments.get(id(provider))
    if found is None:
        found = _instruments[id(provider)] = _create_instruments(provider.get_meter(SCOPE))
    return found


def _create_instruments(meter: Any) -> dict[str, Any]:
    return {
        "stage_duration": _histogram(
            meter, "workflows.stage.duration", "One delivery of a stage", STAGE_BUCKETS
        ),
        "run_duration": _histogram(
            meter, "workflows.run.duration", "A run, from its start to its end", RUN_BUCKETS
        ),
        "retries": meter.create_counter(
            "workflows.stage.retries", description="Failed deliveries put back for another"
        ),
        "lease_losses": meter.create_counter(
            "workflows.lease.losses", description="Outcomes discarded: lease taken over"
        ),
        "job_dead_letters": meter.create_counter(
            "workflows.jobs.dead_letters", description="Jobs given up (dead letters)"
        ),
        "outbox_dead_letters": meter.create_counter(
            "workflows.outbox.dead_letters", description="Outbox events dead-lettered"
        ),
    }


#: Bucket boundaries (seconds) advised for the duration histograms (the SDK's defaults suit
#: milliseconds); a view configured by the application overrides them.
STAGE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 900, 3600)
RUN_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 900, 3600, 4 * 3600, 86400)


def _histogram(meter: Any, name: str, description: str, buckets: tuple[float, ...]) -> Any:
    try:  # the advisory needs opentelemetry-api >= 1.23
        return meter.create_histogram(
            name, unit="s", description=description, explicit_bucket_boundaries_advisory=buckets
        )
    except TypeError:  # pragma: no cover - older API
        return meter.create_histogram(name, unit="s", description=description)


def _context_of(carrier: Any) -> Any:
    """The OpenTelemetry context of a stored carrier (``None``: none stored or malformed)."""
    if not isinstance(carrier, dict) or not carrier.get("traceparent"):
        return None
    ctx = _propagator.extract(carrier)
    span = otel_trace.get_current_span(ctx)
    return ctx if span.get_span_context().is_valid else None


def _carrier(ctx: Any = None) -> dict[str, str] | None:
    carrier: dict[str, str] = {}
    _propagator.inject(carrier, context=ctx)
    return carrier or None


# -- telemetry never fails the engine -------------------------------------------------------

_failures_logged: set[str] = set()


def _failed(where: str) -> None:
    """An OpenTelemetry call raised (a span processor, exporter or instrument of the
    application's providers): the engine goes on without that span or measurement. Logged
    with its traceback once per place and process."""
    if where not in _failures_logged:
        _failures_logged.add(where)
        logging.getLogger("django_workflows").warning(
            "OpenTelemetry failed in %s; going on without it", where, exc_info=True
        )


def _guarded(func: Callable[..., None]) -> Callable[..., None]:
    """``func`` (a metrics hook returning nothing) with any exception it raises logged by
    :func:`_failed` instead of reaching the stage path."""

    @functools.wraps(func)
    def guarded(*args: Any, **kwargs: Any) -> None:
        try:
            func(*args, **kwargs)
        except Exception:
            _failed(func.__name__)

    return guarded


class _Safe:
    """A span's context manager (made by ``make()``) whose own failures - on start or on end,
    where the SDK calls the application's span processors without catching - are logged by
    :func:`_failed` and swallowed; the block's own exceptions pass through unchanged. ``as``
    gives the span, or ``None`` when starting it failed."""

    def __init__(self, where: str, make: Callable[[], Any]) -> None:
        self._where = where
        self._make = make
        self._cm: Any = None

    def __enter__(self) -> Any:
        try:
            cm = self._make()
            span = cm.__enter__()
        except Exception:
            _failed(self._where)
            return None
        self._cm = cm
        return span

    def __exit__(self, *exc: Any) -> bool:
        if self._cm is None:
            return False
        try:
            self._cm.__exit__(*exc)
        except BaseException as raised:
            if exc[1] is not None and raised is exc[1]:
                return False  # the block's own exception, re-raised by the span: let it go on
            if not isinstance(raised, Exception):
                raise
            _failed(self._where)
        return False


# -- create ---------------------------------------------------------------------------------


@contextmanager
def creating(workflow_id: str) -> Iterator[Any]:
    """Around ``run.create``: the span ``workflow.create`` (a child of the current span).
    Yields ``(carrier, span)``: ``carrier`` is the W3C trace context to store with the run
    (``{"traceparent": str, "tracestate"?: str}``, ``None`` without tracing); the caller sets
    ``run_id`` on ``span`` (``None`` without tracing) once the row exists.
    """
    t = tracer()
    if t is None:
        yield None, None
        return
    with _Safe(
        "workflow.create",
        lambda: t.start_as_current_span("workflow.create", attributes={"workflow.id": workflow_id}),
    ) as span:
        carrier = None
        if span is not None:
            try:
                carrier = _carrier()
            except Exception:
                _failed("workflow.create")
        yield carrier, span


# -- one delivery ---------------------------------------------------------------------------


class _Untraced:
    """What :func:`delivering` yields without tracing: the steps are plain blocks."""

    def __init__(self, delivery: Delivery) -> None:
        self._delivery = delivery
        self._began = time.perf_counter()

    def step(self, name: str) -> Any:
        return nullcontext()

    def ended(self, result: Outcome) -> None:
        _record_delivery(self._delivery, result, self._began)


class _Traced(_Untraced):
    def __init__(self, delivery: Delivery, span: Any, t: Any) -> None:
        super().__init__(delivery)
        self._span = span
        self._tracer = t

    def step(self, name: str) -> Any:
        return _Safe(
            f"workflow.{name}", lambda: self._tracer.start_as_current_span(f"workflow.{name}")
        )

    def ended(self, result: Outcome) -> None:
        super().ended(result)
        try:
            self._span.set_attribute("workflow.outcome", result.outcome)
            if result.error:
                self._span.set_status(otel_trace.Status(otel_trace.StatusCode.ERROR, result.error))
        except Exception:
            _failed("workflow.stage")


@contextmanager
def delivering(delivery: Delivery) -> Iterator[_Untraced]:
    """Around steps 2 and 3 of one delivery (:func:`..kernel.delivery.deliver`): the log
    fields of :mod:`django_workflows.logging` and, with tracing, the span
    ``workflow.stage <stage_id>`` (a child of the run's stored trace context, starting when
    the lease began) with its ``workflow.lease`` child. The yielded object's ``step(name)``
    wraps a step in a child span ``workflow.<name>``; ``ended(outcome)`` records the
    delivery's metrics and its outcome on the span.
    """
    d = delivery
    record = d.record
    with delivery_context(d.run.pk, d.node.stage.id, d.job.attempt, record.generation):
        t = tracer()
        started = _stage_span(t, d) if t is not None else None
        if started is None:
            yield _Untraced(d)
            return
        span, token = started
        try:
            yield _Traced(d, span, t)
        except BaseException as exc:
            try:
                span.record_exception(exc)
            except Exception:
                _failed("workflow.stage")
            raise
        finally:
            try:
                otel_context.detach(token)
                span.end()
            except Exception:
                _failed("workflow.stage")


def _stage_span(t: Any, d: Delivery) -> tuple[Any, Any] | None:
    """The started span ``workflow.stage <id>`` of delivery ``d`` (with its finished
    ``workflow.lease`` child) made current, and the context token to detach; ``None`` when
    OpenTelemetry failed (the delivery goes on untraced)."""
    try:
        parent = _context_of(d.run.trace_context)
        began = d.lease_began_ns or d.leased_ns
        attributes = {
            "workflow.id": d.workflow.id,
            "workflow.run_id": str(d.run.pk),
            "workflow.stage_id": d.node.stage.id,
            "workflow.queue": d.job.queue,
            "workflow.delivery": d.job.attempt,
            "workflow.generation": d.record.generation,
        }
        span = t.start_span(
            f"workflow.stage {d.node.stage.id}",
            context=parent,
            attributes=attributes,
            start_time=began,
        )
        under = otel_trace.set_span_in_context(span, parent)
        t.start_span("workflow.lease", context=under, start_time=began).end(end_time=d.leased_ns)
        return span, otel_context.attach(under)
    except Exception:
        _failed("workflow.stage")
        return None


def _attributes(workflow_id: str, stage_id: str, queue: str) -> dict[str, str]:
    return {"workflow_id": workflow_id, "stage_id": stage_id, "queue": queue}


@_guarded
def _record_delivery(d: Delivery, result: Outcome, began: float) -> None:
    m = _meters()
    if m is None:
        return
    attrs = _attributes(d.workflow.id, d.node.stage.id, d.job.queue)
    m["stage_duration"].record(time.perf_counter() - began, {**attrs, "outcome": result.outcome})
    if result.retrying:
        m["retries"].add(1, attrs)


@_guarded
def lease_lost(d: Delivery) -> None:
    """Count a delivery whose outcome was discarded: its lease had been taken over."""
    m = _meters()
    if m is not None:
        m["lease_losses"].add(1, _attributes(d.workflow.id, d.node.stage.id, d.job.queue))


@_guarded
def run_ended(workflow_id: str, outcome: str, seconds: float | None) -> None:
    """A run ended (``completed``/``failed``) in this process ``seconds`` after its start
    (``None``: unknown, not recorded). Called after the commit that ended it.
    """
    m = _meters()
    if m is None or seconds is None:
        return
    m["run_duration"].record(seconds, {"workflow_id": workflow_id, "outcome": outcome})


@_guarded
def runs_ended_at_commit(
    workflow_id: str, events: list[dict[str, Any]], started_at: Any, now: Any
) -> None:
    """Record :func:`run_ended` for a ``workflow:completed`` / ``workflow:failed`` /
    ``workflow:cancelled`` event in ``events`` (the current transaction's) once it commits;
    the run started at ``started_at`` (a datetime; ``None``: never started, not recorded) and
    ended at ``now``. No statement; nothing without metrics.
    """
    if not events or started_at is None or _meters() is None:
        return
    ended = [e["type"].split(":", 1)[1] for e in events if e.get("type") in _RUN_ENDS]
    if ended:
        from django.db import transaction

        seconds = (now - started_at).total_seconds()
        transaction.on_commit(lambda: run_ended(workflow_id, ended[-1], seconds))


_RUN_ENDS = frozenset({"workflow:completed", "workflow:failed", "workflow:cancelled"})


@_guarded
def job_given_up(workflow_id: str, stage_id: str, queue: str, reason: str) -> None:
    """Count a job given up (a dead letter of the job queue): ``reason`` is the
    ``error_type`` its run records (``"DeliveriesExhausted"``, ``"QueueTimeout"``, ...).
    """
    m = _meters()
    if m is not None:
        m["job_dead_letters"].add(
            1, {**_attributes(workflow_id, stage_id, queue), "reason": reason}
        )


# -- outbox delivery and signals -------------------------------------------------------------


def outbox_contexts(run_ids: list[Any]) -> dict[Any, Any]:
    """``{run_id: OpenTelemetry context}`` of the runs of a flush pass: one query, made only
    when tracing is on (``{}`` otherwise); the outbox flush is not on the stage path.
    """
    if tracer() is None or not run_ids:
        return {}
    from .models import WorkflowRun

    found = WorkflowRun.objects.filter(pk__in=set(run_ids)).values_list("pk", "trace_context")
    try:
        return {pk: _context_of(carrier) for pk, carrier in found}
    except Exception:
        _failed("workflow.deliver")
        return {}


def delivering_event(contexts: dict[Any, Any], run_id: Any, event_type: str, sequence: int) -> Any:
    """The span ``workflow.deliver`` (a child of the run's context) around handing one outbox
    event to the event sink; a plain block without tracing.
    """
    t = tracer()
    if t is None:
        return nullcontext()
    return _Safe(
        "workflow.deliver",
        lambda: t.start_as_current_span(
            "workflow.deliver",
            context=contexts.get(run_id),
            attributes={
                "workflow.run_id": str(run_id),
                "workflow.event_type": event_type,
                "workflow.sequence": sequence,
            },
        ),
    )


@_guarded
def event_dead_lettered(event_type: str) -> None:
    """Count an outbox event dead-lettered (its sink's ``max_retries`` used up)."""
    m = _meters()
    if m is not None:
        m["outbox_dead_letters"].add(1, {"event_type": event_type})


def signal_span(run: Any, name: str) -> Any:
    """The span ``workflow.signal`` for a signal sent to ``run``: a child of the run's stored
    context, linked to the sender's current span; a plain block without tracing.
    """
    t = tracer()
    if t is None:
        return nullcontext()

    def start() -> Any:
        sender = otel_trace.get_current_span().get_span_context()
        links = [otel_trace.Link(sender)] if sender.is_valid else []
        return t.start_as_current_span(
            "workflow.signal",
            context=_context_of(getattr(run, "trace_context", None)),
            links=links,
            attributes={"workflow.run_id": str(run.pk), "workflow.signal": name},
        )

    return _Safe("workflow.signal", start)


# -- database-state gauges -------------------------------------------------------------------


def register_state_gauges(
    meter: Any, snapshot_fn: Callable[[], Any], *, max_age_seconds: float = 1.0
) -> list[Any]:
    """Register observable gauges on ``meter`` that read ``snapshot_fn()``
    (:func:`django_workflows.health.state.register_gauges` passes the health checks'
    snapshot, read from the database; a
    ``StateSnapshot``: ``database_ok``, ``queues`` of ``QueueState(queue, ready, running,
    oldest_ready_age_seconds)``, ``workers`` of ``WorkerState(queue, version, count)``,
    ``outbox_undelivered``, ``outbox_lag_seconds``, ``dead_letters``,
    ``schedule_lag_seconds``, ``ticker_live``). One snapshot serves every gauge of a
    collection: it is taken again only when older than ``max_age_seconds``.

    Gauges: ``workflows.queue.ready`` / ``workflows.queue.running`` /
    ``workflows.queue.oldest_ready_age`` (s) per ``queue``; ``workflows.workers`` per
    ``queue`` and ``version``; ``workflows.outbox.undelivered``, ``workflows.outbox.lag``
    (s), ``workflows.outbox.dead_letter_backlog``, ``workflows.schedule.lag`` (s),
    ``workflows.database.up`` and ``workflows.ticker.live`` (0/1). A ``None`` age or lag is
    not observed. A ``snapshot_fn`` that raises makes that collection observe nothing (the
    SDK logs the error).

    Returns the gauges. Raises ``RuntimeError`` when ``opentelemetry`` is not installed.
    """
    if not AVAILABLE:
        raise RuntimeError(
            "register_state_gauges needs opentelemetry-api: pip install django-workflows[otel]"
        )
    Observation = otel_metrics.Observation
    cached: list[Any] = [None, 0.0]

    def snap() -> Any:
        now = time.monotonic()
        if cached[0] is None or now - cached[1] > max_age_seconds:
            cached[0], cached[1] = snapshot_fn(), now
        return cached[0]

    def per_queue(attr: str) -> Callable[[Any], list[Any]]:
        def observe(_options: Any) -> list[Any]:
            return [
                Observation(getattr(q, attr), {"queue": q.queue})
                for q in snap().queues
                if getattr(q, attr) is not None
            ]

        return observe

    def one(read: Callable[[Any], Any]) -> Callable[[Any], list[Any]]:
        def observe(_options: Any) -> list[Any]:
            value = read(snap())
            return [] if value is None else [Observation(value)]

        return observe

    def workers(_options: Any) -> list[Any]:
        return [
            Observation(w.count, {"queue": w.queue, "version": w.version}) for w in snap().workers
        ]

    specs: list[tuple[str, str, Callable[[Any], list[Any]], str]] = [
        ("workflows.queue.ready", "1", per_queue("ready"), "Ready jobs per queue"),
        ("workflows.queue.running", "1", per_queue("running"), "Running jobs per queue"),
        (
            "workflows.queue.oldest_ready_age",
            "s",
            per_queue("oldest_ready_age_seconds"),
            "Age of the oldest ready job per queue",
        ),
        ("workflows.workers", "1", workers, "Live workers per queue and definition version"),
        ("workflows.outbox.undelivered", "1", one(lambda s: s.outbox_undelivered), "Events"),
        ("workflows.outbox.lag", "s", one(lambda s: s.outbox_lag_seconds), "Oldest undelivered"),
        (
            "workflows.outbox.dead_letter_backlog",
            "1",
            one(lambda s: s.dead_letters),
            "Dead-lettered events not yet replayed or skipped",
        ),
        ("workflows.schedule.lag", "s", one(lambda s: s.schedule_lag_seconds), "Late schedules"),
        ("workflows.database.up", "1", one(lambda s: int(s.database_ok)), "Database reachable"),
        ("workflows.ticker.live", "1", one(lambda s: int(s.ticker_live)), "Ticker lease held"),
    ]
    return [
        meter.create_observable_gauge(name, callbacks=[cb], unit=unit, description=text)
        for name, unit, cb, text in specs
    ]
