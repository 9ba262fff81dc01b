"""Dynamic fan-out (issue 18 item 3): a stage placed with ``.map(stage, over=...)`` runs once
per item of a list, each item its own job; the next stage receives :func:`map_results`.

Pure Python: nothing here imports Django or the kernel.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Optional

from pydantic import BaseModel, create_model

from .stage import Stage, WorkflowDefinitionError

#: What happens when an item fails for good (its deliveries used up, or a final failure).
OnItemFailure = Literal["fail", "continue"]
ON_ITEM_FAILURE: tuple[str, ...] = ("fail", "continue")
#: Upper bound of ``max_concurrency`` (items PENDING/RUNNING at once per run).
MAX_CONCURRENCY_LIMIT = 10_000
#: Upper bound of the items one map stage may fan out to in one run.
MAX_ITEMS = 100_000


class MapContext:
    """What ``over(ctx)`` sees when the map stage's execution group is created.

    ``ctx.input``: the run's input (the workflow's input model, or the raw JSON without one);
    ``ctx.output(stage_id)``: the output of an earlier stage (its output model when it
    parses, else the raw JSON; ``KeyError`` naming the known stages if it has none);
    ``ctx.config``: the run's config map ``{stage_id: {...}}``.
    """

    def __init__(self, input: Any, outputs: Mapping[str, Any], config: Mapping[str, Any]):
        self.input = input
        self._outputs = dict(outputs)
        self.config = dict(config)

    def output(self, stage_id: str) -> Any:
        """The output of the earlier stage ``stage_id``.

        Raises:
            KeyError: that stage has no output (not an earlier stage, or not completed).
        """
        if stage_id not in self._outputs:
            raise KeyError(
                f"No output of stage {stage_id!r} before the map; earlier outputs: "
                f"{', '.join(sorted(self._outputs)) or '(none)'}"
            )
        return self._outputs[stage_id]


@dataclass(frozen=True)
class MapSpec:
    """How a stage is fanned out: ``over(ctx) -> list`` (:class:`MapContext`) gives the items,
    each validated by the stage's input model when its job runs; at most ``max_concurrency``
    item jobs of one run are PENDING or RUNNING at once (the others are HELD);
    ``on_item_failure``: ``"fail"`` (the first item that fails for good fails the stage and
    the run, and cancels the items not yet settled) or ``"continue"`` (the fan-in receives
    ``None`` in that item's slot and the failure in ``failures``).
    """

    over: Callable[[MapContext], Any]
    max_concurrency: int = 10
    on_item_failure: str = "fail"

    def describe(self, *, fingerprint: bool = False) -> dict[str, Any]:
        """The JSON stored in ``Workflow.structure()`` under ``"map"``: ``{"over": the
        function's qualified name, "max_concurrency", "on_item_failure"}``; with
        ``fingerprint`` (the fingerprint material) without ``"over"`` (code is not hashed).
        """
        out: dict[str, Any] = {
            "max_concurrency": self.max_concurrency,
            "on_item_failure": self.on_item_failure,
        }
        if not fingerprint:
            out["over"] = getattr(self.over, "__qualname__", repr(self.over))
        return out


def validate_map(
    workflow_id: str, stage: Stage, over: Any, max_concurrency: Any, on_item_failure: Any
) -> MapSpec:
    """Check ``.map()``'s arguments at build time.

    Raises:
        WorkflowDefinitionError: ``over`` not callable, ``max_concurrency`` not an int in
            1..10000, or ``on_item_failure`` not ``"fail"``/``"continue"``.
    """
    where = f"Workflow {workflow_id!r}: map({stage.id!r})"
    if not callable(over):
        raise WorkflowDefinitionError(f"{where}: over must be a callable over(ctx) -> list")
    if (
        isinstance(max_concurrency, bool)
        or not isinstance(max_concurrency, int)
        or not 1 <= max_concurrency <= MAX_CONCURRENCY_LIMIT
    ):
        raise WorkflowDefinitionError(
            f"{where}: max_concurrency must be an integer from 1 to {MAX_CONCURRENCY_LIMIT}, "
            f"got {max_concurrency!r}"
        )
    if on_item_failure not in ON_ITEM_FAILURE:
        raise WorkflowDefinitionError(
            f"{where}: on_item_failure must be 'fail' or 'continue', got {on_item_failure!r}"
        )
    return MapSpec(over=over, max_concurrency=max_concurrency, on_item_failure=on_item_failure)


class MapFailure(BaseModel):
    """One item that failed for good under ``on_item_failure="continue"``: its 0-based
    ``index`` in the list ``over`` returned and the ``error`` of its last delivery.
    """

    index: int
    error: str


class MapResults(BaseModel):
    """Base of the models :func:`map_results` generates: the output of a map stage, which the
    next stage receives. ``items``: one output per item, in item order (``None`` for a failed
    item under ``"continue"``); ``failures``: the failed items in item order (always empty
    under ``"fail"``).
    """

    #: The map stage this result belongs to.
    stage_ids: ClassVar[tuple[str, ...]] = ()
    items: list[Any]
    failures: list[MapFailure] = []

    def succeeded(self) -> list[Any]:
        """The outputs of the items that completed, in item order."""
        return [item for item in self.items if item is not None]


_map_models: dict[Stage, type[MapResults]] = {}


def map_results(stage: Stage) -> type[MapResults]:
    """The input model of the stage after ``.map(stage, ...)``: a :class:`MapResults` whose
    ``items`` are ``list[Out | None]`` (``Out``: the stage's output model, ``Any`` without
    one). The same stage gives the same class. The builder checks that the stage after a map
    takes exactly this input.

    Raises:
        WorkflowDefinitionError: ``stage`` is not a :class:`Stage`.
    """
    if not isinstance(stage, Stage):
        raise WorkflowDefinitionError(f"map_results() expects a stage, got {stage!r}")
    model = _map_models.get(stage)
    if model is None:
        out = stage.output_model or Any
        name = "".join(part.capitalize() for part in stage.id.replace("_", "-").split("-"))
        model = create_model(  # type: ignore[call-overload]
            f"{name}MapResults",
            __base__=MapResults,
            items=(list[Optional[out]], ...),  # noqa: UP045
        )
        model.stage_ids = (stage.id,)
        _map_models[stage] = model
    return model
