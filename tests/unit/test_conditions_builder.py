"""Builder validation of conditional stages and branches (issue 18 items 1 and 2)."""

from __future__ import annotations

import pytest
from pydantic import BaseModel

from django_workflows import (
    Condition,
    StageContext,
    WorkflowDefinitionError,
    define_stage,
    define_workflow,
    parallel_input,
    stage,
)


class Out(BaseModel):
    n: int


def _s(sid: str, **kw) -> object:
    return define_stage(id=sid, execute=lambda ctx: Out(n=1), output=Out, **kw)


def over_ten(ctx) -> bool:
    """total over ten"""
    return True


def test_plain_workflow_keeps_its_structure_and_fingerprint_shape() -> None:
    wf = define_workflow(id="plain").pipe(_s("a")).parallel([_s("b"), _s("c")]).build()
    assert not wf.has_conditions
    for group in wf.structure()["groups"]:
        for item in group:
            assert "when" not in item and "branch" not in item
    for group in wf.fingerprint_material()["groups"]:
        for item in group:
            assert "when" not in item and "branch" not in item


def test_when_is_stored_in_structure_and_changes_fingerprint() -> None:
    plain = define_workflow(id="w").pipe(_s("a")).pipe(_s("b")).build()
    cond = define_workflow(id="w").pipe(_s("a")).pipe(_s("b"), when=over_ten).build()
    assert cond.has_conditions
    assert cond.structure()["groups"][1][0]["when"] == {
        "predicate": "over_ten",
        "reason": "total over ten",
    }
    assert cond.version != plain.version
    # the reason text is documentation: not in the fingerprint
    again = (
        define_workflow(id="w")
        .pipe(_s("a"))
        .pipe(_s("b"), when=Condition(over_ten, reason="other words"))
        .build()
    )
    assert again.version == cond.version


def test_reason_defaults() -> None:
    assert Condition(over_ten).skip_reason() == "condition not met: total over ten"
    assert Condition(lambda c: True).description.endswith("<lambda> is true")
    assert Condition(lambda c: True, reason="big").skip_reason() == "condition not met: big"


def test_stage_level_when() -> None:
    @stage(id="maybe", when=over_ten)
    def maybe(ctx: StageContext[Out]) -> Out:
        return ctx.input

    wf = define_workflow(id="w", input=Out).pipe(maybe).build()
    assert wf.node("maybe").when is not None and wf.node("maybe").when.name == "over_ten"


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda b: b.pipe(_s("a"), when=3), "pipe('a') when"),
        (lambda b: b.parallel([_s("a")], when="x"), "parallel() when"),
        (lambda b: b.pipe(_s("a"), when=Condition(over_ten, reason="x" * 201)), "reason"),
        (lambda b: b.branch(3, {"x": [_s("a")]}), "choose must be callable"),
        (lambda b: b.branch(over_ten, {}), "branches must be a non-empty mapping"),
        (lambda b: b.branch(over_ten, {"x": []}), "branches['x'] must be a non-empty list"),
        (lambda b: b.branch(over_ten, {"x": _s("a")}), "branches['x'] must be a non-empty"),
        (lambda b: b.branch(over_ten, {"bad name": [_s("a")]}), "branches:"),
        (lambda b: b.branch(over_ten, {"x": [_s("a")]}, id="no way"), "id:"),
        (lambda b: b.branch(over_ten, {"x": [_s("a")], "y": [_s("a")]}), "more than one place"),
        (lambda b: b.branch(over_ten, {"x": [[]]}), "empty group"),
        (lambda b: b.branch(over_ten, {"x": ["nope"]}), "in branches['x']"),
        (
            lambda b: b.pipe(_s("a")).branch(over_ten, {"x": [_s("b")], "y": [_s("a")]}),
            "duplicate stage ids a",
        ),
        (
            lambda b: b.branch(over_ten, {"x": [_s("b")], "y": [_s("c", dependencies=["b"])]}),
            "'c' has missing dependencies",
        ),
    ],
)
def test_definition_errors_name_the_field(build, message) -> None:
    with pytest.raises(WorkflowDefinitionError) as err:
        build(define_workflow(id="w")).build()
    assert message in str(err.value)


def test_stage_when_must_be_callable() -> None:
    with pytest.raises(WorkflowDefinitionError, match="Stage 'a': when must be a callable"):
        _s("a", when=5)


def test_duplicate_branch_block_id() -> None:
    b = define_workflow(id="w").branch(over_ten, {"x": [_s("a")]}, id="route")
    with pytest.raises(WorkflowDefinitionError, match="duplicate branch block id 'route'"):
        b.branch(over_ten, {"y": [_s("b")]}, id="route")


def test_failed_branch_leaves_builder_unchanged() -> None:
    b = define_workflow(id="w").pipe(_s("a"))
    with pytest.raises(WorkflowDefinitionError):
        b.branch(over_ten, {"x": [_s("b")], "y": [_s("c", dependencies=["b"])]})
    wf = b.pipe(_s("b")).build()  # nothing half-written: "b" is still free
    assert wf.stage_ids == ("a", "b")


def test_branch_structure_and_groups() -> None:
    wf = (
        define_workflow(id="w")
        .pipe(_s("a"))
        .branch(over_ten, {"small": [_s("b"), [_s("c"), _s("d")]], "large": [_s("e")]}, id="size")
        .pipe(_s("f"))
        .build()
    )
    assert wf.describe_groups() == ["a", "b", "[c | d]", "e", "f"]
    spot = wf.structure()["groups"][2][1]["branch"]
    assert spot == {
        "id": "size",
        "chooser": "over_ten",
        "branches": ["small", "large"],
        "name": "small",
    }
    assert wf.node("e").branch.name == "large" and wf.node("f").branch is None


def test_parallel_input_after_conditional_stage_must_be_optional() -> None:
    a, b = _s("a"), _s("b")
    strict = parallel_input(a, b)
    after = define_stage(id="after", execute=lambda c: None, input=strict)
    define_workflow(id="w1").parallel([a, b]).pipe(after).build()  # no condition: fine
    with pytest.raises(WorkflowDefinitionError, match=r"'after'.*field for 'a'.*optional=\['a'\]"):
        define_workflow(id="w3").parallel([a, b], when=over_ten).pipe(after)
    # parallel() when= applies to both stages: both must be optional
    loose = parallel_input(a, b, optional=["a", "b"])
    ok = define_stage(id="after", execute=lambda c: None, input=loose)
    wf = define_workflow(id="w4").parallel([a, b], when=over_ten).pipe(ok).build()
    assert loose.model_validate({"a": None, "b": {"n": 1}}).a is None
    assert wf.group_count == 2
    with pytest.raises(WorkflowDefinitionError, match="optional names z"):
        parallel_input(a, b, optional=["z"])


def test_stage_level_when_makes_parallel_input_field_optional() -> None:
    a = _s("a", when=over_ten)
    b = _s("b")
    model = parallel_input(a, b)
    assert not model.model_fields["a"].is_required() and model.model_fields["b"].is_required()


def test_parallel_input_right_after_branch_block_is_refused() -> None:
    a, b = _s("a"), _s("b")
    after = define_stage(id="after", execute=lambda c: None, input=parallel_input(a, b))
    with pytest.raises(WorkflowDefinitionError, match="follows a branch block"):
        define_workflow(id="w").branch(over_ten, {"x": [[a, b]]}).pipe(after)


def test_output_schema_is_any_when_last_group_may_be_skipped() -> None:
    plain = define_workflow(id="w").pipe(_s("a")).build()
    assert plain.output_schema["title"] == "Out"
    cond = define_workflow(id="w").pipe(_s("a")).pipe(_s("b"), when=over_ten).build()
    assert cond.output_schema == {}


def test_async_batch_stage_takes_when() -> None:
    from django_workflows import define_async_batch_stage

    batch = define_async_batch_stage(
        id="batch",
        execute=lambda ctx: None,
        check_completion=lambda state, ctx: None,
        when=over_ten,
    )
    wf = define_workflow(id="w").pipe(batch).build()
    assert wf.node("batch").when.name == "over_ten"
