"""The stage execution context (SPEC §3.3-3.4, WF-10..20) and ``annotate`` (§6.1, AN-1..AN-5).

Ports the ★ scenarios of TEST-SCENARIOS G (`T/02-stage-definition/stage-context.test.ts`,
`T/05-data-flow/` require/optional) that apply to the Python API. The database-facing part of
the context is replaced by an in-test fake; annotations are checked in the context's buffer
only (their persistence is covered by the integration tests). No database.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
from pydantic import BaseModel

from django_workflows import CompletionContext, MissingStageOutputError, StageContext
from django_workflows.definition.context import AnnotationInput


@dataclass
class FakeStorage:
    data: dict[str, Any] = field(default_factory=dict)

    def save(self, key: str, data: Any) -> None:
        self.data[key] = data

    def load(self, key: str) -> Any:
        return self.data[key]

    def exists(self, key: str) -> bool:
        return key in self.data

    def delete(self, key: str) -> None:
        self.data.pop(key, None)

    def stage_key(self, stage_id: str, suffix: str | None = None) -> str:
        return f"run-1/{stage_id}/{suffix or 'output.json'}"


@dataclass
class FakeServices:
    """Records what the context forwards to the kernel-side services."""

    storage: FakeStorage = field(default_factory=FakeStorage)
    logs: list[tuple[str, str, dict[str, Any] | None]] = field(default_factory=list)
    progress_calls: list[tuple[float, str, dict[str, Any] | None]] = field(default_factory=list)
    cancelled: bool = False

    def log(self, level: str, message: str, meta: dict[str, Any] | None) -> None:
        self.logs.append((level, message, meta))

    def progress(self, progress: float, message: str, details: dict[str, Any] | None) -> None:
        self.progress_calls.append((progress, message, details))

    def is_cancelled(self) -> bool:
        return self.cancelled


class In(BaseModel):
    value: int


def make_ctx(
    workflow_context: dict[str, Any] | None = None, services: FakeServices | None = None
) -> StageContext[Any, Any]:
    return StageContext(
        workflow_run_id="run-1",
        workflow_id="wf",
        stage_id="summarise",
        stage_record_id="rec-1",
        generation=1,
        services=services or FakeServices(),
        stage_name="Summarise",
        stage_number=2,
        input=In(value=3),
        config=None,
        workflow_context=workflow_context or {},
    )


@dataclass
class TypedKey:
    """Stands in for a typed annotation key (AN-1): only ``key`` is used."""

    key: str
    description: str = "ignored"


# --- identity fields (WF-10) --------------------------------------------------------------------


def test_context_carries_run_and_stage_identity() -> None:
    """WF-10, WF-11: run id, stage id/name, 1-based stage number, record id, input."""
    ctx = make_ctx()
    assert (ctx.workflow_run_id, ctx.stage_id, ctx.stage_name) == (
        "run-1",
        "summarise",
        "Summarise",
    )
    assert (ctx.stage_number, ctx.stage_record_id, ctx.generation) == (2, "rec-1", 1)
    assert ctx.input == In(value=3)
    assert ctx.resume_state is None


def test_the_old_name_of_the_rerun_generation_says_where_it_went() -> None:
    """Issue 17 section 3: ``ctx.attempt`` is gone (no alias: ``attempt`` is only a job's
    delivery number); reading it names ``ctx.generation``. Other missing names are plain."""
    ctx = make_ctx()
    with pytest.raises(AttributeError, match=r"ctx\.attempt was renamed ctx\.generation"):
        _ = ctx.attempt
    with pytest.raises(AttributeError, match="has no attribute 'nope'"):
        _ = ctx.nope
    assert not hasattr(ctx, "attempt")


# --- require / optional (WF-15) -----------------------------------------------------------------


def test_require_returns_the_stage_output() -> None:
    """WF-15: require(id) returns workflow_context[id] unchanged."""
    output = In(value=9)
    assert make_ctx({"extract": output}).require("extract") is output


@pytest.mark.parametrize("falsy", [0, "", False, None, [], {}])
def test_require_treats_falsy_values_as_present(falsy: Any) -> None:
    """WF-15: falsy values (0, "", False, None, ...) count as present; only absence raises."""
    ctx = make_ctx({"zero": falsy})
    assert ctx.require("zero") == falsy
    assert ctx.optional("zero", "default") == falsy


def test_require_missing_lists_available_ids() -> None:
    """WF-15: the error says "Missing required stage output", the id and the available ids."""
    ctx = make_ctx({"b-stage": 1, "a-stage": 2})
    with pytest.raises(MissingStageOutputError) as info:
        ctx.require("c-stage")
    message = str(info.value)
    assert "Missing required stage output" in message
    assert "'c-stage'" in message
    assert "available: a-stage, b-stage" in message


def test_require_missing_with_empty_context_says_none() -> None:
    """WF-15: with no earlier outputs the available list is "(none)"."""
    with pytest.raises(MissingStageOutputError, match=r"available: \(none\)"):
        make_ctx().require("anything")


def test_missing_stage_output_error_is_a_lookup_error() -> None:
    """WF-15: callers can catch it as LookupError."""
    assert issubclass(MissingStageOutputError, LookupError)


def test_optional_returns_value_default_or_none() -> None:
    """WF-15: optional(id) returns the value, else the default, else None."""
    ctx = make_ctx({"here": 5})
    assert ctx.optional("here") == 5
    assert ctx.optional("absent") is None
    assert ctx.optional("absent", {"fallback": True}) == {"fallback": True}


def test_require_and_optional_ignore_dependencies_declaration() -> None:
    """WF-15: neither consults the stage's dependencies; the context alone decides."""
    ctx = make_ctx({"undeclared": "x"})
    assert ctx.require("undeclared") == "x"


# --- progress (WF-16, Part I item 14) -----------------------------------------------------------


def test_progress_autofills_stage_id_and_name() -> None:
    """WF-16: progress events carry the current stage id and name."""
    services = FakeServices()
    ctx = make_ctx(services=services)
    ctx.progress(40, "halfway there")
    assert ctx.progress_events == [
        {
            "stage_id": "summarise",
            "stage_name": "Summarise",
            "progress": 40.0,
            "message": "halfway there",
        }
    ]
    assert services.progress_calls == [(40.0, "halfway there", None)]


def test_progress_includes_details_when_given() -> None:
    """WF-16: keyword details travel in the event and to the live write."""
    services = FakeServices()
    ctx = make_ctx(services=services)
    ctx.progress(10, "items", done=1, total=10)
    assert ctx.progress_events[0]["details"] == {"done": 1, "total": 10}
    assert services.progress_calls == [(10.0, "items", {"done": 1, "total": 10})]


@pytest.mark.parametrize(("given", "stored"), [(-5, 0.0), (150, 100.0), (0, 0.0), (100, 100.0)])
def test_progress_is_clamped_to_0_100(given: float, stored: float) -> None:
    """WF-16: progress values are clamped to 0..100 in the event and the live write."""
    services = FakeServices()
    ctx = make_ctx(services=services)
    ctx.progress(given)
    assert ctx.progress_events[0]["progress"] == stored
    assert services.progress_calls[0][0] == stored


def test_progress_events_accumulate_in_order() -> None:
    """WF-16: every call appends one event, in call order."""
    ctx = make_ctx()
    for value in (10, 50, 90):
        ctx.progress(value, f"at {value}")
    assert [e["progress"] for e in ctx.progress_events] == [10.0, 50.0, 90.0]
    assert [e["message"] for e in ctx.progress_events] == ["at 10", "at 50", "at 90"]


# --- log, storage, cancellation (WF-17, WF-19, Part I item 15) ----------------------------------


@pytest.mark.parametrize("level", ["debug", "info", "warn", "error"])
def test_log_upper_cases_level_and_forwards_meta(level: str) -> None:
    """WF-17: log(level, message, **meta) writes through the services."""
    services = FakeServices()
    make_ctx(services=services).log(level, "hello", nested={"a": 1})
    assert services.logs == [(level.upper(), "hello", {"nested": {"a": 1}})]


def test_log_without_meta_passes_none() -> None:
    """WF-17: no metadata -> None, not an empty dict."""
    services = FakeServices()
    make_ctx(services=services).log("INFO", "plain")
    assert services.logs == [("INFO", "plain", None)]


def test_storage_and_is_cancelled_come_from_services() -> None:
    """WF-19, Part I item 15: storage and cancellation are answered by the services."""
    services = FakeServices()
    ctx = make_ctx(services=services)
    ctx.storage.save("k", {"v": 1})
    assert ctx.storage.load("k") == {"v": 1}
    assert ctx.is_cancelled() is False
    services.cancelled = True
    assert ctx.is_cancelled() is True


# --- annotate (AN-1..AN-5) ----------------------------------------------------------------------


def test_annotate_string_form() -> None:
    """AN-2, AN-4: annotate("ns.key", value, **opts) buffers one input with the options."""
    ctx = make_ctx()
    ctx.annotate(
        "review.score",
        0.9,
        actor={"kind": "model", "id": "m-1", "version": "2"},
        payload={"why": "good"},
        idempotency_key="once",
        emit_event=True,
    )
    assert ctx.annotations == [
        AnnotationInput(
            key="review.score",
            value=0.9,
            actor={"kind": "model", "id": "m-1", "version": "2"},
            payload={"why": "good"},
            idempotency_key="once",
            emit_event=True,
        )
    ]


def test_annotate_typed_key_form_uses_only_key() -> None:
    """AN-1: a typed key object contributes only its ``key``."""
    ctx = make_ctx()
    ctx.annotate(TypedKey("decision.outcome"), "approved")
    assert [(a.key, a.value, a.actor, a.emit_event) for a in ctx.annotations] == [
        ("decision.outcome", "approved", None, False)
    ]


def test_annotate_batch_form_shares_the_envelope() -> None:
    """AN-3: one row per attribute, all with the envelope's actor/payload/key/emit flag."""
    ctx = make_ctx()
    ctx.annotate(
        {
            "attributes": {"a.one": 1, "a.two": "two", "a.three": [3]},
            "actor": {"kind": "human", "id": "u-7"},
            "payload": {"note": "batch"},
            "idempotency_key": "batch-1",
            "emit_event": True,
        }
    )
    assert [(a.key, a.value) for a in ctx.annotations] == [
        ("a.one", 1),
        ("a.two", "two"),
        ("a.three", [3]),
    ]
    for item in ctx.annotations:
        assert item.actor == {"kind": "human", "id": "u-7"}
        assert item.payload == {"note": "batch"}
        assert item.idempotency_key == "batch-1"
        assert item.emit_event is True


def test_annotate_batch_form_without_attributes_adds_nothing() -> None:
    """AN-3: an absent (or empty) ``attributes`` yields no rows."""
    ctx = make_ctx()
    ctx.annotate({"actor": {"kind": "human"}})
    ctx.annotate({"attributes": {}})
    ctx.annotate({"attributes": None})
    assert ctx.annotations == []


def test_annotate_drops_none_values_in_every_form() -> None:
    """AN-5: None attributes are silently dropped (string, typed key and batch forms)."""
    ctx = make_ctx()
    ctx.annotate("x.none", None)
    ctx.annotate(TypedKey("y.none"), None)
    ctx.annotate({"attributes": {"z.none": None, "z.kept": 0, "z.false": False}})
    assert [(a.key, a.value) for a in ctx.annotations] == [("z.kept", 0), ("z.false", False)]


def test_annotate_buffers_across_calls_in_order() -> None:
    """AN-6: annotate returns nothing and only buffers; calls accumulate in order."""
    ctx = make_ctx()
    assert ctx.annotate("k.1", 1) is None
    ctx.annotate(TypedKey("k.2"), 2)
    ctx.annotate({"attributes": {"k.3": 3}})
    assert [a.key for a in ctx.annotations] == ["k.1", "k.2", "k.3"]


def test_annotate_rejects_a_non_key_target() -> None:
    """AN-1/AN-2: a target that is neither a string, a typed key nor an envelope is a TypeError."""
    with pytest.raises(TypeError, match="annotate"):
        make_ctx().annotate(42, "v")


def test_completion_context_buffers_annotations_too() -> None:
    """WF-20: the check_completion context has annotate, log and storage, and carries config."""
    services = FakeServices()
    ctx = CompletionContext(
        workflow_run_id="run-1",
        workflow_id="wf",
        stage_id="batch",
        stage_record_id="rec-2",
        generation=0,
        services=services,
        config={"threshold": 2},
    )
    ctx.annotate("batch.size", 10)
    ctx.log("info", "polled")
    assert [(a.key, a.value) for a in ctx.annotations] == [("batch.size", 10)]
    assert services.logs == [("INFO", "polled", None)]
    assert ctx.config == {"threshold": 2}
    assert not hasattr(ctx, "require")
