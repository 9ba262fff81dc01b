"""Annotations against the database (SPEC §6; catalogue A.14, C.4; Part I items 16 and 17).

Stage annotations are driven through the kernel (``run_to_completion``); outside writes go
through ``kernel.annotations.attach`` and reads through ``kernel.annotations.list``. Runs on
SQLite and PostgreSQL.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
from django.db import transaction
from pydantic import BaseModel

from django_workflows import (
    CompletionCheck,
    StageContext,
    Suspend,
    define_async_batch_stage,
    define_stage,
    define_workflow,
)
from django_workflows.annotations import AnnotationInput, typed_key
from django_workflows.conventions import Decision, Trigger
from django_workflows.kernel import (
    AnnotationSpec,
    CancelRun,
    ClaimPendingRuns,
    CreateRun,
    InvalidCommandError,
    Kernel,
    RerunFrom,
    RunNotFoundError,
    StageNotFoundError,
)
from django_workflows.kernel import events as ev
from django_workflows.kernel.annotations import AttachResult
from django_workflows.kernel.hosting import process_available_jobs, run_maintenance_tick
from django_workflows.kernel.store import write_annotations
from django_workflows.models import (
    OutboxEvent,
    Status,
    WorkflowAnnotation,
    WorkflowRun,
    WorkflowStage,
)
from django_workflows.testing import FakeClock, run_to_completion
from tests.workflows import Num, two_stage

pytestmark = pytest.mark.django_db(transaction=True)

KernelFor = Callable[..., Kernel]


# --- helpers ------------------------------------------------------------------------------------


def _stage(stage_id: str, body: Callable[[StageContext[Any, Any]], Any]) -> Any:
    def execute(ctx: StageContext[Any, Any]) -> Any:
        body(ctx)
        return {"ok": True}

    return define_stage(id=stage_id, execute=execute)


def _workflow(*stages: Any, workflow_id: str = "annotated") -> Any:
    builder = define_workflow(id=workflow_id)
    for st in stages:
        builder = builder.pipe(st)
    return builder.build()


def _create(kernel: Kernel, workflow_id: str = "annotated", **kwargs: Any) -> str:
    return str(kernel.dispatch(CreateRun(workflow_id=workflow_id, **kwargs)).workflow_run_id)


def _run(kernel: Kernel, workflow_id: str = "annotated", **kwargs: Any) -> WorkflowRun:
    return run_to_completion(kernel, _create(kernel, workflow_id, **kwargs), advance_seconds=60)


def _rows(run_id: Any, **filters: Any) -> list[WorkflowAnnotation]:
    return list(WorkflowAnnotation.objects.filter(run_id=run_id, **filters).order_by("id"))


def _events(run_id: Any, event_type: str = ev.ANNOTATION_CREATED) -> list[dict[str, Any]]:
    return [
        e.payload
        for e in OutboxEvent.objects.filter(workflow_run_id=run_id, event_type=event_type).order_by(
            "sequence"
        )
    ]


# --- A.14: stage annotations -------------------------------------------------------------------


def test_stage_annotations_persist_with_completed_stage(kernel_for: KernelFor) -> None:
    """AN-6, AN-7 (A.14 :60): annotations buffered in a stage are written with its COMPLETED
    outcome: scope ``stage``, scope id = stage id, linked to the stage record, with its generation.
    """

    def body(ctx: StageContext[Any, Any]) -> None:
        ctx.annotate("acme.first", 1)
        ctx.annotate("acme.second", {"n": 2})

    kernel = kernel_for(_workflow(_stage("annotate-me", body)))
    run = _run(kernel)
    assert run.status == Status.COMPLETED
    record = WorkflowStage.objects.get(run=run, stage_id="annotate-me")
    rows = _rows(run.pk)
    assert [(r.key, r.value) for r in rows] == [("acme.first", 1), ("acme.second", {"n": 2})]
    for r in rows:
        assert (r.scope, r.scope_id, r.stage_record_id, r.generation) == (
            "stage",
            "annotate-me",
            record.pk,
            record.generation,
        )
        assert r.created_at == record.completed_at  # written in the outcome transaction


def test_stage_batch_form_shares_the_actor_envelope(kernel_for: KernelFor) -> None:
    """AN-3, AN-4 (A.14 :97, :773): three rows from one envelope, all with the actor's kind,
    id and version, the payload and the idempotency key."""
    actor = {"kind": "model", "id": "gpt-x", "version": "2026-01"}

    def body(ctx: StageContext[Any, Any]) -> None:
        ctx.annotate(
            {
                "attributes": {"acme.a": 1, "acme.b": "two", "acme.c": [3]},
                "actor": actor,
                "payload": {"prompt": "why?", "tokens": [1, 2]},
                "idempotency_key": "batch-1",
            }
        )

    kernel = kernel_for(_workflow(_stage("s", body)))
    run = _run(kernel)
    rows = _rows(run.pk)
    assert [r.key for r in rows] == ["acme.a", "acme.b", "acme.c"]
    for r in rows:
        assert (r.actor_kind, r.actor_id, r.actor_version) == ("model", "gpt-x", "2026-01")
        assert r.payload == {"prompt": "why?", "tokens": [1, 2]}
        assert r.idempotency_key == "batch-1"


def test_stage_typed_key_form_stores_key_and_value(kernel_for: KernelFor) -> None:
    """AN-1 (A.14 :142): the conventions' typed keys store their key strings and the value."""

    def body(ctx: StageContext[Any, Any]) -> None:
        ctx.annotate(Decision.outcome, "low")
        ctx.annotate(Decision.confidence, 0.25)

    kernel = kernel_for(_workflow(_stage("s", body)))
    rows = _rows(_run(kernel).pk)
    assert [(r.key, r.value) for r in rows] == [
        ("decision.outcome", "low"),
        ("decision.confidence", 0.25),
    ]


def test_stage_none_values_are_skipped_in_every_form(kernel_for: KernelFor) -> None:
    """AN-5 (A.14 :183, :816): ``None`` attributes vanish in the string, typed and batch forms."""

    def body(ctx: StageContext[Any, Any]) -> None:
        ctx.annotate("x.always", True)
        ctx.annotate("x.never", None)
        ctx.annotate(Decision.rationale, None)
        ctx.annotate({"attributes": {"x.batch.set": 0, "x.batch.unset": None}})

    kernel = kernel_for(_workflow(_stage("s", body)))
    assert [(r.key, r.value) for r in _rows(_run(kernel).pk)] == [
        ("x.always", True),
        ("x.batch.set", 0),
    ]


def test_stage_annotations_before_a_raise_persist_with_failed_outcome(
    kernel_for: KernelFor,
) -> None:
    """AN-6 (A.14 :220): annotations recorded before the stage raises are written with the
    FAILED outcome."""

    def body(ctx: StageContext[Any, Any]) -> None:
        ctx.annotate("acme.before", 1)
        ctx.annotate(Decision.rationale, "about to fail")
        raise ValueError("boom")

    kernel = kernel_for(_workflow(_stage("s", body)))
    run = _run(kernel)
    assert run.status == Status.FAILED
    record = WorkflowStage.objects.get(run=run)
    assert record.error_message == "ValueError: boom"
    # one row per key: the retries annotate again without idempotency keys (no dedupe)
    assert {r.key for r in _rows(run.pk)} == {"acme.before", "decision.rationale"}


def test_stage_annotations_dropped_when_run_cancelled_mid_execution(
    kernel_for: KernelFor,
) -> None:
    """AN-6, K-JE-14, K-JE-15 (A.14 :256): the run is cancelled while the stage body runs; the
    outcome transaction finds it CANCELLED and rolls back - zero annotations, no event."""
    holder: dict[str, Kernel] = {}

    def body(ctx: StageContext[Any, Any]) -> None:
        ctx.annotate("acme.doomed", 1, emit_event=True)
        holder["k"].dispatch(CancelRun(ctx.workflow_run_id, reason="test"))

    kernel = kernel_for(_workflow(_stage("s", body)))
    holder["k"] = kernel
    run = _run(kernel)
    assert run.status == Status.CANCELLED
    assert _rows(run.pk) == []
    assert _events(run.pk) == []


def test_stage_annotations_persist_with_suspended_outcome(kernel_for: KernelFor) -> None:
    """AN-6 (A.14 :320): an async stage's annotations are written with its SUSPENDED outcome;
    the poll's own annotations with the poll outcome (stage scope, same record)."""

    def execute(ctx: StageContext[Any, Any]) -> Suspend:
        ctx.annotate("batch.submitted", "b-1")
        return Suspend(state={"batch_id": "b-1"}, poll_interval_seconds=5)

    def check(state: dict[str, Any], ctx: Any) -> CompletionCheck:
        ctx.annotate("batch.checked", True)
        return CompletionCheck.done({"value": 1})

    st = define_async_batch_stage(id="batch", execute=execute, check_completion=check, output=Num)
    kernel = kernel_for(_workflow(st))
    run_id = _create(kernel)
    kernel.dispatch(ClaimPendingRuns(worker_id="w"))
    process_available_jobs(kernel, "w", max_jobs=10)
    record = WorkflowStage.objects.get(run_id=run_id)
    assert record.status == Status.SUSPENDED
    assert [r.key for r in _rows(run_id)] == ["batch.submitted"]
    run = run_to_completion(kernel, run_id, advance_seconds=10)
    assert run.status == Status.COMPLETED
    rows = _rows(run_id)
    assert [r.key for r in rows] == ["batch.submitted", "batch.checked"]
    assert {(r.scope, r.scope_id, r.stage_record_id) for r in rows} == {
        ("stage", "batch", record.pk)
    }


@pytest.mark.parametrize("outcome", ["reschedule", "failed"])
def test_poll_annotations_persist_with_reschedule_and_failure(
    kernel_for: KernelFor, clock: FakeClock, outcome: str
) -> None:
    """AN-6 (poll side, K-PS-6): annotations buffered in ``check_completion`` are written with
    every poll outcome - a reschedule (not ready) and a failure - with opted-in events."""
    polls = {"n": 0}

    def execute(ctx: StageContext[Any, Any]) -> Suspend:
        return Suspend(state={"batch_id": "b-1"}, poll_interval_seconds=5)

    def check(state: dict[str, Any], ctx: Any) -> CompletionCheck:
        polls["n"] += 1
        ctx.annotate("batch.poll", polls["n"], emit_event=True)
        if outcome == "failed":
            return CompletionCheck.failed("provider said no")
        return CompletionCheck.not_ready()

    st = define_async_batch_stage(id="batch", execute=execute, check_completion=check, output=Num)
    kernel = kernel_for(_workflow(st))
    run_id = _create(kernel)
    run_maintenance_tick(kernel, "w")
    process_available_jobs(kernel, "w", max_jobs=10)
    for _ in range(2):
        clock.advance(6)
        run_maintenance_tick(kernel, "w")
    expected = [1] if outcome == "failed" else [1, 2]
    assert [r.value for r in _rows(run_id)] == expected
    assert [e["value"] for e in _events(run_id)] == expected
    status = WorkflowRun.objects.get(pk=run_id).status
    assert status == (Status.FAILED if outcome == "failed" else Status.RUNNING)


def test_stage_annotation_with_invalid_typed_value_fails_stage_non_retryably(
    kernel_for: KernelFor,
) -> None:
    """Runtime validation of typed keys: ``ctx.annotate(Decision.confidence, "high")`` raises
    in the stage; the stage fails once (not retried) with a message naming the key, and the
    valid annotation made before it is kept (AN-6)."""
    calls = {"n": 0}

    def body(ctx: StageContext[Any, Any]) -> None:
        calls["n"] += 1
        ctx.annotate("acme.before", 1)
        ctx.annotate(Decision.confidence, "high")

    kernel = kernel_for(_workflow(_stage("s", body)))
    run = _run(kernel)
    assert run.status == Status.FAILED
    assert calls["n"] == 1
    error = WorkflowStage.objects.get(run=run).error_message
    assert error.startswith("AnnotationError: decision.confidence")
    assert [r.key for r in _rows(run.pk)] == ["acme.before"]


def test_stage_scope_ids_separate_stages(kernel_for: KernelFor) -> None:
    """AN-7 (A.14 :1265): the scope id tells which stage wrote a row; list() filters on it."""

    def body(ctx: StageContext[Any, Any]) -> None:
        ctx.annotate("acme.by", ctx.stage_id)

    kernel = kernel_for(_workflow(_stage("first", body), _stage("second", body)))
    run = _run(kernel)
    assert [r.value for r in kernel.annotations.list(run.pk, scope_id="first")] == ["first"]
    assert [r.value for r in kernel.annotations.list(run.pk, scope_id="second")] == ["second"]


def test_stage_emit_event_emits_one_event_per_opted_in_row(kernel_for: KernelFor) -> None:
    """AN-40, EV-21 (A.14 :1132): two rows persist, only the opted-in one emits
    ``annotation:created`` (key, value, scope, scope id, generation), after ``stage:completed``."""

    def body(ctx: StageContext[Any, Any]) -> None:
        ctx.annotate("acme.loud", 7, emit_event=True)
        ctx.annotate("acme.quiet", 8)

    kernel = kernel_for(_workflow(_stage("s", body)))
    run = _run(kernel)
    assert len(_rows(run.pk)) == 2
    events = _events(run.pk)
    assert len(events) == 1
    event = events[0]
    assert (
        event["key"],
        event["value"],
        event["scope"],
        event["scope_id"],
        event["generation"],
    ) == (
        "acme.loud",
        7,
        "stage",
        "s",
        0,
    )
    assert "actor_kind" not in event
    types = [
        e.event_type
        for e in OutboxEvent.objects.filter(workflow_run_id=run.pk).order_by("sequence")
    ]
    assert types.index(ev.ANNOTATION_CREATED) == types.index(ev.STAGE_COMPLETED) + 1


# --- A.14: run.create ---------------------------------------------------------------------------


def test_run_create_annotations_are_run_scope_rows(kernel_for: KernelFor) -> None:
    """AN-20, K-CR-6 (A.14 :385, :1222): three run-scope rows (generation 0, no stage link)
    sharing the actor; typed keys accepted as attribute keys; one event for the opted-in entry.
    """
    kernel = kernel_for(two_stage())
    run_id = _create(
        kernel,
        "two-stage",
        input={"value": 1},
        annotations=(
            AnnotationSpec(
                {Trigger.source: "zendesk", "acme.ticket": 4711, Trigger.reason: "ticket"},
                actor={"kind": "integration", "id": "zendesk"},
            ),
            AnnotationSpec({"acme.priority": "high"}, emit_event=True),
        ),
    )
    rows = _rows(run_id)
    assert [(r.key, r.value) for r in rows] == [
        ("trigger.source", "zendesk"),
        ("acme.ticket", 4711),
        ("trigger.reason", "ticket"),
        ("acme.priority", "high"),
    ]
    assert [r.actor_id for r in rows[:3]] == ["zendesk"] * 3
    for r in rows:
        assert (r.scope, r.scope_id, r.stage_record_id, r.generation) == ("run", None, None, 0)
    assert [e["key"] for e in _events(run_id)] == ["acme.priority"]


def test_run_create_without_annotations_writes_none(kernel_for: KernelFor) -> None:
    """AN-20 (A.14 :427): an empty annotations list writes no rows."""
    kernel = kernel_for(two_stage())
    run_id = _create(kernel, "two-stage", input={"value": 1}, annotations=())
    assert _rows(run_id) == []


@pytest.mark.parametrize(
    ("annotations", "field"),
    [
        ((AnnotationSpec({"no_namespace": 1}),), "annotations[0].attributes.no_namespace"),
        (
            (AnnotationSpec({"acme.ok": 1}), AnnotationSpec({Trigger.source: 42})),
            "annotations[1].attributes.trigger.source",
        ),
        ((AnnotationSpec({"acme.k": 1}, actor={"who": "x"}),), "annotations[0].actor.who"),
        (({"attributes": {"acme.k": 1}, "emitEvent": True},), "annotations[0].emitEvent"),
        (("acme.k=1",), "annotations[0]"),
    ],
)
def test_run_create_invalid_annotation_names_field_and_writes_nothing(
    kernel_for: KernelFor, annotations: tuple[Any, ...], field: str
) -> None:
    """AN-20 (atomic with the run), key format rules and typed-key validation at run.create:
    the error names the entry and member; no run, no annotation, no event is written."""
    kernel = kernel_for(two_stage())
    with pytest.raises(InvalidCommandError) as info:
        _create(kernel, "two-stage", input={"value": 1}, annotations=annotations)
    assert info.value.field == field
    assert WorkflowRun.objects.count() == 0
    assert WorkflowAnnotation.objects.count() == 0
    assert OutboxEvent.objects.count() == 0


def test_run_create_accepts_envelope_dicts(kernel_for: KernelFor) -> None:
    """AN-20, AN-3: ``annotations`` may hold envelope objects (what ``--annotations`` loads)."""
    kernel = kernel_for(two_stage())
    run_id = _create(
        kernel,
        "two-stage",
        input={"value": 1},
        annotations=(
            {
                "attributes": {"acme.k": "v"},
                "actor": {"kind": "cli"},
                "idempotency_key": "i-1",
                "emit_event": True,
            },
        ),
    )
    (row,) = _rows(run_id)
    assert (row.key, row.actor_kind, row.idempotency_key) == ("acme.k", "cli", "i-1")
    assert len(_events(run_id)) == 1


# --- A.14: attach -------------------------------------------------------------------------------


def test_attach_writes_a_batch(kernel_for: KernelFor) -> None:
    """AN-21 (A.14 :459): attach writes one run-scope row per attribute with the actor."""
    kernel = kernel_for(two_stage())
    run_id = _create(kernel, "two-stage", input={"value": 1})
    result = kernel.annotations.attach(
        run_id,
        {"review.verdict": "ok", "review.score": 9, "review.skip": None},
        actor={"kind": "user", "id": "alice"},
    )
    assert result == AttachResult(created=2, duplicates=0)
    rows = _rows(run_id)
    assert [(r.key, r.actor_kind, r.actor_id, r.scope) for r in rows] == [
        ("review.verdict", "user", "alice", "run"),
        ("review.score", "user", "alice", "run"),
    ]
    assert _events(run_id) == []


def test_attach_three_times_with_one_idempotency_key_writes_one_row(
    kernel_for: KernelFor, clock: FakeClock
) -> None:
    """AN-8, AN-21 (A.14 :494, C.4 :1066): first write wins - later values are not applied."""
    kernel = kernel_for(two_stage())
    run_id = _create(kernel, "two-stage", input={"value": 1})
    results = []
    for value in ("first", "second", "third"):
        clock.advance(1)
        results.append(kernel.annotations.attach(run_id, {"acme.k": value}, idempotency_key="k1"))
    assert [r.created for r in results] == [1, 0, 0]
    assert [r.duplicates for r in results] == [0, 1, 1]
    assert [r.value for r in _rows(run_id)] == ["first"]


def test_attach_three_times_without_key_writes_three_rows(kernel_for: KernelFor) -> None:
    """AN-8 (A.14 :531, C.4 :1093): a null idempotency key never dedupes."""
    kernel = kernel_for(two_stage())
    run_id = _create(kernel, "two-stage", input={"value": 1})
    for _ in range(3):
        kernel.annotations.attach(run_id, {"acme.k": "v"})
    assert len(_rows(run_id)) == 3


def test_attach_emit_event_carries_the_actor(kernel_for: KernelFor) -> None:
    """AN-40, EV-21 (A.14 :1181): one ``annotation:created`` with actor kind/id; its causation
    id is the idempotency key (AN-21)."""
    kernel = kernel_for(two_stage())
    run_id = _create(kernel, "two-stage", input={"value": 1})
    kernel.annotations.attach(
        run_id,
        {"acme.k": 1},
        actor={"kind": "user", "id": "bob", "version": "1"},
        idempotency_key="attach-1",
        emit_event=True,
    )
    (event,) = _events(run_id)
    assert (event["actor_kind"], event["actor_id"], event["actor_version"]) == ("user", "bob", "1")
    assert (event["scope"], event["generation"]) == ("run", 0)
    row = OutboxEvent.objects.get(workflow_run_id=run_id, event_type=ev.ANNOTATION_CREATED)
    assert row.causation_id == "attach-1"


def test_attach_to_unknown_run_raises_and_writes_nothing(kernel_for: KernelFor) -> None:
    """Part I item 17, EC-52: attach rejects an unknown run (upstream wrote nothing only
    thanks to the FK); a malformed id is an InvalidCommandError naming ``run_id``."""
    kernel = kernel_for(two_stage())
    with pytest.raises(RunNotFoundError):
        kernel.annotations.attach(uuid.uuid4(), {"acme.k": 1}, emit_event=True)
    with pytest.raises(InvalidCommandError) as info:
        kernel.annotations.attach("not-a-uuid", {"acme.k": 1})
    assert info.value.field == "run_id"
    assert WorkflowAnnotation.objects.count() == 0
    assert OutboxEvent.objects.count() == 0


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"attributes": {"bad key": 1}}, "attributes"),
        ({"attributes": {Decision.confidence: "0.9"}}, "attributes.decision.confidence"),
        ({"attributes": {"acme.k": 1}, "actor": {"kind": ""}}, "actor.kind"),
        ({"attributes": {"acme.k": 1}, "scope": ""}, "scope"),
        ({"attributes": {"acme.k": 1}, "scope": "stage"}, "scope_id"),
        ({"attributes": {"acme.k": 1}, "generation": -1}, "generation"),
        ({"attributes": ["acme.k"]}, "attributes"),
    ],
)
def test_attach_rejects_malformed_input_naming_the_field(
    kernel_for: KernelFor, kwargs: dict[str, Any], field: str
) -> None:
    """AN-21 with validation: every malformed part raises InvalidCommandError naming it; the
    run gets no row and no event."""
    kernel = kernel_for(two_stage())
    run_id = _create(kernel, "two-stage", input={"value": 1})
    attributes = kwargs.pop("attributes")
    with pytest.raises(InvalidCommandError) as info:
        kernel.annotations.attach(run_id, attributes, emit_event=True, **kwargs)
    assert info.value.field == field or info.value.field.startswith(field)
    assert _rows(run_id) == []
    assert _events(run_id) == []


def test_attach_stage_scope_links_the_record_and_its_attempt(kernel_for: KernelFor) -> None:
    """AN-7, AN-21: ``scope="stage"`` links the row to the stage's current record and takes
    its generation; a stage id the workflow lacks is a StageNotFoundError."""
    kernel = kernel_for(two_stage())
    run = _run(kernel, "two-stage", input={"value": 1})
    kernel.dispatch(RerunFrom(run.pk, "add-10"))
    record = WorkflowStage.objects.get(run=run, stage_id="add-10")
    assert record.generation == 1
    kernel.annotations.attach(run.pk, {"review.ok": True}, scope="stage", scope_id="add-10")
    (row,) = _rows(run.pk)
    assert (row.scope, row.scope_id, row.stage_record_id, row.generation) == (
        "stage",
        "add-10",
        record.pk,
        1,
    )
    with pytest.raises(StageNotFoundError, match="nope"):
        kernel.annotations.attach(run.pk, {"review.ok": True}, scope="stage", scope_id="nope")


def test_attach_works_on_terminal_runs(kernel_for: KernelFor) -> None:
    """AN-21: a finished run can still be annotated (e.g. a review after completion)."""
    kernel = kernel_for(two_stage())
    run = _run(kernel, "two-stage", input={"value": 1})
    assert run.status == Status.COMPLETED
    assert kernel.annotations.attach(run.pk, {"review.after": "fine"}).created == 1


# --- Part I item 16: a deduplicated annotation emits no second event ---------------------------


def test_dedup_attach_emits_no_second_event(kernel_for: KernelFor) -> None:
    """Part I item 16, EC-29 (replaces AN-41): three attaches with one idempotency key and
    ``emit_event`` write one row and exactly one ``annotation:created``."""
    kernel = kernel_for(two_stage())
    run_id = _create(kernel, "two-stage", input={"value": 1})
    for value in (1, 2, 3):
        kernel.annotations.attach(run_id, {"acme.k": value}, idempotency_key="i", emit_event=True)
    assert len(_rows(run_id)) == 1
    assert [e["value"] for e in _events(run_id)] == [1]


def test_dedup_within_one_batch_keeps_first_and_emits_once(kernel_for: KernelFor) -> None:
    """Part I item 16, AN-8: a repeated (key, idempotency key) inside one write is skipped too
    (first wins), and emits one event; another key with the same idempotency key is new."""
    kernel = kernel_for(two_stage())
    run_id = _create(kernel, "two-stage", input={"value": 1})
    inputs = [
        AnnotationInput("acme.k", "first", idempotency_key="i", emit_event=True),
        AnnotationInput("acme.k", "second", idempotency_key="i", emit_event=True),
        AnnotationInput("acme.other", "x", idempotency_key="i", emit_event=True),
    ]
    with transaction.atomic():
        events = write_annotations(WorkflowRun.objects.get().pk, inputs, now=kernel.clock.now())
    assert [(e["key"], e["value"]) for e in events] == [("acme.k", "first"), ("acme.other", "x")]
    assert [(r.key, r.value) for r in _rows(run_id)] == [("acme.k", "first"), ("acme.other", "x")]


def test_dedup_stage_retry_emits_no_second_event(kernel_for: KernelFor) -> None:
    """Part I item 16, EC-29, AN-8: a stage that annotates with an idempotency key and
    ``emit_event``, fails (retryable) and succeeds on the next delivery leaves one row and one
    ``annotation:created``; the first write's value wins."""
    deliveries = {"n": 0}

    def body(ctx: StageContext[Any, Any]) -> None:
        deliveries["n"] += 1
        ctx.annotate("acme.charge", deliveries["n"], idempotency_key="charge-1", emit_event=True)
        if deliveries["n"] == 1:
            raise ConnectionError("flaky")

    kernel = kernel_for(_workflow(_stage("s", body)))
    run = _run(kernel)
    assert run.status == Status.COMPLETED
    assert deliveries["n"] == 2
    assert [r.value for r in _rows(run.pk)] == [1]
    assert [e["value"] for e in _events(run.pk)] == [1]


def test_dedup_across_run_create_and_attach(kernel_for: KernelFor) -> None:
    """Part I item 16: a key written at run.create is deduplicated by a later attach with the
    same idempotency key (no row, no event)."""
    kernel = kernel_for(two_stage())
    run_id = _create(
        kernel,
        "two-stage",
        input={"value": 1},
        annotations=(AnnotationSpec({"acme.k": 1}, idempotency_key="i", emit_event=True),),
    )
    result = kernel.annotations.attach(run_id, {"acme.k": 2}, idempotency_key="i", emit_event=True)
    assert result == AttachResult(created=0, duplicates=1)
    assert [e["value"] for e in _events(run_id)] == [1]


# --- A.14 / C.4: list and its filters --------------------------------------------------------


@pytest.fixture
def listed(kernel_for: KernelFor, clock: FakeClock) -> tuple[Kernel, str]:
    """A run with four rows: two decision.* by a model, one review by a user, one stage row."""
    kernel = kernel_for(two_stage())
    run_id = _create(kernel, "two-stage", input={"value": 1})
    kernel.annotations.attach(
        run_id,
        {"decision.outcome": "approve", "decision.confidence": 0.8},
        actor={"kind": "model", "id": "m-1"},
    )
    clock.advance(1)
    kernel.annotations.attach(run_id, {"review.note": "ok"}, actor={"kind": "user", "id": "u-1"})
    clock.advance(1)
    kernel.annotations.attach(
        run_id, {"acme.stage": 1}, scope="stage", scope_id="add-1", generation=1
    )
    return kernel, run_id


def test_list_returns_fields_in_created_then_id_order(listed: tuple[Kernel, str]) -> None:
    """AN-8, AN-9, AN-24 (C.4 :981, :1008, :1045; A.14 :643): rows carry key/value/payload/
    scope/generation/created_at; actor and scope id default to null; rows of one batch keep their
    input order; repeated calls return the same order."""
    kernel, run_id = listed
    rows = kernel.annotations.list(run_id)
    assert [r.key for r in rows] == [
        "decision.outcome",
        "decision.confidence",
        "review.note",
        "acme.stage",
    ]
    first = rows[0]
    assert (first.value, first.scope, first.scope_id, first.generation) == (
        "approve",
        "run",
        None,
        0,
    )
    assert first.payload is None and first.idempotency_key is None
    assert first.actor == {"kind": "model", "id": "m-1"}
    assert first.actor_version is None
    assert rows[0].created_at == rows[1].created_at < rows[2].created_at < rows[3].created_at
    assert [r.id for r in kernel.annotations.list(run_id)] == [r.id for r in rows]
    assert first.to_json()["created_at"] == first.created_at.isoformat()


def test_list_filters_by_exact_key_and_prefix(listed: tuple[Kernel, str]) -> None:
    """AN-9 (A.14 :610, :619; C.4 :1111, :1126): exact key; key prefix; key wins over prefix;
    the prefix is literal and case-sensitive (``_``/``%`` are no wildcards)."""
    kernel, run_id = listed
    assert [r.key for r in kernel.annotations.list(run_id, key="decision.outcome")] == [
        "decision.outcome"
    ]
    assert [r.key for r in kernel.annotations.list(run_id, key_prefix="decision.")] == [
        "decision.outcome",
        "decision.confidence",
    ]
    both = kernel.annotations.list(run_id, key="review.note", key_prefix="decision.")
    assert [r.key for r in both] == ["review.note"]
    assert kernel.annotations.list(run_id, key_prefix="Decision.") == []
    assert kernel.annotations.list(run_id, key_prefix="decision_") == []
    assert kernel.annotations.list(run_id, key_prefix="decision%") == []


def test_list_filters_by_scope_and_scope_id(listed: tuple[Kernel, str]) -> None:
    """AN-9 (C.4 :1145): scope, scope id, and a null scope-id filter matching null."""
    kernel, run_id = listed
    assert [r.key for r in kernel.annotations.list(run_id, scope="stage")] == ["acme.stage"]
    assert [r.key for r in kernel.annotations.list(run_id, scope_id="add-1")] == ["acme.stage"]
    assert len(kernel.annotations.list(run_id, scope="run", scope_id=None)) == 3
    assert kernel.annotations.list(run_id, scope="run", scope_id="add-1") == []


def test_list_filters_by_actor(listed: tuple[Kernel, str]) -> None:
    """AN-9 (A.14 :631; C.4 :1179): actor kind and actor id."""
    kernel, run_id = listed
    assert [r.key for r in kernel.annotations.list(run_id, actor_kind="user")] == ["review.note"]
    assert len(kernel.annotations.list(run_id, actor_id="m-1")) == 2
    assert kernel.annotations.list(run_id, actor_id="m-1", actor_kind="user") == []


def test_list_filters_by_attempt(listed: tuple[Kernel, str]) -> None:
    """AN-9 (A.14 :852; C.4 :1212): generation 0 vs 1 (set explicitly through attach)."""
    kernel, run_id = listed
    assert len(kernel.annotations.list(run_id, generation=0)) == 3
    assert [r.key for r in kernel.annotations.list(run_id, generation=1)] == ["acme.stage"]


def test_list_filters_by_since_and_until(listed: tuple[Kernel, str], clock: FakeClock) -> None:
    """AN-9 (A.14 :899; C.4 :1239): ``since`` is created_at >=, ``until`` created_at <=."""
    kernel, run_id = listed
    t0 = kernel.annotations.list(run_id)[0].created_at
    t1, t2 = t0 + timedelta(seconds=1), t0 + timedelta(seconds=2)
    assert len(kernel.annotations.list(run_id, since=t1)) == 2
    assert len(kernel.annotations.list(run_id, until=t1)) == 3
    assert [r.key for r in kernel.annotations.list(run_id, since=t1, until=t1)] == ["review.note"]
    assert [r.key for r in kernel.annotations.list(run_id, since=t2)] == ["acme.stage"]


def test_list_limit_defaults_to_1000(kernel_for: KernelFor) -> None:
    """AN-9 (A.14 :652; C.4 :1261): ``limit`` truncates in order; the default is 1000."""
    kernel = kernel_for(two_stage())
    run_id = _create(kernel, "two-stage", input={"value": 1})
    kernel.annotations.attach(run_id, {f"acme.k{i:04d}": i for i in range(1005)})
    assert [r.value for r in kernel.annotations.list(run_id, limit=2)] == [0, 1]
    rows = kernel.annotations.list(run_id)
    assert len(rows) == 1000
    assert rows[-1].value == 999
    assert kernel.annotations.list(run_id, limit=0) == []


def test_list_rejects_malformed_filters_and_value_filters(listed: tuple[Kernel, str]) -> None:
    """AN-9, AN-10: malformed filters name themselves; values and payloads are not filterable
    (there is no such parameter)."""
    kernel, run_id = listed
    for filters, field in (
        ({"limit": -1}, "limit"),
        ({"generation": "1"}, "generation"),
        ({"since": "2026-01-01"}, "since"),
        ({"key": 5}, "key"),
    ):
        with pytest.raises(InvalidCommandError) as info:
            kernel.annotations.list(run_id, **filters)
        assert info.value.field == field
    with pytest.raises(TypeError):
        kernel.annotations.list(run_id, value="approve")


def test_list_unknown_run_is_empty(kernel_for: KernelFor) -> None:
    """AN-23: listing a run without annotations (or an unknown one) returns nothing."""
    kernel = kernel_for(two_stage())
    assert kernel.annotations.list(uuid.uuid4()) == []


def test_empty_attach_is_a_no_op(kernel_for: KernelFor) -> None:
    """AN-21, C.4 :1277: no surviving attribute -> nothing written."""
    kernel = kernel_for(two_stage())
    run_id = _create(kernel, "two-stage", input={"value": 1})
    assert kernel.annotations.attach(run_id, {}) == AttachResult(0, 0)
    assert kernel.annotations.attach(run_id, {"acme.k": None}) == AttachResult(0, 0)
    assert _rows(run_id) == []


# --- legacy metadata shim (AN-30..AN-32) ---------------------------------------------------------


def _legacy_run(kernel: Kernel, metadata: dict[str, Any] | None) -> str:
    with pytest.warns(DeprecationWarning, match="metadata is deprecated"):
        return _create(kernel, "two-stage", input={"value": 1}, metadata=metadata)


def test_legacy_shim_synthesises_metadata_rows(kernel_for: KernelFor) -> None:
    """AN-30, AN-31 (A.14 :689): each metadata entry becomes a virtual run-scope row
    ``legacy.metadata.<k>`` with id ``synthesized:<run>:<k>`` and the run's created_at; nothing
    is written (AN-32). Passing metadata warns (deprecated)."""
    kernel = kernel_for(two_stage())
    run_id = _legacy_run(kernel, {"source": "email", "tags": ["a"]})
    run = WorkflowRun.objects.get(pk=run_id)
    rows = kernel.annotations.list(run_id)
    assert [(r.key, r.value) for r in rows] == [
        ("legacy.metadata.source", "email"),
        ("legacy.metadata.tags", ["a"]),
    ]
    for r in rows:
        assert r.synthesized
        assert r.id == f"synthesized:{run_id}:{r.key.removeprefix('legacy.metadata.')}"
        assert (r.scope, r.scope_id, r.generation, r.created_at) == ("run", None, 0, run.created_at)
        assert r.actor is None and r.stage_record_id is None
    assert WorkflowAnnotation.objects.count() == 0
    assert kernel.annotations.list(run_id, include_legacy=False) == []


def test_legacy_shim_merges_with_persisted_rows_in_order(
    kernel_for: KernelFor, clock: FakeClock
) -> None:
    """AN-32: virtual rows sort by created_at with the persisted ones; the limit applies to
    the merged list."""
    kernel = kernel_for(two_stage())
    run_id = _legacy_run(kernel, {"source": "email"})
    clock.advance(1)
    kernel.annotations.attach(run_id, {"acme.later": 1})
    assert [r.key for r in kernel.annotations.list(run_id)] == [
        "legacy.metadata.source",
        "acme.later",
    ]
    assert [r.key for r in kernel.annotations.list(run_id, limit=1)] == ["legacy.metadata.source"]


def test_legacy_shim_disabled_by_a_persisted_legacy_row(kernel_for: KernelFor) -> None:
    """AN-30 (2) (A.14 :704): once a ``legacy.metadata.*`` row is persisted, only real rows
    are returned."""
    kernel = kernel_for(two_stage())
    run_id = _legacy_run(kernel, {"source": "email", "other": 1})
    kernel.annotations.attach(run_id, {"legacy.metadata.source": "email"})
    rows = kernel.annotations.list(run_id)
    assert [(r.key, r.synthesized) for r in rows] == [("legacy.metadata.source", False)]


def test_legacy_shim_honours_key_and_prefix(kernel_for: KernelFor) -> None:
    """AN-31 (A.14 :718): exact key and prefix apply to virtual rows; a prefix shorter than
    ``legacy.metadata.`` still matches them; a non-legacy key filter excludes them."""
    kernel = kernel_for(two_stage())
    run_id = _legacy_run(kernel, {"source": "email", "sender": "x", "tags": []})
    assert [r.key for r in kernel.annotations.list(run_id, key="legacy.metadata.tags")] == [
        "legacy.metadata.tags"
    ]
    assert [r.key for r in kernel.annotations.list(run_id, key_prefix="legacy.metadata.s")] == [
        "legacy.metadata.sender",  # equal created_at: ordered by id (AN-32)
        "legacy.metadata.source",
    ]
    assert len(kernel.annotations.list(run_id, key_prefix="legacy.")) == 3
    assert kernel.annotations.list(run_id, key_prefix="acme.") == []
    assert kernel.annotations.list(run_id, key="acme.source") == []


def test_legacy_shim_skipped_for_filters_that_cannot_match(kernel_for: KernelFor) -> None:
    """AN-30 (1) (A.14 :737): stage scope, a scope id, actor filters or generation > 0 rule the
    virtual rows out; since/until compare with the run's created_at (AN-31)."""
    kernel = kernel_for(two_stage())
    run_id = _legacy_run(kernel, {"source": "email"})
    created = WorkflowRun.objects.get(pk=run_id).created_at
    for filters in (
        {"scope": "stage"},
        {"scope_id": "add-1"},
        {"actor_id": "x"},
        {"actor_kind": "user"},
        {"generation": 1},
        {"since": created + timedelta(seconds=1)},
        {"until": created - timedelta(seconds=1)},
    ):
        assert kernel.annotations.list(run_id, **filters) == [], filters
    for filters in ({"scope": "run"}, {"scope_id": None}, {"generation": 0}, {"since": created}):
        assert len(kernel.annotations.list(run_id, **filters)) == 1, filters


def test_legacy_shim_partial_migration_hidden_by_filter_still_disables(
    kernel_for: KernelFor,
) -> None:
    """AN-30 (2) (A.14 :743): the migration probe ignores the caller's filters - a migrated
    row the filter hides still turns synthesis off, so the result is empty."""
    kernel = kernel_for(two_stage())
    run_id = _legacy_run(kernel, {"source": "email", "other": 1})
    kernel.annotations.attach(run_id, {"legacy.metadata.source": "email"})
    assert kernel.annotations.list(run_id, key="legacy.metadata.other") == []


def test_legacy_shim_ignores_non_object_metadata(kernel_for: KernelFor) -> None:
    """AN-30 (3): no metadata (or an empty one) synthesises nothing."""
    kernel = kernel_for(two_stage())
    run_id = _legacy_run(kernel, {})
    assert kernel.annotations.list(run_id) == []
    plain = _create(kernel, "two-stage", input={"value": 1})
    assert kernel.annotations.list(plain) == []


# --- reruns (AN-12, AN-13; A.14 :948, :1019; C.4 :1281) -----------------------------------------


def _seen_workflow() -> Any:
    def body(ctx: StageContext[Any, Any]) -> None:
        ctx.annotate("acme.seen", ctx.generation)

    return _workflow(_stage("stage1", body), _stage("stage2", body))


def test_rerun_keeps_old_annotations_unlinked_and_links_new_ones(kernel_for: KernelFor) -> None:
    """AN-12, AN-13, DM-13 (A.14 :948, C.4 :1281): after rerunFrom(stage2) the old stage2 row
    keeps generation 0 with its stage link nulled; the new one has generation 1 and is linked to the
    new record; stage1's row is untouched; ``generation`` separates the generations."""
    kernel = kernel_for(_seen_workflow())
    run = _run(kernel)
    old = WorkflowAnnotation.objects.get(run=run, scope_id="stage2")
    stage1_row = WorkflowAnnotation.objects.get(run=run, scope_id="stage1")
    kernel.dispatch(RerunFrom(run.pk, "stage2"))
    old.refresh_from_db()
    assert (old.generation, old.stage_record_id) == (0, None)
    run = run_to_completion(kernel, run.pk)
    assert run.status == Status.COMPLETED
    new_record = WorkflowStage.objects.get(run=run, stage_id="stage2")
    rows = kernel.annotations.list(run.pk, scope_id="stage2")
    assert [(r.generation, r.value, r.stage_record_id) for r in rows] == [
        (0, 0, None),
        (1, 1, str(new_record.pk)),
    ]
    assert [r.generation for r in kernel.annotations.list(run.pk, generation=1)] == [1]
    stage1_row.refresh_from_db()
    assert stage1_row.stage_record_id is not None and stage1_row.generation == 0


def test_rerun_downstream_stage_inherits_the_new_attempt(kernel_for: KernelFor) -> None:
    """AN-12 (A.14 :1019): after rerunFrom(stage1) both stages run again with generation 1;
    stage2's annotations carry attempts [0, 1]."""
    kernel = kernel_for(_seen_workflow())
    run = _run(kernel)
    kernel.dispatch(RerunFrom(run.pk, "stage1"))
    run_to_completion(kernel, run.pk)
    assert [r.generation for r in kernel.annotations.list(run.pk, scope_id="stage2")] == [0, 1]
    assert [r.value for r in kernel.annotations.list(run.pk, scope_id="stage1")] == [0, 1]
    assert all(r.stage_record_id is None for r in kernel.annotations.list(run.pk, generation=0))


# --- typed keys from users (AN-50) -------------------------------------------------------------


def test_user_typed_key_value_validated_at_every_entry_point(kernel_for: KernelFor) -> None:
    """AN-50, runtime validation: a user's ``typed_key`` is enforced in attach and run.create
    (values stored in JSON form), and its errors name the key."""

    class Review(BaseModel):
        score: int
        reviewer: str

    review = typed_key("acme.review", Review, stability="stable")
    kernel = kernel_for(two_stage())
    run_id = _create(
        kernel,
        "two-stage",
        input={"value": 1},
        annotations=(AnnotationSpec({review: Review(score=3, reviewer="al")}),),
    )
    kernel.annotations.attach(run_id, {review: {"score": 4, "reviewer": "bo"}})
    assert [r.value for r in _rows(run_id)] == [
        {"score": 3, "reviewer": "al"},
        {"score": 4, "reviewer": "bo"},
    ]
    with pytest.raises(InvalidCommandError, match=r"acme\.review") as info:
        kernel.annotations.attach(run_id, {review: {"score": "4", "reviewer": "bo"}})
    assert info.value.field == "attributes.acme.review"
