"""Stage definitions (SPEC §3.1-3.2, WF-1..9; Part I item 5).

A stage is an id, pydantic models for its input, output and config, and a function::

    class Out(BaseModel):
        count: int

    @stage(id="count-words", input=Text, output=Out)
    def count_words(ctx: StageContext[Text, NoConfig]) -> Out:
        return Out(count=len(ctx.input.text.split()))

Async-batch stages also define ``check_completion(state, ctx)`` and return :class:`Suspend` from
``execute`` (see :func:`define_async_batch_stage`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError
from pydantic_core import PydanticUndefined, to_jsonable_python

#: Stage and workflow ids: lower-case letters, digits, ``-`` and ``_``; 1-100 characters,
#: starting with a letter or digit (Part I item 5, WF-36).
ID_PATTERN = re.compile(r"^[a-z0-9][a-z0-9_-]{0,99}$")

StageMode = Literal["sync", "async-batch"]

#: The queue of a stage that names none: served by the default django-q2 cluster.
DEFAULT_QUEUE = "default"
#: Queue names (the worker pool a stage runs on, issue 8 item 5): 1-40 lower-case letters,
#: digits, ``-`` and ``_``, starting with a letter or digit (short: a worker's presence row is
#: named after each queue it serves).
QUEUE_PATTERN = re.compile(r"^[a-z0-9][a-z0-9_-]{0,39}$")


class WorkflowDefinitionError(ValueError):
    """A workflow or stage definition is malformed; the message names the offending ids."""


class NoInput(BaseModel):
    """The input model of a stage that takes no input: accepts any object, yields ``{}`` (WF-6)."""

    model_config = ConfigDict(extra="ignore")


class NoConfig(BaseModel):
    """The config model of a stage without configuration."""

    model_config = ConfigDict(extra="ignore")


def validate_id(kind: str, value: object) -> str:
    """Return ``value`` if it is a valid id, else raise :class:`WorkflowDefinitionError`."""
    if not isinstance(value, str) or not ID_PATTERN.match(value):
        raise WorkflowDefinitionError(
            f"Invalid {kind} id {value!r}: use 1-100 lower-case letters, digits, '-' or '_', "
            "starting with a letter or digit"
        )
    return value


def format_validation_error(error: ValidationError) -> str:
    """``path: message`` pairs joined by ``"; "`` (WF-42); the root path is ``(root)``."""
    parts = []
    for item in error.errors(include_url=False):
        path = ".".join(str(p) for p in item["loc"]) or "(root)"
        parts.append(f"{path}: {item['msg']}")
    return "; ".join(parts)


def model_defaults(model: type[BaseModel]) -> dict[str, Any]:
    """Top-level field defaults of a config model as JSON values (WF-43).

    Fields without a default are left out; default factories are called.
    """
    defaults: dict[str, Any] = {}
    for name, info in model.model_fields.items():
        if info.default is PydanticUndefined and info.default_factory is None:
            continue
        try:
            value = info.get_default(call_default_factory=True, validated_data={})
            defaults[info.alias or name] = to_jsonable_python(value)
        except Exception:  # a default that cannot be represented yields nothing (WF-43)
            continue
    return defaults


def to_json_value(value: Any) -> Any:
    """A pydantic model or JSON-like value as plain JSON data (aliases applied)."""
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json", by_alias=True)
    return to_jsonable_python(value)


def seconds_error(value: object) -> str | None:
    """``None`` if ``value`` is ``None`` or a positive, finite number of seconds; else what is
    wrong with it (used for ``timeout_seconds`` and ``queue_timeout_seconds``).
    """
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        return f"must be a number of seconds or None, got {value!r}"
    if not math.isfinite(value) or value <= 0:
        return f"must be a positive, finite number of seconds, got {value!r}"
    return None


@dataclass(eq=False)
class Stage:
    """A stage definition (WF-1). Build one with :func:`stage`, :func:`define_stage` or
    :func:`define_async_batch_stage` rather than directly.

    Attributes:
        id: unique within its workflow; used in config maps, context keys and blob keys.
        name: human-readable name (defaults to the id).
        execute: ``execute(ctx) -> output | StageResult | Suspend``.
        input_model / output_model / config_model: pydantic models (``None`` output model:
            any JSON value is accepted).
        dependencies: ids of earlier stages whose output this stage reads (checked at build
            time, WF-33).
        mode: ``"sync"`` or ``"async-batch"``.
        check_completion: ``check_completion(state, ctx) -> CompletionCheck`` (async-batch only).
        queue: the worker pool that runs the stage's jobs (default ``"default"``); mapped onto
            a django-q2 cluster by the ``QUEUES`` setting (see :mod:`..kernel.routing`).
        timeout_seconds: the longest one delivery of ``execute`` may run (seconds, > 0), or
            ``None``: ``DEFAULT_STAGE_TIMEOUT_SECONDS`` applies (issue 12 item 2; see
            :mod:`..kernel.timeouts`).
        queue_timeout_seconds: the longest a ready job of the stage may wait for a worker of
            its ``queue`` (seconds, > 0), or ``None``: ``DEFAULT_QUEUE_TIMEOUT_SECONDS``.
    """

    id: str
    name: str
    execute: Callable[..., Any]
    input_model: type[BaseModel] = NoInput
    output_model: type[BaseModel] | None = None
    config_model: type[BaseModel] = NoConfig
    description: str = ""
    dependencies: tuple[str, ...] = ()
    mode: StageMode = "sync"
    check_completion: Callable[..., Any] | None = None
    estimate_cost: Callable[[Any, Any], float] | None = None
    queue: str = DEFAULT_QUEUE
    timeout_seconds: float | None = None
    queue_timeout_seconds: float | None = None
    _defaults: dict[str, Any] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        validate_id("stage", self.id)
        if not callable(self.execute):
            raise WorkflowDefinitionError(f"Stage {self.id!r}: execute must be callable")
        for attr in ("input_model", "config_model"):
            model = getattr(self, attr)
            if not (isinstance(model, type) and issubclass(model, BaseModel)):
                raise WorkflowDefinitionError(
                    f"Stage {self.id!r}: {attr} must be a pydantic BaseModel subclass"
                )
        if self.output_model is not None and not (
            isinstance(self.output_model, type) and issubclass(self.output_model, BaseModel)
        ):
            raise WorkflowDefinitionError(
                f"Stage {self.id!r}: output_model must be a pydantic BaseModel subclass or None"
            )
        if self.mode == "async-batch" and not callable(self.check_completion):
            raise WorkflowDefinitionError(
                f"Async-batch stage {self.id!r} needs a callable check_completion"
            )
        if self.mode == "sync" and self.check_completion is not None:
            raise WorkflowDefinitionError(
                f"Stage {self.id!r}: check_completion is only for async-batch stages"
            )
        if not isinstance(self.queue, str) or not QUEUE_PATTERN.match(self.queue):
            raise WorkflowDefinitionError(
                f"Stage {self.id!r}: invalid queue {self.queue!r}: use 1-40 lower-case "
                "letters, digits, '-' or '_', starting with a letter or digit"
            )
        for attr in ("timeout_seconds", "queue_timeout_seconds"):
            problem = seconds_error(getattr(self, attr))
            if problem:
                raise WorkflowDefinitionError(f"Stage {self.id!r}: {attr} {problem}")
        self.dependencies = tuple(self.dependencies)
        self._defaults = model_defaults(self.config_model)

    # --- schema helpers -------------------------------------------------------------------

    def parse_input(self, raw: Any) -> BaseModel:
        """Validate the stage input (WF-11). Raises ``pydantic.ValidationError``."""
        return self.input_model.model_validate(raw)

    def parse_config(self, raw: Any) -> BaseModel:
        """Validate the stage's config slice, applying defaults (WF-12)."""
        return self.config_model.model_validate(raw if raw is not None else {})

    def parse_output(self, raw: Any) -> Any:
        """Validate an output and return it as JSON data (Part I item 6).

        Raises:
            pydantic.ValidationError: the output does not match ``output_model``.
        """
        if self.output_model is None:
            return to_json_value(raw)
        if isinstance(raw, self.output_model):
            value = raw
        else:
            value = self.output_model.model_validate(to_json_value(raw))
        return value.model_dump(mode="json", by_alias=True)

    def load_output(self, data: Any) -> Any:
        """A stored output as the stage's output model (or the raw JSON without one)."""
        if self.output_model is None or data is None:
            return data
        try:
            return self.output_model.model_validate(data)
        except ValidationError:
            return data

    @property
    def default_config(self) -> dict[str, Any]:
        """Top-level config defaults as JSON (WF-43)."""
        return dict(self._defaults)

    def validate_config(self, raw: Any) -> str | None:
        """``None`` if ``raw`` is a valid config slice, else the error text (WF-42).

        Keys the config model does not know are errors too (a typo would otherwise be
        dropped silently), unless the model sets ``extra="allow"``.
        """
        try:
            self.parse_config(raw or {})
        except ValidationError as exc:
            return format_validation_error(exc)
        if isinstance(raw, dict) and self.config_model.model_config.get("extra") != "allow":
            known = set()
            for name, info in self.config_model.model_fields.items():
                known.update({name, info.alias or name})
            unknown = sorted(str(k) for k in raw if k not in known)
            if unknown:
                return (
                    f"unknown config keys {', '.join(unknown)}; "
                    f"known keys: {', '.join(sorted(known)) or '(none)'}"
                )
        return None

    def __repr__(self) -> str:
        return f"<Stage {self.id} ({self.mode})>"


def define_stage(
    *,
    id: str,
    execute: Callable[..., Any],
    name: str | None = None,
    input: type[BaseModel] | None = None,
    output: type[BaseModel] | None = None,
    config: type[BaseModel] | None = None,
    description: str = "",
    dependencies: tuple[str, ...] | list[str] = (),
    estimate_cost: Callable[[Any, Any], float] | None = None,
    queue: str = DEFAULT_QUEUE,
    timeout_seconds: float | None = None,
    queue_timeout_seconds: float | None = None,
) -> Stage:
    """Define a synchronous stage (WF-5).

    Args:
        id: stage id (see :data:`ID_PATTERN`).
        execute: ``execute(ctx)`` returning the output, or a :class:`StageResult`. Returning a
            :class:`Suspend` from a sync stage fails it, non-retryable (Part I item 5).
        input / output / config: pydantic models; ``input=None`` takes no input (WF-6).
        queue: the worker pool that runs the stage (:data:`DEFAULT_QUEUE` unless named;
            :data:`QUEUE_PATTERN`); see :mod:`..kernel.routing`.
        timeout_seconds: the longest one delivery may run (seconds, > 0); past it the
            delivery fails with ``StageTimeout`` and is retried like any failure
            (:mod:`..kernel.timeouts`). ``None``: ``DEFAULT_STAGE_TIMEOUT_SECONDS``.
        queue_timeout_seconds: the longest a ready job may wait for a worker of ``queue``
            (seconds, > 0); past it the stage and run fail naming the queue. ``None``:
            ``DEFAULT_QUEUE_TIMEOUT_SECONDS``.

    Raises:
        WorkflowDefinitionError: a malformed id, model, queue name or timeout.
    """
    return Stage(
        id=id,
        name=name or id,
        execute=execute,
        input_model=input or NoInput,
        output_model=output,
        config_model=config or NoConfig,
        description=description,
        dependencies=tuple(dependencies),
        estimate_cost=estimate_cost,
        queue=queue,
        timeout_seconds=timeout_seconds,
        queue_timeout_seconds=queue_timeout_seconds,
    )


def define_async_batch_stage(
    *,
    id: str,
    execute: Callable[..., Any],
    check_completion: Callable[..., Any],
    name: str | None = None,
    input: type[BaseModel] | None = None,
    output: type[BaseModel] | None = None,
    config: type[BaseModel] | None = None,
    description: str = "",
    dependencies: tuple[str, ...] | list[str] = (),
    queue: str = DEFAULT_QUEUE,
    timeout_seconds: float | None = None,
    queue_timeout_seconds: float | None = None,
) -> Stage:
    """Define an async-batch stage (WF-5, WF-7).

    ``execute(ctx)`` submits work and returns :class:`Suspend`; the maintenance tick later calls
    ``check_completion(state, ctx)`` (outside any transaction) until it returns a ready or failed
    :class:`CompletionCheck` (SPEC §4.7). ``queue``: as for :func:`define_stage` (the
    ``execute`` delivery runs on that pool; ``check_completion`` runs in the maintenance tick).
    ``timeout_seconds`` / ``queue_timeout_seconds``: as for :func:`define_stage`; they bound
    each delivery of ``execute`` (the wait for the batch is bounded by ``Suspend``'s
    ``max_wait_seconds``, not by these).

    Raises:
        WorkflowDefinitionError: a malformed id, model, queue name or timeout.
    """
    return Stage(
        id=id,
        name=name or id,
        execute=execute,
        input_model=input or NoInput,
        output_model=output,
        config_model=config or NoConfig,
        description=description,
        dependencies=tuple(dependencies),
        mode="async-batch",
        check_completion=check_completion,
        queue=queue,
        timeout_seconds=timeout_seconds,
        queue_timeout_seconds=queue_timeout_seconds,
    )


def stage(
    *,
    id: str,
    name: str | None = None,
    input: type[BaseModel] | None = None,
    output: type[BaseModel] | None = None,
    config: type[BaseModel] | None = None,
    description: str = "",
    dependencies: tuple[str, ...] | list[str] = (),
    queue: str = DEFAULT_QUEUE,
    timeout_seconds: float | None = None,
    queue_timeout_seconds: float | None = None,
) -> Callable[[Callable[..., Any]], Stage]:
    """Decorator form of :func:`define_stage`; the decorated function becomes ``execute``.

    ``queue``: the worker pool that runs the stage, e.g. ``@stage(id="embed", queue="gpu")``.
    ``timeout_seconds`` / ``queue_timeout_seconds``: see :func:`define_stage`, e.g.
    ``@stage(id="embed", queue="gpu", timeout_seconds=600, queue_timeout_seconds=60)``.

    Raises:
        WorkflowDefinitionError: a malformed id, model, queue name or timeout (at decoration).
    """

    def wrap(fn: Callable[..., Any]) -> Stage:
        return define_stage(
            id=id,
            execute=fn,
            name=name,
            input=input,
            output=output,
            config=config,
            description=description or (fn.__doc__ or "").strip().split("\n")[0],
            dependencies=dependencies,
            queue=queue,
            timeout_seconds=timeout_seconds,
            queue_timeout_seconds=queue_timeout_seconds,
        )

    return wrap
