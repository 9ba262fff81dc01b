"""Outbox, plugins and dead letters (SPEC §5, §4.10-4.11; catalogue A.10, A.11, C.5; Part I
item 16): flush order, retries, dead-lettering, strict per-run order behind a dead letter,
``plugin.replayDLQ``, the operator's ``outbox.skipDeadLetter``, ``define_plugin`` with plugins
listed in settings, the ``workflow_event`` signal and the ``workflows_outbox`` command.
"""

from __future__ import annotations

import io
import json
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import transaction

from django_workflows import define_plugin, workflow_event
from django_workflows.admin.timeline import event_state
from django_workflows.kernel import (
    ClaimPendingRuns,
    CreateRun,
    FlushOutbox,
    InvalidCommandError,
    Kernel,
    OutboxEventNotFoundError,
    OutboxEventStateError,
    ReplayDeadLetters,
    SkipDeadLetter,
)
from django_workflows.kernel import events as ev
from django_workflows.kernel.outbox import append_events
from django_workflows.kernel.runtime import build_kernel
from django_workflows.models import OutboxEvent
from django_workflows.plugins import Plugin, PluginRunner, load_plugins
from django_workflows.testing import CollectingSink, FakeClock, make_kernel
from tests.workflows import two_stage

pytestmark = pytest.mark.django_db(transaction=True)


class Handler:
    """A plugin handler that records events and fails while ``failures`` says so.

    ``failures``: how many more calls fail (``-1``: always); ``only_run``: fail only for events
    of this run id.
    """

    def __init__(self, failures: int = 0, only_run: str | None = None) -> None:
        self.failures = failures
        self.only_run = only_run
        self.calls: list[dict[str, Any]] = []

    def __call__(self, event: dict[str, Any]) -> None:
        self.calls.append(event)
        if self.only_run is not None and event["workflow_run_id"] != self.only_run:
            return
        if self.failures != 0:
            self.failures -= 1 if self.failures > 0 else 0
            raise RuntimeError("plugin is down")

    def types(self, run_id: Any = None) -> list[str]:
        return [
            e["type"] for e in self.calls if run_id is None or e["workflow_run_id"] == str(run_id)
        ]


def _kernel(
    clock: FakeClock, handler: Handler, *, max_retries: int = 3, on: tuple[str, ...] = ()
) -> Kernel:
    plugin = define_plugin(id="p", name="P", on=on or ev.EVENT_TYPES, handle=handler)
    return make_kernel(
        two_stage(), clock=clock, event_sink=PluginRunner([plugin], max_retries=max_retries)
    )


def _create(kernel: Kernel) -> str:
    return str(
        kernel.dispatch(CreateRun(workflow_id="two-stage", input={"value": 1})).workflow_run_id
    )


def _flush(kernel: Kernel, max_events: int = 100) -> int:
    return int(kernel.dispatch(FlushOutbox(max_events=max_events)).published)


def _row(run_id: str, sequence: int) -> OutboxEvent:
    return OutboxEvent.objects.get(workflow_run_id=run_id, sequence=sequence)


# --------------------------------------------------------------------------------------------
# outbox.flush (A.10, C.5)
# --------------------------------------------------------------------------------------------


def test_events_wait_in_the_outbox_until_a_flush_publishes_them(
    kernel_for: Callable[..., Kernel], sink: CollectingSink
) -> None:
    """EV-1, EV-2, EV-4, A.10 :58/:78/:135: a command writes its event to the outbox, not to
    the sink; a flush publishes it (``published_at`` set, the sink gets the stored payload);
    a second flush publishes nothing."""
    kernel = kernel_for(two_stage())
    run_id = _create(kernel)
    assert sink.events == []
    row = _row(run_id, 1)
    assert (row.event_type, row.published_at) == (ev.WORKFLOW_CREATED, None)

    assert _flush(kernel) == 1
    assert sink.events == [{**row.payload, "sequence": 1, "event_id": row.pk}]
    assert _row(run_id, 1).published_at == kernel.clock.now()
    assert _flush(kernel) == 0


def test_flush_respects_max_events(kernel_for: Callable[..., Kernel]) -> None:
    """EV-4, A.10 :99, C.5 :1374: two events, ``max_events=1`` -> 1, then 1, then 0."""
    kernel = kernel_for(two_stage())
    _create(kernel)
    _create(kernel)
    assert [_flush(kernel, 1), _flush(kernel, 1), _flush(kernel, 1)] == [1, 1, 0]


def test_flush_publishes_each_run_in_sequence_order(
    kernel_for: Callable[..., Kernel], sink: CollectingSink
) -> None:
    """EV-3, EV-4, DM-20, A.10 :153/:184, C.5 :1313/:1345: per-run sequences start at 1 and are
    gap-free; a flush emits run by run (run id order), each in sequence order."""
    kernel = kernel_for(two_stage())
    runs = [_create(kernel), _create(kernel)]
    kernel.dispatch(ClaimPendingRuns(worker_id="w"))

    assert _flush(kernel) == 4

    for run_id in runs:
        rows = OutboxEvent.objects.filter(workflow_run_id=run_id).order_by("sequence")
        assert [(r.sequence, r.event_type) for r in rows] == [
            (1, ev.WORKFLOW_CREATED),
            (2, ev.WORKFLOW_STARTED),
        ]
    emitted = [(e["workflow_run_id"], e["type"]) for e in sink.events]
    expected = [(r, t) for r in sorted(runs) for t in (ev.WORKFLOW_CREATED, ev.WORKFLOW_STARTED)]
    assert emitted == expected


def test_append_events_numbers_a_batch_and_ignores_an_empty_one(clock: FakeClock) -> None:
    """EV-3, DM-20, K-5, C.5 :1313/:1430: a batch appended in one transaction continues each
    run's sequence in input order and shares one causation id; an empty batch writes nothing."""
    run_a, run_b = str(uuid.uuid4()), str(uuid.uuid4())
    now = clock.now()
    with transaction.atomic():
        assert append_events([], "nothing", now) == 0
        append_events([ev.event(ev.WORKFLOW_CREATED, run_a, now)], "c-1", now)
        count = append_events(
            [
                ev.event(ev.WORKFLOW_STARTED, run_a, now),
                ev.event(ev.WORKFLOW_CREATED, run_b, now),
                ev.event(ev.WORKFLOW_CANCELLED, run_a, now),
            ],
            "c-2",
            now,
        )
    assert count == 3
    rows = OutboxEvent.objects.order_by("workflow_run_id", "sequence")
    got = {(str(r.workflow_run_id), r.sequence): (r.event_type, r.causation_id) for r in rows}
    assert got == {
        (run_a, 1): (ev.WORKFLOW_CREATED, "c-1"),
        (run_a, 2): (ev.WORKFLOW_STARTED, "c-2"),
        (run_a, 3): (ev.WORKFLOW_CANCELLED, "c-2"),
        (run_b, 1): (ev.WORKFLOW_CREATED, "c-2"),
    }
    assert {r.occurred_at for r in rows} == {now}


def test_failed_delivery_is_retried_on_the_next_flush(clock: FakeClock) -> None:
    """EV-4, EV-31, A.10 :217/:361, C.5 :1441: a plugin that throws once -> published 0 and
    ``retry_count`` 1; the next flush publishes it (the handler was called twice)."""
    handler = Handler(failures=1)
    kernel = _kernel(clock, handler)
    run_id = _create(kernel)

    assert _flush(kernel) == 0
    assert (_row(run_id, 1).retry_count, _row(run_id, 1).dlq_at) == (1, None)
    assert _flush(kernel) == 1
    assert len(handler.calls) == 2
    assert _row(run_id, 1).published_at is not None


def test_always_failing_event_is_dead_lettered_after_max_retries(clock: FakeClock) -> None:
    """EV-4, EV-5, EV-7, A.10 :253, C.5 :1465: with ``max_retries=2`` an always-failing event is
    attempted twice, then dead-lettered (``dlq_at``); later flushes neither emit nor count it."""
    handler = Handler(failures=-1)
    kernel = _kernel(clock, handler, max_retries=2)
    run_id = _create(kernel)

    assert [_flush(kernel), _flush(kernel), _flush(kernel)] == [0, 0, 0]

    row = _row(run_id, 1)
    assert (row.retry_count, row.dlq_at, row.published_at) == (2, clock.now(), None)
    assert len(handler.calls) == 2


def test_max_retries_one_dead_letters_on_the_first_failure(clock: FakeClock) -> None:
    """EV-5: ``max_retries=1`` dead-letters on the first failure."""
    kernel = _kernel(clock, Handler(failures=-1), max_retries=1)
    run_id = _create(kernel)
    _flush(kernel)
    assert _row(run_id, 1).dlq_at is not None


def test_a_failing_run_does_not_hold_up_other_runs(clock: FakeClock) -> None:
    """EV-4, EC-17, A.10 :287: run A's first event fails -> A's later event is not attempted in
    that pass while run B's event is published; the next flush publishes A's events in order."""
    handler = Handler()
    kernel = _kernel(clock, handler)
    run_a = _create(kernel)
    kernel.dispatch(ClaimPendingRuns(worker_id="w"))
    run_b = _create(kernel)
    handler.failures, handler.only_run = 1, run_a

    assert _flush(kernel) == 1

    assert handler.types(run_a) == [ev.WORKFLOW_CREATED]
    assert _row(run_b, 1).published_at is not None
    assert _row(run_a, 2).retry_count == 0
    handler.calls.clear()
    assert _flush(kernel) == 2
    assert handler.types(run_a) == [ev.WORKFLOW_CREATED, ev.WORKFLOW_STARTED]


# --------------------------------------------------------------------------------------------
# Strict order behind a dead letter, replay and skip (Part I item 16, A.11, EV-32)
# --------------------------------------------------------------------------------------------


@pytest.fixture
def dead_run(clock: FakeClock) -> Iterator[tuple[Kernel, Handler, str, str]]:
    """Run A's ``workflow:created`` is dead-lettered (``max_retries=1``) and A has a later
    event (``workflow:started``); run B is healthy."""
    handler = Handler(failures=1)
    kernel = _kernel(clock, handler, max_retries=1)
    run_a = _create(kernel)
    _flush(kernel)
    assert _row(run_a, 1).dlq_at is not None
    kernel.dispatch(ClaimPendingRuns(worker_id="w"))
    run_b = _create(kernel)
    handler.calls.clear()
    yield kernel, handler, run_a, run_b


def test_dead_letter_blocks_the_later_events_of_its_run(
    dead_run: tuple[Kernel, Handler, str, str],
) -> None:
    """Part I item 16, EC-27 (fixes EV-7): while A's first event is dead-lettered, A's later
    events are never published (however many flushes), other runs flow."""
    kernel, handler, run_a, run_b = dead_run
    for _ in range(3):
        _flush(kernel)
    assert handler.types(run_a) == []
    assert _row(run_a, 2).published_at is None
    assert _row(run_a, 2).retry_count == 0
    assert handler.types(run_b) == [ev.WORKFLOW_CREATED]


def test_replay_re_arms_a_dead_letter_and_the_run_flows_in_order(
    dead_run: tuple[Kernel, Handler, str, str],
) -> None:
    """EV-32, Part I item 16, A.11 :75, C.5 :1487: after the plugin is fixed, ``replayDLQ``
    re-arms the dead letter (``dlq_at`` cleared, ``retry_count`` 0); the next flush publishes
    A's events in sequence order."""
    kernel, handler, run_a, _ = dead_run

    assert kernel.dispatch(ReplayDeadLetters()).replayed == 1

    row = _row(run_a, 1)
    assert (row.dlq_at, row.retry_count) == (None, 0)
    _flush(kernel)
    assert handler.types(run_a) == [ev.WORKFLOW_CREATED, ev.WORKFLOW_STARTED]


def test_replay_of_an_empty_dead_letter_queue_and_max_events(
    kernel_for: Callable[..., Kernel],
) -> None:
    """EV-32, A.11 :108/:118, C.5 :1515: nothing dead -> replayed 0; three dead letters with
    ``max_events=2`` -> replayed 2, one left."""
    kernel = kernel_for(two_stage())
    assert kernel.dispatch(ReplayDeadLetters()).replayed == 0
    for _ in range(3):
        _create(kernel)
    OutboxEvent.objects.update(dlq_at=kernel.clock.now(), retry_count=3)

    assert kernel.dispatch(ReplayDeadLetters(max_events=2)).replayed == 2
    assert OutboxEvent.objects.filter(dlq_at__isnull=False).count() == 1


def test_skip_unblocks_the_run_and_keeps_the_row_for_audit(
    dead_run: tuple[Kernel, Handler, str, str], clock: FakeClock
) -> None:
    """Part I item 16: the operator skips A's dead letter: it is never delivered, keeps
    ``dlq_at``/``retry_count``, gets ``published_at = skipped_at = now`` and the note; the next
    flush delivers A's later events; a replay does not re-arm it."""
    kernel, handler, run_a, _ = dead_run
    dead = _row(run_a, 1)
    clock.advance(60)

    result = kernel.dispatch(SkipDeadLetter(event_id=dead.pk, note="audit plugin rejects it"))

    assert (result.event_id, result.workflow_run_id, result.sequence) == (dead.pk, run_a, 1)
    assert (result.event_type, result.unblocked) == (ev.WORKFLOW_CREATED, 1)
    row = _row(run_a, 1)
    assert (row.skipped_at, row.published_at, row.skip_note) == (
        clock.now(),
        clock.now(),
        "audit plugin rejects it",
    )
    assert (row.dlq_at, row.retry_count) == (dead.dlq_at, 1)
    assert event_state(row, run_blocked=False) == "skipped"  # what the admin shows
    assert kernel.dispatch(ReplayDeadLetters()).replayed == 0
    _flush(kernel)
    assert handler.types(run_a) == [ev.WORKFLOW_STARTED]


def test_skip_refuses_anything_but_a_dead_letter(
    dead_run: tuple[Kernel, Handler, str, str],
) -> None:
    """Part I item 16: skipping an unknown id, a published event, an event still being
    delivered, or one already skipped raises a precise error and changes nothing."""
    kernel, _, run_a, run_b = dead_run
    with pytest.raises(OutboxEventNotFoundError, match="Outbox event 999999 not found"):
        kernel.dispatch(SkipDeadLetter(event_id=999999))
    with pytest.raises(InvalidCommandError, match="event_id"):
        kernel.dispatch(SkipDeadLetter(event_id="seven"))  # type: ignore[arg-type]
    waiting = _row(run_a, 2)
    with pytest.raises(OutboxEventStateError, match="is not dead-lettered"):
        kernel.dispatch(SkipDeadLetter(event_id=waiting.pk))
    _flush(kernel)
    published = _row(run_b, 1)
    with pytest.raises(OutboxEventStateError, match="already published"):
        kernel.dispatch(SkipDeadLetter(event_id=published.pk))
    dead = _row(run_a, 1)
    kernel.dispatch(SkipDeadLetter(event_id=dead.pk))
    with pytest.raises(OutboxEventStateError, match="already skipped"):
        kernel.dispatch(SkipDeadLetter(event_id=dead.pk))
    assert _row(run_a, 2).skipped_at is None
    assert _row(run_b, 1).skipped_at is None


# --------------------------------------------------------------------------------------------
# Plugins (A.11, EV-30/31) and the Django signal
# --------------------------------------------------------------------------------------------


def _event(type_: str = ev.WORKFLOW_CREATED) -> dict[str, Any]:
    return {"type": type_, "timestamp": "2025-01-01T00:00:00+00:00", "workflow_run_id": "r"}


def test_plugin_runner_routes_events_to_subscribed_plugins_in_order() -> None:
    """EV-31, A.11 :17/:40/:64/:132: matching plugins are called in registration order with the
    event; a non-matching plugin is not; a plugin on two types is called for each."""
    calls: list[tuple[str, str]] = []

    def record(name: str) -> Callable[[dict[str, Any]], None]:
        return lambda event: calls.append((name, event["type"]))

    runner = PluginRunner(
        [
            define_plugin(id="a", name="A", on=[ev.WORKFLOW_CREATED], handle=record("a")),
            define_plugin(id="b", name="B", on=[ev.WORKFLOW_FAILED], handle=record("b")),
            define_plugin(
                id="c",
                name="C",
                on=[ev.WORKFLOW_CREATED, ev.WORKFLOW_FAILED],
                handle=record("c"),
            ),
        ]
    )
    runner.emit(_event(ev.WORKFLOW_CREATED))
    runner.emit(_event(ev.WORKFLOW_FAILED))
    runner.emit(_event(ev.STAGE_STARTED))
    assert calls == [
        ("a", ev.WORKFLOW_CREATED),
        ("c", ev.WORKFLOW_CREATED),
        ("b", ev.WORKFLOW_FAILED),
        ("c", ev.WORKFLOW_FAILED),
    ]


def test_plugin_error_propagates_and_stops_later_plugins() -> None:
    """EV-31, A.11 :96: the first handler that raises aborts ``emit``; later plugins are not
    called (the outbox retries the whole event)."""
    later: list[dict[str, Any]] = []
    runner = PluginRunner(
        [
            define_plugin(id="x", name="X", on=[ev.WORKFLOW_CREATED], handle=Handler(-1)),
            define_plugin(id="y", name="Y", on=[ev.WORKFLOW_CREATED], handle=later.append),
        ]
    )
    with pytest.raises(RuntimeError, match="plugin is down"):
        runner.emit(_event())
    assert later == []


def test_plugin_runner_defaults() -> None:
    """EV-31, A.11 :119/:160/:165: no plugins is a no-op; ``max_retries`` is exposed (5) and
    defaults to 3."""
    PluginRunner([]).emit(_event())
    assert PluginRunner([], max_retries=5).max_retries == 5
    assert PluginRunner([]).max_retries == 3


def test_define_plugin_validates_event_types_and_handler() -> None:
    """EV-30: ``define_plugin`` returns the definition; an unknown event type or a handler that
    is not callable raises naming the plugin."""
    plugin = define_plugin(id="p", name="P", on=[ev.STAGE_FAILED], handle=print)
    assert (plugin.id, plugin.name, plugin.on) == ("p", "P", (ev.STAGE_FAILED,))
    with pytest.raises(ValueError, match=r"Plugin 'p': unknown event types \['stage:exploded'\]"):
        define_plugin(id="p", name="P", on=["stage:exploded"], handle=print)
    with pytest.raises(ValueError, match="handle must be callable"):
        define_plugin(id="p", name="P", on=[ev.STAGE_FAILED], handle="print")  # type: ignore[arg-type]


RECEIVED: list[dict[str, Any]] = []
AUDIT = define_plugin(id="audit", name="Audit", on=[ev.WORKFLOW_CREATED], handle=RECEIVED.append)
NOT_A_PLUGIN = object()


def test_plugins_listed_in_settings_receive_published_events(settings: Any) -> None:
    """EV-30, EV-5, issue 3 item 4: ``DJANGO_WORKFLOWS["PLUGINS"]`` lists dotted paths; the
    default kernel's sink runs them with ``OUTBOX_MAX_RETRIES``; a bad entry raises naming it."""
    RECEIVED.clear()
    settings.DJANGO_WORKFLOWS = {
        **settings.DJANGO_WORKFLOWS,
        "PLUGINS": ["tests.integration.test_outbox_plugins.AUDIT"],
        "OUTBOX_MAX_RETRIES": 5,
    }
    assert load_plugins() == [AUDIT]
    kernel = build_kernel()
    assert isinstance(kernel.event_sink, PluginRunner)
    assert kernel.event_sink.max_retries == 5
    kernel.registry = make_kernel(two_stage()).registry
    run_id = _create(kernel)
    _flush(kernel)
    assert [(e["type"], e["workflow_run_id"]) for e in RECEIVED] == [(ev.WORKFLOW_CREATED, run_id)]

    settings.DJANGO_WORKFLOWS = {
        **settings.DJANGO_WORKFLOWS,
        "PLUGINS": ["tests.integration.test_outbox_plugins.NOT_A_PLUGIN"],
    }
    with pytest.raises(TypeError, match="NOT_A_PLUGIN' is not a Plugin"):
        load_plugins()


def _silent_kernel(clock: FakeClock) -> Kernel:
    """A kernel whose sink hands events to no one: no plugin (and, unless a test connects one,
    no ``workflow_event`` receiver)."""
    return make_kernel(two_stage(), clock=clock, event_sink=PluginRunner([]))


def test_a_sink_with_no_receiver_has_events_marked_published_in_order_without_reading_them(
    clock: FakeClock,
) -> None:
    """Issue 19: with no plugin, no ``workflow_event`` receiver and tracing off, a pass marks
    published exactly the events a delivering pass would publish - the first ``max_events``
    by run id, then sequence - in one statement; the rest wait for the next pass."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    kernel = _silent_kernel(clock)
    assert kernel.event_sink.receives_nothing()  # type: ignore[attr-defined]
    runs = [_create(kernel) for _ in range(3)]
    kernel.dispatch(ClaimPendingRuns(worker_id="w"))  # each run: created, then started, ...
    waiting = list(
        OutboxEvent.objects.filter(published_at__isnull=True)
        .order_by("workflow_run_id", "sequence")
        .values_list("pk", flat=True)
    )
    assert len(waiting) > 4 and {str(r) for r in runs} == {
        str(r) for r in OutboxEvent.objects.values_list("workflow_run_id", flat=True)
    }
    with CaptureQueriesContext(connection) as queries:
        assert _flush(kernel, max_events=4) == 4
    assert len(queries.captured_queries) == 1
    assert queries.captured_queries[0]["sql"].lstrip().upper().startswith("UPDATE")
    published = set(
        OutboxEvent.objects.filter(published_at=clock.now()).values_list("pk", flat=True)
    )
    assert published == set(waiting[:4])
    assert _flush(kernel) == len(waiting) - 4
    assert not OutboxEvent.objects.filter(published_at__isnull=True).exists()
    assert _flush(kernel) == 0
    assert _flush(kernel, max_events=0) == 0


def test_a_sink_with_no_receiver_still_holds_a_dead_lettered_runs_later_events(
    dead_run: tuple[Kernel, Handler, str, str], clock: FakeClock
) -> None:
    """EC-27 on the marking pass: a run behind a dead letter keeps its later events unpublished
    (the plugin that failed was removed); other runs' events are marked published."""
    _, _, run_a, run_b = dead_run
    kernel = _silent_kernel(clock)
    assert _flush(kernel) == 1  # run B's workflow:created
    assert _row(run_b, 1).published_at == clock.now()
    assert _row(run_a, 1).published_at is None and _row(run_a, 1).dlq_at is not None
    assert _row(run_a, 2).published_at is None


def test_a_workflow_event_receiver_gets_every_event_though_there_is_no_plugin(
    clock: FakeClock,
) -> None:
    """A receiver of ``workflow_event`` connected to a sink without plugins turns the marking
    pass off: events are read and delivered to it, payload, sequence and id included."""
    got: list[dict[str, Any]] = []

    def listener(sender: Any, event: dict[str, Any], **kwargs: Any) -> None:
        got.append(event)

    kernel = _silent_kernel(clock)
    run_id = _create(kernel)
    workflow_event.connect(listener, dispatch_uid="test-silent-listener")
    try:
        assert not kernel.event_sink.receives_nothing()  # type: ignore[attr-defined]
        assert _flush(kernel) == 1
    finally:
        workflow_event.disconnect(dispatch_uid="test-silent-listener")
    row = _row(run_id, 1)
    assert got == [{**row.payload, "sequence": 1, "event_id": row.pk}]
    assert row.published_at == clock.now()


def test_workflow_event_signal_reaches_in_process_listeners(
    kernel_for: Callable[..., Kernel],
) -> None:
    """EV-31, issue 3 item 4: every published event is sent as the ``workflow_event`` Django
    signal (sender PluginRunner); a listener that raises makes the flush retry the event."""
    got: list[dict[str, Any]] = []
    state = {"fail": True}

    def listener(sender: Any, event: dict[str, Any], **kwargs: Any) -> None:
        if state["fail"]:
            state["fail"] = False
            raise RuntimeError("listener down")
        assert sender is PluginRunner
        got.append(event)

    workflow_event.connect(listener, dispatch_uid="test-listener")
    try:
        kernel = kernel_for(two_stage())
        run_id = _create(kernel)
        assert _flush(kernel) == 0
        assert _flush(kernel) == 1
    finally:
        workflow_event.disconnect(dispatch_uid="test-listener")
    assert [(e["type"], e["workflow_run_id"]) for e in got] == [(ev.WORKFLOW_CREATED, run_id)]
    assert isinstance(AUDIT, Plugin)


# --------------------------------------------------------------------------------------------
# manage.py workflows_outbox
# --------------------------------------------------------------------------------------------


def _call(*args: str) -> str:
    out = io.StringIO()
    call_command("workflows_outbox", *args, stdout=out, stderr=io.StringIO())
    return out.getvalue()


def _seed(clock: FakeClock) -> tuple[str, str]:
    """Run A: event 1 dead-lettered, events 2 and 3 behind it; run B: one pending event."""
    run_a, run_b = str(uuid.uuid4()), str(uuid.uuid4())
    now = clock.now()
    with transaction.atomic():
        append_events(
            [
                ev.event(ev.WORKFLOW_CREATED, run_a, now),
                ev.event(ev.WORKFLOW_STARTED, run_a, now),
                ev.event(ev.WORKFLOW_CANCELLED, run_a, now),
                ev.event(ev.WORKFLOW_CREATED, run_b, now),
            ],
            "seed",
            now,
        )
    OutboxEvent.objects.filter(workflow_run_id=run_a, sequence=1).update(dlq_at=now, retry_count=3)
    return run_a, run_b


def test_outbox_command_lists_dead_letters(clock: FakeClock) -> None:
    """Part I item 16, issue 3 item 4: ``dead-letters`` lists each dead letter with the number
    of events it blocks, as text or JSON; with none it says so."""
    assert _call("dead-letters").strip() == "no dead letters"
    run_a, _ = _seed(clock)
    dead = _row(run_a, 1)

    text = _call("dead-letters")
    assert f"#{dead.pk} run {run_a} seq 1 workflow:created retries=3" in text
    assert "blocks 2" in text
    assert "1 dead letter blocks 1 run" in text

    (row,) = json.loads(_call("dead-letters", "--json"))
    assert row == {
        "id": dead.pk,
        "workflow_run_id": run_a,
        "sequence": 1,
        "event_type": ev.WORKFLOW_CREATED,
        "retry_count": 3,
        "dlq_at": clock.now().isoformat(),
        "blocks": 2,
        "last_error": None,
    }


def test_outbox_command_flush_replay_and_skip(clock: FakeClock) -> None:
    """Part I item 16, EV-4, EV-32, issue 3 item 4: ``flush`` publishes what is not blocked;
    ``skip`` unblocks run A; ``flush --all`` delivers the rest; ``replay`` re-arms dead
    letters and ``--flush`` publishes them at once."""
    run_a, run_b = _seed(clock)
    dead = _row(run_a, 1)

    out = _call("flush")
    assert "published 1 event" in out
    assert "1 dead letter blocks 1 run" in out
    assert _row(run_b, 1).published_at is not None

    out = _call("skip", str(dead.pk), "--note", "bad payload")
    assert f"skipped #{dead.pk} (workflow:created #1 of run {run_a}); 2 later events" in out
    assert _row(run_a, 1).skip_note == "bad payload"
    assert "published 2 events" in _call("flush", "--all", "--max-events", "1")

    OutboxEvent.objects.filter(workflow_run_id=run_b).update(published_at=None, dlq_at=clock.now())
    out = _call("replay", "--flush")
    assert "replayed 1 dead letter" in out
    assert "published 1 event" in out
    assert _row(run_b, 1).published_at is not None


def test_outbox_command_errors_are_command_errors(clock: FakeClock) -> None:
    """Part I item 16: bad ids and non-dead events raise ``CommandError`` with the kernel's
    message; bad option values are refused."""
    _, run_b = _seed(clock)
    with pytest.raises(CommandError, match="not an outbox event id"):
        _call("skip", "abc")
    with pytest.raises(CommandError, match="Outbox event 424242 not found"):
        _call("skip", "424242")
    with pytest.raises(CommandError, match="is not dead-lettered"):
        _call("skip", str(_row(run_b, 1).pk))
    with pytest.raises(CommandError, match="--max-events: must be > 0"):
        _call("flush", "--max-events", "0")
    with pytest.raises(CommandError):
        _call()
