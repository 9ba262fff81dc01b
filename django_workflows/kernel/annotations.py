"""``kernel.annotations``: attach annotations from outside a stage and list a run's timeline
(SPEC §6.2-6.6, AN-8..AN-10, AN-20..AN-24, AN-30..AN-32, AN-40; Part I items 16 and 17).

* :meth:`AnnotationsAPI.attach` writes one row per non-``None`` attribute and the opted-in
  ``annotation:created`` events in **one** transaction that locks the run row; an unknown run
  raises :class:`RunNotFoundError` (Part I item 17). A repeated ``(key, idempotency_key)`` is
  skipped and emits nothing (AN-8, Part I item 16).
* :meth:`AnnotationsAPI.list` / :func:`list_annotations` AND the filters of AN-9 and return rows
  ordered by ``created_at`` then ``id``, merged with the rows the legacy metadata shim
  synthesises (AN-30..AN-32). Every filter is served by an index of ``workflow_annotations``.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

from django.db import transaction
from django.db.models import F, Lookup

from ..annotations import (
    LEGACY_METADATA_PREFIX,
    AnnotationError,
    AnnotationInput,
    build_inputs,
    check_scope,
    inputs_from_envelope,
)
from ..definition.results import UNSET
from ..models import WorkflowAnnotation, WorkflowRun, WorkflowStage
from .annotation_spec import AnnotationSpec
from .errors import InvalidCommandError, RunNotFoundError, StageNotFoundError
from .locking import lock_run, parse_run_id
from .outbox import append_events, new_causation_id
from .store import insert_annotations

if TYPE_CHECKING:
    from .dispatch import Kernel

#: Rows :func:`list_annotations` returns when no ``limit`` is given (AN-9).
DEFAULT_LIST_LIMIT = 1000


@dataclass(frozen=True)
class AnnotationRecord:
    """One annotation as listed (SPEC §1.6). ``id`` is the row id, or
    ``"synthesized:{run_id}:{key}"`` for a row the legacy metadata shim made up (AN-31);
    ``stage_record_id`` is ``None`` for run-scope rows and for rows whose stage record a rerun
    deleted (AN-13).
    """

    id: int | str
    created_at: datetime
    workflow_run_id: str
    stage_record_id: str | None
    generation: int
    scope: str
    scope_id: str | None
    actor_kind: str | None
    actor_id: str | None
    actor_version: str | None
    key: str
    value: Any
    payload: Any
    idempotency_key: str | None

    @property
    def synthesized(self) -> bool:
        """True for a virtual row of the legacy metadata shim (AN-31)."""
        return isinstance(self.id, str)

    @property
    def actor(self) -> dict[str, str] | None:
        """``{"kind", "id", "version"}`` of the actor (absent members left out), or ``None``."""
        out = {
            name: value
            for name, value in (
                ("kind", self.actor_kind),
                ("id", self.actor_id),
                ("version", self.actor_version),
            )
            if value is not None
        }
        return out or None

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (``created_at`` as ISO-8601)."""
        data = asdict(self)
        data["created_at"] = self.created_at.isoformat()
        return data

    @classmethod
    def from_row(cls, row: WorkflowAnnotation) -> AnnotationRecord:
        return cls(
            id=row.pk,
            created_at=row.created_at,
            workflow_run_id=str(row.run_id),
            stage_record_id=str(row.stage_record_id) if row.stage_record_id else None,
            generation=row.generation,
            scope=row.scope,
            scope_id=row.scope_id,
            actor_kind=row.actor_kind,
            actor_id=row.actor_id,
            actor_version=row.actor_version,
            key=row.key,
            value=row.value,
            payload=row.payload,
            idempotency_key=row.idempotency_key,
        )


@dataclass(frozen=True)
class AttachResult:
    """What :meth:`AnnotationsAPI.attach` wrote: ``created`` rows, and ``duplicates`` inputs
    skipped because their ``(key, idempotency_key)`` was already on the run (AN-8).
    """

    created: int
    duplicates: int


# --- key prefix lookup --------------------------------------------------------------------------


class KeyStartsWith(Lookup):  # type: ignore[type-arg]
    """Case-sensitive ``starts with`` that an index can serve on both databases.

    PostgreSQL: ``key LIKE 'prefix%'`` (escaped), served by the ``varchar_pattern_ops`` index on
    ``(run, key)``. SQLite: ``key GLOB 'prefix*'`` - SQLite's ``LIKE`` ignores case, ``GLOB``
    does not and can use the ``(run, key)`` index. Used as ``.filter(KeyStartsWith(F("key"),
    prefix))``; not registered as a field lookup.
    """

    lookup_name = "dw_key_startswith"
    prepare_rhs = False

    def as_sql(self, compiler: Any, connection: Any) -> tuple[str, list[Any]]:
        lhs, params = self.process_lhs(compiler, connection)
        prefix = str(self.rhs)
        escaped = prefix.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
        return f"{lhs} LIKE %s", [*params, escaped + "%"]

    def as_sqlite(self, compiler: Any, connection: Any) -> tuple[str, list[Any]]:
        lhs, params = self.process_lhs(compiler, connection)
        prefix = str(self.rhs)
        escaped = "".join(f"[{c}]" if c in "*?[" else c for c in prefix)
        return f"{lhs} GLOB %s", [*params, escaped + "*"]


# --- validation helpers -------------------------------------------------------------------------


def _invalid(exc: AnnotationError) -> InvalidCommandError:
    return InvalidCommandError(str(exc), field=exc.field)


def inputs_from_specs(specs: Any) -> list[AnnotationInput]:
    """Validate the ``annotations`` of ``run.create`` (AN-20): a list of
    :class:`~django_workflows.kernel.commands.AnnotationSpec` or envelope dicts
    (``{"attributes": {...}, "actor": ..., ...}``).

    Raises:
        InvalidCommandError: ``field`` names the entry and member, e.g.
            ``annotations[1].attributes.trigger.source``.
    """
    if specs is None:
        return []
    if isinstance(specs, str | bytes | Mapping) or not isinstance(specs, Sequence):
        raise InvalidCommandError(
            "annotations: expected a list of AnnotationSpec (or envelope objects)",
            field="annotations",
        )
    out: list[AnnotationInput] = []
    for index, spec in enumerate(specs):
        prefix = f"annotations[{index}]."
        try:
            if isinstance(spec, AnnotationSpec):
                out += build_inputs(
                    spec.attributes,
                    actor=spec.actor,
                    payload=spec.payload,
                    idempotency_key=spec.idempotency_key,
                    emit_event=spec.emit_event,
                    field_prefix=prefix,
                )
            elif isinstance(spec, Mapping):
                out += inputs_from_envelope(spec, field_prefix=prefix)
            else:
                raise InvalidCommandError(
                    f"annotations[{index}]: expected an AnnotationSpec or an object with "
                    f"'attributes', got {type(spec).__name__}",
                    field=f"annotations[{index}]",
                )
        except AnnotationError as exc:
            raise _invalid(exc) from None
    return out


def _optional_str(value: Any, name: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise InvalidCommandError(f"{name}: expected a string, got {value!r}", field=name)
    return value


def _generation(value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidCommandError(
            f"generation: expected an integer >= 0, got {value!r}", field="generation"
        )
    return value


def _datetime(value: Any, name: str) -> datetime | None:
    if value is None:
        return None
    if not isinstance(value, datetime) or value.tzinfo is None:
        raise InvalidCommandError(
            f"{name}: expected a timezone-aware datetime, got {value!r}", field=name
        )
    return value


# --- list ---------------------------------------------------------------------------------------


def _legacy_could_match(
    key: str | None,
    key_prefix: str | None,
    scope: str | None,
    scope_id: Any,
    actor_id: str | None,
    actor_kind: str | None,
    generation: int | None,
) -> bool:
    """AN-30 (1): could the filters match a synthesised ``legacy.metadata.*`` run-scope row?"""
    if scope not in (None, "run") or scope_id not in (UNSET, None):
        return False
    if actor_id is not None or actor_kind is not None or generation not in (None, 0):
        return False
    if key is not None:
        return key.startswith(LEGACY_METADATA_PREFIX)
    if key_prefix is not None:
        return LEGACY_METADATA_PREFIX.startswith(key_prefix) or key_prefix.startswith(
            LEGACY_METADATA_PREFIX
        )
    return True


def _legacy_rows(
    run_id: uuid.UUID,
    key: str | None,
    key_prefix: str | None,
    since: datetime | None,
    until: datetime | None,
) -> list[AnnotationRecord]:
    """AN-30 (2, 3), AN-31: the virtual rows of the run's deprecated ``metadata``."""
    run = WorkflowRun.objects.filter(pk=run_id).values("created_at", "metadata").first()
    if run is None or not isinstance(run["metadata"], dict) or not run["metadata"]:
        return []
    migrated = (
        WorkflowAnnotation.objects.filter(run_id=run_id)
        .filter(KeyStartsWith(F("key"), LEGACY_METADATA_PREFIX))
        .exists()
    )
    if migrated:  # a partial manual migration disables synthesis entirely (AN-30 2)
        return []
    created_at: datetime = run["created_at"]
    if (since is not None and created_at < since) or (until is not None and created_at > until):
        return []
    rows = []
    for name, value in run["metadata"].items():
        full = f"{LEGACY_METADATA_PREFIX}{name}"
        if key is not None and full != key:
            continue
        if key is None and key_prefix is not None and not full.startswith(key_prefix):
            continue
        rows.append(
            AnnotationRecord(
                id=f"synthesized:{run_id}:{name}",
                created_at=created_at,
                workflow_run_id=str(run_id),
                stage_record_id=None,
                generation=0,
                scope="run",
                scope_id=None,
                actor_kind=None,
                actor_id=None,
                actor_version=None,
                key=full,
                value=value,
                payload=None,
                idempotency_key=None,
            )
        )
    return rows


#: ``values_list`` columns in :class:`AnnotationRecord` field order (without the run id).
_LIST_FIELDS = (
    "id",
    "created_at",
    "stage_record_id",
    "generation",
    "scope",
    "scope_id",
    "actor_kind",
    "actor_id",
    "actor_version",
    "key",
    "value",
    "payload",
    "idempotency_key",
)


def _order(record: AnnotationRecord) -> tuple[Any, ...]:
    # persisted rows keep their id order; synthesised ids sort after them at equal times
    if isinstance(record.id, int):
        return (record.created_at, 0, record.id, "")
    return (record.created_at, 1, 0, record.id)


def list_annotations(
    run_id: Any,
    *,
    key: str | None = None,
    key_prefix: str | None = None,
    scope: str | None = None,
    scope_id: Any = UNSET,
    actor_id: str | None = None,
    actor_kind: str | None = None,
    generation: int | None = None,
    since: datetime | None = None,
    until: datetime | None = None,
    limit: int | None = DEFAULT_LIST_LIMIT,
    include_legacy: bool = True,
) -> list[AnnotationRecord]:
    """A run's annotations, oldest first (AN-9, AN-23, AN-24). Filters are ANDed.

    Args:
        run_id: the run (UUID or string). An unknown run has no annotations (``[]``).
        key: exact key (``key_prefix`` is then ignored).
        key_prefix: keys starting with this (case-sensitive).
        scope: ``"run"``, ``"stage"`` or a consumer scope.
        scope_id: equal to this; ``None`` matches rows without a scope id; leave it out (the
            ``UNSET`` default) for no filter.
        actor_id / actor_kind: equal to these.
        generation: the rerun generation (AN-12, AN-13).
        since / until: ``created_at >= since`` / ``created_at <= until`` (aware datetimes).
        limit: at most this many rows (default 1000; ``None`` means the default).
        include_legacy: merge the legacy metadata shim's virtual rows (AN-30..AN-32).

    Returns:
        :class:`AnnotationRecord` objects ordered by ``created_at`` then ``id``; rows written
        in one batch keep their input order. Values are never filterable (AN-10).

    Raises:
        InvalidCommandError: a malformed run id or filter (``field`` names it).
    """
    rid = parse_run_id(run_id, field="run_id")
    key = _optional_str(key, "key")
    key_prefix = _optional_str(key_prefix, "key_prefix")
    scope = _optional_str(scope, "scope")
    if scope_id is not UNSET:
        scope_id = _optional_str(scope_id, "scope_id")
    actor_id = _optional_str(actor_id, "actor_id")
    actor_kind = _optional_str(actor_kind, "actor_kind")
    generation = _generation(generation)
    since = _datetime(since, "since")
    until = _datetime(until, "until")
    if limit is None:
        limit = DEFAULT_LIST_LIMIT
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
        raise InvalidCommandError(f"limit: expected an integer >= 0, got {limit!r}", field="limit")

    qs = WorkflowAnnotation.objects.filter(run_id=rid)
    if key is not None:
        qs = qs.filter(key=key)
    elif key_prefix:
        qs = qs.filter(KeyStartsWith(F("key"), key_prefix))
    if scope is not None:
        qs = qs.filter(scope=scope)
    if scope_id is None:
        qs = qs.filter(scope_id__isnull=True)
    elif scope_id is not UNSET:
        qs = qs.filter(scope_id=scope_id)
    if actor_id is not None:
        qs = qs.filter(actor_id=actor_id)
    if actor_kind is not None:
        qs = qs.filter(actor_kind=actor_kind)
    if generation is not None:
        qs = qs.filter(generation=generation)
    if since is not None:
        qs = qs.filter(created_at__gte=since)
    if until is not None:
        qs = qs.filter(created_at__lte=until)
    rows = qs.order_by("created_at", "id").values_list(*_LIST_FIELDS)[:limit]
    run_str = str(rid)
    records = [
        AnnotationRecord(pk, created_at, run_str, str(stage_pk) if stage_pk else None, *rest)
        for pk, created_at, stage_pk, *rest in rows
    ]

    if include_legacy and _legacy_could_match(
        key, key_prefix, scope, scope_id, actor_id, actor_kind, generation
    ):
        legacy = _legacy_rows(rid, key, key_prefix, since, until)
        if legacy:
            records = sorted([*records, *legacy], key=_order)[:limit]
    return records


# --- the API object -------------------------------------------------------------------------------


class AnnotationsAPI:
    """``kernel.annotations``: :meth:`attach` and :meth:`list` (K-2, SPEC §6.3)."""

    def __init__(self, kernel: Kernel) -> None:
        self._kernel = kernel

    def attach(
        self,
        run_id: Any,
        attributes: Mapping[Any, Any] | None,
        *,
        actor: Mapping[str, Any] | None = None,
        scope: str = "run",
        scope_id: str | None = None,
        generation: int | None = None,
        payload: Any = None,
        idempotency_key: str | None = None,
        emit_event: bool = False,
    ) -> AttachResult:
        """Attach annotations to a run (or one of its stages) from outside a stage (AN-21).

        One transaction: lock the run row, insert one row per non-``None`` attribute sharing
        the envelope, append the opted-in ``annotation:created`` events (AN-40; causation id =
        ``idempotency_key`` or a fresh UUID). Inputs whose ``(key, idempotency_key)`` is already
        on the run are skipped and emit nothing (AN-8, Part I item 16).

        Args:
            run_id: the run (UUID or string); any status, terminal runs included.
            attributes: ``{key: value}``; keys are strings or typed keys (values type-checked).
            actor: ``{"kind", "id", "version"}`` (any subset).
            scope: ``"run"`` (default), ``"stage"`` or a consumer scope.
            scope_id: for ``scope="stage"`` the stage id (required); the row is linked to that
                stage's current record and gets its ``generation``.
            generation: override the generation (default: the stage record's, else 0).
            payload: a JSON value kept with every row (not queryable, AN-10).
            idempotency_key: dedupe key per ``(run, key)``; first write wins.
            emit_event: append an ``annotation:created`` event per inserted row.

        Returns:
            :class:`AttachResult` with the created and deduplicated counts.

        Raises:
            InvalidCommandError: a malformed run id, key, value, actor, scope or option
                (``field`` names it); nothing is written.
            RunNotFoundError: no such run (Part I item 17, EC-52).
            StageNotFoundError: ``scope="stage"`` names a stage the run's workflow lacks.
        """
        rid = parse_run_id(run_id, field="run_id")
        try:
            scope, scope_id = check_scope(scope, scope_id)
            inputs = build_inputs(
                attributes,
                actor=actor,
                payload=payload,
                idempotency_key=idempotency_key,
                emit_event=emit_event,
            )
        except AnnotationError as exc:
            raise _invalid(exc) from None
        generation = _generation(generation)
        if scope == "stage" and scope_id is None:
            raise InvalidCommandError(
                "scope_id: a stage-scope annotation needs the stage id", field="scope_id"
            )
        kernel = self._kernel
        with transaction.atomic():
            run = lock_run(rid)
            if run is None:
                raise RunNotFoundError(rid)
            stage_pk = None
            if scope == "stage":
                assert scope_id is not None
                record = WorkflowStage.objects.filter(run_id=rid, stage_id=scope_id).first()
                if record is not None:
                    stage_pk = record.pk
                    generation = record.generation if generation is None else generation
                else:
                    workflow = kernel.registry.get(run.workflow_id)
                    if workflow is None or not workflow.has_stage(scope_id):
                        valid = workflow.stage_ids if workflow is not None else ()
                        raise StageNotFoundError(run.workflow_id, scope_id, valid)
            if not inputs:
                return AttachResult(0, 0)
            now = kernel.clock.now()
            created, events = insert_annotations(
                rid,
                inputs,
                now=now,
                scope=scope,
                scope_id=scope_id,
                stage_pk=stage_pk,
                generation=generation or 0,
            )
            append_events(events, idempotency_key or new_causation_id(), now)
        return AttachResult(created, len(inputs) - created)

    def list(self, run_id: Any, **filters: Any) -> list[AnnotationRecord]:
        """:func:`list_annotations` (AN-23): persisted rows plus the legacy shim's."""
        return list_annotations(run_id, **filters)


__all__ = [
    "DEFAULT_LIST_LIMIT",
    "AnnotationRecord",
    "AnnotationsAPI",
    "AttachResult",
    "KeyStartsWith",
    "inputs_from_specs",
    "list_annotations",
]
