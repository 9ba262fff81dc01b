"""Workflow builder and the immutable workflow it builds (SPEC §3.5-3.8; Part I item 5).

::

    workflow = (
        define_workflow(id="docs", name="Document pipeline", input=DocsInput)
        .pipe(discover)                        # execution group 1
        .parallel([parse_metadata, text_stats])  # execution group 2
        .pipe(report)                          # execution group 3
        .build()
    )

Groups run in order; the stages of one group run in parallel. A stage in group ``n > 1``
receives the output of group ``n - 1``: the single stage's output, or ``{stage_id: output}``
for a parallel group (WF-40).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model

from .conditions import BranchSpot, Condition
from .mapping import MapContext, MapResults, MapSpec, validate_map
from .stage import NoInput, Stage, WorkflowDefinitionError, format_validation_error, validate_id

#: Explicit definition versions (``define_workflow(version=...)``): 1-64 printable characters
#: without spaces, not starting with :data:`FINGERPRINT_PREFIX` (reserved for fingerprints).
VERSION_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:+@/-]{0,63}$")
#: A fingerprint version is this prefix and 16 hex digits of a SHA-256 (see
#: :meth:`Workflow.fingerprint_material`).
FINGERPRINT_PREFIX = "fp-"
#: Bumped when the fingerprint material changes shape (it is part of the hashed document).
FINGERPRINT_FORMAT = 2


def _validate_version(workflow_id: str, field: str, value: object) -> str:
    if not isinstance(value, str) or not VERSION_PATTERN.match(value):
        raise WorkflowDefinitionError(
            f"Workflow {workflow_id!r}: {field} must be a string of 1-64 letters, digits or "
            f"'._:+@/-' starting with a letter or digit, got {value!r}"
        )
    return value


#: Schema keywords that document rather than constrain: dropped from the fingerprint.
_ANNOTATION_KEYWORDS = frozenset({"title", "description", "examples", "default"})
#: Keywords whose value maps names (field names, definition names) to schemas.
_SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions"})


def _schema(model: type[BaseModel] | None) -> Any:
    """The model's JSON schema normalised for the fingerprint (:func:`normalise_schema`)."""
    return None if model is None else normalise_schema(model.model_json_schema())


def normalise_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` without what does not change which values validate: the keywords
    ``title``, ``description``, ``examples`` and ``default`` are dropped at every level
    (schema keywords only: property names, the keys of ``properties``, stay), and the
    ``$defs`` entries are renamed ``d0``, ``d1``, ... in the order their first ``$ref`` is
    reached walking the schema with sorted keys (``$ref`` values and a discriminator's
    ``mapping`` rewritten to match), so
    renaming a model class or editing a docstring keeps the fingerprint. Unreferenced
    definitions are dropped. Returns a new dict; ``schema`` is not changed.
    """
    defs: dict[str, Any] = dict(schema.get("$defs") or {})
    names: dict[str, str] = {}
    order: list[str] = []

    def ref_name(ref: str) -> str:
        prefix = "#/$defs/"
        if not ref.startswith(prefix):
            return ref
        old = ref[len(prefix) :]
        if old not in names:
            names[old] = f"d{len(names)}"
            order.append(old)
        return prefix + names[old]

    def walk(node: Any) -> Any:
        if isinstance(node, list):
            return [walk(item) for item in node]
        if not isinstance(node, dict):
            return node
        out: dict[str, Any] = {}
        for key in sorted(node):
            value = node[key]
            if key in _ANNOTATION_KEYWORDS or key == "$defs":
                continue
            if key == "$ref" and isinstance(value, str):
                out[key] = ref_name(value)
            elif key == "mapping" and isinstance(value, dict):  # a discriminator's refs
                out[key] = {
                    name: ref_name(ref) if isinstance(ref, str) else walk(ref)
                    for name, ref in sorted(value.items())
                }
            elif key == "required" and isinstance(value, list):
                out[key] = sorted(value)  # a set of field names: declaration order is moot
            elif key in _SCHEMA_MAPS and isinstance(value, dict):
                out[key] = {name: walk(value[name]) for name in sorted(value)}
            else:
                out[key] = walk(value)
        return out

    result = walk(schema)
    normalised: dict[str, Any] = {}
    index = 0
    while index < len(order):  # walking a definition may reach further definitions
        old = order[index]
        normalised[names[old]] = walk(defs.get(old, {}))
        index += 1
    if normalised:
        result["$defs"] = normalised
    return result


class ParallelInput(BaseModel):
    """Base of the models :func:`parallel_input` generates: the combined output of a parallel
    group, one field per stage. ``model["stage-id"]`` reads a field by its stage id.
    """

    model_config = ConfigDict(populate_by_name=True)
    #: The stage ids of the group, in order.
    stage_ids: ClassVar[tuple[str, ...]] = ()

    def __getitem__(self, stage_id: str) -> Any:
        """The output of ``stage_id``. Raises ``KeyError`` naming the group's stage ids."""
        for name, info in type(self).model_fields.items():
            if info.alias == stage_id:
                return getattr(self, name)
        raise KeyError(
            f"{stage_id!r} is not a stage of this parallel group; stages: "
            f"{', '.join(self.stage_ids)}"
        )


_parallel_models: dict[tuple[Stage, ...], type[ParallelInput]] = {}


def _field_name(stage_id: str) -> str:
    name = stage_id.replace("-", "_")
    return f"stage_{name}" if name[0].isdigit() else name


def parallel_input(*stages: Stage, optional: Iterable[str] = ()) -> type[ParallelInput]:
    """The input model of the stage after ``.parallel([a, b])``: the group's combined output
    ``{stage_id: output}`` (WF-40) as a pydantic model, one field per stage - named after its
    id with ``-`` as ``_`` (``parse-metadata`` -> ``parse_metadata``), aliased to the id, typed
    with the stage's output model (``Any`` without one).

    Use it as the next stage's input annotation::

        Checked = parallel_input(reserve_stock, price_shipping)

        @stage(id="confirm")
        def confirm(ctx: StageContext[Checked]) -> Confirmation:
            ctx.input.reserve_stock  # or ctx.input["reserve-stock"]

    The same stages give the same model class (so it can be named twice). The builder checks
    that a stage with such an input follows exactly that parallel group.

    A stage that may be SKIPPED (``when=``, ``docs/conditions.md``) is ``None`` in the model:
    its field is ``Optional`` (default ``None``) when the stage has its own ``when`` or its id
    is in ``optional`` (for a ``when=`` given to ``.parallel()`` or ``.pipe()``); the builder
    checks that every conditional stage of the group has such a field.

    Raises:
        WorkflowDefinitionError: no stage, something that is not a :class:`Stage`, a
            repeated stage id, or an ``optional`` id that is not one of ``stages``.
    """
    if not stages:
        raise WorkflowDefinitionError("parallel_input() needs at least one stage")
    for item in stages:
        if not isinstance(item, Stage):
            raise WorkflowDefinitionError(f"parallel_input() expects stages, got {item!r}")
    ids = [item.id for item in stages]
    dupes = sorted({i for i in ids if ids.count(i) > 1})
    if dupes:
        raise WorkflowDefinitionError(f"parallel_input(): duplicate stage ids {', '.join(dupes)}")
    if isinstance(optional, str):
        optional = (optional,)
    maybe = frozenset(optional)
    unknown = sorted(maybe - set(ids))
    if unknown:
        raise WorkflowDefinitionError(
            f"parallel_input(): optional names {', '.join(unknown)}, not one of the stages "
            f"{', '.join(ids)}"
        )
    maybe |= {item.id for item in stages if item.when is not None}
    key = (*stages, *sorted(maybe)) if maybe else tuple(stages)
    model = _parallel_models.get(key)  # type: ignore[arg-type]
    if model is None:
        fields: dict[str, Any] = {
            _field_name(item.id): (
                (item.output_model or Any) | None if item.id in maybe else item.output_model or Any,
                Field(None, alias=item.id) if item.id in maybe else Field(alias=item.id),
            )
            for item in stages
        }
        name = "".join(part.capitalize() for i in ids for part in i.replace("_", "-").split("-"))
        model = create_model(  # type: ignore[call-overload]
            f"{name}Input", __base__=ParallelInput, **fields
        )
        model.stage_ids = tuple(ids)
        _parallel_models[key] = model  # type: ignore[index]
    return model


@dataclass(frozen=True)
class WorkflowLimits:
    """A workflow's shared limits (issue 18 item 6; docs/limits.md), enforced by the database
    when a job is leased or a PENDING run is claimed.

    ``max_running_stages``: at most this many RUNNING jobs (stage deliveries) of the workflow
    across the cluster; ``None``: no limit. ``concurrency_key``: ``key(input) -> str | None``,
    called once when a run is created with the validated input model; the result (a string,
    at most :data:`MAX_CONCURRENCY_KEY_LENGTH` characters) is stored on the run
    (``WorkflowRun.concurrency_key``); ``None`` means the run is not limited.
    ``max_running_per_key``: at most this many RUNNING runs of the workflow per key (the
    others stay PENDING and start oldest first when a slot frees).
    """

    max_running_stages: int | None = None
    concurrency_key: Any = None
    max_running_per_key: int | None = None

    def structure(self) -> dict[str, Any]:
        """``{"max_running_stages": N, "max_running_per_key": N, "concurrency_key": True}``,
        only the parts used."""
        out: dict[str, Any] = {}
        if self.max_running_stages is not None:
            out["max_running_stages"] = self.max_running_stages
        if self.concurrency_key is not None:
            out["concurrency_key"] = True
            out["max_running_per_key"] = self.max_running_per_key
        return out


#: The longest concurrency key a run may carry (``WorkflowRun.concurrency_key``).
MAX_CONCURRENCY_KEY_LENGTH = 200


def _positive_int(workflow_id: str, field: str, value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise WorkflowDefinitionError(
            f"Workflow {workflow_id!r}: {field} must be a positive integer or None, got {value!r}"
        )
    return value


def make_limits(
    workflow_id: str,
    max_running_stages: Any = None,
    concurrency_key: Any = None,
    max_running_per_key: Any = None,
) -> WorkflowLimits | None:
    """Validated :class:`WorkflowLimits`, or ``None`` when no limit is declared.

    Raises:
        WorkflowDefinitionError: a limit that is not a positive integer, a
            ``concurrency_key`` that is not callable, or ``max_running_per_key`` without a
            ``concurrency_key``; the message names the field.
    """
    stages = _positive_int(workflow_id, "max_running_stages", max_running_stages)
    per_key = _positive_int(workflow_id, "max_running_per_key", max_running_per_key)
    if concurrency_key is not None and not callable(concurrency_key):
        raise WorkflowDefinitionError(
            f"Workflow {workflow_id!r}: concurrency_key must be a callable "
            f"(input -> str | None), got {concurrency_key!r}"
        )
    if per_key is not None and concurrency_key is None:
        raise WorkflowDefinitionError(
            f"Workflow {workflow_id!r}: max_running_per_key needs a concurrency_key "
            "(a callable computing the key from the run input)"
        )
    if concurrency_key is not None and per_key is None:
        per_key = 1
    if stages is None and concurrency_key is None:
        return None
    return WorkflowLimits(stages, concurrency_key, per_key)


@dataclass(frozen=True)
class StageNode:
    """A stage placed in a workflow: its 1-based execution group and stage number (WF-31/32)."""

    stage: Stage
    execution_group: int
    stage_number: int
    #: The stage's condition (``when=``): ``None`` for a stage that always runs.
    when: Condition | None = None
    #: Where the stage sits in a branch block (``.branch()``), ``None`` outside one.
    branch: BranchSpot | None = None

    @property
    def conditional(self) -> bool:
        """Whether the stage may be SKIPPED (it has a condition or is in a branch)."""
        return self.when is not None or self.branch is not None

    #: How the stage fans out (``.map()``; issue 18 item 3), ``None`` for a plain stage.
    map: MapSpec | None = None


class Workflow:
    """A built, immutable workflow definition (WF-34, WF-37)."""

    def __init__(
        self,
        *,
        id: str,
        name: str,
        description: str,
        input_model: type[BaseModel],
        groups: Sequence[Sequence[Stage]],
        version: str | None = None,
        takes_over: Iterable[str] = (),
        placements: dict[str, tuple[Condition | None, BranchSpot | None]] | None = None,
        maps: Mapping[str, MapSpec] | None = None,
        limits: WorkflowLimits | None = None,
    ) -> None:
        self.id = id
        self.name = name
        maps = dict(maps or {})
        #: Whether any stage is a map stage (the kernel's fan-out code runs only then).
        self.has_maps = bool(maps)
        #: Shared limits (issue 18 item 6), ``None`` when the workflow declares none.
        self.limits: WorkflowLimits | None = limits
        self.description = description
        self.input_model = input_model
        self._groups: tuple[tuple[StageNode, ...], ...] = ()
        nodes: list[tuple[StageNode, ...]] = []
        number = 0
        for group_index, group in enumerate(groups, start=1):
            placed = []
            for stage in group:
                number += 1
                when, spot = (placements or {}).get(stage.id, (None, None))
                when = when or Condition.of(stage.when)
                placed.append(StageNode(stage, group_index, number, when, spot, maps.get(stage.id)))
            nodes.append(tuple(placed))
        self._groups = tuple(nodes)
        #: Whether any stage may be SKIPPED (``when=`` or a branch): the transition rules
        #: take the conditional path (:mod:`..kernel.stage_path.conditions`) only then.
        self.has_conditions = any(n.conditional for g in self._groups for n in g)
        self._by_id = {node.stage.id: node for group in self._groups for node in group}
        _check_child_cycles(id, self._groups)
        #: Whether :attr:`version` was given (``define_workflow(version=...)``) rather than
        #: computed (:meth:`fingerprint`).
        self.version_is_explicit = version is not None
        if version is not None:
            _validate_version(id, "version", version)
            if version.startswith(FINGERPRINT_PREFIX):
                raise WorkflowDefinitionError(
                    f"Workflow {id!r}: version {version!r} may not start with "
                    f"{FINGERPRINT_PREFIX!r} (reserved for fingerprints); leave version unset "
                    "to use the fingerprint"
                )
        #: The definition version every run of this workflow records
        #: (``WorkflowRun.definition_version``): the explicit version, else the fingerprint.
        self.version: str = version if version is not None else self.fingerprint()
        if isinstance(takes_over, str):
            raise WorkflowDefinitionError(
                f"Workflow {id!r}: takes_over must be a list of versions, not the string "
                f"{takes_over!r}"
            )
        older = tuple(_validate_version(id, "takes_over", v) for v in takes_over)
        if self.version in older:
            raise WorkflowDefinitionError(
                f"Workflow {id!r}: takes_over lists its own version {self.version!r}"
            )
        #: Older versions whose in-flight runs this definition may execute (sorted).
        self.takes_over: tuple[str, ...] = tuple(sorted(set(older)))

    # --- queries (WF-37) ------------------------------------------------------------------

    @property
    def execution_plan(self) -> tuple[tuple[StageNode, ...], ...]:
        """Execution groups in order, each a tuple of :class:`StageNode`."""
        return self._groups

    @property
    def group_count(self) -> int:
        return len(self._groups)

    @property
    def nodes(self) -> tuple[StageNode, ...]:
        """All stage nodes in definition order."""
        return tuple(node for group in self._groups for node in group)

    @property
    def stages(self) -> tuple[Stage, ...]:
        return tuple(node.stage for node in self.nodes)

    @property
    def stage_ids(self) -> tuple[str, ...]:
        return tuple(node.stage.id for node in self.nodes)

    def has_stage(self, stage_id: str) -> bool:
        return stage_id in self._by_id

    def get_stage(self, stage_id: str) -> Stage | None:
        node = self._by_id.get(stage_id)
        return node.stage if node else None

    def node(self, stage_id: str) -> StageNode:
        """The node of ``stage_id``. Raises ``KeyError`` naming the valid ids."""
        try:
            return self._by_id[stage_id]
        except KeyError:
            raise KeyError(
                f"Stage {stage_id!r} not found in workflow {self.id!r}; "
                f"valid stage ids: {', '.join(self.stage_ids)}"
            ) from None

    def stages_in_group(self, group: int) -> tuple[StageNode, ...]:
        """Nodes of the 1-based execution group ``group`` (empty when out of range)."""
        if 1 <= group <= len(self._groups):
            return self._groups[group - 1]
        return ()

    def stage_index(self, stage_id: str) -> int:
        """0-based position of ``stage_id`` in definition order, ``-1`` if absent (WF-37)."""
        node = self._by_id.get(stage_id)
        return node.stage_number - 1 if node else -1

    def execution_group_of(self, stage_id: str) -> int:
        """The 1-based execution group of ``stage_id`` (WF-37). Raises ``KeyError`` naming the
        valid ids for an unknown id."""
        return self.node(stage_id).execution_group

    def previous_stage_id(self, stage_id: str) -> str | None:
        """The id of the stage before ``stage_id`` in definition order (``None`` for the first;
        WF-37). Raises ``KeyError`` naming the valid ids for an unknown id."""
        index = self.node(stage_id).stage_number - 1
        return self.stage_ids[index - 1] if index > 0 else None

    # --- schemas (WF-34, WF-37) -------------------------------------------------------------

    @property
    def input_schema(self) -> dict[str, Any]:
        """JSON Schema of the workflow input (the input model's)."""
        return self.input_model.model_json_schema()

    @property
    def output_schema(self) -> dict[str, Any]:
        """JSON Schema of the run's output: the last execution group's output (WF-34). For a
        single stage, its output model's schema (``{}``, any JSON value, when it declares
        none); for a parallel group, an object keyed by stage id whose members are the
        stages' output schemas (every member required: a COMPLETED run has them all). When a
        stage of the last group may be SKIPPED (``when=``, a branch), the output may come from
        an earlier group or be ``None`` (``docs/conditions.md``): ``{}``, any JSON value."""
        last = self._groups[-1] if self._groups else ()
        if any(node.conditional for node in last):
            return {}
        if len(last) == 1:
            model = last[0].stage.output_model
            return model.model_json_schema() if model is not None else {}
        return _keyed_schema(f"{self.id} output", [node.stage for node in last])

    def stage_configs(self) -> dict[str, dict[str, Any]]:
        """``{stage_id: {"schema", "defaults", "name", "description"}}`` for every stage, in
        definition order (WF-37); ``schema`` is the config model's JSON Schema."""
        return {
            node.stage.id: {
                "schema": node.stage.config_model.model_json_schema(),
                "defaults": node.stage.default_config,
                "name": node.stage.name,
                "description": node.stage.description,
            }
            for node in self.nodes
        }

    def estimate_cost(self, input: Any, config: dict[str, Any] | None = None) -> float:
        """Sum of every stage's ``estimate_cost(input, config[stage_id] or {})`` (stages
        without an estimator count 0; WF-37, deprecated upstream, kept for parity)."""
        config = config or {}
        return float(
            sum(
                stage.estimate_cost(input, config.get(stage.id) or {})
                for stage in self.stages
                if stage.estimate_cost is not None
            )
        )

    def execution_order(self) -> str:
        """A human-readable plan, one line per execution group (WF-37)::

        1. validate
        2. reserve | price-shipping (parallel)
        3. confirm
        """
        lines = []
        for number, group in enumerate(self._groups, start=1):
            ids = " | ".join(node.stage.id for node in group)
            lines.append(f"{number}. {ids}{' (parallel)' if len(group) > 1 else ''}")
        return "\n".join(lines)

    # --- definition versions (issue 12 item 3) --------------------------------------------

    @property
    def runs_versions(self) -> tuple[str, ...]:
        """The versions whose runs this definition executes: its own, then :attr:`takes_over`."""
        return (self.version, *self.takes_over)

    def fingerprint_material(self) -> dict[str, Any]:
        """What the fingerprint hashes: the execution groups in order, each stage's id, kind
        (``mode``: ``"sync"`` / ``"async-batch"``) and the JSON schemas of its input, output
        and config models (``None`` for a stage without an output model), plus the workflow's
        input schema and :data:`FINGERPRINT_FORMAT`. Each schema is normalised
        (:func:`normalise_schema`): no ``title``, ``description``, ``examples`` or
        ``default`` keywords, ``$defs`` renamed canonically.

        Names, descriptions, queues, docstrings, ``Field(description=...)``, default values,
        model class names, the numbers of the shared limits and the stage functions' code
        are not in it (a ``concurrency_key`` adds ``"limit"``): renaming a stage's
        title, a model class, or moving a stage to another pool keeps the version; adding,
        removing, re-ordering or re-typing a stage or a field, or changing whether a field
        is required, changes it.
        """
        material: dict[str, Any] = {
            "format": FINGERPRINT_FORMAT,
            "input": _schema(self.input_model),
            "groups": [
                [
                    {
                        "id": node.stage.id,
                        "kind": node.stage.mode,
                        "input": _schema(node.stage.input_model),
                        "output": _schema(node.stage.output_model),
                        "config": _schema(node.stage.config_model),
                        **_placement(node, fingerprint=True),
                        **(
                            {"map": node.map.describe(fingerprint=True)}
                            if node.map is not None
                            else {}
                        ),
                        # only when used: every other workflow keeps its fingerprint
                        **(
                            {"signal": node.stage.signal.fingerprint_material()}
                            if node.stage.signal is not None
                            else {}
                        ),
                        # Only on a child-workflow stage: which workflow it starts.
                        **(
                            {"child": node.stage.child.workflow_id}
                            if node.stage.child is not None
                            else {}
                        ),
                    }
                    for node in group
                ]
                for group in self._groups
            ],
        }
        if self.limits is not None and self.limits.concurrency_key is not None:
            # Only whether runs carry a concurrency key (issue 18 item 6): the limits' numbers
            # are tuning knobs, changing them keeps the version.
            material["limit"] = {"concurrency_key": True}
        return material

    def fingerprint(self) -> str:
        """``"fp-"`` and the first 16 hex digits of the SHA-256 of
        :meth:`fingerprint_material` as canonical JSON (keys sorted, no spaces, ASCII): the
        same in every process and Python version for the same definition (no ``hash()``, no
        object ids); it changes with the pydantic schema output only if pydantic changes it.
        """
        text = json.dumps(
            self.fingerprint_material(), sort_keys=True, separators=(",", ":"), ensure_ascii=True
        )
        return FINGERPRINT_PREFIX + hashlib.sha256(text.encode("ascii")).hexdigest()[:16]

    def structure(self) -> dict[str, Any]:
        """The definition as stored once per version (``WorkflowDefinitionVersion.structure``)
        for the admin's view of a run: ``{"name", "groups": [[{"id", "name", "kind",
        "queue"}, ...], ...]}``; a conditional stage adds ``"when": {"predicate", "reason"}``
        and a stage of a branch block ``"branch": {"id", "chooser", "branches", "name"}``;
        a ``wait_for_signal`` stage also has ``"signal"``
        (:meth:`~django_workflows.definition.signal.SignalWait.structure`); the workflow has
        ``"limit"`` (:meth:`WorkflowLimits.structure`) when it declares shared limits.
        """
        out: dict[str, Any] = {
            "name": self.name,
            "groups": [
                [
                    {
                        "id": node.stage.id,
                        "name": node.stage.name,
                        "kind": node.stage.mode,
                        "queue": node.stage.queue,
                        **_placement(node),
                        **({"map": node.map.describe()} if node.map is not None else {}),
                        **(
                            {"signal": node.stage.signal.structure()}
                            if node.stage.signal is not None
                            else {}
                        ),
                        **(
                            {"child": {"workflow_id": node.stage.child.workflow_id}}
                            if node.stage.child is not None
                            else {}
                        ),
                    }
                    for node in group
                ]
                for group in self._groups
            ],
        }
        if self.limits is not None:
            out["limit"] = self.limits.structure()
        return out

    # --- config and input (WF-42..44, K-CR-2/3) -------------------------------------------

    def default_config(self) -> dict[str, dict[str, Any]]:
        """``{stage_id: defaults}`` for every stage (WF-43)."""
        return {node.stage.id: node.stage.default_config for node in self.nodes}

    def merge_config(self, config: dict[str, Any] | None) -> dict[str, Any]:
        """Shallow merge of defaults and the caller's map (WF-44)."""
        return {**self.default_config(), **(config or {})}

    def validate_config(self, config: dict[str, Any]) -> list[tuple[str, str]]:
        """Every config error as ``(stage_id, "Config validation failed: ...")`` (WF-42)."""
        errors = []
        for node in self.nodes:
            error = node.stage.validate_config(config.get(node.stage.id) or {})
            if error:
                errors.append((node.stage.id, f"Config validation failed: {error}"))
        return errors

    def parse_input(self, raw: Any) -> BaseModel:
        """Validate the workflow input. Raises ``pydantic.ValidationError``."""
        return self.input_model.model_validate(raw)

    def input_errors(self, raw: Any) -> str | None:
        """Why ``raw`` is not a valid input of this workflow, or ``None``."""
        try:
            self.parse_input(raw)
        except ValidationError as exc:
            return format_validation_error(exc)
        except RecursionError:
            return "the input is nested too deeply (more than about 900 levels)"
        return None

    def __repr__(self) -> str:
        return f"<Workflow {self.id}: {' -> '.join(self.describe_groups())}>"

    def describe_groups(self) -> list[str]:
        """One text per execution group, e.g. ``"discover"`` or ``"[a | b]"``."""
        out = []
        for group in self._groups:
            ids = [node.stage.id for node in group]
            out.append(ids[0] if len(ids) == 1 else "[" + " | ".join(ids) + "]")
        return out


def _placement(node: StageNode, *, fingerprint: bool = False) -> dict[str, Any]:
    """The ``when`` / ``branch`` keys of a stage in the structure and the fingerprint
    material: present only when used, so an unconditional stage keeps its fingerprint. The
    fingerprint has the predicate's and chooser's names, not the reason text."""
    out: dict[str, Any] = {}
    if node.when is not None:
        out["when"] = node.when.name if fingerprint else node.when.structure()
    if node.branch is not None:
        spot = node.branch.structure()
        if fingerprint:
            spot.pop("chooser")
        out["branch"] = spot
    return out


def _keyed_schema(title: str, stages: Sequence[Stage]) -> dict[str, Any]:
    """JSON Schema of ``{stage_id: output}`` over ``stages``, with one ``$defs`` for all.

    The output models' schemas are generated together (pydantic's ``models_json_schema``), so
    two different models with one class name (``class Result`` in two modules, nested or not)
    get distinct ``$defs`` names (qualified by module) instead of one overwriting the other.
    A stage's own model is inlined under its stage id unless something else refers to it (a
    recursive model, or one model shared by two stages): then the member is its ``$ref``.
    """
    from pydantic.json_schema import models_json_schema

    template = "#/$defs/{model}"
    models = list(dict.fromkeys(s.output_model for s in stages if s.output_model is not None))
    refs, top = models_json_schema([(m, "validation") for m in models], ref_template=template)
    defs: dict[str, Any] = dict(top.get("$defs", {}))
    prefix = template.format(model="")
    member = {m: refs[(m, "validation")] for m in models}
    uses: dict[str, int] = {}

    def count(value: Any) -> None:
        if isinstance(value, dict):
            ref = value.get("$ref")
            if isinstance(ref, str) and ref.startswith(prefix):
                uses[ref[len(prefix) :]] = uses.get(ref[len(prefix) :], 0) + 1
            for item in value.values():
                count(item)
        elif isinstance(value, list):
            for item in value:
                count(item)

    count(defs)
    for stage in stages:
        if stage.output_model is not None:
            count(member[stage.output_model])
    properties: dict[str, Any] = {}
    for stage in stages:
        model = stage.output_model
        if model is None:
            properties[stage.id] = {}
            continue
        ref = member[model].get("$ref", "")
        name = ref[len(prefix) :] if ref.startswith(prefix) else None
        if name in defs and uses.get(name) == 1:  # only this member refers to it: inline it
            properties[stage.id] = defs.pop(name)
        else:
            properties[stage.id] = member[model]
    out: dict[str, Any] = {
        "title": title,
        "type": "object",
        "properties": properties,
        "required": [stage.id for stage in stages],
    }
    if defs:
        out["$defs"] = defs
    return out


def _check_child_cycles(workflow_id: str, groups: Sequence[Sequence[StageNode]]) -> None:
    """No child-workflow stage may start this workflow again, directly (a stage naming its own
    workflow) or through child workflows given as objects (issue 18 item 5). A chain through
    ids resolved only at run time cannot be seen here; its depth is bounded when it runs.

    Raises:
        WorkflowDefinitionError: naming the stages of the cycle.
    """

    def walk(nodes: Iterable[StageNode], path: tuple[str, ...], seen: set[int]) -> None:
        for node in nodes:
            spec = node.stage.child
            if spec is None:
                continue
            here = (*path, f"{node.stage.id} -> {spec.workflow_id}")
            if spec.workflow_id == workflow_id:
                raise WorkflowDefinitionError(
                    f"Workflow {workflow_id!r}: child-workflow stage cycle: "
                    f"{workflow_id}: {' / '.join(here)}"
                )
            child = spec.workflow
            if isinstance(child, Workflow) and id(child) not in seen:
                seen.add(id(child))
                walk(child.nodes, here, seen)

    walk((node for group in groups for node in group), (), set())


class WorkflowBuilder:
    """Builds a :class:`Workflow` group by group (WF-30..35). Obtain one from
    :func:`define_workflow`.
    """

    def __init__(
        self,
        id: str,
        name: str,
        description: str = "",
        input: type[BaseModel] | None = None,
        version: str | None = None,
        takes_over: Iterable[str] = (),
        limits: WorkflowLimits | None = None,
    ) -> None:
        self.id = validate_id("workflow", id)
        self.limits = limits
        self.version = version
        self.takes_over = takes_over
        self.name = name or id
        self.description = description
        self.input_model = input or NoInput
        if not (isinstance(self.input_model, type) and issubclass(self.input_model, BaseModel)):
            raise WorkflowDefinitionError(
                f"Workflow {id!r}: input must be a pydantic BaseModel subclass"
            )
        self._groups: list[list[Stage]] = []
        self._ids: list[str] = []
        #: ``{stage_id: (condition, branch spot)}`` of the stages placed with either.
        self._placements: dict[str, tuple[Condition | None, BranchSpot | None]] = {}
        #: Index in ``_groups`` of the group after the last branch block (no ParallelInput).
        self._after_branch: int | None = None
        self._branch_ids: list[str] = []
        self._maps: dict[str, MapSpec] = {}

    def _check(
        self,
        stages: list[Stage],
        parallel: bool,
        *,
        known: list[str] | None = None,
        previous: list[Stage] | None = None,
        where: str = "",
        mapping: bool = False,
    ) -> None:
        for stage in stages:
            if not isinstance(stage, Stage):
                raise WorkflowDefinitionError(
                    f"Workflow {self.id!r}: expected a Stage{where}, got {stage!r}"
                )
        new_ids = [s.id for s in stages]
        dupes = sorted({i for i in new_ids if new_ids.count(i) > 1 or i in self._ids})
        if dupes:
            raise WorkflowDefinitionError(
                f"Workflow {self.id!r}: duplicate stage ids {', '.join(dupes)}"
            )
        defined = self._ids if known is None else known
        before = (self._groups[-1] if self._groups else []) if previous is None else previous
        previous_ids = [s.id for s in before]
        mapped = (
            previous_ids[0] if len(previous_ids) == 1 and previous_ids[0] in self._maps else None
        )
        for stage in stages:
            model = stage.input_model
            is_results = isinstance(model, type) and issubclass(model, MapResults)
            fits = is_results and model.stage_ids == (mapped,)
            if mapped is not None and not mapping and not fits:
                raise WorkflowDefinitionError(
                    f"Stage {stage.id!r} follows the map stage {mapped!r}: its input must be "
                    f"map_results({mapped}) (the item outputs in item order)"
                )
            if is_results and mapped is None:
                raise WorkflowDefinitionError(
                    f"Stage {stage.id!r}: its input is map_results({model.stage_ids[0]}) but "
                    f"the execution group before it is {', '.join(previous_ids) or '(none)'}, "
                    "not that map stage"
                )
            if isinstance(model, type) and issubclass(model, ParallelInput):
                if previous is None and self._after_branch == len(self._groups):
                    raise WorkflowDefinitionError(
                        f"Stage {stage.id!r}: its input is parallel_input(...) but it follows a "
                        "branch block, whose output is its chosen branch's last group"
                    )
                if list(model.stage_ids) != previous_ids:
                    raise WorkflowDefinitionError(
                        f"Stage {stage.id!r}: its input is parallel_input("
                        f"{', '.join(model.stage_ids)}) but the execution group before it is "
                        f"{', '.join(previous_ids) or '(none: it is the first)'}"
                    )
                self._check_optional(stage, model, before)
            missing = [d for d in stage.dependencies if d not in defined]
            if missing:
                place = " (in parallel group)" if parallel else ""
                current = ", ".join(defined) or "(none)"
                raise WorkflowDefinitionError(
                    f"Stage {stage.id!r} has missing dependencies{place}: {', '.join(missing)}. "
                    f"Stages defined before it: {current}"
                )

    def _check_optional(self, stage: Stage, model: type[ParallelInput], group: list[Stage]) -> None:
        """A conditional stage of ``group`` is ``None`` in ``model``: its field must allow it."""
        for sibling in group:
            placed_when = self._placements.get(sibling.id, (None, None))[0]
            if placed_when is None and sibling.when is None:
                continue
            info = model.model_fields[_field_name(sibling.id)]
            if info.is_required():
                raise WorkflowDefinitionError(
                    f"Stage {stage.id!r}: its input parallel_input({', '.join(model.stage_ids)})"
                    f" has a required field for {sibling.id!r}, which may be SKIPPED (when=); "
                    f"use parallel_input(..., optional=[{sibling.id!r}])"
                )

    def _condition(self, when: Any, what: str) -> Condition | None:
        try:
            return Condition.of(when)
        except WorkflowDefinitionError as exc:
            raise WorkflowDefinitionError(f"Workflow {self.id!r}: {what}: {exc}") from None

    def pipe(self, stage: Stage, *, when: Any = None) -> WorkflowBuilder:
        """Append ``stage`` as a new execution group of its own (WF-31).

        ``when``: a predicate ``fn(ctx) -> bool`` (``ctx`` a
        :class:`~.conditions.ConditionContext`) or a :class:`~.conditions.Condition`; false:
        the stage is SKIPPED with the condition's reason (``docs/conditions.md``). It wins
        over the stage's own ``when``.
        """
        condition = self._condition(when, f"pipe({getattr(stage, 'id', stage)!r}) when")
        self._check([stage], parallel=False)
        self._groups.append([stage])
        self._ids.append(stage.id)
        if condition is not None:
            self._placements[stage.id] = (condition, None)
        return self

    def parallel(self, stages: Iterable[Stage], *, when: Any = None) -> WorkflowBuilder:
        """Append one execution group whose stages run in parallel (WF-31).

        ``when``: one condition for the whole group (see :meth:`pipe`), evaluated once per
        stage: the group runs or is SKIPPED as a whole. A stage's own ``when`` applies when
        the group has none.

        Raises:
            WorkflowDefinitionError: an empty group (Part I item 5, EC-31b), a duplicate id, or
                a dependency on a sibling or a later stage (WF-33).
        """
        group = list(stages)
        if not group:
            raise WorkflowDefinitionError(
                f"Workflow {self.id!r}: parallel() needs at least one stage (empty group "
                f"after {', '.join(self._ids) or 'the start'})"
            )
        condition = self._condition(when, "parallel() when")
        self._check(group, parallel=True)
        self._groups.append(group)
        self._ids.extend(s.id for s in group)
        if condition is not None:
            for item in group:
                self._placements[item.id] = (condition, None)
        return self

    def branch(
        self,
        choose: Any,
        branches: Mapping[str, Sequence[Stage | Sequence[Stage]]],
        *,
        id: str | None = None,
    ) -> WorkflowBuilder:
        """Append a branch block: ``choose(ctx)`` (a :class:`~.conditions.ConditionContext`)
        returns the name of one of ``branches``; that branch's chain runs, every stage of the
        others is SKIPPED (reason: which branch was chosen). The choice is made once, when the
        block is reached, and recorded (``branch:chosen`` event).

        ``branches``: ``{name: [stage, [parallel, stages], ...]}`` in declaration order; each
        item of a chain is a stage (a group of its own) or a list of stages (a parallel
        group). The block's groups follow one another in the definition; the stage after the
        block receives the output of the chosen branch's last group (``docs/conditions.md``).

        ``id``: the block's name in events and the structure (default ``"branch-<n>"``).

        Raises:
            WorkflowDefinitionError: ``choose`` not callable, no branch, a malformed branch
                name or block id, an empty chain, a non-stage item, a stage id used twice
                (also across branches), or a dependency on a stage of another branch.
        """
        label = f"Workflow {self.id!r}: branch()"
        if not callable(choose):
            raise WorkflowDefinitionError(f"{label}: choose must be callable, got {choose!r}")
        block = f"branch-{len(self._branch_ids) + 1}" if id is None else id
        try:
            validate_id("branch", block)
        except WorkflowDefinitionError as exc:
            raise WorkflowDefinitionError(f"{label}: id: {exc}") from None
        if block in self._branch_ids:
            raise WorkflowDefinitionError(f"{label}: duplicate branch block id {block!r}")
        if not isinstance(branches, Mapping) or not branches:
            raise WorkflowDefinitionError(
                f"{label}: branches must be a non-empty mapping of branch name to a list of "
                f"stages, got {branches!r}"
            )
        names = tuple(branches)
        chains: list[tuple[str, list[list[Stage]]]] = []
        for name in names:
            try:
                validate_id("branch name", name)
            except WorkflowDefinitionError as exc:
                raise WorkflowDefinitionError(f"{label}: branches: {exc}") from None
            chain = branches[name]
            if isinstance(chain, Stage) or not isinstance(chain, Sequence) or not chain:
                raise WorkflowDefinitionError(
                    f"{label}: branches[{name!r}] must be a non-empty list of stages, got {chain!r}"
                )
            groups = [list(item) if isinstance(item, Sequence) else [item] for item in chain]
            if any(not g for g in groups):
                raise WorkflowDefinitionError(f"{label}: branches[{name!r}] has an empty group")
            chains.append((name, groups))
        all_ids = [s.id for _, groups in chains for g in groups for s in g if isinstance(s, Stage)]
        dupes = sorted({i for i in all_ids if all_ids.count(i) > 1})
        if dupes:
            raise WorkflowDefinitionError(
                f"{label}: stage ids used in more than one place: {', '.join(dupes)}"
            )
        before_ids = list(self._ids)
        before_group = self._groups[-1] if self._groups else []
        for name, groups in chains:  # check all first: nothing half-written
            known, previous = list(before_ids), before_group
            for group in groups:
                self._check(
                    group,
                    parallel=len(group) > 1,
                    known=known,
                    previous=previous,
                    where=f" in branches[{name!r}]",
                )
                known += [s.id for s in group]
                previous = group
        for name, groups in chains:
            spot = BranchSpot(block, choose, names, name)
            for group in groups:
                self._groups.append(group)
                for item in group:
                    self._ids.append(item.id)
                    self._placements[item.id] = (None, spot)
        self._branch_ids.append(block)
        self._after_branch = len(self._groups)
        return self

    def map(
        self,
        stage: Stage,
        *,
        over: Callable[[MapContext], Any],
        max_concurrency: int = 10,
        on_item_failure: str = "fail",
    ) -> WorkflowBuilder:
        """Append ``stage`` as an execution group of its own that runs once per item of
        ``over(ctx)`` (issue 18 item 3; see docs/fan-out.md).

        ``over(ctx)`` (:class:`.mapping.MapContext`: ``.input``, ``.output(stage_id)``,
        ``.config``) is called once when the group is created and must return a list (or
        tuple) of JSON values, at most :data:`.mapping.MAX_ITEMS`; each item is validated by
        the stage's input model when its job runs. ``max_concurrency``: items of one run
        PENDING or RUNNING at once (1..10000). ``on_item_failure``: ``"fail"`` or
        ``"continue"``. The next stage's input must be ``map_results(stage)``.

        Raises:
            WorkflowDefinitionError: a bad argument (naming it), a duplicate id, or an
                input model that does not fit the previous group.
        """
        self._check([stage], parallel=False, mapping=True)
        spec = validate_map(self.id, stage, over, max_concurrency, on_item_failure)
        self._groups.append([stage])
        self._ids.append(stage.id)
        self._maps[stage.id] = spec
        return self

    def build(self) -> Workflow:
        """Return the immutable workflow. Raises if it has no stage (Part I item 5)."""
        if not self._groups:
            raise WorkflowDefinitionError(f"Workflow {self.id!r} has no stages")
        return Workflow(
            id=self.id,
            name=self.name,
            description=self.description,
            input_model=self.input_model,
            groups=[list(g) for g in self._groups],
            version=self.version,
            takes_over=self.takes_over,
            placements=self._placements,
            maps=self._maps,
            limits=self.limits,
        )


def define_workflow(
    *,
    id: str,
    name: str | None = None,
    input: type[BaseModel] | None = None,
    description: str = "",
    version: str | None = None,
    takes_over: Iterable[str] = (),
    max_running_stages: int | None = None,
    concurrency_key: Any = None,
    max_running_per_key: int | None = None,
) -> WorkflowBuilder:
    """Start a workflow definition (WF-30). ``input=None`` accepts any object and ignores it.

    Args:
        version: the definition version its runs record (issue 12 item 3): 1-64 letters,
            digits or ``._:+@/-``; default: the fingerprint of the structure and schemas
            (:meth:`Workflow.fingerprint`).
        takes_over: older versions whose in-flight runs this definition may execute (a
            worker with it also leases their jobs); must not include ``version``.
        max_running_stages: at most this many stages of this workflow RUNNING at once across
            the cluster (issue 18 item 6, docs/limits.md); ``None``: no limit.
        concurrency_key: ``key(input) -> str | None`` computed once per run from its
            validated input (e.g. ``lambda i: i.customer_id``); runs with the same key share
            ``max_running_per_key`` slots.
        max_running_per_key: at most this many RUNNING runs per key (default 1 when
            ``concurrency_key`` is given); the others stay PENDING and start in order.

    Raises:
        WorkflowDefinitionError: a limit that is not a positive integer, a non-callable
            ``concurrency_key``, ``max_running_per_key`` without ``concurrency_key`` (at
            once); (at :meth:`WorkflowBuilder.build`) a malformed ``version`` or
            ``takes_over`` entry, naming the field.
    """
    limits = make_limits(id, max_running_stages, concurrency_key, max_running_per_key)
    return WorkflowBuilder(id, name or id, description, input, version, takes_over, limits)
