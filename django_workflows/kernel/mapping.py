"""Dynamic fan-out in the kernel (issue 18 item 3; docs/fan-out.md): a map stage's items.

A map stage has ONE stage record (``items_total`` / ``items_completed`` / ``items_failed``,
``progress`` = settled / total) and one job per item (``WorkflowJob.item_index``, the item in
``payload["item"]``). Every item job takes the one stage path of :mod:`.delivery`: its own
lease, heartbeat, fenced outcome, retries and redelivery.

* :func:`expand` - when the map stage's group is created (in the transaction that creates
  it): call ``over(ctx)``, insert the item jobs in batches of :data:`INSERT_BATCH` (a constant
  number of statements per batch), the first ``max_concurrency`` PENDING (the first one
  leased to the worker that advanced the run, if any), the rest HELD; the record RUNNING.
* :func:`settle_item` - in an item's outcome transaction (run row locked, job fenced):
  the counters (one read, one UPDATE), the next HELD item promoted to PENDING (one UPDATE),
  and when the last item settles the fan-in output: every item's output read in ONE query in
  item order (streamed in chunks), written as the stage's output blob, record COMPLETED. Under
  ``on_item_failure="fail"`` the first item that fails for good fails the stage and the run
  and cancels the items not yet settled.

Statements per item are constant: they do not grow with the number of items.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any

from django.db import transaction

from ..blobs import output_key
from ..conf import workflow_settings
from ..definition.mapping import MAX_ITEMS, MapContext, map_results
from ..definition.stage import DEFAULT_QUEUE, to_json_value
from ..definition.workflow import StageNode, Workflow
from ..models import Status, WorkflowJob, WorkflowRun, WorkflowStage
from . import events as ev
from . import rows
from .jsonvalue import storable_json_error
from .store import duration_ms, load_outputs, run_error, stages_of, update_run, update_stage

if TYPE_CHECKING:
    from .dispatch import Kernel
    from .queue import JobQueue

#: Item jobs per INSERT statement (keeps the statement under every database's parameter limit).
INSERT_BATCH = 500
#: Rows per fetch when the fan-in reads the item outputs.
READ_CHUNK = 2000
#: ``run.error["error_type"]`` of a run whose map stage's ``over`` raised or returned a bad list.
MAP_OVER_FAILED = "MapOverFailed"
#: ``run.error["error_type"]`` of a run failed by an item under ``on_item_failure="fail"``.
MAP_ITEM_FAILED = "MapItemFailed"


class _MapOverError(Exception):
    """``over(ctx)`` raised or did not return a list of at most :data:`MAX_ITEMS` JSON values."""


def _load(workflow: Workflow, stage_id: str, data: Any) -> Any:
    node = workflow.node(stage_id) if workflow.has_stage(stage_id) else None
    if node is None:
        return data
    if node.map is not None:
        try:
            return map_results(node.stage).model_validate(data)
        except Exception:
            return data
    return node.stage.load_output(data)


def load_for_context(workflow: Workflow, raw_outputs: dict[str, Any]) -> dict[str, Any]:
    """Earlier outputs as models (a map stage's as its :func:`map_results` model)."""
    return {sid: _load(workflow, sid, data) for sid, data in raw_outputs.items()}


def items_of(kernel: Kernel, workflow: Workflow, run: WorkflowRun, node: StageNode) -> list[Any]:
    """Call the map's ``over(ctx)`` with the run's input and the earlier groups' outputs.

    Raises:
        _MapOverError: ``over`` raised, or returned something other than a list/tuple of at
            most :data:`MAX_ITEMS` JSON values.
    """
    assert node.map is not None
    earlier = [
        r
        for r in stages_of(run.pk)
        if r.execution_group < node.execution_group and r.status == Status.COMPLETED
    ]
    outputs = load_for_context(workflow, load_outputs(kernel.blobs, earlier) if earlier else {})
    try:
        parsed: Any = workflow.parse_input(run.input)
    except Exception:
        parsed = run.input
    sid = node.stage.id
    try:
        items = node.map.over(MapContext(parsed, outputs, run.config or {}))
    except Exception as exc:
        raise _MapOverError(
            f"Map stage {sid!r}: over() raised {type(exc).__name__}: {exc}"
        ) from exc
    if not isinstance(items, (list, tuple)):
        raise _MapOverError(
            f"Map stage {sid!r}: over() must return a list, got {type(items).__name__}"
        )
    if len(items) > MAX_ITEMS:
        raise _MapOverError(
            f"Map stage {sid!r}: over() returned {len(items)} items; at most {MAX_ITEMS}"
        )
    try:
        values = [to_json_value(item) for item in items]
    except Exception as exc:
        raise _MapOverError(f"Map stage {sid!r}: an item is not JSON: {exc}") from exc
    # NaN/Infinity, NUL characters and lone surrogates pass to_json_value but neither
    # database stores them: name the item here instead of failing the INSERT (which surfaced
    # as a database IntegrityError, error_type ClaimFailed, with no stage named).
    for index, value in enumerate(values):
        problem = storable_json_error(value)
        if problem is not None:
            raise _MapOverError(f"Map stage {sid!r}: item {index} cannot be stored: {problem}")
    return values


def expand(
    kernel: Kernel,
    queue: JobQueue,
    workflow: Workflow,
    run: WorkflowRun,
    record: WorkflowStage,
    *,
    reserve_for: str | None,
    serves: frozenset[str] | None,
    events: list[dict[str, Any]] | None = None,
) -> list[WorkflowJob]:
    """Fan the PENDING map ``record`` out: insert its item jobs and mark it RUNNING (see the
    module docstring). An empty list completes the stage at once (``items: []``). Returns the
    inserted jobs, the one leased to ``reserve_for`` (if any) first; the rest of the caller's
    reservation logic is :func:`.handlers.base.enqueue_stage_jobs`'.

    Raises:
        _MapOverError: see :func:`items_of` (the caller fails the run or rolls back).
    """
    node = workflow.node(record.stage_id)
    assert node.map is not None
    items = items_of(kernel, workflow, run, node)
    now = kernel.clock.now()
    stage = node.stage
    if events is not None:
        events.append(
            ev.event(ev.MAP_STARTED, run.pk, now, stage_id=stage.id, items_total=len(items))
        )
    if not items:
        _finish(kernel, run, record, [], [], now)
        return []
    limit = node.map.max_concurrency
    max_attempts = (
        stage.retry.max_attempts
        if stage.retry and stage.retry.max_attempts
        else int(workflow_settings.MAX_ATTEMPTS)
    )
    queue_name = stage.queue or DEFAULT_QUEUE
    reserve = reserve_for if reserve_for and (serves is None or queue_name in serves) else None
    first_id: int | None = None
    reserved: WorkflowJob | None = None
    for start in range(0, len(items), INSERT_BATCH):
        batch = []
        for index in range(start, min(start + INSERT_BATCH, len(items))):
            job = rows.new(
                WorkflowJob,
                created_at=now,
                updated_at=now,
                workflow_run_id=run.pk,
                workflow_id=run.workflow_id,
                stage_id=stage.id,
                status=Status.PENDING if index < limit else Status.HELD,
                priority=run.priority,
                payload={"item": items[index]},
                max_attempts=max_attempts,
                run_created_at=run.created_at or now,
                queue=queue_name,
                definition_version=run.definition_version,
                item_index=index,
            )
            if index == 0 and reserve is not None:
                job.status = Status.RUNNING
                job.worker_id = reserve
                job.locked_at = queue.lease_clock.now()
                job.started_at = now
                job.attempt = 1
                reserved = job
            batch.append(job)
        rows.insert(batch)
        if first_id is None:
            first_id = batch[0].pk
    fields = dict(
        status=Status.RUNNING,
        started_at=now,
        items_total=len(items),
        items_completed=0,
        items_failed=0,
        progress=0.0,
        metrics={"map_first_job_id": first_id},
    )
    update_stage(record.pk, now, **fields)
    for name, value in fields.items():
        setattr(record, name, value)
    ready = min(limit, len(items)) - (1 if reserved is not None else 0)
    if ready:
        transaction.on_commit(lambda: queue.transport.wake_workers(ready, queue=queue_name))
    return [reserved] if reserved is not None else []


@dataclass
class Settled:
    """What :func:`settle_item` did: the events to append, whether the run failed (policy
    ``"fail"``), and the fan-in output when the item was the stage's last (the stage record
    is then COMPLETED and the caller transitions the run).
    """

    events: list[dict[str, Any]] = field(default_factory=list)
    run_failed: bool = False
    finished: bool = False
    output: Any = None
    #: The next item, leased to ``reserve_for`` (``None``: none promoted, or made PENDING).
    promoted: WorkflowJob | None = None


def settle_item(
    kernel: Kernel,
    run: WorkflowRun,
    node: StageNode,
    record_pk: Any,
    job: WorkflowJob,
    now: datetime,
    *,
    error: str | None,
    error_type: str | None = None,
    reserve_for: str | None = None,
) -> Settled:
    """After an item's job was settled for good (COMPLETED, or FAILED with ``error``) in the
    caller's transaction (run row locked and RUNNING): counters, promotion, fan-in or the
    ``"fail"`` policy. O(1) statements, except the fan-in's one streamed read.
    ``reserve_for``: a worker id; the promoted item is leased to it (``Settled.promoted``).
    """
    assert node.map is not None
    out = Settled()
    row = (
        WorkflowStage.objects.filter(pk=record_pk)
        .values("items_total", "items_completed", "items_failed", "metrics", "started_at")
        .first()
    )
    if row is None or row["items_total"] is None:
        return out
    total, done, failed = row["items_total"], row["items_completed"] or 0, row["items_failed"] or 0
    sid = node.stage.id
    index = job.item_index
    if error is not None:
        failed += 1
        out.events.append(
            ev.event(ev.MAP_ITEM_FAILED, run.pk, now, stage_id=sid, item_index=index, error=error)
        )
        if node.map.on_item_failure == "fail":
            message = f"Item {index} of map stage {sid!r} failed: {error}"
            kernel.queue.cancel_by_run(run.pk)
            update_stage(
                record_pk,
                now,
                status=Status.FAILED,
                completed_at=now,
                duration_ms=duration_ms(row["started_at"], now),
                error_message=message,
                items_failed=failed,
                metrics={**(row["metrics"] or {}), "error_type": MAP_ITEM_FAILED},
            )
            update_run(
                run.pk,
                now,
                status=Status.FAILED,
                completed_at=now,
                duration_ms=duration_ms(run.started_at, now),
                error=run_error(sid, message, MAP_ITEM_FAILED, delivery=job.attempt),
            )
            run.status = Status.FAILED
            out.events.append(
                ev.event(
                    ev.STAGE_FAILED, run.pk, now, stage_id=sid, stage_name=node.stage.name,
                    error=message,
                )
            )  # fmt: skip
            out.events.append(ev.event(ev.WORKFLOW_FAILED, run.pk, now, error=message))
            out.run_failed = True
            return out
    else:
        done += 1
    settled = done + failed
    update_stage(
        record_pk,
        now,
        items_completed=done,
        items_failed=failed,
        progress=round(100.0 * settled / total, 2),
    )
    if settled + node.map.max_concurrency <= total:  # a HELD item is left: promote one
        out.promoted = _promote(kernel, run, sid, now, reserve_for)
    if settled < total:
        return out
    first_id = (row["metrics"] or {}).get("map_first_job_id") or 0
    items: list[Any] = [None] * total
    failures: list[dict[str, Any]] = []
    for i, status, value, last_error in (
        WorkflowJob.objects.filter(
            workflow_run_id=run.pk,
            stage_id=sid,
            item_index__isnull=False,
            pk__gte=first_id,
            status__in=(Status.COMPLETED, Status.FAILED),
        )
        .order_by("item_index")
        .values_list("item_index", "status", "item_output", "last_error")
        .iterator(chunk_size=READ_CHUNK)
    ):
        if status == Status.COMPLETED:
            items[i] = value
        else:
            failures.append({"index": i, "error": last_error or "failed"})
    record = WorkflowStage.objects.get(pk=record_pk)
    out.output = _finish(kernel, run, record, items, failures, now)
    out.events.append(
        ev.event(
            ev.STAGE_COMPLETED,
            run.pk,
            now,
            stage_id=sid,
            stage_name=node.stage.name,
            duration_ms=duration_ms(row["started_at"], now),
        )
    )
    out.finished = True
    return out


def _promote(
    kernel: Kernel, run: WorkflowRun, sid: str, now: datetime, reserve_for: str | None
) -> WorkflowJob | None:
    """Free the settled item's slot: the next HELD item (in item order; two statements). With
    ``reserve_for`` it is leased to that worker at once (RUNNING, attempt 1, lease stamped:
    the worker continues with it, no wake and no lease transaction) and returned; otherwise
    it becomes PENDING and one worker of its queue is woken after commit.

    A HELD item exists only while ``settled + max_concurrency <= total`` (the caller checks):
    ``max_concurrency`` items were made ready at first, one more per settled item.
    """
    job = (
        WorkflowJob.objects.filter(
            workflow_run_id=run.pk, stage_id=sid, status=Status.HELD, item_index__isnull=False
        )
        .order_by("item_index")
        .first()
    )
    if job is None:
        return None
    if reserve_for is None:
        values: dict[str, Any] = {"status": Status.PENDING, "updated_at": now}
    else:
        values = {
            "status": Status.RUNNING,
            "worker_id": reserve_for,
            "locked_at": kernel.queue.lease_clock.now(),
            "started_at": now,
            "updated_at": now,
            "attempt": job.attempt + 1,
        }
    if not rows.update(WorkflowJob, job.pk, values, where={"status": Status.HELD}):
        return None
    for name, value in values.items():
        setattr(job, name, value)
    if reserve_for is None:
        transaction.on_commit(lambda: kernel.transport.wake_workers(1, queue=job.queue))
        return None
    return job


def _finish(
    kernel: Kernel,
    run: WorkflowRun,
    record: WorkflowStage,
    items: list[Any],
    failures: list[dict[str, Any]],
    now: datetime,
) -> dict[str, Any]:
    """Write the fan-in output blob and mark the map record COMPLETED; returns the output."""
    output = {"items": items, "failures": failures}
    key = output_key(run.workflow_type, str(run.pk), record.stage_id)
    kernel.blobs.put_many([(key, output)], run_id=str(run.pk), stage_id=record.stage_id)
    started = record.started_at or now
    fields = dict(
        status=Status.COMPLETED,
        started_at=started,
        completed_at=now,
        duration_ms=duration_ms(started, now),
        output_data={"_artifactKey": key},
        progress=100.0,
        items_total=record.items_total if record.items_total is not None else len(items),
        items_completed=len(items) - len(failures),
        items_failed=len(failures),
    )
    update_stage(record.pk, now, **fields)
    for name, value in fields.items():
        setattr(record, name, value)
    return output
