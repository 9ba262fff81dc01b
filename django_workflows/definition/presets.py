"""Config presets and combinators (SPEC WF-50/51, without the AI-model registry).

Presets are pydantic config models for settings many stages share; a combinator adds a
preset's fields to your own config model (the preset's field wins when both define a name)
and returns a new model, so they chain::

    class ScrapeConfig(BaseModel):
        base_url: str = "https://example.org"

    Config = with_debug(with_standard_config(ScrapeConfig))
    # fields: base_url, concurrency, delay_ms, max_retries, feature_flags, verbose, dry_run

    @stage(id="scrape", config=Config)
    def scrape(ctx): ...

Field names are snake_case (upstream's ``delayMs`` is ``delay_ms``, ``featureFlags`` is
``feature_flags``, ``dryRun`` is ``dry_run``). Upstream's ``AIConfigSchema``, ``withAIConfig``
and ``MinimalAIConfigSchema`` validate against an AI-model registry this port does not have;
they are left out, so ``with_standard_config`` is concurrency + feature flags here.
"""

from __future__ import annotations

from pydantic import BaseModel, Field, create_model

from .stage import NoConfig, WorkflowDefinitionError


class ConcurrencyConfig(BaseModel):
    """WF-50 ``ConcurrencyConfigSchema``: how much a stage does at once."""

    #: parallel requests or workers the stage may use (> 0)
    concurrency: int = Field(default=5, gt=0)
    #: pause between requests, milliseconds (>= 0)
    delay_ms: int = Field(default=0, ge=0)
    #: retries of the stage's own external calls (>= 0; not the job's deliveries)
    max_retries: int = Field(default=3, ge=0)


class FeatureFlagsConfig(BaseModel):
    """WF-50 ``FeatureFlagsConfigSchema``: named on/off switches."""

    feature_flags: dict[str, bool] = Field(default_factory=dict)


class DebugConfig(BaseModel):
    """WF-50 ``DebugConfigSchema``."""

    verbose: bool = False
    dry_run: bool = False


#: WF-50 ``EmptyConfigSchema``: a config with no fields (the same model as :class:`NoConfig`).
EmptyConfig = NoConfig


def _combine(
    model: type[BaseModel] | None, *presets: type[BaseModel], suffix: str
) -> type[BaseModel]:
    """A subclass of ``model`` (default :class:`NoConfig`) with every field of ``presets``
    added; a preset's field replaces a field of ``model`` with the same name (WF-51).

    Raises:
        WorkflowDefinitionError: ``model`` is not a pydantic model class.
    """
    base = NoConfig if model is None else model
    if not (isinstance(base, type) and issubclass(base, BaseModel)):
        raise WorkflowDefinitionError(
            f"config presets combine with a pydantic BaseModel subclass, got {base!r}"
        )
    fields: dict[str, tuple[object, object]] = {}
    for preset in presets:
        for name, info in preset.model_fields.items():
            fields[name] = (info.annotation, info)
    name = f"{base.__name__}With{suffix}" if model is not None else f"{suffix}Config"
    return create_model(name, __base__=base, __module__=base.__module__, **fields)  # type: ignore[call-overload,no-any-return]


def with_concurrency(model: type[BaseModel] | None = None) -> type[BaseModel]:
    """``model`` plus :class:`ConcurrencyConfig`'s ``concurrency``, ``delay_ms``,
    ``max_retries`` (WF-51 ``withConcurrency``)."""
    return _combine(model, ConcurrencyConfig, suffix="Concurrency")


def with_feature_flags(model: type[BaseModel] | None = None) -> type[BaseModel]:
    """``model`` plus ``feature_flags`` (WF-51 ``withFeatureFlags``)."""
    return _combine(model, FeatureFlagsConfig, suffix="FeatureFlags")


def with_debug(model: type[BaseModel] | None = None) -> type[BaseModel]:
    """``model`` plus ``verbose`` and ``dry_run`` (WF-51 ``withDebug``)."""
    return _combine(model, DebugConfig, suffix="Debug")


def with_standard_config(model: type[BaseModel] | None = None) -> type[BaseModel]:
    """``model`` plus concurrency and feature flags (WF-51 ``withStandardConfig`` without the
    AI preset, see the module docstring)."""
    return _combine(model, ConcurrencyConfig, FeatureFlagsConfig, suffix="StandardConfig")


def with_full_config(model: type[BaseModel] | None = None) -> type[BaseModel]:
    """:func:`with_standard_config` plus :func:`with_debug` (WF-51 ``withFullConfig``)."""
    return _combine(model, ConcurrencyConfig, FeatureFlagsConfig, DebugConfig, suffix="FullConfig")
