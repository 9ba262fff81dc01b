"""Issue 11 item 1 under ``from __future__ import annotations``: every annotation is a string,
evaluated with the function's globals, its closure and the names of the function that
defined it (models local to a test or a factory)."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import BaseModel

from django_workflows import (
    CompletionCheck,
    NoConfig,
    StageContext,
    Suspend,
    WorkflowDefinitionError,
    define_async_batch_stage,
    stage,
)


class ModuleInput(BaseModel):
    text: str


def test_module_level_models() -> None:
    @stage(id="m")
    def m(ctx: StageContext[ModuleInput]) -> ModuleInput:
        return ctx.input

    assert (m.input_model, m.config_model, m.output_model) == (ModuleInput, NoConfig, ModuleInput)


def test_models_local_to_the_defining_function() -> None:
    class LocalIn(BaseModel):
        n: int

    class LocalCfg(BaseModel):
        k: int = 2

    class LocalOut(BaseModel):
        n: int

    @stage(id="local")
    def local(ctx: StageContext[LocalIn, LocalCfg]) -> LocalOut:
        return LocalOut(n=ctx.input.n * ctx.config.k)

    assert (local.input_model, local.config_model, local.output_model) == (
        LocalIn,
        LocalCfg,
        LocalOut,
    )

    def submit(ctx: StageContext[LocalIn]) -> Suspend: ...

    def check(state: dict[str, Any], ctx: Any) -> CompletionCheck[LocalOut]: ...

    batch = define_async_batch_stage(id="b", execute=submit, check_completion=check)
    assert (batch.input_model, batch.output_model) == (LocalIn, LocalOut)


def make_stage(model: type[BaseModel]) -> Any:
    """A factory: the annotation names the factory's parameter."""

    @stage(id="made")
    def made(ctx: StageContext[model]) -> None: ...  # type: ignore[valid-type]

    return made


def test_models_from_a_factory_parameter() -> None:
    assert make_stage(ModuleInput).input_model is ModuleInput


def test_mismatch_and_unknown_names_under_future_annotations() -> None:
    class A(BaseModel):
        pass

    with pytest.raises(WorkflowDefinitionError, match=r"'mm': input=ModuleInput disagrees.*A"):

        @stage(id="mm", input=ModuleInput)
        def mm(ctx: StageContext[A]) -> None: ...

    with pytest.raises(WorkflowDefinitionError, match=r"'nn'.*return.*NotDefinedAnywhere"):

        @stage(id="nn")
        def nn(ctx: StageContext[A]) -> NotDefinedAnywhere: ...  # noqa: F821
