"""Small persistence helpers shared by the handlers: versioned updates, stage upserts, output
loading, logs and annotation writes. Handlers read as logic; the queries live here.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterable, Sequence
from datetime import datetime
from typing import Any

from ..annotations import AnnotationInput
from ..blobs import BlobNotFoundError
from ..definition.workflow import StageNode, Workflow
from ..models import (
    Status,
    WorkflowAnnotation,
    WorkflowLog,
    WorkflowRun,
    WorkflowStage,
)
from ..ports import BlobStore
from . import events as ev
from . import rows

logger = logging.getLogger("django_workflows")


def duration_ms(start: datetime | None, end: datetime) -> int | None:
    """Milliseconds from ``start`` to ``end`` (64-bit, Part I item 13); ``None`` without a start."""
    return int((end - start).total_seconds() * 1000) if start else None


def update_run(run_id: uuid.UUID, now: datetime, **fields: Any) -> int:
    """Update a run, bumping ``version`` and ``updated_at`` (DM-5, DM-8)."""
    return rows.update(WorkflowRun, run_id, {"updated_at": now, **fields}, bump_version=True)


def run_error(
    stage_id: str | None,
    message: str,
    error_type: str | None,
    *,
    generation: int | None = None,
    delivery: int | None = None,
) -> dict[str, Any]:
    """The ``WorkflowRun.error`` document of a failed run (issue 11 item 2): the stage
    concerned (``None``: no stage caused it), the error message, the kind of failure, the
    stage's rerun generation (``generation``, SM-30) and the job delivery it failed on
    (``delivery``, the job's ``attempt``, SM-31).
    """
    return {
        "stage_id": stage_id,
        "message": message,
        "error_type": error_type,
        "generation": generation,
        "delivery": delivery,
    }


def update_stage(stage_pk: uuid.UUID, now: datetime, **fields: Any) -> int:
    """Update a stage record, bumping ``version`` and ``updated_at`` (DM-5, DM-8)."""
    return rows.update(WorkflowStage, stage_pk, {"updated_at": now, **fields}, bump_version=True)


def update_stage_write(stage_pk: uuid.UUID, now: datetime, **fields: Any) -> rows.Write:
    """:func:`update_stage`'s statement, not sent (for :func:`.rows.update`'s ``carrying``)."""
    return rows.update_write(
        WorkflowStage, stage_pk, {"updated_at": now, **fields}, bump_version=True
    )


def stages_of(run_id: uuid.UUID) -> list[WorkflowStage]:
    """The run's stage records ordered by group then stage number (DM-32)."""
    return rows.select(
        WorkflowStage,
        "stages_of",
        "run_id = %s",
        [rows.prep(WorkflowStage, "run_id", run_id)],
        order_by="execution_group ASC, stage_number ASC",
    )


def create_missing_stages(
    run: WorkflowRun,
    nodes: Sequence[StageNode],
    *,
    generation: int,
    now: datetime,
    records: Iterable[WorkflowStage] | None = None,
) -> list[WorkflowStage]:
    """Upsert PENDING records for ``nodes`` (K-CP-4, K-TR-3/6): existing records are kept as
    they are (EC-3). ``records``: the run's records when the caller has already read them.
    Returns the records of ``nodes``, existing or new, in node order.
    """
    out, new = plan_missing_stages(run, nodes, generation=generation, now=now, records=records)
    rows.insert(new)
    return out


def plan_missing_stages(
    run: WorkflowRun,
    nodes: Sequence[StageNode],
    *,
    generation: int,
    now: datetime,
    records: Iterable[WorkflowStage] | None = None,
) -> tuple[list[WorkflowStage], list[WorkflowStage]]:
    """:func:`create_missing_stages` without its INSERT: ``(records of nodes in node order,
    the new ones)``; the new ones are PENDING and unsaved (the caller inserts them, with
    :func:`.rows.insert`, after it may have started one, :func:`mark_started`).
    """
    ids = {n.stage.id for n in nodes}
    if records is None:
        records = stages_of(run.pk)
    existing = {s.stage_id: s for s in records if s.stage_id in ids}
    config = run.config or {}
    new = [
        rows.new(
            WorkflowStage,
            created_at=now,
            updated_at=now,
            run_id=run.pk,
            stage_id=n.stage.id,
            stage_name=n.stage.name,
            stage_number=n.stage_number,
            execution_group=n.execution_group,
            generation=generation,
            status=Status.PENDING,
            config=config.get(n.stage.id) or {},
        )
        for n in nodes
        if n.stage.id not in existing
    ]
    existing.update({s.stage_id: s for s in new})
    return [existing[n.stage.id] for n in nodes], new


def started_fields(now: datetime) -> dict[str, Any]:
    """The columns phase 1 sets on the stage record it starts (K-JE-6): RUNNING from ``now``,
    the previous execution's end, error, suspension and progress cleared (Part I item 9).
    """
    return dict(
        status=Status.RUNNING,
        started_at=now,
        completed_at=None,
        duration_ms=None,
        error_message=None,
        suspended_state=None,
        next_poll_at=None,
        poll_interval_ms=None,
        max_wait_until=None,
        progress=None,
        progress_message="",
    )


def mark_started(record: WorkflowStage, now: datetime) -> None:
    """Start an unsaved new record (from :func:`plan_missing_stages`) before its INSERT, so it
    is inserted RUNNING: exactly the row that inserting it PENDING and then starting it with
    :func:`update_stage` (:func:`started_fields`, ``version`` + 1, ``updated_at``) at ``now``
    would leave, in one statement instead of two.
    """
    for name, value in started_fields(now).items():
        setattr(record, name, value)
    record.version += 1
    record.updated_at = now


def load_outputs(blobs: BlobStore, records: Iterable[WorkflowStage]) -> dict[str, Any]:
    """``{stage_id: output}`` for COMPLETED records, read from the blob store in one call
    (WF-14). A record whose ``output_data`` has no ``_artifactKey`` contributes that object.

    Raises:
        KeyError: a referenced output blob is missing (K-JE-4).
    """
    keys: dict[str, str] = {}
    out: dict[str, Any] = {}
    for rec in records:
        if rec.status != Status.COMPLETED:
            continue
        data = rec.output_data
        if isinstance(data, dict) and "_artifactKey" in data:
            keys[rec.stage_id] = data["_artifactKey"]
        elif data is not None:
            out[rec.stage_id] = data
    found = blobs.get_many(keys.values())
    for stage_id, key in keys.items():
        if key not in found:
            raise BlobNotFoundError(key)
        out[stage_id] = found[key]
    return out


def group_output(workflow: Workflow, group: int, outputs: dict[str, Any]) -> tuple[bool, Any]:
    """The output of execution group ``group`` (WF-40): ``(present, value)``.

    A single-stage group yields that stage's output; a parallel group ``{stage_id: output}``
    of the siblings whose output is present (always present, possibly ``{}``).
    """
    nodes = workflow.stages_in_group(group)
    if len(nodes) == 1:
        sid = nodes[0].stage.id
        return (sid in outputs, outputs.get(sid))
    return True, {n.stage.id: outputs[n.stage.id] for n in nodes if n.stage.id in outputs}


def write_log(
    now: datetime,
    level: str,
    message: str,
    *,
    run_id: uuid.UUID | None = None,
    stage_pk: uuid.UUID | None = None,
    metadata: dict[str, Any] | None = None,
) -> None:
    """Append a log row; failures are logged and swallowed (WF-17)."""
    try:
        WorkflowLog.objects.create(
            created_at=now,
            run_id=run_id,
            stage_id=stage_pk,
            level=level,
            message=message,
            metadata=metadata,
        )
    except Exception:  # logs must never break the engine
        logger.exception("Could not write workflow log %r", message)


def write_annotations(
    run_id: uuid.UUID,
    inputs: Iterable[AnnotationInput],
    *,
    now: datetime,
    scope: str = "run",
    scope_id: str | None = None,
    stage_pk: uuid.UUID | None = None,
    generation: int = 0,
) -> list[dict[str, Any]]:
    """Insert annotations and return the ``annotation:created`` events of the inserted inputs
    that asked for one (AN-40), in input order.

    Deduplication (AN-8, DM-16): an input whose ``(key, idempotency_key)`` already exists on the
    run, or repeats an earlier input of the same batch, is skipped - first write wins - and
    emits no event (Part I item 16, EC-29). Inputs without an idempotency key never dedupe.
    Callers hold the run row lock (RUNNING guard, ``annotations.attach``) or created the run in
    this transaction, so the existence check cannot race another writer of the same run.
    """
    return insert_annotations(
        run_id,
        inputs,
        now=now,
        scope=scope,
        scope_id=scope_id,
        stage_pk=stage_pk,
        generation=generation,
    )[1]


def insert_annotations(
    run_id: uuid.UUID,
    inputs: Iterable[AnnotationInput],
    *,
    now: datetime,
    scope: str = "run",
    scope_id: str | None = None,
    stage_pk: uuid.UUID | None = None,
    generation: int = 0,
) -> tuple[int, list[dict[str, Any]]]:
    """:func:`write_annotations` that also returns how many rows it inserted."""
    inputs = list(inputs)
    keyed = {(i.key, i.idempotency_key) for i in inputs if i.idempotency_key is not None}
    seen: set[tuple[str, str]] = set()
    if keyed:
        seen = set(
            WorkflowAnnotation.objects.filter(
                run_id=run_id,
                key__in={k for k, _ in keyed},
                idempotency_key__in={ik for _, ik in keyed},
            ).values_list("key", "idempotency_key")
        )
    rows = []
    events = []
    for item in inputs:
        if item.idempotency_key is not None:
            pair = (item.key, item.idempotency_key)
            if pair in seen:
                continue
            seen.add(pair)
        actor = item.actor or {}
        rows.append(
            WorkflowAnnotation(
                created_at=now,
                run_id=run_id,
                stage_record_id=stage_pk,
                generation=generation,
                scope=scope,
                scope_id=scope_id,
                actor_kind=actor.get("kind"),
                actor_id=actor.get("id"),
                actor_version=actor.get("version"),
                key=item.key,
                value=item.value,
                payload=item.payload,
                idempotency_key=item.idempotency_key,
            )
        )
        if item.emit_event:
            events.append(
                ev.event(
                    ev.ANNOTATION_CREATED,
                    run_id,
                    now,
                    key=item.key,
                    value=item.value,
                    scope=scope,
                    scope_id=scope_id,
                    generation=generation,
                    actor_kind=actor.get("kind"),
                    actor_id=actor.get("id"),
                    actor_version=actor.get("version"),
                )
            )
    if rows:
        # ignore_conflicts stays as a last line of defence against a writer without the lock
        WorkflowAnnotation.objects.bulk_create(rows, ignore_conflicts=True)
    return len(rows), events
