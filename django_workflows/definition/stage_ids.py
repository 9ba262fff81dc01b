"""Stage-id helpers (SPEC WF-55..58): constants for a workflow's stage ids, checks, and the
``require_stage_output`` helper.

::

    ids = create_stage_ids(order)          # or define_stage_ids(["validate", "price-shipping"])
    ids.PRICE_SHIPPING                     # "price-shipping"
    ids["VALIDATE"]                        # "validate"
    assert_valid_stage_id(order, ids.PRICE_SHIPPING)
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from pydantic import BaseModel

from .context import MissingStageOutputError, StageContext
from .stage import WorkflowDefinitionError, validate_id
from .workflow import Workflow


def stage_constant_name(stage_id: str) -> str:
    """The constant name of a stage id: upper case, ``-`` replaced by ``_`` (WF-55):
    ``"price-shipping"`` -> ``"PRICE_SHIPPING"``."""
    return stage_id.upper().replace("-", "_")


class StageIds(Mapping[str, str]):
    """A frozen map ``CONSTANT_NAME -> stage id`` (WF-56), also readable as attributes
    (``ids.PRICE_SHIPPING``). Iterates in definition order."""

    __slots__ = ("_ids",)

    def __init__(self, ids: Iterable[str]) -> None:
        mapping: dict[str, str] = {}
        for stage_id in ids:
            validate_id("stage", stage_id)
            name = stage_constant_name(stage_id)
            if name in mapping:
                what = (
                    "is listed twice"
                    if mapping[name] == stage_id
                    else (f"and {mapping[name]!r} have the same constant name {name}")
                )
                raise WorkflowDefinitionError(f"Stage id {stage_id!r} {what}")
            mapping[name] = stage_id
        object.__setattr__(self, "_ids", mapping)

    def __getitem__(self, name: str) -> str:
        try:
            return self._ids[name]
        except KeyError:
            raise KeyError(
                f"No stage id constant {name!r}; defined: {', '.join(self._ids) or '(none)'}"
            ) from None

    def __getattr__(self, name: str) -> str:
        if name.startswith("_"):
            raise AttributeError(name)
        try:
            return self._ids[name]
        except KeyError:
            raise AttributeError(
                f"No stage id constant {name!r}; defined: {', '.join(self._ids) or '(none)'}"
            ) from None

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("StageIds is frozen")

    def __iter__(self) -> Iterator[str]:
        return iter(self._ids)

    def __len__(self) -> int:
        return len(self._ids)

    def __repr__(self) -> str:
        return f"StageIds({self._ids!r})"


def create_stage_ids(workflow: Workflow) -> StageIds:
    """The :class:`StageIds` of every stage of ``workflow`` (WF-56 ``createStageIds``).

    Raises:
        WorkflowDefinitionError: two stage ids map to the same constant name (``a-b``, ``a_b``).
    """
    return StageIds(workflow.stage_ids)


def define_stage_ids(ids: Iterable[str]) -> StageIds:
    """:class:`StageIds` from a list of ids (WF-56 ``defineStageIds``).

    Raises:
        WorkflowDefinitionError: a malformed id, an id listed twice, or two ids with the same
            constant name.
    """
    if isinstance(ids, str):
        raise WorkflowDefinitionError(f"define_stage_ids() expects a list of ids, got {ids!r}")
    return StageIds(ids)


def is_valid_stage_id(workflow: Workflow, stage_id: str) -> bool:
    """Whether ``workflow`` has a stage ``stage_id`` (WF-57)."""
    return workflow.has_stage(stage_id)


def assert_valid_stage_id(workflow: Workflow, stage_id: str) -> str:
    """Return ``stage_id`` if ``workflow`` has that stage (WF-57).

    Raises:
        WorkflowDefinitionError: it has not; the message names the id, the workflow and the
            valid ids.
    """
    if not workflow.has_stage(stage_id):
        raise WorkflowDefinitionError(
            f"Invalid stage id {stage_id!r} for workflow {workflow.id!r}; "
            f"valid stage ids: {', '.join(workflow.stage_ids)}"
        )
    return stage_id


def require_stage_output(
    ctx: StageContext[Any, Any], stage_id: str, field: str | None = None
) -> Any:
    """The output of an earlier stage, or one field of it (WF-58; kept for parity, prefer
    ``ctx.require``). A stored ``None`` output counts as present (only a missing one is
    absent, the 0.11 fix).

    Raises:
        MissingStageOutputError: the stage's output is not in the context, or ``field`` is
            given and the output is not an object (model or dict) with that field ("Missing
            required field").
    """
    output = ctx.require(stage_id)
    if field is None:
        return output
    if isinstance(output, BaseModel):
        if field in type(output).model_fields:
            return getattr(output, field)
        data = output.model_dump(by_alias=True)
        if field in data:
            return data[field]
    elif isinstance(output, Mapping) and field in output:
        return output[field]
    raise MissingStageOutputError(
        f"Missing required field {field!r} in the output of stage {stage_id!r}"
    )
