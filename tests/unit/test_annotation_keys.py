"""Annotation keys, typed keys, value validation and the conventions registry (SPEC §6.1, §6.7;
TEST-SCENARIOS F). No database.
"""

from __future__ import annotations

import math
import uuid
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any, Literal

import pytest
from pydantic import BaseModel

from django_workflows import StageContext
from django_workflows.annotations import (
    CONVENTION_KEY_PATTERN,
    LEGACY_METADATA_PREFIX,
    AnnotationError,
    AnnotationInput,
    TypedKey,
    annotate_inputs,
    build_inputs,
    inputs_from_envelope,
    typed_key,
    validate_key,
)
from django_workflows.conventions import (
    NAMESPACES,
    Approval,
    Decision,
    Revision,
    Trigger,
    published_keys,
)

# --- key format (write-side rules) ----------------------------------------------------------------


@pytest.mark.parametrize(
    "key",
    ["decision.outcome", "acme.ticket_id", "acme.review.score-v2", "a.b", "Acme.Ticket", "x_1.y"],
)
def test_validate_key_accepts_namespaced_keys(key: str) -> None:
    """§1.6 (dot-namespaced keys): ``ns.name[.more]`` of letters, digits, '_' and '-'."""
    assert validate_key(key) == key


@pytest.mark.parametrize(
    "key",
    [
        "ticket",  # no namespace
        "",
        ".leading",
        "trailing.",
        "double..dot",
        "has space.key",
        "acme.ticket id",
        "acme.tïcket",
        "acme.*",
        "-acme.key",
        "acme." + "k" * 200,  # longer than the column
    ],
)
def test_validate_key_rejects_malformed_keys_naming_the_field(key: str) -> None:
    """§1.6, key format rules enforced on write: the error is an AnnotationError (ValueError)
    whose ``field`` names where the key came from."""
    with pytest.raises(AnnotationError) as info:
        validate_key(key, field="attributes.x")
    assert info.value.field == "attributes.x"
    assert isinstance(info.value, ValueError)


def test_validate_key_rejects_a_non_string() -> None:
    """§1.6: a key is a string."""
    with pytest.raises(AnnotationError, match="must be a string"):
        validate_key(42)


# --- typed keys (AN-50) ---------------------------------------------------------------------------


def test_typed_key_minimal_is_experimental_without_description() -> None:
    """AN-50 (F :21): ``typed_key(key)`` -> stability "experimental", no description, any value."""
    key = typed_key("acme.note")
    assert (key.key, key.stability, key.description) == ("acme.note", "experimental", None)
    assert key.validate({"any": ["json", 1]}) == {"any": ["json", 1]}
    assert str(key) == "acme.note"


def test_typed_key_explicit_stability_and_description() -> None:
    """AN-50 (F :28, :38): the three stability levels and a description are kept."""
    for level in ("stable", "experimental", "deprecated"):
        key = typed_key("acme.level", str, stability=level, description="d")  # type: ignore[arg-type]
        assert key.stability == level
        assert key.description == "d"


def test_typed_key_rejects_unknown_stability_and_bad_key() -> None:
    """AN-50: stability is one of stable/experimental/deprecated; the key follows the rules."""
    with pytest.raises(AnnotationError, match="stability"):
        typed_key("acme.level", str, stability="beta")  # type: ignore[arg-type]
    with pytest.raises(AnnotationError, match="invalid annotation key"):
        typed_key("no_namespace", str)


@pytest.mark.parametrize(
    ("value_type", "good", "bad"),
    [
        (str, "x", 1),
        (int, 3, "3"),
        (int, 3, True),
        (float, 0.5, "0.5"),
        (bool, False, 0),
        (list[str], ["a"], ("a",)),
        (list[str], ["a"], ["a", 1]),
        (Literal["low", "high"], "low", "medium"),
    ],
)
def test_typed_key_validates_values_strictly(value_type: Any, good: Any, bad: Any) -> None:
    """Runtime value validation of typed keys: strict (no "3" -> 3, no 1 -> True, no tuple ->
    list); the error names the key and the expected type."""
    key = typed_key("acme.value", value_type)
    assert key.validate(good) == good
    with pytest.raises(AnnotationError) as info:
        key.validate(bad)
    assert "acme.value" in str(info.value)
    assert info.value.field == "acme.value"


def test_typed_key_stores_the_json_form() -> None:
    """A float key accepts an int (stored as float); a model value is stored as its JSON."""

    class Score(BaseModel):
        points: int
        at: datetime

    assert typed_key("acme.ratio", float).validate(1) == 1.0
    when = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
    stored = typed_key("acme.score", Score).validate(Score(points=3, at=when))
    assert stored == {"points": 3, "at": "2026-01-02T03:04:05Z"}


def test_typed_keys_hash_by_key_and_work_as_attribute_keys() -> None:
    """AN-1, AN-3: typed keys can be dict keys of ``attributes``; only ``key`` is stored."""
    inputs = build_inputs({Decision.outcome: "approve", Decision.confidence: 0.9})
    assert [(i.key, i.value) for i in inputs] == [
        ("decision.outcome", "approve"),
        ("decision.confidence", 0.9),
    ]
    assert typed_key("acme.x", str) == typed_key("acme.x", str)
    assert hash(typed_key("acme.x", str)) == hash(typed_key("acme.x", int))


# --- building inputs (AN-1..AN-5) ----------------------------------------------------------------


def test_build_inputs_type_checks_typed_keys_and_names_the_attribute() -> None:
    """Typed-key value validation in the batch form: the field is ``attributes.<key>`` with the
    envelope prefix; nothing is returned on error (all-or-nothing)."""
    with pytest.raises(AnnotationError) as info:
        build_inputs({"acme.ok": 1, Decision.confidence: "high"}, field_prefix="annotations[0].")
    assert info.value.field == "annotations[0].attributes.decision.confidence"
    assert "expected float" in str(info.value)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"actor": {"kind": "user", "name": "x"}}, "actor.name"),
        ({"actor": {"kind": 7}}, "actor.kind"),
        ({"actor": "alice"}, "actor"),
        ({"actor": {"id": "x" * 201}}, "actor.id"),
        ({"payload": {"obj": object()}}, "payload"),
        ({"idempotency_key": ""}, "idempotency_key"),
        ({"idempotency_key": 5}, "idempotency_key"),
        ({"emit_event": "yes"}, "emit_event"),
    ],
)
def test_build_inputs_rejects_a_malformed_envelope(kwargs: dict[str, Any], field: str) -> None:
    """AN-4: actor is {kind, id, version} strings, payload JSON, idempotency key a non-empty
    string, emit_event a bool; the error names the member."""
    with pytest.raises(AnnotationError) as info:
        build_inputs({"acme.k": 1}, **kwargs)
    assert info.value.field == field


@pytest.mark.parametrize("value", [object(), {1, 2}, math.nan, float("inf")])
def test_build_inputs_rejects_non_json_values(value: Any) -> None:
    """§1.6 (value is JSON): a value Django's encoder cannot write (or NaN) is an error naming
    the attribute, raised at the call instead of at commit time."""
    with pytest.raises(AnnotationError) as info:
        build_inputs({"acme.k": value})
    assert info.value.field == "attributes.acme.k"


def test_build_inputs_accepts_values_djangos_encoder_writes() -> None:
    """EC-43 (Part I item 13): datetimes, decimals and UUIDs are JSON through Django's encoder."""
    values = {
        "acme.when": datetime(2026, 1, 1, tzinfo=UTC),
        "acme.amount": Decimal("1.50"),
        "acme.ref": uuid.uuid4(),
    }
    assert len(build_inputs(values)) == 3


def test_envelope_rejects_unknown_members() -> None:
    """AN-3: a misspelt member (``idempotencyKey``) is an error, never silently ignored."""
    with pytest.raises(AnnotationError) as info:
        inputs_from_envelope({"attributes": {"acme.k": 1}, "idempotencyKey": "x"})
    assert info.value.field == "idempotencyKey"


def test_annotate_inputs_three_forms() -> None:
    """AN-1, AN-2, AN-3: typed key (value checked), string key, envelope."""
    assert annotate_inputs(Decision.rationale, "because") == [
        AnnotationInput("decision.rationale", "because")
    ]
    assert annotate_inputs("acme.k", 1, idempotency_key="i") == [
        AnnotationInput("acme.k", 1, idempotency_key="i")
    ]
    assert annotate_inputs({"attributes": {"acme.a": 1, "acme.b": None}}) == [
        AnnotationInput("acme.a", 1)
    ]
    with pytest.raises(AnnotationError, match=r"decision\.confidence"):
        annotate_inputs(Decision.confidence, "very")
    with pytest.raises(TypeError, match="annotate"):
        annotate_inputs(3.5, "v")


def _ctx() -> StageContext[Any, Any]:
    return StageContext(
        workflow_run_id="run-1",
        workflow_id="wf",
        stage_id="s",
        stage_record_id="rec",
        generation=0,
        services=None,  # type: ignore[arg-type]
    )


def test_ctx_annotate_rejects_a_bad_call_and_buffers_nothing_of_it() -> None:
    """AN-6 with validation: a failing annotate() raises at once and leaves the buffer as it
    was (earlier calls stay buffered, a partly valid batch adds nothing)."""
    ctx = _ctx()
    ctx.annotate("acme.first", 1)
    with pytest.raises(AnnotationError):
        ctx.annotate({"attributes": {"acme.ok": 1, "bad key": 2}})
    with pytest.raises(AnnotationError):
        ctx.annotate(Approval.approvers, "alice")  # always a list (AN-51)
    assert [a.key for a in ctx.annotations] == ["acme.first"]


# --- conventions (AN-51, AN-52; F) ----------------------------------------------------------------

DOCUMENTED = {
    ("Trigger", "source"): ("trigger.source", "stable"),
    ("Trigger", "parent_run_id"): ("trigger.parent_run_id", "stable"),
    ("Trigger", "reason"): ("trigger.reason", "stable"),
    ("Trigger", "actor_kind"): ("trigger.actor.kind", "stable"),
    ("Trigger", "actor_id"): ("trigger.actor.id", "stable"),
    ("Decision", "outcome"): ("decision.outcome", "stable"),
    ("Decision", "rationale"): ("decision.rationale", "stable"),
    ("Decision", "confidence"): ("decision.confidence", "stable"),
    ("Decision", "alternatives"): ("decision.alternatives", "stable"),
    ("Decision", "used_fallback"): ("decision.used_fallback", "experimental"),
    ("Approval", "approvers"): ("approval.approvers", "stable"),
    ("Approval", "timestamp"): ("approval.timestamp", "stable"),
    ("Approval", "policy_version"): ("approval.policy.version", "experimental"),
    ("Revision", "previous_run_id"): ("revision.previous_run_id", "stable"),
    ("Revision", "reason"): ("revision.reason", "stable"),
}


def test_conventions_publish_the_documented_keys_and_stability() -> None:
    """AN-51 (F :64, :72, :88, :96, :117, :131, :139, :144): exactly the documented key
    strings, each with its stability; every key has a description (F :80)."""
    found = {(ns, attr): (k.key, k.stability) for ns, attr, k in published_keys()}
    assert found == DOCUMENTED
    assert set(NAMESPACES) == {"Trigger", "Decision", "Approval", "Revision"}
    for _, _, key in published_keys():
        assert key.description


def test_conventions_keys_follow_the_format_and_never_clash() -> None:
    """AN-52 (F :211, :225, :237): every published key matches the lower-case dotted regex,
    none starts with ``legacy.metadata.``, no duplicates across namespaces."""
    keys = [k.key for _, _, k in published_keys()]
    for key in keys:
        assert CONVENTION_KEY_PATTERN.match(key), key
        assert not key.startswith(LEGACY_METADATA_PREFIX)
        validate_key(key)
    assert len(keys) == len(set(keys))


@pytest.mark.parametrize(
    ("key", "good", "bad"),
    [
        (Trigger.source, "zendesk", 7),
        (Trigger.parent_run_id, "3f1c", 12),
        (Decision.outcome, {"any": "json"}, object()),
        (Decision.rationale, "why", ["why"]),
        (Decision.confidence, 0.8, "0.8"),
        (Decision.alternatives, ["a", 2], "a"),
        (Decision.used_fallback, True, "true"),
        (Approval.approvers, ["alice", "bob"], "alice"),
        (Approval.timestamp, "2026-01-01T00:00:00+00:00", "yesterday"),
        (Approval.policy_version, "v3", 3),
        (Revision.previous_run_id, "3f1c", None.__class__),
        (Revision.reason, "typo", 1),
    ],
)
def test_conventions_value_types_are_enforced(key: TypedKey[Any], good: Any, bad: Any) -> None:
    """AN-51 value types (list of strings for approvers, number for confidence, ISO-8601 for
    the approval timestamp, ...) are validated at runtime when the typed key is used."""
    assert build_inputs({key: good})[0].value == good
    with pytest.raises(AnnotationError) as info:
        build_inputs({key: bad})
    assert info.value.field == f"attributes.{key.key}"


def test_conventions_convert_datetimes_and_uuids_to_text() -> None:
    """AN-51: ``approval.timestamp`` is ISO-8601 text (a datetime is converted); run ids are
    text (a UUID is converted)."""
    when = datetime(2026, 3, 4, 5, 6, 7, tzinfo=UTC)
    run_id = uuid.uuid4()
    inputs = build_inputs({Approval.timestamp: when, Trigger.parent_run_id: run_id})
    assert [i.value for i in inputs] == [when.isoformat(), str(run_id)]
