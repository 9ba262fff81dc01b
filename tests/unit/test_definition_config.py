"""Stage configuration: default extraction, merging and validation (SPEC §3.8, WF-42..44).

Ports the ★ scenarios of TEST-SCENARIOS G (`T/04-configuration/config-defaults.test.ts`,
`config-validation.test.ts`, `T/01-workflow-building/workflow-validation.test.ts:132..308`).
No database.
"""

from __future__ import annotations

import itertools
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from django_workflows import Workflow, define_stage, define_workflow
from django_workflows.definition import Stage


def mk(stage_id: str, config: type[BaseModel] | None = None) -> Stage:
    return define_stage(id=stage_id, execute=lambda ctx: None, config=config)


class Multiply(BaseModel):
    multiplier: int = 2
    addend: int = 0


class Partial(BaseModel):
    required: str
    optional_with_default: int | None = 5
    flag: bool = False


class Inner(BaseModel):
    x: int = 1
    y: str = "inner"


class Nested(BaseModel):
    no_default: Inner
    with_default: Inner = Inner(x=7)
    with_factory: Inner = Field(default_factory=Inner)


class Ranged(BaseModel):
    count: int = Field(ge=1, le=10)
    mode: Literal["fast", "slow"] = "fast"
    tags: list[int] = Field(default_factory=list)
    inner: Inner = Inner()


# --- default extraction (WF-43) -----------------------------------------------------------------


def test_default_config_collects_defaults_per_stage() -> None:
    """WF-43: {stage_id: defaults} for every stage."""
    wf = define_workflow(id="d").pipe(mk("calc", Multiply)).pipe(mk("plain")).build()
    assert wf.default_config() == {"calc": {"multiplier": 2, "addend": 0}, "plain": {}}


def test_default_config_is_empty_for_stage_without_config() -> None:
    """WF-43: a stage without a config model contributes {}."""
    assert mk("none").default_config == {}


def test_default_config_omits_fields_without_default() -> None:
    """WF-43: partial schemas contribute only the fields that declare a default."""
    assert mk("p", Partial).default_config == {"optional_with_default": 5, "flag": False}


def test_default_config_evaluates_default_factories() -> None:
    """WF-43: function defaults are evaluated (at definition time)."""
    counter = itertools.count(41)

    class Factory(BaseModel):
        items: list[str] = Field(default_factory=lambda: ["a", "b"])
        number: int = Field(default_factory=lambda: next(counter))

    stage = mk("f", Factory)
    assert stage.default_config == {"items": ["a", "b"], "number": 41}
    # the copy handed out is not shared state
    stage.default_config["items"] = "changed"
    assert stage.default_config["items"] == ["a", "b"]


def test_default_config_nested_model_default_comes_from_the_field() -> None:
    """WF-43: a nested object contributes only if the field itself has a default, taken as-is
    (the nested model's own field defaults do not make the field default).
    """
    defaults = mk("n", Nested).default_config
    assert "no_default" not in defaults
    assert defaults["with_default"] == {"x": 7, "y": "inner"}
    assert defaults["with_factory"] == {"x": 1, "y": "inner"}


def test_default_config_uses_field_aliases() -> None:
    """WF-43: defaults are keyed as the config map is written (aliases apply)."""

    class Aliased(BaseModel):
        max_items: int = Field(default=3, alias="maxItems")

    assert mk("a", Aliased).default_config == {"maxItems": 3}


def test_default_config_skips_unrepresentable_defaults_without_raising() -> None:
    """WF-43: a default that cannot be represented as JSON yields nothing instead of raising."""

    class Opaque(BaseModel):
        model_config = ConfigDict(arbitrary_types_allowed=True)
        handle: object = object()
        size: int = 4

    assert mk("o", Opaque).default_config == {"size": 4}


def test_merge_config_is_shallow() -> None:
    """WF-44: a caller entry replaces the stage's default object entirely."""
    wf = define_workflow(id="m").pipe(mk("calc", Multiply)).pipe(mk("other", Partial)).build()
    merged = wf.merge_config({"calc": {"addend": 10}})
    assert merged["calc"] == {"addend": 10}
    assert merged["other"] == {"optional_with_default": 5, "flag": False}
    assert wf.merge_config(None) == wf.default_config()


def test_parse_config_reapplies_defaults_omitted_by_caller() -> None:
    """WF-12, WF-44: parsing a caller slice fills in the defaults it left out."""
    parsed = mk("calc", Multiply).parse_config({"addend": 10})
    assert parsed.model_dump() == {"multiplier": 2, "addend": 10}
    assert mk("calc", Multiply).parse_config(None).model_dump() == {"multiplier": 2, "addend": 0}


# --- validation (WF-42) -------------------------------------------------------------------------


def validation_workflow() -> Workflow:
    return (
        define_workflow(id="v")
        .pipe(mk("calc", Multiply))
        .parallel([mk("needs", Partial), mk("ranged", Ranged)])
        .pipe(mk("free"))
        .build()
    )


def test_validate_config_accepts_defaults_only() -> None:
    """WF-42: a map of defaults validates when every required field has a default."""
    wf = define_workflow(id="ok").pipe(mk("calc", Multiply)).pipe(mk("free")).build()
    assert wf.validate_config(wf.default_config()) == []
    assert wf.validate_config({}) == []


def test_validate_config_collects_errors_of_every_stage() -> None:
    """WF-42: all failing stages are reported, identified by stage id, in definition order."""
    errors = validation_workflow().validate_config({"calc": {"multiplier": "lots"}})
    assert [stage_id for stage_id, _ in errors] == ["calc", "needs", "ranged"]
    assert all(msg.startswith("Config validation failed: ") for _, msg in errors)


def test_validate_config_messages_name_field_paths() -> None:
    """WF-42: each issue is `path: message`; several issues of one stage are joined by "; "."""
    errors = dict(
        validation_workflow().validate_config(
            {
                "calc": {"multiplier": 2},
                "needs": {"required": "yes"},
                "ranged": {
                    "count": 11,
                    "mode": "medium",
                    "tags": [1, "two"],
                    "inner": {"x": "not-int"},
                },
            }
        )
    )
    assert set(errors) == {"ranged"}
    issues = errors["ranged"].removeprefix("Config validation failed: ").split("; ")
    assert [issue.split(": ", 1)[0] for issue in issues] == ["count", "mode", "tags.1", "inner.x"]
    assert "less than or equal to 10" in issues[0]
    assert "'fast' or 'slow'" in issues[1]


def test_validate_config_reports_missing_required_field() -> None:
    """WF-42: an absent slice is validated as {} and a required field is reported."""
    errors = dict(validation_workflow().validate_config({"ranged": {"count": 3}}))
    assert errors == {"needs": "Config validation failed: required: Field required"}


def test_validate_config_treats_falsy_slice_as_empty() -> None:
    """WF-42: a None slice is parsed as {} (defaults apply, required fields still required)."""
    wf = define_workflow(id="f").pipe(mk("calc", Multiply)).pipe(mk("needs", Partial)).build()
    assert wf.validate_config({"calc": None, "needs": {"required": "x"}}) == []
    assert [sid for sid, _ in wf.validate_config({"needs": None})] == ["needs"]


def test_stage_validate_config_returns_none_when_valid() -> None:
    """WF-42: per-stage validation returns None or the error text."""
    stage = mk("r", Ranged)
    assert stage.validate_config({"count": 1}) is None
    assert stage.validate_config({"count": 0}) == (
        "count: Input should be greater than or equal to 1"
    )


def test_validate_config_rejects_unknown_keys_unless_model_allows_extra() -> None:
    """A typo in a config key is an error naming the key and the known keys."""
    from pydantic import BaseModel, ConfigDict

    from django_workflows import define_stage

    class Strict(BaseModel):
        top_words: int = 15

    class Open(BaseModel):
        model_config = ConfigDict(extra="allow")
        top_words: int = 15

    strict = define_stage(id="strict", execute=lambda ctx: {}, config=Strict)
    assert strict.validate_config({"top_wrods": 3}) == (
        "unknown config keys top_wrods; known keys: top_words"
    )
    assert strict.validate_config({"top_words": 3}) is None
    loose = define_stage(id="open", execute=lambda ctx: {}, config=Open)
    assert loose.validate_config({"anything": 1}) is None
    none = define_stage(id="none", execute=lambda ctx: {})
    assert none.validate_config({"zzz": 1}) == "unknown config keys zzz; known keys: (none)"
