"""What a delivery carries and what a failed one leaves behind (SPEC §5.2, EV-4..7, EV-32;
Part I item 16; user-trial findings): delivered events carry ``sequence`` and ``event_id`` for
deduplication, a failed delivery records ``last_error`` (shown by ``workflows_outbox
dead-letters`` and the admin), and the admin bounds the JSON it shows.
"""

from __future__ import annotations

import io
import json
import re
from collections.abc import Iterator
from typing import Any

import pytest
from django.core.management import call_command
from django.urls import reverse

from django_workflows.admin.display import MAX_JSON_CHARS, bounded_json, pretty_json
from django_workflows.definition.registry import registry
from django_workflows.kernel import CreateRun, FlushOutbox, Kernel, ReplayDeadLetters
from django_workflows.kernel import events as ev
from django_workflows.kernel.commands import AnnotationSpec, ClaimPendingRuns, SkipDeadLetter
from django_workflows.kernel.handlers.outbox_flush import MAX_ERROR_CHARS
from django_workflows.models import OutboxEvent
from django_workflows.testing import CollectingSink, FakeClock, make_kernel
from tests.workflows import two_stage

pytestmark = pytest.mark.django_db(transaction=True)


class FailingSink(CollectingSink):
    """A collecting sink whose failures are ``errors`` in turn (then it delivers)."""

    def __init__(self, errors: list[Exception], max_retries: int = 3) -> None:
        super().__init__(max_retries=max_retries)
        self.errors = list(errors)

    def emit(self, event: dict[str, Any]) -> None:
        if self.errors:
            raise self.errors.pop(0)
        super().emit(event)


def _create(kernel: Kernel, **kwargs: Any) -> str:
    return str(
        kernel.dispatch(
            CreateRun(workflow_id="two-stage", input={"value": 1}, **kwargs)
        ).workflow_run_id
    )


def _row(run_id: str, sequence: int) -> OutboxEvent:
    return OutboxEvent.objects.get(workflow_run_id=run_id, sequence=sequence)


def _outbox(*args: str) -> str:
    out = io.StringIO()
    call_command("workflows_outbox", *args, stdout=out, stderr=io.StringIO())
    return out.getvalue()


# --- sequence and event id --------------------------------------------------------------------


def test_delivered_events_carry_sequence_and_event_id(clock: FakeClock) -> None:
    """EV-4, DM-20: the sink receives each event with ``sequence`` (1, 2, ... per run) and
    ``event_id`` (the outbox row id) so a plugin can deduplicate; the stored payload is
    unchanged."""
    sink = CollectingSink()
    kernel = make_kernel(two_stage(), clock=clock, event_sink=sink)
    run_id = _create(kernel)
    kernel.dispatch(ClaimPendingRuns(worker_id="w"))
    kernel.dispatch(FlushOutbox())

    rows = list(OutboxEvent.objects.filter(workflow_run_id=run_id).order_by("sequence"))
    delivered = [e for e in sink.events if e["workflow_run_id"] == run_id]
    assert len(rows) >= 2
    assert [e["sequence"] for e in delivered] == list(range(1, len(rows) + 1))
    assert [e["event_id"] for e in delivered] == [r.pk for r in rows]
    assert [e["type"] for e in delivered] == [r.event_type for r in rows]
    for row in rows:
        assert "sequence" not in row.payload and "event_id" not in row.payload


def test_a_redelivered_event_carries_the_same_sequence_and_event_id(clock: FakeClock) -> None:
    """EV-4: at-least-once delivery - an event retried after a failure arrives with the same
    ``event_id`` and ``sequence`` as the first attempt, so a plugin can recognise it."""
    seen: list[dict[str, Any]] = []

    class FlakySink(CollectingSink):
        def emit(self, event: dict[str, Any]) -> None:
            seen.append(event)
            if len(seen) == 1:
                raise RuntimeError("timeout after the plugin acted")
            super().emit(event)

    kernel = make_kernel(two_stage(), clock=clock, event_sink=FlakySink())
    run_id = _create(kernel)
    kernel.dispatch(FlushOutbox())
    kernel.dispatch(FlushOutbox())
    first, second = seen[0], seen[1]
    assert (first["event_id"], first["sequence"]) == (second["event_id"], second["sequence"])
    assert first["event_id"] == _row(run_id, 1).pk


# --- last_error -------------------------------------------------------------------------------


def test_failed_delivery_records_last_error_and_replay_clears_it(clock: FakeClock) -> None:
    """EV-4, EV-5, EV-32: each failed delivery stores its error (the latest one wins); the
    dead letter keeps it; a replay clears it with ``dlq_at`` and ``retry_count``."""
    sink = FailingSink([ConnectionError("CRM timeout"), ValueError("CRM said 422")], max_retries=2)
    kernel = make_kernel(two_stage(), clock=clock, event_sink=sink)
    run_id = _create(kernel)

    kernel.dispatch(FlushOutbox())
    assert _row(run_id, 1).last_error == "ConnectionError: CRM timeout"
    kernel.dispatch(FlushOutbox())
    row = _row(run_id, 1)
    assert row.dlq_at is not None
    assert row.last_error == "ValueError: CRM said 422"

    assert kernel.dispatch(ReplayDeadLetters()).replayed == 1
    row = _row(run_id, 1)
    assert (row.dlq_at, row.retry_count, row.last_error) == (None, 0, None)
    kernel.dispatch(FlushOutbox())
    row = _row(run_id, 1)
    assert row.published_at is not None and row.last_error is None


def test_skip_keeps_last_error(clock: FakeClock) -> None:
    """Part I item 16: a skipped dead letter keeps its ``last_error`` for audit."""
    sink = FailingSink([RuntimeError("account deleted")], max_retries=1)
    kernel = make_kernel(two_stage(), clock=clock, event_sink=sink)
    run_id = _create(kernel)
    kernel.dispatch(FlushOutbox())
    kernel.dispatch(SkipDeadLetter(event_id=_row(run_id, 1).pk, note="gone"))
    row = _row(run_id, 1)
    assert row.skipped_at is not None and row.published_at is not None
    assert row.last_error == "RuntimeError: account deleted"


def test_last_error_is_truncated_and_nul_made_visible(clock: FakeClock) -> None:
    """EV-4 (storable text): a huge error is cut to ``MAX_ERROR_CHARS`` with a note, and a NUL
    character (which PostgreSQL cannot store) is made visible instead of failing the flush."""
    sink = FailingSink([RuntimeError("bad\x00byte " + "x" * 100_000)], max_retries=1)
    kernel = make_kernel(two_stage(), clock=clock, event_sink=sink)
    run_id = _create(kernel)
    kernel.dispatch(FlushOutbox())
    error = _row(run_id, 1).last_error
    assert error is not None
    assert error.startswith("RuntimeError: bad\\x00byte xxx")
    assert "\x00" not in error
    assert len(error) < MAX_ERROR_CHARS + 100
    assert re.search(r"… \(\d+ more characters\)$", error)


# --- workflows_outbox -------------------------------------------------------------------------


@pytest.fixture
def dead_letter(clock: FakeClock) -> Iterator[tuple[Kernel, str]]:
    """A run whose first event was dead-lettered by a failing plugin (two events behind it)."""
    sink = FailingSink([RuntimeError("plugin down\nsecond line")], max_retries=1)
    kernel = make_kernel(two_stage(), clock=clock, event_sink=sink)
    run_id = _create(kernel)
    kernel.dispatch(FlushOutbox())
    kernel.dispatch(ClaimPendingRuns(worker_id="w"))
    yield kernel, run_id


def test_outbox_dead_letters_shows_last_error(dead_letter: tuple[Kernel, str]) -> None:
    """Part I item 16: ``dead-letters`` shows why each event was dead-lettered, as text and
    in ``--json``; its summary does not point at itself."""
    _, run_id = dead_letter
    row = _row(run_id, 1)

    text = _outbox("dead-letters")
    assert f"#{row.pk} run {run_id} seq 1" in text
    assert "    last error: RuntimeError: plugin down\n      second line\n" in text
    assert "1 dead letter blocks 1 run\n" in text
    assert "see `workflows_outbox dead-letters`" not in text

    (listed,) = json.loads(_outbox("dead-letters", "--json"))
    assert listed["id"] == row.pk
    assert listed["last_error"] == "RuntimeError: plugin down\nsecond line"


def test_outbox_summary_counts_waiting_events_in_singular_and_plural(
    dead_letter: tuple[Kernel, str],
) -> None:
    """Part I item 16: the summary says "1 event waiting" / "N events waiting"; ``flush``
    points at ``dead-letters``, ``dead-letters`` does not point at itself."""
    kernel, run_id = dead_letter
    OutboxEvent.objects.filter(workflow_run_id=run_id, sequence__gt=2).delete()

    out = _outbox("flush")
    assert out.endswith(
        "1 dead letter blocks 1 run (see `workflows_outbox dead-letters`)\n1 event waiting\n"
    )
    assert _outbox("dead-letters").endswith("1 dead letter blocks 1 run\n1 event waiting\n")
    _create(kernel)
    assert _outbox("dead-letters").endswith("\n2 events waiting\n")


# --- admin ------------------------------------------------------------------------------------


def test_admin_outbox_shows_last_error(admin_client: Any, dead_letter: tuple[Kernel, str]) -> None:
    """Part I item 16: the outbox list shows the first line of the latest delivery error; the
    event page shows all of it."""
    _, run_id = dead_letter
    row = _row(run_id, 1)
    listing = admin_client.get(reverse("admin:django_workflows_outboxevent_changelist"))
    assert listing.status_code == 200
    html = listing.content.decode()
    assert "RuntimeError: plugin down" in html
    page = admin_client.get(reverse("admin:django_workflows_outboxevent_change", args=[row.pk]))
    assert page.status_code == 200
    assert "RuntimeError: plugin down\nsecond line" in page.content.decode()


def test_bounded_json_cuts_with_a_note() -> None:
    """Admin display: JSON longer than ``MAX_JSON_CHARS`` is cut with how much was left out;
    short JSON is untouched."""
    assert bounded_json({"a": 1}) == '{\n  "a": 1\n}'
    text = bounded_json({"blob": "x" * 10_000})
    head, note = text.rsplit("\n", 1)
    assert len(head) == MAX_JSON_CHARS
    full = len(json.dumps({"blob": "x" * 10_000}, indent=2))
    assert note == f"… ({full - MAX_JSON_CHARS:,} more characters)"
    assert len(str(pretty_json({"blob": "x" * 1_000_000}))) < MAX_JSON_CHARS + 200


def test_admin_pages_stay_small_with_a_1mb_annotation_payload(
    admin_client: Any, clock: FakeClock
) -> None:
    """Admin display: a run with a 1 MB annotation payload (and a 60 KB value) renders its run
    page, the annotation list/page and the outbox pages well under 200 KB."""
    workflow = two_stage()
    kernel = make_kernel(workflow, clock=clock)
    big = {"blob": "x" * 1_000_000}
    spec = AnnotationSpec(attributes={"ticket.body": "y" * 60_000}, payload=big, emit_event=True)
    run_id = _create(kernel, annotations=(spec,))
    kernel.dispatch(FlushOutbox())
    registry.register(workflow)
    try:
        run_page = admin_client.get(
            reverse("admin:django_workflows_workflowrun_change", args=[run_id])
        )
    finally:
        registry.unregister(workflow.id)
    assert run_page.status_code == 200
    html = run_page.content.decode()
    assert len(html) < 200_000
    assert "ticket.body" in html and "more characters)" in html

    from django_workflows.models import WorkflowAnnotation

    annotation = WorkflowAnnotation.objects.get(run_id=run_id)
    urls = [
        reverse("admin:django_workflows_workflowannotation_changelist"),
        reverse("admin:django_workflows_workflowannotation_change", args=[annotation.pk]),
        reverse("admin:django_workflows_outboxevent_changelist"),
        *(
            reverse("admin:django_workflows_outboxevent_change", args=[pk])
            for pk in OutboxEvent.objects.filter(workflow_run_id=run_id).values_list(
                "pk", flat=True
            )
        ),
    ]
    for url in urls:
        response = admin_client.get(url)
        assert response.status_code == 200, url
        assert len(response.content) < 200_000, url
    assert ev.ANNOTATION_CREATED in {
        e.event_type for e in OutboxEvent.objects.filter(workflow_run_id=run_id)
    }
