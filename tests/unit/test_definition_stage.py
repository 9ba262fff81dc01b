"""Stage definitions, the registry and suspension normalisation (SPEC §3.1-3.2, WF-1..8, K-1).

Ports the ★ scenarios of TEST-SCENARIOS G (`T/02-stage-definition/sync-stages.test.ts`,
`async-batch-stages.test.ts`) that apply to the Python API. No database.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from pydantic import BaseModel, ValidationError

from django_workflows import (
    CompletionCheck,
    NoConfig,
    NoInput,
    Stage,
    StageResult,
    Suspend,
    WorkflowDefinitionError,
    define_async_batch_stage,
    define_stage,
    define_workflow,
    stage,
)
from django_workflows.definition import UNSET, WorkflowRegistry
from django_workflows.kernel.executor import normalise_suspend

NOW = datetime(2025, 1, 1, 12, 0, tzinfo=UTC)


class Text(BaseModel):
    text: str


class Count(BaseModel):
    count: int


def noop(ctx: Any) -> None:
    return None


def check(state: dict[str, Any], ctx: Any) -> CompletionCheck:
    return CompletionCheck.done()


# --- sync stages (WF-5..7) ----------------------------------------------------------------------


def test_define_stage_fields_and_sync_mode() -> None:
    """WF-5, WF-7: id, name, description, models, dependencies, estimate_cost; mode "sync"."""

    def cost(inp: Any, cfg: Any) -> float:
        return 1.5

    st = define_stage(
        id="count-words",
        name="Count words",
        description="Counts words",
        execute=noop,
        input=Text,
        output=Count,
        dependencies=["earlier"],
        estimate_cost=cost,
    )
    assert (st.id, st.name, st.description) == ("count-words", "Count words", "Counts words")
    assert (st.input_model, st.output_model, st.config_model) == (Text, Count, NoConfig)
    assert st.dependencies == ("earlier",)
    assert st.mode == "sync"
    assert st.check_completion is None
    assert st.estimate_cost is cost
    assert st.execute is noop


def test_define_stage_defaults() -> None:
    """WF-5, WF-6: name defaults to the id; no input model means NoInput; no output model."""
    st = define_stage(id="bare", execute=noop)
    assert st.name == "bare"
    assert st.input_model is NoInput
    assert st.output_model is None
    assert st.dependencies == ()
    assert st.estimate_cost is None


def test_stage_decorator_wraps_the_function() -> None:
    """WF-5: @stage makes the function the stage's execute; description from the docstring."""

    @stage(id="shout", input=Text, output=Text)
    def shout(ctx: Any) -> Text:
        """Upper-cases the text.

        More detail that is not part of the description.
        """
        return Text(text=ctx.input.text.upper())

    assert isinstance(shout, Stage)
    assert shout.id == "shout"
    assert shout.description == "Upper-cases the text."
    ctx = type("Ctx", (), {"input": Text(text="hi")})()
    assert shout.execute(ctx) == Text(text="HI")


def test_define_stage_rejects_non_callable_execute() -> None:
    """WF-5: execute must be callable; the message names the stage."""
    with pytest.raises(WorkflowDefinitionError, match="'broken': execute must be callable"):
        define_stage(id="broken", execute="nope")  # type: ignore[arg-type]


@pytest.mark.parametrize("field", ["input", "output", "config"])
def test_define_stage_rejects_non_model_schemas(field: str) -> None:
    """WF-5: input, output and config must be pydantic model classes."""
    with pytest.raises(WorkflowDefinitionError, match=f"'bad': {field}_model must be"):
        define_stage(id="bad", execute=noop, **{field: dict})


def test_no_input_accepts_any_object_and_yields_empty() -> None:
    """WF-6: the no-input model accepts any object and strips its keys."""
    st = define_stage(id="no-input", execute=noop)
    parsed = st.parse_input({"anything": 1, "nested": {"a": [1, 2]}})
    assert isinstance(parsed, NoInput)
    assert parsed.model_dump() == {}
    assert st.parse_input({}).model_dump() == {}


@pytest.mark.parametrize("value", [5, "text", [1, 2], None, 1.5, True])
def test_no_input_rejects_non_objects(value: Any) -> None:
    """WF-6: the no-input model still rejects non-objects."""
    with pytest.raises(ValidationError):
        define_stage(id="no-input", execute=noop).parse_input(value)


def test_stage_parse_input_validates_with_input_model() -> None:
    """WF-11: the input model validates the stage input."""
    st = define_stage(id="typed", execute=noop, input=Text)
    assert st.parse_input({"text": "a"}) == Text(text="a")
    with pytest.raises(ValidationError):
        st.parse_input({"text": 1})


def test_stage_parse_output_validates_and_returns_json() -> None:
    """Part I item 6: outputs are validated with the output model and stored as JSON."""
    st = define_stage(id="typed", execute=noop, output=Count)
    assert st.parse_output(Count(count=3)) == {"count": 3}
    assert st.parse_output({"count": "4"}) == {"count": 4}
    with pytest.raises(ValidationError):
        st.parse_output({"count": "many"})
    untyped = define_stage(id="untyped", execute=noop)
    assert untyped.parse_output(Count(count=1)) == {"count": 1}
    assert untyped.parse_output([1, "a"]) == [1, "a"]


def test_stage_load_output_returns_the_output_model() -> None:
    """WF-14: stored outputs come back as the producer's output model (raw when invalid)."""
    st = define_stage(id="typed", execute=noop, output=Count)
    assert st.load_output({"count": 2}) == Count(count=2)
    assert st.load_output({"other": 1}) == {"other": 1}
    assert st.load_output(None) is None


# --- async-batch stages (WF-5, WF-7) ------------------------------------------------------------


def test_define_async_batch_stage_mode_and_check_completion() -> None:
    """WF-7: mode "async-batch" with check_completion attached; dependencies copied."""
    st = define_async_batch_stage(
        id="batch", execute=noop, check_completion=check, dependencies=("prep", "data")
    )
    assert st.mode == "async-batch"
    assert st.check_completion is check
    assert st.dependencies == ("prep", "data")


def test_async_batch_stage_requires_check_completion() -> None:
    """WF-7: an async-batch stage without a callable check_completion is rejected."""
    with pytest.raises(WorkflowDefinitionError, match="'batch' needs a callable check_completion"):
        define_async_batch_stage(id="batch", execute=noop, check_completion=None)  # type: ignore[arg-type]
    with pytest.raises(WorkflowDefinitionError, match="check_completion"):
        Stage(id="batch", name="b", execute=noop, mode="async-batch")


def test_sync_stage_rejects_check_completion() -> None:
    """WF-7: check_completion belongs to async-batch stages only."""
    with pytest.raises(WorkflowDefinitionError, match="only for async-batch stages"):
        Stage(id="sync", name="s", execute=noop, check_completion=check)


def test_async_stage_in_workflow_keeps_its_mode() -> None:
    """WF-7, WF-37: the workflow hands out the same stage object with its mode."""
    st = define_async_batch_stage(id="batch", execute=noop, check_completion=check)
    wf = define_workflow(id="w").pipe(st).build()
    assert wf.get_stage("batch") is st
    assert wf.node("batch").stage.mode == "async-batch"


# --- results (WF-2, WF-3) -----------------------------------------------------------------------


def test_completion_check_constructors() -> None:
    """WF-3: done / not_ready / failed build the three answers."""
    done = CompletionCheck.done({"v": 1}, metrics={"items": 3})
    assert (done.ready, done.output, done.error, done.metrics) == (
        True,
        {"v": 1},
        None,
        {"items": 3},
    )
    assert CompletionCheck.done().output is UNSET
    later = CompletionCheck.not_ready(12)
    assert (later.ready, later.next_check_in_seconds, later.error) == (False, 12, None)
    failed = CompletionCheck.failed("boom")
    assert (failed.ready, failed.error) == (False, "boom")


def test_unset_is_distinct_from_none() -> None:
    """WF-3: None is a valid output; UNSET means "no output given"."""
    assert CompletionCheck.done(None).output is None
    assert not UNSET
    assert repr(UNSET) == "UNSET"


def test_stage_result_defaults() -> None:
    """WF-2: a stage result carries output plus optional metrics, artifacts, embeddings."""
    result = StageResult(output={"a": 1})
    assert (result.metrics, result.artifacts, result.embeddings) == (None, None, None)


# --- registry (K-1) -----------------------------------------------------------------------------


def small_workflow(workflow_id: str = "wf") -> Any:
    return define_workflow(id=workflow_id).pipe(define_stage(id="s", execute=noop)).build()


def test_registry_register_and_get() -> None:
    """K-1: registered workflows resolve by id; unknown ids give None."""
    reg = WorkflowRegistry()
    wf = small_workflow()
    assert reg.register(wf) is wf
    assert reg.get("wf") is wf
    assert reg.get("unknown") is None
    assert "wf" in reg
    assert "unknown" not in reg
    assert len(reg) == 1


def test_registry_rejects_duplicate_id() -> None:
    """K-1: a second workflow with a registered id is rejected, naming the id."""
    reg = WorkflowRegistry()
    first = reg.register(small_workflow("dup"))
    with pytest.raises(WorkflowDefinitionError, match="'dup' is already registered"):
        reg.register(small_workflow("dup"))
    assert reg.get("dup") is first


def test_registry_re_registering_same_workflow_is_harmless() -> None:
    """K-1: registering the same object twice (e.g. a re-imported module) is a no-op."""
    reg = WorkflowRegistry()
    wf = small_workflow()
    reg.register(wf)
    reg.register(wf)
    assert len(reg) == 1


def test_registry_rejects_builder() -> None:
    """K-1: only built workflows can be registered; the message says to call .build()."""
    reg = WorkflowRegistry()
    with pytest.raises(WorkflowDefinitionError, match=r"call \.build\(\)"):
        reg.register(define_workflow(id="w"))  # type: ignore[arg-type]


def test_registry_iterates_sorted_and_unregisters() -> None:
    """K-1: iteration is sorted by id; unregister and clear remove entries."""
    reg = WorkflowRegistry()
    for wid in ("zeta", "alpha", "mid"):
        reg.register(small_workflow(wid))
    assert [w.id for w in reg] == ["alpha", "mid", "zeta"]
    reg.unregister("mid")
    reg.unregister("never-there")
    assert [w.id for w in reg] == ["alpha", "zeta"]
    reg.clear()
    assert len(reg) == 0


# --- suspension normalisation (WF-4, WF-8, K-JE-16) ---------------------------------------------


def test_normalise_suspend_defaults() -> None:
    """WF-8: 30 s poll interval, 24 h max wait, submitted_at back-filled, first poll after 30 s."""
    out = normalise_suspend(Suspend(state={"batch_id": "b-1"}), NOW)
    assert out.state == {
        "batch_id": "b-1",
        "submitted_at": NOW.isoformat(),
        "poll_interval_seconds": 30.0,
        "max_wait_seconds": 86400.0,
    }
    assert out.poll_interval_ms == 30_000
    assert out.next_poll_at == NOW + timedelta(seconds=30)
    assert out.max_wait_until == NOW + timedelta(hours=24)
    assert out.metrics is None


def test_normalise_suspend_uses_state_values() -> None:
    """WF-8: poll interval and max wait fall back to the state's values; submitted_at kept."""
    state = {
        "batch_id": "b-2",
        "submitted_at": "2024-12-31T23:00:00+00:00",
        "poll_interval_seconds": 5,
        "max_wait_seconds": 60,
        "metadata": {"provider": "x"},
    }
    out = normalise_suspend(Suspend(state=state), NOW)
    assert out.state["submitted_at"] == "2024-12-31T23:00:00+00:00"
    assert out.state["metadata"] == {"provider": "x"}
    assert out.poll_interval_ms == 5000
    # the first poll counts from the supplied submission time (WF-8)
    assert out.next_poll_at == datetime(2024, 12, 31, 23, 0, 5, tzinfo=UTC)
    assert out.max_wait_until == NOW + timedelta(seconds=60)
    assert state == {  # the caller's dict is not modified
        "batch_id": "b-2",
        "submitted_at": "2024-12-31T23:00:00+00:00",
        "poll_interval_seconds": 5,
        "max_wait_seconds": 60,
        "metadata": {"provider": "x"},
    }


def test_normalise_suspend_explicit_values_win_over_state() -> None:
    """WF-8: explicit poll interval, max wait and next poll time are honoured exactly."""
    first_poll = NOW + timedelta(minutes=7)
    out = normalise_suspend(
        Suspend(
            state={"batch_id": "b-3", "poll_interval_seconds": 5, "max_wait_seconds": 60},
            poll_interval_seconds=2.5,
            max_wait_seconds=600,
            next_poll_at=first_poll,
            metrics={"submitted": 10},
        ),
        NOW,
    )
    assert out.poll_interval_ms == 2500
    assert out.state["poll_interval_seconds"] == 2.5
    assert out.state["max_wait_seconds"] == 600
    assert out.next_poll_at == first_poll
    assert out.max_wait_until == NOW + timedelta(seconds=600)
    assert out.metrics == {"submitted": 10}


def test_normalise_suspend_zero_max_wait_disables_deadline() -> None:
    """K-JE-16: maxWaitUntil is left unset when the max wait is 0."""
    out = normalise_suspend(Suspend(state={"batch_id": "b"}, max_wait_seconds=0), NOW)
    assert out.max_wait_until is None


@pytest.mark.parametrize(
    "state", [{}, {"batch_id": ""}, {"batch_id": 42}, {"batch_id": None}, {"batchId": "camel"}]
)
def test_normalise_suspend_rejects_missing_batch_id(state: dict[str, Any]) -> None:
    """WF-4: the suspended state must hold a non-empty batch_id string."""
    with pytest.raises(ValueError, match="batch_id"):
        normalise_suspend(Suspend(state=state), NOW)


def test_normalise_suspend_first_poll_counts_from_supplied_submitted_at() -> None:
    """WF-8: nextPollAt = submittedAt + pollInterval when the state names submittedAt."""
    from datetime import UTC, datetime, timedelta

    from django_workflows.definition.results import Suspend
    from django_workflows.kernel.executor import normalise_suspend

    now = datetime(2025, 1, 1, 12, 0, tzinfo=UTC)
    submitted = now - timedelta(seconds=20)
    out = normalise_suspend(
        Suspend(
            state={"batch_id": "b", "submitted_at": submitted.isoformat()}, poll_interval_seconds=30
        ),
        now,
    )
    assert out.next_poll_at == submitted + timedelta(seconds=30)
