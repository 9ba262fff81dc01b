"""What transactional handlers return to the dispatcher."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from ...definition.stage import DEFAULT_QUEUE, Stage
from ...definition.workflow import StageNode, Workflow
from ...models import Status, WorkflowJob, WorkflowRun, WorkflowStage
from .. import rows
from ..commands import Result
from ..limits import check_job
from ..queue import JobQueue, JobSpec
from ..store import mark_started, plan_missing_stages


@dataclass
class HandlerOutput:
    """A handler's public result and the events to append in its transaction (K-5, K-6)."""

    result: Result
    events: list[dict[str, Any]] = field(default_factory=list)


def enqueue_stage_jobs(
    queue: JobQueue,
    run: WorkflowRun,
    records: list[WorkflowStage],
    *,
    workflow: Workflow | None,
    reserve_for: str | None = None,
    serves: frozenset[str] | None = None,
    kernel: Any = None,
    events: list[dict[str, Any]] | None = None,
) -> list[WorkflowJob]:
    """Enqueue one job per PENDING record (K-CP-4, K-TR-6): priority = run priority, payload =
    ``{"config": run.config}`` (WF-45), queue = its stage's ``queue`` in ``workflow``
    (``"default"`` for a stage ``workflow`` does not have, or without a workflow),
    ``max_attempts`` = its stage's ``retry.max_attempts`` (else the ``MAX_ATTEMPTS`` setting).
    ``definition_version`` = the run's (issue 12 item 3).

    ``reserve_for``: lease one job to that worker (:meth:`JobQueue.enqueue_jobs`): the first
    whose queue is in ``serves`` (the worker's queues; ``None``: any), and none if no job's
    queue is served (they stay PENDING and their queues' clusters are woken), and none if a
    shared limit (:func:`..limits.check_job`) holds that job. Returns the
    inserted jobs, the reserved one (RUNNING) first.

    A map stage's record (issue 18 item 3; ``kernel`` required then) is fanned out by
    :func:`..mapping.expand` instead (its item jobs; ``map:started`` appended to ``events``).

    Raises:
        _MapOverError: a map stage's ``over(ctx)`` failed (see :func:`..mapping.items_of`).
    """
    if workflow is not None and workflow.has_maps:
        return _enqueue_with_maps(
            queue, run, records, workflow, reserve_for, serves, kernel, events
        )
    return _enqueue_plain(queue, run, records, workflow, reserve_for, serves)


def _enqueue_plain(
    queue: JobQueue,
    run: WorkflowRun,
    records: list[WorkflowStage],
    workflow: Workflow | None,
    reserve_for: str | None,
    serves: frozenset[str] | None,
) -> list[WorkflowJob]:
    def stage_of(stage_id: str) -> Stage | None:
        return workflow.get_stage(stage_id) if workflow is not None else None

    def queue_of(stage_id: str) -> str:
        stage = stage_of(stage_id)
        return stage.queue if stage is not None else DEFAULT_QUEUE

    def max_attempts_of(stage_id: str) -> int | None:
        stage = stage_of(stage_id)
        return stage.retry.max_attempts if stage is not None and stage.retry else None

    specs = [
        JobSpec(
            workflow_run_id=run.pk,
            workflow_id=run.workflow_id,
            stage_id=rec.stage_id,
            priority=run.priority,
            payload={"config": run.config or {}},
            run_created_at=run.created_at,
            queue=queue_of(rec.stage_id),
            max_attempts=max_attempts_of(rec.stage_id),
            definition_version=run.definition_version,
        )
        for rec in records
        if rec.status == Status.PENDING
    ]
    if reserve_for is not None and serves is not None:
        first = next((i for i, spec in enumerate(specs) if spec.queue in serves), None)
        if first is None:
            reserve_for = None
        elif first:
            specs.insert(0, specs.pop(first))
    if reserve_for is not None and specs and check_job(workflow, specs[0].queue) is not None:
        reserve_for = None  # held by a shared limit (issue 18 item 6): left PENDING
    return queue.enqueue_jobs(specs, reserve_for=reserve_for)


@dataclass
class OpenedStages:
    """What :func:`open_stages` wrote: the records of its nodes (existing or new, in node
    order), the jobs (the one leased to the worker first) and the new record it inserted
    RUNNING for that job (``None``: none leased, or its record already existed).
    """

    records: list[WorkflowStage]
    jobs: list[WorkflowJob]
    started: WorkflowStage | None = None


def open_stages(
    queue: JobQueue,
    run: WorkflowRun,
    nodes: Sequence[StageNode],
    *,
    workflow: Workflow,
    generation: int,
    now: datetime,
    records: list[WorkflowStage] | None = None,
    reserve_for: str | None = None,
    serves: frozenset[str] | None = None,
) -> OpenedStages:
    """:func:`..store.create_missing_stages` then :func:`enqueue_stage_jobs` for a workflow
    without map stages, in two INSERTs: the jobs first, then the new records - the record of
    the job leased to ``reserve_for`` inserted RUNNING from ``now`` (:func:`..store.mark_started`),
    so the caller's :func:`..stage_path.lease.begin` (``started=``) need not UPDATE it. Same
    rows as the create, enqueue and start, one statement fewer (issue 19).
    """
    assert not workflow.has_maps, "a map stage is fanned out by enqueue_stage_jobs"
    out, new = plan_missing_stages(run, nodes, generation=generation, now=now, records=records)
    jobs = _enqueue_plain(queue, run, out, workflow, reserve_for, serves)
    leased = job_leased_to(jobs, reserve_for)
    started = None
    if leased is not None:
        started = next((r for r in new if r.stage_id == leased.stage_id), None)
        if started is not None:
            mark_started(started, now)
    rows.insert(new)
    return OpenedStages(out, jobs, started)


def job_leased_to(jobs: list[WorkflowJob], reserve_for: str | None) -> WorkflowJob | None:
    """The job :func:`enqueue_stage_jobs` leased to ``reserve_for``, if it leased one."""
    if reserve_for and jobs and jobs[0].worker_id == reserve_for:
        return jobs[0]
    return None


def _enqueue_with_maps(
    queue: JobQueue,
    run: WorkflowRun,
    records: list[WorkflowStage],
    workflow: Workflow,
    reserve_for: str | None,
    serves: frozenset[str] | None,
    kernel: Any,
    events: list[dict[str, Any]] | None,
) -> list[WorkflowJob]:
    """:func:`enqueue_stage_jobs` for a workflow with map stages: plain records as usual,
    map records through :func:`..mapping.expand` (a map stage is alone in its group).
    """
    from ..mapping import expand

    maps = [
        r
        for r in records
        if r.status == Status.PENDING
        and workflow.has_stage(r.stage_id)
        and workflow.node(r.stage_id).map is not None
    ]
    if not maps:
        return _enqueue_plain(queue, run, records, workflow, reserve_for, serves)
    if kernel is None:
        raise RuntimeError("enqueue_stage_jobs: a map stage needs the kernel")
    jobs: list[WorkflowJob] = []
    for record in maps:
        jobs += expand(
            kernel,
            queue,
            workflow,
            run,
            record,
            reserve_for=reserve_for if not jobs else None,
            serves=serves,
            events=events,
        )
    return jobs
