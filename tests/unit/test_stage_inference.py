"""Issue 11 item 1: ``@stage`` and ``define_async_batch_stage`` take input, config and output
from the annotations; explicit arguments win but must agree; ``parallel_input`` gives a
parallel group's combined input. (This module has no ``from __future__ import annotations``:
see ``test_stage_inference_future.py`` for that form.)
"""

from typing import Any

import pytest
from pydantic import BaseModel

from django_workflows import (
    CompletionCheck,
    NoConfig,
    NoInput,
    RetryPolicy,
    StageContext,
    StageResult,
    Suspend,
    WorkflowDefinitionError,
    define_async_batch_stage,
    define_stage,
    define_workflow,
    parallel_input,
    stage,
)


class Order(BaseModel):
    sku: str


class Limits(BaseModel):
    max_items: int = 3


class Validated(BaseModel):
    ok: bool


class Other(BaseModel):
    x: int = 0


def test_input_config_and_output_are_inferred() -> None:
    @stage(id="validate")
    def validate(ctx: StageContext[Order, Limits]) -> Validated:
        return Validated(ok=True)

    assert (validate.input_model, validate.config_model, validate.output_model) == (
        Order,
        Limits,
        Validated,
    )
    assert validate.default_config == {"max_items": 3}


def test_one_parameter_means_no_config_and_none_return_means_no_output() -> None:
    @stage(id="a")
    def a(ctx: StageContext[Order]) -> None: ...

    @stage(id="b")
    def b(ctx: StageContext[Order]): ...  # type: ignore[no-untyped-def]

    for s in (a, b):
        assert (s.input_model, s.config_model, s.output_model) == (Order, NoConfig, None)


def test_any_bare_and_missing_annotations_declare_nothing() -> None:
    @stage(id="any")
    def any_types(ctx: StageContext[Any, Any]) -> Any: ...

    @stage(id="bare")
    def bare(ctx):  # type: ignore[no-untyped-def]
        return None

    @stage(id="plain")
    def plain(ctx: StageContext) -> dict:  # type: ignore[type-arg]
        return {}

    for s in (any_types, bare, plain):
        assert (s.input_model, s.config_model, s.output_model) == (NoInput, NoConfig, None)


def test_a_stage_result_return_declares_no_output() -> None:
    @stage(id="r")
    def r(ctx: StageContext[Order]) -> StageResult:
        return StageResult(output=1)

    assert r.output_model is None


def test_explicit_arguments_that_agree_are_accepted() -> None:
    @stage(id="s", input=Order, output=Validated, config=Limits)
    def s(ctx: StageContext[Order, Limits]) -> Validated: ...

    assert (s.input_model, s.config_model, s.output_model) == (Order, Limits, Validated)


def test_explicit_arguments_fill_what_the_annotation_leaves_open() -> None:
    @stage(id="s", input=Order, config=Limits, output=Validated)
    def s(ctx: StageContext[Any, Any]) -> Any: ...

    assert (s.input_model, s.config_model, s.output_model) == (Order, Limits, Validated)


@pytest.mark.parametrize(
    ("kwargs", "what", "explicit", "annotated", "where"),
    [
        ({"input": Other}, "input", "Other", "Order", "parameter 'ctx'"),
        ({"config": Other}, "config", "Other", "Limits", "parameter 'ctx'"),
        ({"output": Other}, "output", "Other", "Validated", "return annotation"),
    ],
)
def test_an_explicit_argument_that_disagrees_is_a_definition_error(
    kwargs: dict[str, Any], what: str, explicit: str, annotated: str, where: str
) -> None:
    with pytest.raises(WorkflowDefinitionError) as err:

        @stage(id="mismatch", **kwargs)
        def mismatch(ctx: StageContext[Order, Limits]) -> Validated: ...

    message = str(err.value)
    assert "'mismatch'" in message and f"{what}={explicit}" in message
    assert annotated in message and where in message


def test_config_given_for_a_one_parameter_context_disagrees() -> None:
    with pytest.raises(WorkflowDefinitionError, match=r"config=Limits disagrees.*NoConfig"):

        @stage(id="c", config=Limits)
        def c(ctx: StageContext[Order]) -> None: ...


def test_forward_references_as_strings_are_resolved() -> None:
    @stage(id="fwd")
    def fwd(ctx: "StageContext[Later, Limits]") -> "Later":
        return ctx.input

    assert (fwd.input_model, fwd.output_model) == (Later, Later)


class Later(BaseModel):
    """Defined after the function that names it (a forward reference)."""

    n: int = 0


def test_an_unknown_name_is_an_error_naming_stage_function_and_parameter() -> None:
    with pytest.raises(WorkflowDefinitionError) as err:

        @stage(id="unknown")
        def unknown(ctx: "StageContext[Missing]") -> None: ...  # noqa: F821

    message = str(err.value)
    assert "'unknown'" in message and "parameter 'ctx'" in message and "Missing" in message
    assert "unknown()" in message


def test_an_unknown_name_is_ignored_when_explicit_arguments_cover_it() -> None:
    @stage(id="covered", input=Order, config=Limits, output=Validated)
    def covered(ctx: "StageContext[Missing]") -> "Gone":  # noqa: F821
        ...

    assert (covered.input_model, covered.output_model) == (Order, Validated)


def test_a_non_model_input_annotation_is_an_error() -> None:
    with pytest.raises(WorkflowDefinitionError, match=r"'lst'.*input annotation.*BaseModel"):

        @stage(id="lst")
        def lst(ctx: StageContext[list[int]]) -> None: ...  # type: ignore[type-var]


def test_define_stage_is_unchanged_it_takes_models_only_from_arguments() -> None:
    def body(ctx: StageContext[Order, Limits]) -> Validated: ...

    s = define_stage(id="plain", execute=body, output=Other)
    assert (s.input_model, s.config_model, s.output_model) == (NoInput, NoConfig, Other)


def test_async_batch_stage_infers_from_execute_and_check_completion() -> None:
    def submit(ctx: StageContext[Order, Limits]) -> Suspend:
        return Suspend(state={"batch_id": "b"})

    def check(state: dict[str, Any], ctx: Any) -> CompletionCheck[Validated]:
        return CompletionCheck.done(Validated(ok=True))

    s = define_async_batch_stage(id="batch", execute=submit, check_completion=check)
    assert (s.input_model, s.config_model, s.output_model) == (Order, Limits, Validated)
    assert s.mode == "async-batch"


def test_async_batch_output_is_explicit_when_check_completion_declares_none() -> None:
    def submit(ctx: StageContext[Order]) -> Suspend: ...

    def check(state: dict[str, Any], ctx: Any) -> CompletionCheck:  # type: ignore[type-arg]
        ...

    s = define_async_batch_stage(
        id="batch", execute=submit, check_completion=check, output=Validated
    )
    assert (s.input_model, s.output_model) == (Order, Validated)
    with pytest.raises(WorkflowDefinitionError, match=r"'batch2'.*output=Other.*CompletionCheck"):

        def typed(state: dict[str, Any], ctx: Any) -> CompletionCheck[Validated]: ...

        define_async_batch_stage(id="batch2", execute=submit, check_completion=typed, output=Other)


# --- retry= -----------------------------------------------------------------------------------


def test_retry_shorthand_and_policy() -> None:
    @stage(id="three", retry=3)
    def three(ctx: StageContext[Order]) -> None: ...

    assert three.retry == RetryPolicy(max_attempts=3)
    policy = RetryPolicy(max_attempts=5, backoff_base_seconds=0.5, backoff_max_seconds=2)
    s = define_stage(id="p", execute=lambda ctx: None, retry=policy)
    assert s.retry is policy
    assert [policy.delay_seconds(n, 2.0, 300.0) for n in (1, 2, 3, 4)] == [0.5, 1.0, 2.0, 2.0]
    assert RetryPolicy(max_attempts=2).delay_seconds(3, 2.0, 300.0) == 8.0  # the settings


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_attempts": 0}, "max_attempts"),
        ({"max_attempts": True}, "max_attempts"),
        ({"max_attempts": 2.5}, "max_attempts"),
        ({"max_attempts": 2, "backoff_base_seconds": -1}, "backoff_base_seconds"),
        ({"max_attempts": 2, "backoff_max_seconds": float("inf")}, "backoff_max_seconds"),
        ({"max_attempts": 2, "backoff_base_seconds": "1"}, "backoff_base_seconds"),
        ({"max_attempts": 2, "backoff_base_seconds": 10, "backoff_max_seconds": 1}, "backoff_base"),
    ],
)
def test_a_bad_retry_policy_names_the_field(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(WorkflowDefinitionError, match=rf"RetryPolicy\.{field}"):
        RetryPolicy(**kwargs)


@pytest.mark.parametrize("value", [0, -1, "3", 2.0])
def test_a_bad_retry_argument_names_the_stage(value: Any) -> None:
    with pytest.raises(WorkflowDefinitionError, match=r"Stage 'bad'.*(retry|max_attempts)"):
        define_stage(id="bad", execute=lambda ctx: None, retry=value)


# --- parallel_input ---------------------------------------------------------------------------


class Stock(BaseModel):
    reserved: bool


class Shipping(BaseModel):
    cents: int


@stage(id="reserve-stock")
def reserve_stock(ctx: StageContext[Order]) -> Stock:
    return Stock(reserved=True)


@stage(id="price-shipping")
def price_shipping(ctx: StageContext[Order]) -> Shipping:
    return Shipping(cents=499)


def test_parallel_input_is_a_model_of_the_group_outputs_by_stage_id() -> None:
    Checked = parallel_input(reserve_stock, price_shipping)
    assert Checked is parallel_input(reserve_stock, price_shipping)
    assert Checked.stage_ids == ("reserve-stock", "price-shipping")
    value = Checked.model_validate(
        {"reserve-stock": {"reserved": True}, "price-shipping": {"cents": 499}}
    )
    assert value.reserve_stock == Stock(reserved=True)
    assert value["price-shipping"] == Shipping(cents=499)
    with pytest.raises(KeyError, match="reserve-stock, price-shipping"):
        value["validate"]
    with pytest.raises(ValueError, match="cents"):
        Checked.model_validate({"reserve-stock": {"reserved": True}, "price-shipping": {}})


def test_parallel_input_as_the_next_stage_annotation_and_the_builder_check() -> None:
    Checked = parallel_input(reserve_stock, price_shipping)

    @stage(id="confirm")
    def confirm(ctx: StageContext[Checked]) -> Validated:  # type: ignore[valid-type]
        return Validated(ok=ctx.input.reserve_stock.reserved)

    assert confirm.input_model is Checked
    wf = (
        define_workflow(id="order", input=Order)
        .parallel([reserve_stock, price_shipping])
        .pipe(confirm)
        .build()
    )
    assert wf.stage_ids == ("reserve-stock", "price-shipping", "confirm")
    with pytest.raises(WorkflowDefinitionError, match=r"'confirm'.*parallel_input.*reserve-stock"):
        define_workflow(id="wrong", input=Order).pipe(reserve_stock).pipe(confirm)


def test_parallel_input_rejects_no_stage_non_stages_and_duplicates() -> None:
    with pytest.raises(WorkflowDefinitionError, match="at least one"):
        parallel_input()
    with pytest.raises(WorkflowDefinitionError, match="expects stages"):
        parallel_input(Order)  # type: ignore[arg-type]
    with pytest.raises(WorkflowDefinitionError, match="duplicate stage ids reserve-stock"):
        parallel_input(reserve_stock, reserve_stock)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"retryable": "no"}, "retryable must be True or False, got 'no'"),
        ({"retryable": 0}, "retryable must be True or False, got 0"),
        ({"error_type": ""}, "error_type must be None or a non-empty string"),
    ],
)
def test_stage_failed_refuses_arguments_that_would_mean_something_else(
    kwargs: dict[str, Any], match: str
) -> None:
    """``retryable="no"`` is truthy: it would have retried a failure meant to be final."""
    from django_workflows import StageFailed

    with pytest.raises(TypeError, match=match):
        StageFailed("boom", **kwargs)
    assert StageFailed("boom", retryable=True).retryable is True
