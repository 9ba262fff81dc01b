"""Stage definitions (SPEC §3.1-3.2, WF-1..9; Part I item 5).

A stage is an id, pydantic models for its input, output and config, and a function::

    class Out(BaseModel):
        count: int

    @stage(id="count-words")
    def count_words(ctx: StageContext[Text]) -> Out:
        return Out(count=len(ctx.input.text.split()))

``@stage`` and :func:`define_async_batch_stage` take the models from the function's annotations
(:func:`infer_stage_types`): input and config from ``ctx: StageContext[In, Cfg]``
(``StageContext[In]``: no config), output from the return annotation. Explicit ``input=``,
``output=`` and ``config=`` still win; one that disagrees with the annotation is a
:class:`WorkflowDefinitionError`. :func:`define_stage` takes the models only as arguments.

Async-batch stages also define ``check_completion(state, ctx)`` and return :class:`Suspend` from
``execute`` (see :func:`define_async_batch_stage`).
"""

from __future__ import annotations

import inspect
import math
import re
import sys
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, RootModel, ValidationError
from pydantic_core import PydanticUndefined, to_jsonable_python

from .noconfig import NoConfig

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


class AnyInput(RootModel[Any]):
    """The input model of a built-in stage that does not read the previous group's output
    (``wait_for_signal``; ``child_workflow`` without ``stage_input``): any JSON value,
    object or not, kept as ``ctx.input.root``. ``NoInput`` would reject a non-object, so such
    a stage placed after a stage returning a list or a number failed its run."""


def validate_id(kind: str, value: object) -> str:
    """Return ``value`` if it is a valid id, else raise :class:`WorkflowDefinitionError`."""
    if not isinstance(value, str) or not ID_PATTERN.match(value):
        raise WorkflowDefinitionError(
            f"Invalid {kind} id {value!r}: use 1-100 lower-case letters, digits, '-' or '_', "
            "starting with a letter or digit"
        )
    return value


def check_model_argument(owner: str, field: str, value: object) -> None:
    """Raise :class:`WorkflowDefinitionError` naming ``owner`` and ``field`` unless ``value``
    is ``None`` or a pydantic ``BaseModel`` subclass (for factories such as
    ``wait_for_signal(payload=...)`` whose argument becomes a stage's model)."""
    if value is not None and not (isinstance(value, type) and issubclass(value, BaseModel)):
        raise WorkflowDefinitionError(
            f"{owner}: {field} must be a pydantic BaseModel subclass or None, got {value!r}"
        )


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


@dataclass(frozen=True)
class RetryPolicy:
    """How often a stage is delivered and how long it waits between deliveries; overrides the
    ``MAX_ATTEMPTS``, ``RETRY_BACKOFF_BASE_SECONDS`` and ``RETRY_BACKOFF_MAX_SECONDS``
    settings for one stage (``retry=`` on :func:`stage`, :func:`define_stage`,
    :func:`define_async_batch_stage`; ``retry=3`` is ``RetryPolicy(max_attempts=3)``).

    Attributes:
        max_attempts: deliveries of the stage's job, the first included (>= 1; ``1``: never
            retried). It bounds every re-delivery - a failure, or a worker that died while
            running the stage (Part I item 3) - as ``MAX_ATTEMPTS`` does.
        backoff_base_seconds: the wait before delivery ``n + 1`` is ``backoff_base_seconds *
            2**(n-1)`` (DM-44), in seconds, >= 0; ``None``: the setting.
        backoff_max_seconds: cap of that wait, in seconds, >= 0; ``None``: the setting.

    Raises:
        WorkflowDefinitionError: a value out of range; the message names the field.
    """

    max_attempts: int
    backoff_base_seconds: float | None = None
    backoff_max_seconds: float | None = None

    def __post_init__(self) -> None:
        attempts = self.max_attempts
        if isinstance(attempts, bool) or not isinstance(attempts, int) or attempts < 1:
            raise WorkflowDefinitionError(
                f"RetryPolicy.max_attempts must be an integer >= 1, got {attempts!r}"
            )
        for name in ("backoff_base_seconds", "backoff_max_seconds"):
            value = getattr(self, name)
            if value is None:
                continue
            if (
                isinstance(value, bool)
                or not isinstance(value, int | float)
                or not math.isfinite(value)
                or value < 0
            ):
                raise WorkflowDefinitionError(
                    f"RetryPolicy.{name} must be a finite number of seconds >= 0, got {value!r}"
                )
        base, cap = self.backoff_base_seconds, self.backoff_max_seconds
        if base is not None and cap is not None and base > cap:
            raise WorkflowDefinitionError(
                f"RetryPolicy.backoff_base_seconds ({base!r}) must not exceed "
                f"backoff_max_seconds ({cap!r}): every wait would be the cap"
            )

    @classmethod
    def of(cls, value: RetryPolicy | int | None) -> RetryPolicy | None:
        """``retry=`` as a policy: an int is ``max_attempts``; ``None`` stays ``None``.

        Raises:
            WorkflowDefinitionError: neither ``None``, an int nor a :class:`RetryPolicy`.
        """
        if value is None or isinstance(value, RetryPolicy):
            return value
        if isinstance(value, int) and not isinstance(value, bool):
            return cls(max_attempts=value)
        raise WorkflowDefinitionError(
            f"retry must be None, an int (max_attempts) or a RetryPolicy, got {value!r}"
        )

    def delay_seconds(self, attempt: int, base: float, cap: float) -> float:
        """The back-off before delivery ``attempt + 1``, in seconds: ``base * 2**(attempt-1)``
        capped by ``cap``, with this policy's values in place of the given settings.
        """
        if self.backoff_base_seconds is not None:
            base = float(self.backoff_base_seconds)
        if self.backoff_max_seconds is not None:
            cap = float(self.backoff_max_seconds)
        return min(base * 2 ** max(attempt - 1, 0), cap)


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


@dataclass(frozen=True, eq=False)
class ChildSpec:
    """What a child-workflow stage starts (issue 18 item 5; see
    :func:`django_workflows.children.child_workflow`).

    Attributes:
        workflow_id: the child workflow's id, resolved in the kernel's registry when the stage
            runs.
        workflow: the child :class:`~.workflow.Workflow` object when one was given (the test
            kit registers it; build-time checks walk it for cycles), else ``None``.
        input: ``input(ctx) -> dict``: the child run's input, from the parent stage's context.
        config: the child run's config map (``{stage_id: {...}}``) or ``None``.
        poll_interval_seconds: how often the parent's suspended stage looks at the child when
            nothing woke it (seconds, > 0); a child's end wakes it at once.
    """

    workflow_id: str
    workflow: Any
    input: Callable[..., Any]
    config: dict[str, Any] | None = None
    poll_interval_seconds: float = 30.0


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
        retry: the stage's :class:`RetryPolicy` (``None``: the settings); an int given here is
            turned into ``RetryPolicy(max_attempts=n)``.
        timeout_seconds: the longest one delivery of ``execute`` may run (seconds, > 0), or
            ``None``: ``DEFAULT_STAGE_TIMEOUT_SECONDS`` applies (issue 12 item 2; see
            :mod:`..kernel.timeouts`).
        queue_timeout_seconds: the longest a ready job of the stage may wait for a worker of
            its ``queue`` (seconds, > 0), or ``None``: ``DEFAULT_QUEUE_TIMEOUT_SECONDS``.
        when: ``None``, or a predicate ``fn(ctx) -> bool`` / a
            :class:`~.conditions.Condition` deciding whether the stage runs wherever it is
            placed (see ``docs/conditions.md``); a ``when=`` given to the builder wins.
        signal: ``None``, or the :class:`~django_workflows.definition.signal.SignalWait` of a
            stage made by :func:`~django_workflows.wait_for_signal` (the poller consumes a
            signal instead of calling ``check_completion``).
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
    retry: RetryPolicy | None = None
    timeout_seconds: float | None = None
    queue_timeout_seconds: float | None = None
    when: Any = None
    signal: Any = None
    #: Set on a child-workflow stage (:func:`django_workflows.children.child_workflow`): what
    #: child run it starts. ``None`` for every other stage.
    child: ChildSpec | None = None
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
        try:
            self.retry = RetryPolicy.of(self.retry)
        except WorkflowDefinitionError as exc:
            raise WorkflowDefinitionError(f"Stage {self.id!r}: {exc}") from None
        for attr in ("timeout_seconds", "queue_timeout_seconds"):
            problem = seconds_error(getattr(self, attr))
            if problem:
                raise WorkflowDefinitionError(f"Stage {self.id!r}: {attr} {problem}")
        if self.when is not None and not callable(getattr(self.when, "fn", self.when)):
            raise WorkflowDefinitionError(
                f"Stage {self.id!r}: when must be a callable predicate or a Condition, got "
                f"{self.when!r}"
            )
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


# --- types from annotations -------------------------------------------------------------------


@dataclass(frozen=True)
class AnnotatedTypes:
    """The models a stage function's annotations declare (:func:`infer_stage_types`); ``None``
    where an annotation declares none (missing, ``Any``, ``None``, a type variable).

    Attributes:
        input / config: from the first parameter's ``StageContext[In, Cfg]``
            (``StageContext[In]``: config :class:`NoConfig`).
        output: from the return annotation (a model), or ``CompletionCheck[Out]`` of an
            async-batch stage's ``check_completion``.
        parameter: the name of the first parameter (``"ctx"``), for error messages.
    """

    input: type[BaseModel] | None = None
    config: type[BaseModel] | None = None
    output: type[BaseModel] | None = None
    parameter: str = "ctx"


def _is_model(value: Any) -> bool:
    return isinstance(value, type) and issubclass(value, BaseModel)


def _qualname(fn: Callable[..., Any]) -> str:
    return f"{getattr(fn, '__qualname__', None) or repr(fn)}()"


def _caller_namespace(depth: int) -> dict[str, Any]:
    """The local names of the frame ``depth`` levels above the caller (where a stage function
    was defined, for annotations naming classes local to a function under
    ``from __future__ import annotations``); ``{}`` where frames are not available.
    """
    try:
        return dict(sys._getframe(depth + 1).f_locals)
    except (AttributeError, ValueError):  # pragma: no cover - no frame support
        return {}


def _hint(fn: Callable[..., Any], name: str, annotation: Any, localns: Mapping[str, Any]) -> Any:
    """One annotation of ``fn`` evaluated with ``typing.get_type_hints`` (the function's
    globals, then its closure variables and ``localns``). Raises ``NameError`` (and whatever
    evaluating a string annotation raises) when it names something unknown.
    """

    def holder() -> None: ...

    holder.__annotations__ = {name: annotation}
    names: dict[str, Any] = dict(localns)
    code = getattr(fn, "__code__", None)
    for var, cell in zip(
        getattr(code, "co_freevars", ()), getattr(fn, "__closure__", None) or (), strict=False
    ):
        try:
            names.setdefault(var, cell.cell_contents)
        except ValueError:  # an empty cell
            continue
    hints = typing.get_type_hints(holder, globalns=getattr(fn, "__globals__", {}), localns=names)
    return hints[name]


def _declared(
    stage_id: str, value: Any, what: str, where: str, *, strict: bool
) -> type[BaseModel] | None:
    """A type from an annotation as a model, ``None`` when it declares none. ``strict``: a type
    that is neither a model nor "none" (``Any``, ``None``, a type variable) is an error (it
    would be inferred), else it is ignored (an explicit argument covers it).
    """
    if value is Any or value is None or value is type(None) or isinstance(value, typing.TypeVar):
        return None
    if _is_model(value):
        return value  # type: ignore[no-any-return]
    if strict:
        raise WorkflowDefinitionError(
            f"Stage {stage_id!r}: the {what} annotation of {where} is {value!r}, not a pydantic "
            f"BaseModel subclass; annotate a model, or pass {what}= explicitly"
        )
    return None


def infer_stage_types(
    stage_id: str,
    execute: Callable[..., Any],
    *,
    check_completion: Callable[..., Any] | None = None,
    need: frozenset[str] = frozenset({"input", "config", "output"}),
    localns: Mapping[str, Any] | None = None,
) -> AnnotatedTypes:
    """Read the models a stage's annotations declare.

    ``execute``'s first parameter annotated ``StageContext[In, Cfg]`` gives input ``In`` and
    config ``Cfg`` (``StageContext[In]``: :class:`NoConfig`); its return annotation, when a
    model, gives the output (``-> None`` or none: no declared output). With
    ``check_completion`` (an async-batch stage) the output comes from its
    ``-> CompletionCheck[Out]`` instead. String annotations (``from __future__ import
    annotations``, forward references) are evaluated with ``typing.get_type_hints`` in the
    function's globals, closure and ``localns``.

    ``need``: the kinds (``input``, ``config``, ``output``) no explicit argument gives; an
    annotation of one of them that cannot be evaluated or is not a model is an error, the
    others are only read for the agreement check (and skipped when unreadable).

    Raises:
        WorkflowDefinitionError: a needed annotation names an unknown type or a non-model
            type; the message names the stage, the function and the parameter.
    """
    from .context import StageContext
    from .results import CompletionCheck

    where = _qualname(execute)
    ns = localns or {}
    found: dict[str, Any] = {}
    try:
        params = [
            p
            for p in inspect.signature(execute).parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
    except (TypeError, ValueError):  # a builtin or a callable without a signature
        params = []
    parameter = params[0].name if params else "ctx"

    def evaluate(fn: Callable[..., Any], name: str, annotation: Any, kinds: set[str]) -> Any:
        try:
            return _hint(fn, name, annotation, ns)
        except Exception as exc:
            if kinds & need:
                label = "return" if name == "return" else f"parameter {name!r}"
                raise WorkflowDefinitionError(
                    f"Stage {stage_id!r}: cannot evaluate the annotation of {label} of "
                    f"{_qualname(fn)} ({type(exc).__name__}: {exc}); define the type where "
                    f"the function can see it, or pass "
                    f"{' and '.join(k + '=' for k in sorted(kinds & need))} explicitly"
                ) from None
            return None

    if params and params[0].annotation is not inspect.Parameter.empty:
        hint = evaluate(execute, parameter, params[0].annotation, {"input", "config"})
        if typing.get_origin(hint) is StageContext:
            args = typing.get_args(hint)
            at = f"parameter {parameter!r} of {where}"
            found["input"] = (
                _declared(stage_id, args[0], "input", at, strict="input" in need) if args else None
            )
            if len(args) > 1:
                found["config"] = _declared(
                    stage_id, args[1], "config", at, strict="config" in need
                )
    if check_completion is not None:
        annotation = getattr(check_completion, "__annotations__", {}).get("return")
        if annotation is not None:
            hint = evaluate(check_completion, "return", annotation, {"output"})
            if typing.get_origin(hint) is CompletionCheck:
                (arg,) = typing.get_args(hint)
                found["output"] = _declared(
                    stage_id, arg, "output", _qualname(check_completion), strict=False
                )
    else:
        annotation = getattr(execute, "__annotations__", {}).get("return")
        if annotation is not None:
            hint = evaluate(execute, "return", annotation, {"output"})
            found["output"] = hint if _is_model(hint) else None
    return AnnotatedTypes(
        input=found.get("input"),
        config=found.get("config"),
        output=found.get("output"),
        parameter=parameter,
    )


def _agree(
    stage_id: str,
    what: str,
    explicit: type[BaseModel] | None,
    annotated: type[BaseModel] | None,
    source: str,
) -> type[BaseModel] | None:
    """The explicit model if given (it must be the annotated one, if any), else the annotated.

    Raises:
        WorkflowDefinitionError: both are given and differ.
    """
    if explicit is None:
        return annotated
    if annotated is not None and explicit is not annotated:
        raise WorkflowDefinitionError(
            f"Stage {stage_id!r}: {what}={explicit.__qualname__} disagrees with {source}, "
            f"which declares {annotated.__qualname__}; pass the same model or drop {what}="
        )
    return explicit


def _typed(
    *,
    id: str,
    execute: Callable[..., Any],
    check_completion: Callable[..., Any] | None,
    input: type[BaseModel] | None,
    output: type[BaseModel] | None,
    config: type[BaseModel] | None,
    localns: Mapping[str, Any],
) -> tuple[type[BaseModel] | None, type[BaseModel] | None, type[BaseModel] | None]:
    """``(input, output, config)``: the explicit models, else the annotated ones."""
    validate_id("stage", id)
    need = frozenset(
        kind
        for kind, value in (("input", input), ("config", config), ("output", output))
        if value is None
    )
    types = infer_stage_types(
        id, execute, check_completion=check_completion, need=need, localns=localns
    )
    where = _qualname(execute)
    context = f"the annotation StageContext[...] of parameter {types.parameter!r} of {where}"
    if check_completion is not None:
        returned = f"the return annotation CompletionCheck[...] of {_qualname(check_completion)}"
    else:
        returned = f"the return annotation of {where}"
    return (
        _agree(id, "input", input, types.input, context),
        _agree(id, "output", output, types.output, returned),
        _agree(id, "config", config, types.config, context),
    )


# --- definition functions -------------------------------------------------------------------


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
    retry: RetryPolicy | int | None = None,
    timeout_seconds: float | None = None,
    queue_timeout_seconds: float | None = None,
    when: Any = None,
) -> Stage:
    """Define a synchronous stage (WF-5). The models are taken only from the arguments (use
    :func:`stage` to take them from the annotations).

    Args:
        id: stage id (see :data:`ID_PATTERN`).
        execute: ``execute(ctx)`` returning the output, or a :class:`StageResult`. Returning a
            :class:`Suspend` from a sync stage fails it, non-retryable (Part I item 5).
        input / output / config: pydantic models; ``input=None`` takes no input (WF-6).
        queue: the worker pool that runs the stage (:data:`DEFAULT_QUEUE` unless named;
            :data:`QUEUE_PATTERN`); see :mod:`..kernel.routing`.
        retry: a :class:`RetryPolicy`, or an int (``max_attempts``); ``None``: the settings.
        timeout_seconds: the longest one delivery may run (seconds, > 0); past it the
            delivery fails with ``StageTimeout`` and is retried like any failure
            (:mod:`..kernel.timeouts`). ``None``: ``DEFAULT_STAGE_TIMEOUT_SECONDS``.
        queue_timeout_seconds: the longest a ready job may wait for a worker of ``queue``
            (seconds, > 0); past it the stage and run fail naming the queue. ``None``:
            ``DEFAULT_QUEUE_TIMEOUT_SECONDS``.
        when: a predicate ``fn(ctx) -> bool`` or a ``Condition``: the stage runs only when it
            is true, else it is SKIPPED (``docs/conditions.md``).

    Raises:
        WorkflowDefinitionError: a malformed id, model, queue name, retry policy, timeout or
            ``when``.
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
        retry=retry,  # type: ignore[arg-type]  # normalised by Stage
        timeout_seconds=timeout_seconds,
        queue_timeout_seconds=queue_timeout_seconds,
        when=when,
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
    retry: RetryPolicy | int | None = None,
    timeout_seconds: float | None = None,
    queue_timeout_seconds: float | None = None,
    when: Any = None,
) -> Stage:
    """Define an async-batch stage (WF-5, WF-7).

    ``execute(ctx)`` submits work and returns :class:`Suspend`; the maintenance tick later calls
    ``check_completion(state, ctx)`` (outside any transaction) until it returns a ready or failed
    :class:`CompletionCheck` (SPEC §4.7). ``queue``: as for :func:`define_stage` (the
    ``execute`` delivery runs on that pool; ``check_completion`` runs in the maintenance tick).

    Input and config default to ``execute``'s ``ctx: StageContext[In, Cfg]`` annotation, the
    output to ``check_completion``'s ``-> CompletionCheck[Out]`` (see :func:`stage`).
    ``retry``: as for :func:`define_stage` (it bounds the deliveries of ``execute``).

    ``timeout_seconds`` / ``queue_timeout_seconds``: as for :func:`define_stage`; they bound
    each delivery of ``execute`` (the wait for the batch is bounded by ``Suspend``'s
    ``max_wait_seconds``, not by these).

    ``when``: as for :func:`define_stage` (``docs/conditions.md``).

    Raises:
        WorkflowDefinitionError: as :func:`define_stage`, and an explicit model that disagrees
            with the annotations.
    """
    input, output, config = _typed(
        id=id,
        execute=execute,
        check_completion=check_completion,
        input=input,
        output=output,
        config=config,
        localns=_caller_namespace(1),
    )
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
        retry=retry,  # type: ignore[arg-type]  # normalised by Stage
        timeout_seconds=timeout_seconds,
        queue_timeout_seconds=queue_timeout_seconds,
        when=when,
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
    retry: RetryPolicy | int | None = None,
    timeout_seconds: float | None = None,
    queue_timeout_seconds: float | None = None,
    when: Any = None,
) -> Callable[[Callable[..., Any]], Stage]:
    """Decorator form of :func:`define_stage`; the decorated function becomes ``execute``.

    The models default to the function's annotations::

        @stage(id="validate", retry=RetryPolicy(max_attempts=5, backoff_base_seconds=1))
        def validate(ctx: StageContext[Order, Limits]) -> Validated: ...

    is ``input=Order, config=Limits, output=Validated``. ``StageContext[Order]`` means no
    config; ``-> None`` or no return annotation means no declared output; ``Any`` declares
    nothing. An explicit argument wins, but must be the annotated model when there is one.

    ``queue``: the worker pool that runs the stage, e.g. ``@stage(id="embed", queue="gpu")``.
    ``retry``: a :class:`RetryPolicy` or an int (``max_attempts``) for this stage.

    ``timeout_seconds`` / ``queue_timeout_seconds``: see :func:`define_stage`, e.g.
    ``@stage(id="embed", queue="gpu", timeout_seconds=600, queue_timeout_seconds=60)``.

    ``when``: a predicate ``fn(ctx) -> bool`` or a ``Condition``; the stage runs only when it
    is true, else it is SKIPPED with a reason (``docs/conditions.md``).

    Raises:
        WorkflowDefinitionError: (when decorating) a malformed id, queue, retry policy or
            timeout; an explicit model that disagrees with the annotation (naming the stage,
            both models and the parameter); an annotation that names an unknown or non-model
            type.
    """

    def wrap(fn: Callable[..., Any]) -> Stage:
        typed_input, typed_output, typed_config = _typed(
            id=id,
            execute=fn,
            check_completion=None,
            input=input,
            output=output,
            config=config,
            localns=_caller_namespace(1),
        )
        return define_stage(
            id=id,
            execute=fn,
            name=name,
            input=typed_input,
            output=typed_output,
            config=typed_config,
            description=description or (fn.__doc__ or "").strip().split("\n")[0],
            dependencies=dependencies,
            queue=queue,
            retry=retry,
            timeout_seconds=timeout_seconds,
            queue_timeout_seconds=queue_timeout_seconds,
            when=when,
        )

    return wrap
