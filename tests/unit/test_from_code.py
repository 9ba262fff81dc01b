"""Workflow output schema and queries (WF-34, WF-37), config presets (WF-50/51) and stage-id
helpers (WF-55..58)."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import BaseModel, ValidationError

from django_workflows import (
    ConcurrencyConfig,
    EmptyConfig,
    NoConfig,
    StageContext,
    StageIds,
    WorkflowDefinitionError,
    assert_valid_stage_id,
    create_stage_ids,
    define_stage,
    define_stage_ids,
    define_workflow,
    is_valid_stage_id,
    require_stage_output,
    stage_constant_name,
    with_concurrency,
    with_debug,
    with_feature_flags,
    with_full_config,
    with_standard_config,
)
from django_workflows.definition.context import MissingStageOutputError


class Order(BaseModel):
    sku: str


class Priced(BaseModel):
    cost: float


class Reserved(BaseModel):
    reserved: bool


class Cfg(BaseModel):
    region: str = "eu"


def _stage(id: str, output: type[BaseModel] | None = None, **kw: Any) -> Any:
    return define_stage(id=id, execute=lambda ctx: {}, output=output, **kw)


def order() -> Any:
    return (
        define_workflow(id="order", name="Order", description="an order", input=Order)
        .pipe(_stage("validate", Order, config=Cfg, estimate_cost=lambda i, c: 1.5))
        .parallel([_stage("reserve", Reserved), _stage("price-shipping", Priced)])
        .pipe(_stage("confirm", Priced, estimate_cost=lambda i, c: float(c.get("n", 2))))
        .build()
    )


# --- WF-34 / WF-37 ------------------------------------------------------------------------


def test_output_schema_is_the_last_stages_output_schema() -> None:
    wf = order()
    assert wf.output_schema == Priced.model_json_schema()
    assert wf.input_schema == Order.model_json_schema()
    untyped = define_workflow(id="u").pipe(_stage("a")).build()
    assert untyped.output_schema == {}  # no output model: any JSON value


def test_output_schema_of_a_parallel_last_group_is_keyed_by_stage_id() -> None:
    class Inner(BaseModel):
        n: int

    class Nested(BaseModel):
        inner: Inner

    wf = (
        define_workflow(id="fan")
        .pipe(_stage("a"))
        .parallel([_stage("reserve", Reserved), _stage("nested", Nested), _stage("free")])
        .build()
    )
    schema = wf.output_schema
    assert schema["type"] == "object"
    assert schema["required"] == ["reserve", "nested", "free"]
    assert schema["properties"]["reserve"] == Reserved.model_json_schema()
    assert schema["properties"]["free"] == {}
    assert schema["properties"]["nested"]["properties"]["inner"] == {"$ref": "#/$defs/Inner"}
    assert schema["$defs"]["Inner"] == Inner.model_json_schema()


def _models_of_two_modules() -> tuple[type[BaseModel], type[BaseModel]]:
    """Two output models that each nest a model named ``Result`` (as ``shop.billing`` and
    ``shop.shipping`` would), with different fields; the outer models share a name too."""
    from pydantic import create_model

    billed = create_model("Result", __module__="shop.billing", amount=(float, ...))
    shipped = create_model("Result", __module__="shop.shipping", carrier=(str, ...))
    a = create_model("Out", __module__="shop.billing", result=(billed, ...))
    b = create_model(
        "Out", __module__="shop.shipping", result=(shipped, ...), more=(list[shipped], ...)
    )
    return a, b


def test_output_schema_keeps_same_named_models_of_a_parallel_group_apart() -> None:
    """Two stages whose output models nest different models of one class name (``Result``)
    each keep their own definition: a bill with a carrier and a shipment with an amount are
    refused, the right shapes accepted (the hoisted ``$defs`` once merged them by name)."""
    import jsonschema

    billing, shipping = _models_of_two_modules()
    wf = (
        define_workflow(id="fan")
        .pipe(_stage("a"))
        .parallel([_stage("bill", billing), _stage("ship", shipping)])
        .build()
    )
    schema = wf.output_schema
    jsonschema.Draft202012Validator.check_schema(schema)
    validator = jsonschema.Draft202012Validator(schema)
    good = {
        "bill": {"result": {"amount": 9.5}},
        "ship": {"result": {"carrier": "dhl"}, "more": [{"carrier": "ups"}]},
    }
    assert list(validator.iter_errors(good)) == []
    swapped = {
        "bill": {"result": {"carrier": "dhl"}},
        "ship": {"result": {"amount": 9.5}, "more": []},
    }
    missing = {e.message for e in validator.iter_errors(swapped)}
    assert missing == {"'amount' is a required property", "'carrier' is a required property"}
    # Every model has its own definition: two named Result, one per module.
    titles = sorted(d.get("title") for d in schema.get("$defs", {}).values())
    assert titles == ["Result", "Result"]
    # Each stage's member keeps its own shape, as the stage's own schema describes it.
    assert set(schema["properties"]["bill"]["properties"]) == {"result"}
    assert set(schema["properties"]["ship"]["properties"]) == {"result", "more"}


def test_output_schema_of_shared_and_recursive_models_refers_to_one_definition() -> None:
    """One output model on two stages, and a recursive one: the members refer to ``$defs``
    (valid JSON Schema that accepts the models' outputs)."""
    import jsonschema

    class Tree(BaseModel):
        name: str
        kids: list[Tree] = []

    wf = (
        define_workflow(id="fan")
        .pipe(_stage("a"))
        .parallel([_stage("x", Priced), _stage("y", Priced), _stage("tree", Tree)])
        .build()
    )
    schema = wf.output_schema
    jsonschema.Draft202012Validator.check_schema(schema)
    assert schema["properties"]["x"] == schema["properties"]["y"] == {"$ref": "#/$defs/Priced"}
    assert schema["$defs"]["Priced"] == Priced.model_json_schema()
    assert schema["properties"]["tree"] == {"$ref": "#/$defs/Tree"}
    validator = jsonschema.Draft202012Validator(schema)
    ok = {"x": {"cost": 1}, "y": {"cost": 2}, "tree": {"name": "r", "kids": [{"name": "k"}]}}
    assert list(validator.iter_errors(ok)) == []
    bad = {"x": {"cost": 1}, "y": {"cost": 2}, "tree": {"name": "r", "kids": [{"kids": []}]}}
    assert [e.message for e in validator.iter_errors(bad)] == ["'name' is a required property"]


def test_workflow_queries() -> None:
    wf = order()
    assert (wf.id, wf.name, wf.description) == ("order", "Order", "an order")
    assert wf.stage_ids == ("validate", "reserve", "price-shipping", "confirm")
    assert [[n.stage.id for n in g] for g in wf.execution_plan] == [
        ["validate"],
        ["reserve", "price-shipping"],
        ["confirm"],
    ]
    assert [n.stage.id for n in wf.stages_in_group(2)] == ["reserve", "price-shipping"]
    assert wf.stages_in_group(9) == ()
    assert wf.get_stage("nope") is None and wf.has_stage("confirm")
    assert [wf.stage_index(i) for i in ("validate", "price-shipping", "nope")] == [0, 2, -1]
    assert wf.execution_group_of("price-shipping") == 2
    with pytest.raises(KeyError, match="valid stage ids: validate, reserve"):
        wf.execution_group_of("nope")
    assert wf.previous_stage_id("validate") is None
    assert wf.previous_stage_id("price-shipping") == "reserve"
    with pytest.raises(KeyError, match="'nope' not found in workflow 'order'"):
        wf.previous_stage_id("nope")
    configs = wf.stage_configs()
    assert list(configs) == list(wf.stage_ids)
    assert configs["validate"] == {
        "schema": Cfg.model_json_schema(),
        "defaults": {"region": "eu"},
        "name": "validate",
        "description": "",
    }
    assert wf.default_config()["validate"] == {"region": "eu"}
    assert wf.estimate_cost({"sku": "a"}) == 3.5
    assert wf.estimate_cost({"sku": "a"}, {"confirm": {"n": 10}}) == 11.5
    assert wf.execution_order() == (
        "1. validate\n2. reserve | price-shipping (parallel)\n3. confirm"
    )


# --- WF-50 / WF-51 ------------------------------------------------------------------------


def test_presets_defaults_and_bounds() -> None:
    assert ConcurrencyConfig().model_dump() == {"concurrency": 5, "delay_ms": 0, "max_retries": 3}
    with pytest.raises(ValidationError, match="concurrency"):
        ConcurrencyConfig(concurrency=0)
    with pytest.raises(ValidationError, match="delay_ms"):
        ConcurrencyConfig(delay_ms=-1)
    assert EmptyConfig is NoConfig


def test_combinators_add_preset_fields_and_chain() -> None:
    Full = with_debug(with_standard_config(Cfg))
    assert list(Full.model_fields) == [
        "region",
        "concurrency",
        "delay_ms",
        "max_retries",
        "feature_flags",
        "verbose",
        "dry_run",
    ]
    cfg = Full.model_validate({"feature_flags": {"beta": True}})
    assert (cfg.region, cfg.concurrency, cfg.feature_flags, cfg.dry_run) == (
        "eu",
        5,
        {"beta": True},
        False,
    )
    assert issubclass(Full, Cfg)
    assert list(with_full_config(Cfg).model_fields) == list(Full.model_fields)
    assert list(with_concurrency().model_fields) == ["concurrency", "delay_ms", "max_retries"]
    assert list(with_feature_flags().model_fields) == ["feature_flags"]
    # a config model made this way works on a stage: defaults extracted, unknown keys refused
    st = define_stage(id="s", execute=lambda ctx: {}, config=Full)
    assert st.default_config["concurrency"] == 5 and st.default_config["feature_flags"] == {}
    assert "unknown config keys concurency" in (st.validate_config({"concurency": 2}) or "")


def test_a_preset_field_wins_over_the_users_field() -> None:
    class Mine(BaseModel):
        concurrency: str = "lots"
        keep: int = 1

    combined = with_concurrency(Mine)
    assert combined().concurrency == 5 and combined().keep == 1
    with pytest.raises(ValidationError):
        combined(concurrency="lots")


def test_combinators_reject_what_is_not_a_model() -> None:
    with pytest.raises(WorkflowDefinitionError, match="pydantic BaseModel subclass, got"):
        with_debug(dict)  # type: ignore[arg-type]


# --- WF-55..58 ----------------------------------------------------------------------------


def test_stage_ids_constants() -> None:
    assert stage_constant_name("price-shipping") == "PRICE_SHIPPING"
    ids = create_stage_ids(order())
    assert isinstance(ids, StageIds)
    assert dict(ids) == {
        "VALIDATE": "validate",
        "RESERVE": "reserve",
        "PRICE_SHIPPING": "price-shipping",
        "CONFIRM": "confirm",
    }
    assert ids.PRICE_SHIPPING == "price-shipping" and ids["CONFIRM"] == "confirm"
    with pytest.raises(AttributeError, match="No stage id constant 'SHIP'; defined: VALIDATE"):
        _ = ids.SHIP
    with pytest.raises(KeyError, match="No stage id constant"):
        _ = ids["SHIP"]
    with pytest.raises(AttributeError, match="frozen"):
        ids.CONFIRM = "x"  # type: ignore[misc]
    assert dict(define_stage_ids(["a-b", "c"])) == {"A_B": "a-b", "C": "c"}


def test_define_stage_ids_refuses_bad_lists() -> None:
    with pytest.raises(WorkflowDefinitionError, match="'a_b' and 'a-b' have the same constant"):
        define_stage_ids(["a-b", "a_b"])
    with pytest.raises(WorkflowDefinitionError, match="'a' is listed twice"):
        define_stage_ids(["a", "a"])
    with pytest.raises(WorkflowDefinitionError, match="Invalid stage id 'Bad'"):
        define_stage_ids(["Bad"])
    with pytest.raises(WorkflowDefinitionError, match="expects a list of ids"):
        define_stage_ids("abc")


def test_valid_stage_id_checks() -> None:
    wf = order()
    assert is_valid_stage_id(wf, "reserve") and not is_valid_stage_id(wf, "ship")
    assert assert_valid_stage_id(wf, "reserve") == "reserve"
    with pytest.raises(
        WorkflowDefinitionError,
        match="Invalid stage id 'ship' for workflow 'order'; valid stage ids: validate, "
        "reserve, price-shipping, confirm",
    ):
        assert_valid_stage_id(wf, "ship")


def test_require_stage_output() -> None:
    ctx: StageContext[Any, Any] = StageContext(
        workflow_run_id="r",
        workflow_id="w",
        stage_id="s",
        stage_record_id="x",
        generation=0,
        services=None,  # type: ignore[arg-type]
        workflow_context={"price": Priced(cost=2), "raw": {"a": 1}, "none": None, "n": 3},
    )
    assert require_stage_output(ctx, "price") == Priced(cost=2)
    assert require_stage_output(ctx, "price", "cost") == 2
    assert require_stage_output(ctx, "raw", "a") == 1
    assert require_stage_output(ctx, "none") is None  # a stored None is present (0.11 fix)
    with pytest.raises(MissingStageOutputError, match="Missing required stage output 'gone'"):
        require_stage_output(ctx, "gone")
    for stage_id in ("price", "raw", "n", "none"):
        with pytest.raises(MissingStageOutputError, match="Missing required field 'zz'"):
            require_stage_output(ctx, stage_id, "zz")
