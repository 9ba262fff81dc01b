"""Conditional stages and branches (issue 18 items 1 and 2): what the builder stores on a
placed stage, and the read-only context a predicate sees.

* ``when=`` (:meth:`WorkflowBuilder.pipe`, :meth:`~WorkflowBuilder.parallel`,
  ``@stage(when=...)``): a predicate ``fn(ctx) -> bool`` of the run input, the outputs of
  earlier stages and the run config. False: the stage is ``SKIPPED`` with a reason.
* ``.branch(choose, {"small": [...], "large": [...]})``: ``choose(ctx)`` returns one declared
  branch name; the other branches' stages are ``SKIPPED``.

The kernel evaluates both once, in the transaction that opens the execution group
(:mod:`..kernel.stage_path.conditions`). Nothing here imports Django.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from .context import MissingStageOutputError
from .stage import WorkflowDefinitionError


def _callable_name(fn: Callable[..., Any]) -> str:
    return str(getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn))


@dataclass(frozen=True)
class Condition:
    """A ``when=`` predicate with the reason a skipped stage records.

    ``Condition(lambda c: c.output("charge").total > 1000, reason="total over 1000")``.
    A bare callable given as ``when=`` becomes ``Condition(fn)``: its reason is then the first
    line of its docstring, or ``"<qualname> returned false"``.

    Attributes:
        fn: ``fn(ctx: ConditionContext) -> bool`` (truthiness is used).
        reason: what the condition means, e.g. ``"total over 1000"`` (at most 200 characters).
    """

    fn: Callable[[ConditionContext], Any]
    reason: str = ""

    def __post_init__(self) -> None:
        if not callable(self.fn):
            raise WorkflowDefinitionError(f"when: expected a callable predicate, got {self.fn!r}")
        if not isinstance(self.reason, str) or len(self.reason) > 200:
            raise WorkflowDefinitionError(
                f"when: reason must be a string of at most 200 characters, got {self.reason!r}"
            )

    @property
    def name(self) -> str:
        """The predicate's qualified name (``"<lambda>"`` for a lambda)."""
        return _callable_name(self.fn)

    @property
    def description(self) -> str:
        """The explicit reason, else the docstring's first line, else ``"<name> is true"``."""
        if self.reason:
            return self.reason
        doc = (getattr(self.fn, "__doc__", None) or "").strip()
        if doc and not isinstance(self.fn, type):
            return doc.splitlines()[0][:200]
        return f"{getattr(self.fn, '__name__', None) or self.name} is true"

    def skip_reason(self) -> str:
        """The reason a stage skipped by this condition records."""
        return f"condition not met: {self.description}"

    @classmethod
    def of(cls, value: Condition | Callable[..., Any] | None) -> Condition | None:
        """``value`` as a :class:`Condition` (``None`` stays ``None``). Raises
        :class:`WorkflowDefinitionError` for something that is not callable."""
        if value is None or isinstance(value, Condition):
            return value
        return cls(value)

    def structure(self) -> dict[str, str]:
        return {"predicate": self.name, "reason": self.description}


@dataclass(frozen=True)
class BranchSpot:
    """Where a placed stage sits in a branch block: the block's ``id``, the ``choose``
    function, the names of all declared ``branches`` (declaration order) and this stage's
    ``name`` among them."""

    id: str
    choose: Callable[[ConditionContext], Any]
    branches: tuple[str, ...]
    name: str

    def structure(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "chooser": _callable_name(self.choose),
            "branches": list(self.branches),
            "name": self.name,
        }


class ConditionContext:
    """What a ``when=`` predicate or a branch's ``choose`` function receives (read-only).

    Attributes:
        input: the run input as the workflow's input model.
        config: the run's config map ``{stage_id: {...}}`` (defaults merged).
        stage_id: the stage the predicate decides about (the first stage of the block for
            ``choose``).
    """

    __slots__ = ("_earlier", "_load", "_skipped", "config", "input", "stage_id")

    def __init__(
        self,
        *,
        input: BaseModel,
        config: Mapping[str, Any],
        stage_id: str,
        earlier: frozenset[str],
        skipped: frozenset[str],
        load: Callable[[str], Any],
    ) -> None:
        self.input = input
        self.config = config
        self.stage_id = stage_id
        self._earlier = earlier
        self._skipped = skipped
        self._load = load

    def _known(self, stage_id: str) -> None:
        if stage_id not in self._earlier:
            raise LookupError(
                f"{stage_id!r} is not a stage of an earlier execution group; earlier stages: "
                f"{', '.join(sorted(self._earlier)) or '(none)'}"
            )

    def skipped(self, stage_id: str) -> bool:
        """Whether the earlier stage ``stage_id`` was SKIPPED."""
        self._known(stage_id)
        return stage_id in self._skipped

    def output(self, stage_id: str) -> Any:
        """The output of the earlier stage ``stage_id`` (its output model when it declares
        one), or ``None`` when it was SKIPPED. Raises ``LookupError`` for a stage that is not
        in an earlier execution group."""
        self._known(stage_id)
        if stage_id in self._skipped:
            return None
        return self._load(stage_id)

    def require(self, stage_id: str) -> Any:
        """:meth:`output`, but a SKIPPED stage raises :class:`MissingStageOutputError`."""
        self._known(stage_id)
        if stage_id in self._skipped:
            raise MissingStageOutputError(f"Stage {stage_id!r} was SKIPPED: it has no output")
        return self._load(stage_id)
