"""The workflow builder and the built workflow (SPEC §3.5-3.6, WF-31..37; Part I item 5).

Ports the ★ scenarios of TEST-SCENARIOS G (`T/01-workflow-building/`): execution-group and
stage numbering, dependency validation messages, build-time rejections and workflow queries.
No database.
"""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import BaseModel

from django_workflows import (
    NoInput,
    Stage,
    Workflow,
    WorkflowDefinitionError,
    define_stage,
    define_workflow,
)
from django_workflows.definition import StageNode, WorkflowBuilder


class Num(BaseModel):
    value: int


def mk(stage_id: str, *, deps: tuple[str, ...] = (), name: str | None = None) -> Stage:
    """A trivial sync stage."""
    return define_stage(id=stage_id, name=name, execute=lambda ctx: {"ok": True}, dependencies=deps)


def diamond() -> Workflow:
    """a -> [b | c] -> d (groups 1, 2, 2, 3)."""
    return (
        define_workflow(id="diamond", name="Diamond", input=Num, description="four stages")
        .pipe(mk("a"))
        .parallel([mk("b"), mk("c")])
        .pipe(mk("d"))
        .build()
    )


# --- execution groups and stage numbers (WF-31, WF-32) ------------------------------------------


def test_builder_pipe_places_each_stage_in_its_own_group() -> None:
    """WF-31: pipe() increments the 1-based group counter once per stage."""
    wf = define_workflow(id="seq").pipe(mk("one")).pipe(mk("two")).pipe(mk("three")).build()
    assert [(n.stage.id, n.execution_group) for n in wf.nodes] == [
        ("one", 1),
        ("two", 2),
        ("three", 3),
    ]
    assert wf.group_count == 3


def test_builder_parallel_places_all_stages_in_one_group_in_list_order() -> None:
    """WF-31: parallel() increments the counter once and keeps the list order."""
    wf = define_workflow(id="par").parallel([mk("z"), mk("a"), mk("m")]).build()
    assert wf.group_count == 1
    assert [n.stage.id for n in wf.stages_in_group(1)] == ["z", "a", "m"]
    assert {n.execution_group for n in wf.nodes} == {1}


def test_builder_mixed_groups_are_numbered_in_order() -> None:
    """WF-31: pipe, parallel, pipe -> groups 1, 2, 2, 3."""
    wf = diamond()
    assert [(n.stage.id, n.execution_group) for n in wf.nodes] == [
        ("a", 1),
        ("b", 2),
        ("c", 2),
        ("d", 3),
    ]
    assert [[n.stage.id for n in group] for group in wf.execution_plan] == [
        ["a"],
        ["b", "c"],
        ["d"],
    ]
    assert wf.describe_groups() == ["a", "[b | c]", "d"]


def test_builder_stage_numbers_follow_flat_definition_order() -> None:
    """WF-32: stage numbers are 1-based positions in the flat order, independent of groups."""
    wf = (
        define_workflow(id="numbers")
        .parallel([mk("p1"), mk("p2"), mk("p3")])
        .pipe(mk("s"))
        .parallel([mk("q1"), mk("q2")])
        .build()
    )
    assert [(n.stage.id, n.stage_number, n.execution_group) for n in wf.nodes] == [
        ("p1", 1, 1),
        ("p2", 2, 1),
        ("p3", 3, 1),
        ("s", 4, 2),
        ("q1", 5, 3),
        ("q2", 6, 3),
    ]


def test_builder_consecutive_parallel_groups_are_distinct() -> None:
    """WF-31: two parallel() calls in a row make two groups."""
    wf = define_workflow(id="two-par").parallel([mk("a"), mk("b")]).parallel([mk("c")]).build()
    assert [n.stage.id for n in wf.stages_in_group(1)] == ["a", "b"]
    assert [n.stage.id for n in wf.stages_in_group(2)] == ["c"]


def test_builder_build_keeps_workflow_metadata() -> None:
    """WF-30, WF-37: id, name, description and input model are carried to the workflow."""
    wf = diamond()
    assert (wf.id, wf.name, wf.description, wf.input_model) == (
        "diamond",
        "Diamond",
        "four stages",
        Num,
    )
    unnamed = define_workflow(id="unnamed").pipe(mk("a")).build()
    assert unnamed.name == "unnamed"
    assert unnamed.input_model is NoInput


def test_builder_later_changes_do_not_alter_a_built_workflow() -> None:
    """WF-34: build() returns an immutable workflow; the builder can go on independently."""
    builder = define_workflow(id="grow").pipe(mk("a"))
    first = builder.build()
    builder.pipe(mk("b"))
    assert first.stage_ids == ("a",)
    assert builder.build().stage_ids == ("a", "b")


def test_define_workflow_returns_a_builder() -> None:
    """WF-30: define_workflow() is the builder entry point."""
    assert isinstance(define_workflow(id="x"), WorkflowBuilder)


# --- dependency validation (WF-33) --------------------------------------------------------------


def test_builder_rejects_dependency_on_unknown_stage_with_none_listed() -> None:
    """WF-33: missing dependency of the first stage; "(none)" when no stage came before."""
    with pytest.raises(WorkflowDefinitionError) as info:
        define_workflow(id="deps").pipe(mk("first", deps=("ghost",)))
    message = str(info.value)
    assert "missing dependencies" in message
    assert "'first'" in message
    assert "ghost" in message
    assert "(none)" in message
    assert "(in parallel group)" not in message


def test_builder_rejects_forward_dependency_and_lists_current_ids() -> None:
    """WF-33: a dependency on a stage added later is missing at pipe() time."""
    builder = define_workflow(id="deps").pipe(mk("a")).pipe(mk("b"))
    with pytest.raises(WorkflowDefinitionError) as info:
        builder.pipe(mk("c", deps=("a", "d")))
    message = str(info.value)
    assert "missing dependencies" in message
    assert ": d." in message  # only the missing id is listed as missing
    assert "a, b" in message  # the ids defined so far
    assert "(none)" not in message


def test_builder_accepts_dependencies_on_earlier_stages() -> None:
    """WF-33: dependencies on stages added before (any earlier group) are fine."""
    wf = (
        define_workflow(id="ok-deps")
        .pipe(mk("a"))
        .parallel([mk("b", deps=("a",)), mk("c", deps=("a",))])
        .pipe(mk("d", deps=("a", "b", "c")))
        .build()
    )
    assert wf.get_stage("d").dependencies == ("a", "b", "c")  # type: ignore[union-attr]


def test_builder_rejects_sibling_dependency_in_parallel_group() -> None:
    """WF-33: siblings of one parallel group cannot depend on each other."""
    with pytest.raises(WorkflowDefinitionError) as info:
        define_workflow(id="sib").pipe(mk("a")).parallel([mk("b"), mk("c", deps=("b",))])
    message = str(info.value)
    assert "missing dependencies" in message
    assert "(in parallel group)" in message
    assert "'c'" in message
    assert ": b." in message
    assert "Stages defined before it: a" in message


def test_builder_parallel_dependency_message_says_none_when_first() -> None:
    """WF-33: parallel variant with nothing defined before -> "(in parallel group)", "(none)"."""
    with pytest.raises(WorkflowDefinitionError) as info:
        define_workflow(id="sib").parallel([mk("x", deps=("y",)), mk("y")])
    message = str(info.value)
    assert "(in parallel group)" in message
    assert "(none)" in message


def test_builder_failed_dependency_check_adds_nothing() -> None:
    """WF-33: a rejected pipe()/parallel() leaves the builder as it was."""
    builder = define_workflow(id="atomic").pipe(mk("a"))
    with pytest.raises(WorkflowDefinitionError):
        builder.parallel([mk("b"), mk("c", deps=("zzz",))])
    assert builder.build().stage_ids == ("a",)


# --- build-time rejections (Part I item 5, EC-31, EC-32, WF-35) ---------------------------------


def test_builder_rejects_duplicate_id_across_groups() -> None:
    """Part I item 5 / EC-32: a repeated stage id raises, naming the id."""
    builder = define_workflow(id="dupes").pipe(mk("same")).pipe(mk("other"))
    with pytest.raises(WorkflowDefinitionError, match=r"duplicate stage ids same\b"):
        builder.pipe(mk("same"))


def test_builder_rejects_duplicate_id_inside_parallel_group() -> None:
    """Part I item 5 / EC-32: duplicates within one parallel group are rejected too."""
    with pytest.raises(WorkflowDefinitionError) as info:
        define_workflow(id="dupes").parallel([mk("a"), mk("b"), mk("a")])
    assert "duplicate stage ids a" in str(info.value)
    assert "'dupes'" in str(info.value)


def test_builder_rejects_parallel_stage_reusing_earlier_id() -> None:
    """Part I item 5 / EC-32: a parallel member may not reuse an id of an earlier group."""
    with pytest.raises(WorkflowDefinitionError, match="duplicate stage ids x"):
        define_workflow(id="dupes").pipe(mk("x")).parallel([mk("y"), mk("x")])


def test_builder_rejects_empty_parallel_group() -> None:
    """Part I item 5 / EC-31(b): parallel([]) raises, naming the workflow and the position."""
    with pytest.raises(WorkflowDefinitionError) as info:
        define_workflow(id="empty-par").pipe(mk("a")).parallel([])
    message = str(info.value)
    assert "'empty-par'" in message
    assert "empty group after a" in message


def test_builder_rejects_empty_parallel_group_from_generator() -> None:
    """Part I item 5: an empty iterable (not only a list) is an empty group."""
    with pytest.raises(WorkflowDefinitionError, match="empty group after the start"):
        define_workflow(id="gen").parallel(s for s in [])


def test_builder_rejects_empty_workflow() -> None:
    """Part I item 5 / WF-35: build() without stages raises, naming the workflow id."""
    with pytest.raises(WorkflowDefinitionError, match="'nothing' has no stages"):
        define_workflow(id="nothing").build()


@pytest.mark.parametrize(
    "bad_id", ["", "Upper", "has space", "-leading-dash", "dots.not.ok", "a" * 101, "ümlaut"]
)
def test_define_stage_rejects_malformed_id(bad_id: str) -> None:
    """Part I item 5 / WF-35: stage ids are 1-100 lower-case letters, digits, '-' or '_'."""
    with pytest.raises(WorkflowDefinitionError) as info:
        mk(bad_id)
    assert f"Invalid stage id {bad_id!r}" in str(info.value)


@pytest.mark.parametrize("bad_id", ["", "My Workflow", "UPPER", "x/y"])
def test_define_workflow_rejects_malformed_id(bad_id: str) -> None:
    """Part I item 5: workflow ids follow the same rule and the message names the id."""
    with pytest.raises(WorkflowDefinitionError) as info:
        define_workflow(id=bad_id)
    assert f"Invalid workflow id {bad_id!r}" in str(info.value)


@pytest.mark.parametrize("good_id", ["a", "0", "stage-1", "snake_case", "a" * 100])
def test_define_stage_accepts_well_formed_ids(good_id: str) -> None:
    """Part I item 5: the boundaries of the id rule are accepted."""
    assert mk(good_id).id == good_id


def test_builder_rejects_non_stage_objects() -> None:
    """Part I item 5: pipe()/parallel() only take Stage objects; the message names the value."""
    with pytest.raises(WorkflowDefinitionError, match="expected a Stage"):
        define_workflow(id="w").pipe("not-a-stage")  # type: ignore[arg-type]
    with pytest.raises(WorkflowDefinitionError, match="expected a Stage"):
        define_workflow(id="w").parallel([mk("a"), lambda ctx: None])  # type: ignore[list-item]


def test_define_workflow_rejects_non_model_input() -> None:
    """WF-30: the workflow input must be a pydantic model class."""
    with pytest.raises(WorkflowDefinitionError, match="input must be a pydantic BaseModel"):
        define_workflow(id="w", input=dict)  # type: ignore[arg-type]


# --- workflow queries (WF-37) -------------------------------------------------------------------


def test_workflow_stage_ids_and_stages_in_definition_order() -> None:
    """WF-37: stage_ids / stages / nodes list every stage (parallel ones included) in order."""
    wf = diamond()
    assert wf.stage_ids == ("a", "b", "c", "d")
    assert [s.id for s in wf.stages] == ["a", "b", "c", "d"]
    assert all(isinstance(n, StageNode) for n in wf.nodes)


def test_workflow_get_stage_and_has_stage() -> None:
    """WF-37: get_stage returns the stage or None; has_stage answers membership."""
    b = mk("b")
    wf = define_workflow(id="q").pipe(mk("a")).parallel([b, mk("c")]).build()
    assert wf.get_stage("b") is b
    assert wf.get_stage("missing") is None
    assert wf.has_stage("c")
    assert not wf.has_stage("missing")


def test_workflow_node_returns_group_and_number() -> None:
    """WF-37: node(id) gives the stage with its execution group and stage number."""
    node = diamond().node("c")
    assert (node.stage.id, node.execution_group, node.stage_number) == ("c", 2, 3)


def test_workflow_node_of_unknown_id_names_the_valid_ids() -> None:
    """WF-37: an unknown id raises KeyError naming the workflow and the valid ids."""
    with pytest.raises(KeyError) as info:
        diamond().node("nope")
    message = str(info.value)
    assert "'nope'" in message
    assert "'diamond'" in message
    assert "a, b, c, d" in message


@pytest.mark.parametrize(
    ("group", "expected"), [(1, ["a"]), (2, ["b", "c"]), (3, ["d"]), (0, []), (4, []), (-1, [])]
)
def test_workflow_stages_in_group(group: int, expected: list[str]) -> None:
    """WF-37: stages of a 1-based group; empty when the group does not exist."""
    assert [n.stage.id for n in diamond().stages_in_group(group)] == expected


def test_workflow_repr_shows_the_execution_plan() -> None:
    """WF-37 (getExecutionOrder): a readable text of the groups."""
    assert repr(diamond()) == "<Workflow diamond: a -> [b | c] -> d>"


def test_workflow_parse_input_uses_input_model() -> None:
    """K-CR-2: the workflow input is validated with its input model; errors carry the path."""
    wf = diamond()
    assert wf.parse_input({"value": 3}) == Num(value=3)
    assert wf.input_errors({"value": 3}) is None
    error: Any = wf.input_errors({"value": "x"})
    assert error.startswith("value: ")
    assert wf.input_errors({}) == "value: Field required"
