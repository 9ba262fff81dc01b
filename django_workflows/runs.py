"""Convenience entry points for application code: start, cancel and rerun runs; attach and
list their annotations; what a run waits for (:func:`waiting_reasons`) and its error
(:func:`run_error`), shared by the admin, the HTTP API and the CLI."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

from .kernel.annotations import AnnotationRecord, AttachResult
from .kernel.commands import AnnotationSpec, CancelRun, CreateRun, RerunFrom
from .kernel.runtime import get_kernel

if TYPE_CHECKING:
    from .models import WorkflowJob, WorkflowRun, WorkflowStage


def start_run(
    workflow_id: str,
    input: dict[str, Any] | None = None,
    *,
    config: dict[str, Any] | None = None,
    priority: int = 5,
    idempotency_key: str | None = None,
    annotations: list[AnnotationSpec] | tuple[AnnotationSpec, ...] = (),
) -> str:
    """Create a PENDING run and return its id; workers pick it up after commit (SPEC §4.1).

    Raises:
        WorkflowNotFoundError, InvalidWorkflowInputError, InvalidWorkflowConfigError,
        InvalidCommandError: nothing was written.
    """
    result = get_kernel().dispatch(
        CreateRun(
            workflow_id=workflow_id,
            input=input if input is not None else {},
            config=config,
            priority=priority,
            idempotency_key=idempotency_key,
            annotations=tuple(annotations),
        )
    )
    return str(result.workflow_run_id)


def cancel_run(run_id: Any, reason: str | None = None) -> bool:
    """Cancel a PENDING or RUNNING run; ``False`` if it is missing or already terminal."""
    return bool(get_kernel().dispatch(CancelRun(run_id, reason)).cancelled)


def rerun_from(run_id: Any, stage_id: str, *, idempotency_key: str | None = None) -> list[str]:
    """Rerun a COMPLETED or FAILED run from ``stage_id`` (SPEC §4.5, Part I items 8 and 10).

    Deletes the records of the stage's execution group and every later group (and what those
    stages stored), sets the run RUNNING and queues the group again with the next rerun
    ``generation``. Returns the deleted stage ids.

    In a workflow with conditions (``docs/conditions.md``) the conditions are decided again
    from that group on; a stage of a branch block reruns the block from its first group.

    Raises:
        RunNotFoundError, StageNotFoundError, WorkflowNotFoundError, RunStateError (run not
        COMPLETED/FAILED, or an earlier group not COMPLETED or SKIPPED): nothing was changed.
    """
    result = get_kernel().dispatch(RerunFrom(run_id, stage_id, idempotency_key=idempotency_key))
    return list(result.deleted_stages)


def annotate_run(run_id: Any, attributes: dict[Any, Any], **options: Any) -> AttachResult:
    """Attach annotations to a run from outside a stage: ``get_kernel().annotations.attach``
    (AN-21). ``options``: ``actor``, ``scope``, ``scope_id``, ``generation``, ``payload``,
    ``idempotency_key``, ``emit_event``.

    Raises:
        RunNotFoundError: no such run. InvalidCommandError: a malformed key, value or option
        (nothing written).
    """
    return get_kernel().annotations.attach(run_id, attributes, **options)


def list_annotations(run_id: Any, **filters: Any) -> list[AnnotationRecord]:
    """A run's annotations, oldest first: ``get_kernel().annotations.list`` (AN-9, AN-23).
    ``filters``: ``key``, ``key_prefix``, ``scope``, ``scope_id``, ``actor_id``,
    ``actor_kind``, ``generation``, ``since``, ``until``, ``limit`` (default 1000).
    """
    return get_kernel().annotations.list(run_id, **filters)


def error_details(run: WorkflowRun) -> str:
    """``"StageFailed, generation 0, delivery 1"``: the kind of failure and where, from
    ``run.error`` (``""`` without one); shown next to :func:`run_error`.
    """
    recorded = run.__dict__.get("error")
    if not isinstance(recorded, dict):
        return ""
    parts = [str(recorded["error_type"])] if recorded.get("error_type") else []
    for name in ("generation", "delivery"):
        if recorded.get(name) is not None:
            parts.append(f"{name} {recorded[name]}")
    return ", ".join(parts)


def run_error(run: WorkflowRun, stages: list[WorkflowStage] | None = None) -> str | None:
    """The error of a run as one line: for a FAILED run its ``run.error``
    (``"stage validate: Duplicate SKU"``, or the message alone when no stage caused it);
    else ``output["error"]`` (a CANCELLED run's reason); for a FAILED run of an engine older
    than ``run.error`` the ``error_message`` of its first failed stage; ``None`` when there is
    none.
    """
    recorded = run.__dict__.get("error")  # never a query for a deferred column
    if isinstance(recorded, dict) and recorded.get("message"):
        stage_id = recorded.get("stage_id")
        message = str(recorded["message"])
        return f"stage {stage_id}: {message}" if stage_id else message
    output = run.output if isinstance(run.output, dict) else {}
    error = output.get("error")
    if isinstance(error, dict) and error.get("message"):
        return str(error["message"])
    if isinstance(error, str) and error:
        return error
    from .models import Status, WorkflowStage

    if run.status != Status.FAILED:
        return None
    if stages is None:
        stages = list(WorkflowStage.objects.filter(run=run))
    for record in sorted(stages, key=lambda s: (s.execution_group, s.stage_number)):
        if record.status == Status.FAILED and record.error_message:
            return f"stage {record.stage_id}: {record.error_message}"
    return None


#: ``queued_ahead`` stops counting here (the count reads at most this many index entries).
MAX_QUEUED_AHEAD = 1000


@dataclass(frozen=True)
class WaitingReason:
    """Why a run is not moving right now: one per open stage (or one for a PENDING run).

    Attributes:
        reason: ``claim`` (PENDING run, waiting for the tick), ``job_queued`` (a worker has to
            pick the stage's job up), ``retry`` (the job waits out a retry back-off),
            ``executing`` (a worker holds the lease), ``poll`` (a suspended stage waits for its
            next completion check), ``approval`` (a suspended approval stage waits for a
            human decision), ``signal`` (a ``wait_for_signal`` stage waits for a signal;
            ``at``: its timeout, ``None`` without one), ``child`` (a child-workflow stage waits
            for its child run: "waiting for child run <id> (RUNNING, stage x)"),
            ``no_worker`` (no live worker serves the job's queue, or none runs the run's
            definition version: "waiting for a worker with version X") or ``limit`` (a shared
            limit is full, issue 18 item 6: "held by the limit max_running_per_key=1 for key
            'cust-7' (run <id> holds it)").
        stage_id: the stage concerned (``None`` for ``claim``).
        signal: the signal name a ``signal`` reason waits for, else ``None``.
        at: when it is due, if known (next poll, retry not-before time; aware datetime).
        message: one human sentence (no interface-specific hint: callers add their own).
        allowed_approvers: who may decide an ``approval`` (empty: anyone with the permission).
        queued_ahead: for ``job_queued``/``retry``, how many PENDING jobs a worker serves
            first (capped at ``MAX_QUEUED_AHEAD``; ``None`` when not counted).
        attempt: the job's delivery count so far (``retry``), else ``None``.
        max_attempts: the job's delivery limit (``retry``), else ``None``.
        worker_id: the worker holding the lease (``executing``), else ``None``.
        child_run_id: the child run (``child``), else ``None``.
    """

    reason: str
    stage_id: str | None
    at: datetime | None = None
    message: str = ""
    allowed_approvers: tuple[str, ...] = ()
    queued_ahead: int | None = None
    attempt: int | None = None
    max_attempts: int | None = None
    worker_id: str | None = None
    signal: str | None = None
    child_run_id: str | None = None

    @property
    def is_human(self) -> bool:
        """Whether a person has to act (an approval decision)."""
        return self.reason == "approval"


def queued_ahead(job: WorkflowJob, cap: int = MAX_QUEUED_AHEAD) -> int:
    """How many PENDING jobs of ``job``'s queue a worker takes before ``job`` (claim order:
    priority descending, then oldest run, then job id; SPEC §1.7), counting at most ``cap``
    (one bounded query that walks the queue's claim index)."""
    from django.db.models import Q

    from .models import Status, WorkflowJob

    ahead = Q(priority__gt=job.priority)
    if job.run_created_at is not None:
        ahead |= Q(priority=job.priority, run_created_at__lt=job.run_created_at)
        ahead |= Q(priority=job.priority, run_created_at=job.run_created_at, pk__lt=job.pk)
    else:
        ahead |= Q(priority=job.priority, pk__lt=job.pk)
    ids = (
        WorkflowJob.objects.filter(ahead, status=Status.PENDING, queue=job.queue)
        .exclude(pk=job.pk)
        .order_by()
        .values("pk")[:cap]
    )
    return WorkflowJob.objects.filter(pk__in=ids).count()


def _child_reason(stage: WorkflowStage, state: dict[str, Any], details: bool) -> WaitingReason:
    """``child``: a child-workflow stage waits for its child run (issue 18 item 5): "waiting
    for child run <id> (RUNNING, stage x)" - two reads, for child stages only; without
    ``details`` "waiting for child run <id>" and no read."""
    from .models import ACTIVE_STAGE_STATUSES, WorkflowRun, WorkflowStage

    child_id = state.get("child_run_id")
    if child_id and not details:
        return WaitingReason(
            "child",
            stage.stage_id,
            at=stage.next_poll_at,
            message=f"waiting for child run {child_id}",
            child_run_id=str(child_id),
        )
    status = (
        WorkflowRun.objects.filter(pk=child_id).values_list("status", flat=True).first()
        if child_id
        else None
    )
    if status is None:
        return WaitingReason(
            "child", stage.stage_id, at=stage.next_poll_at, message="waiting for its child run"
        )
    open_stages = list(
        WorkflowStage.objects.filter(run_id=child_id, status__in=ACTIVE_STAGE_STATUSES)
        .order_by("stage_number")
        .values_list("stage_id", flat=True)[:3]
    )
    where = f", stage {', '.join(open_stages)}" if open_stages else ""
    return WaitingReason(
        "child",
        stage.stage_id,
        at=stage.next_poll_at,
        message=f"waiting for child run {child_id} ({status}{where})",
        child_run_id=str(child_id),
    )


def waiting_reasons(
    run: WorkflowRun,
    stages: list[WorkflowStage] | None = None,
    jobs: dict[str, WorkflowJob] | None = None,
    *,
    count_queue: bool = False,
    now: datetime | None = None,
    live_queues: Callable[[], set[str]] | None = None,
    live_versions: Callable[[], dict[str, set[str]]] | None = None,
    child_details: bool = True,
) -> list[WaitingReason]:
    """Why ``run`` is where it is: one :class:`WaitingReason` per open stage, ``[]`` for a
    terminal run.

    Args:
        run: the run.
        stages: its stage records (read when ``None``: one query).
        jobs: its open jobs by stage id (PENDING or RUNNING; read when ``None`` and the run is
            active: one query).
        count_queue: also count the jobs queued ahead of each queued job (one bounded query
            per queued job; see :func:`queued_ahead`). Lists leave it off.
        now: the time a due retry is compared with (default: ``timezone.now()``).
        live_queues: returns the queues with a live worker (default:
            :func:`django_workflows.kernel.routing.live_queues`, one query); a list page passes
            one memoised function for all its runs.
        live_versions: returns the definition versions live workers run (default:
            :func:`django_workflows.kernel.versions.live_versions` with the default kernel's
            lease clock, one query); memoised like ``live_queues``.
        child_details: a child-workflow stage's reason reads its child run's status and open
            stages (two queries per such stage); lists pass ``False`` for "waiting for child
            run <id>" without a query.

    Used by the admin (list and run page), the HTTP API (``waiting``) and usable by the CLI.
    A ready job whose queue no live worker serves (stage routing) is ``no_worker``: "waiting
    for a gpu worker" (one query on the presence leases, only when a job is queued). A ready
    job, a suspended async-batch stage (its completion checks run on such a worker) or a
    PENDING run whose definition version no live worker runs, while workers are live, is
    ``no_worker`` too: "waiting for a worker with version X" (issue 12 item 3; one
    query on the advertised versions).
    """
    from django.utils import timezone

    from .approval import APPROVAL_KIND
    from .children import CHILD_KIND
    from .definition.signal import SIGNAL_WAIT_KIND
    from .models import TERMINAL_RUN_STATUSES, Status, WorkflowJob, WorkflowStage

    advertised: dict[str, set[str]] | None = None

    def version_missing(workflow_id: str, version: str) -> bool:
        # Workers advertise what they run, but none runs ``version`` (one query, once).
        nonlocal advertised
        if not version:
            return False
        if advertised is None:
            if live_versions is not None:
                advertised = live_versions()
            else:
                from .kernel import versions

                advertised = versions.live_versions(lease_clock=get_kernel().lease_clock)
        return bool(advertised) and version not in advertised.get(workflow_id, ())

    if run.status == Status.PENDING:
        if run.concurrency_key is not None:
            from .definition.registry import registry
            from .kernel.limits import describe_run_hold

            held = describe_run_hold(run, registry.get(run.workflow_id))
            if held:
                return [WaitingReason("limit", None, message=held)]
        if version_missing(run.workflow_id, run.definition_version):
            from .kernel.versions import describe_missing_version

            return [
                WaitingReason(
                    "no_worker", None, message=describe_missing_version(run.definition_version)
                )
            ]
        return [
            WaitingReason(
                "claim", None, message="waiting for the maintenance tick to claim the run"
            )
        ]
    if run.status in TERMINAL_RUN_STATUSES:
        return []
    if stages is None:
        stages = list(
            WorkflowStage.objects.filter(run=run).order_by("execution_group", "stage_number")
        )
    if jobs is None:
        jobs = {}
        for job in WorkflowJob.objects.filter(
            workflow_run_id=run.pk, status__in=[Status.PENDING, Status.RUNNING]
        ).order_by("id"):
            jobs[job.stage_id] = job
    now = now or timezone.now()
    out: list[WaitingReason] = []
    idle: set[str] | None = None
    from .definition.registry import registry
    from .kernel.limits import describe_job_hold, queue_limits

    def limited(job: WorkflowJob) -> bool:  # no query: a limited workflow or queue only
        workflow = registry.get(job.workflow_id)
        return bool(
            (workflow is not None and workflow.limits and workflow.limits.max_running_stages)
            or job.queue in queue_limits()
        )

    def unserved(queue: str) -> bool:  # no live worker serves ``queue`` (one query, once)
        nonlocal idle
        if idle is None:
            from .kernel import routing

            live = (live_queues or routing.live_queues)()
            idle = {j.queue for j in jobs.values() if j.status == Status.PENDING} - live
        return queue in idle

    for stage in stages:
        job = jobs.get(stage.stage_id)
        if stage.status == Status.SUSPENDED:
            state = stage.suspended_state if isinstance(stage.suspended_state, dict) else {}
            if state.get("kind") == APPROVAL_KIND:
                approvers = tuple(str(a) for a in state.get("allowed_approvers") or ())
                who = f" by one of {', '.join(approvers)}" if approvers else ""
                out.append(
                    WaitingReason(
                        "approval",
                        stage.stage_id,
                        at=stage.next_poll_at,
                        message=f"waiting for an approval decision{who}",
                        allowed_approvers=approvers,
                    )
                )
            elif state.get("kind") == SIGNAL_WAIT_KIND:
                name = str(state.get("signal") or "")
                deadline = (
                    f"timeout at {stage.max_wait_until.isoformat()}"
                    if stage.max_wait_until is not None
                    else "no timeout"
                )
                out.append(
                    WaitingReason(
                        "signal",
                        stage.stage_id,
                        at=stage.max_wait_until,
                        message=f"waiting for signal {name!r} ({deadline})",
                        signal=name,
                    )
                )
            elif state.get("kind") == CHILD_KIND:
                out.append(_child_reason(stage, state, child_details))
            elif version_missing(run.workflow_id, run.definition_version):
                from .kernel.versions import describe_missing_version

                out.append(
                    WaitingReason(
                        "no_worker",
                        stage.stage_id,
                        at=stage.next_poll_at,
                        message=describe_missing_version(run.definition_version),
                    )
                )
            else:
                out.append(
                    WaitingReason(
                        "poll",
                        stage.stage_id,
                        at=stage.next_poll_at,
                        message="suspended until its next completion check",
                    )
                )
        elif (
            job is not None
            and job.status == Status.PENDING
            and (job.next_poll_at is None or job.next_poll_at <= now)
            and limited(job)
            and (held := describe_job_hold(job, registry.get(job.workflow_id)))
        ):
            out.append(WaitingReason("limit", stage.stage_id, at=job.next_poll_at, message=held))
        elif (
            job is not None
            and job.status == Status.PENDING
            and (job.next_poll_at is None or job.next_poll_at <= now)  # ready: no back-off left
            and unserved(job.queue)
        ):
            from .kernel.routing import describe_waiting

            out.append(
                WaitingReason(
                    "no_worker",
                    stage.stage_id,
                    at=job.next_poll_at,
                    message=describe_waiting([job.queue]) or "waiting for a worker",
                )
            )
        elif (
            job is not None
            and job.status == Status.PENDING
            and (job.next_poll_at is None or job.next_poll_at <= now)
            and version_missing(job.workflow_id, job.definition_version)
        ):
            from .kernel.versions import describe_missing_version

            out.append(
                WaitingReason(
                    "no_worker",
                    stage.stage_id,
                    at=job.next_poll_at,
                    message=describe_missing_version(job.definition_version),
                )
            )
        elif job is not None and job.status == Status.PENDING:
            ahead = queued_ahead(job) if count_queue else None
            if job.attempt > 0:
                backing_off = job.next_poll_at is not None and job.next_poll_at > now
                out.append(
                    WaitingReason(
                        "retry",
                        stage.stage_id,
                        at=job.next_poll_at,
                        message=f"delivery {job.attempt + 1} of {job.max_attempts} "
                        + ("after back-off" if backing_off else "is due"),
                        queued_ahead=ahead,
                        attempt=job.attempt,
                        max_attempts=job.max_attempts,
                    )
                )
            else:
                out.append(
                    WaitingReason(
                        "job_queued",
                        stage.stage_id,
                        at=job.next_poll_at,
                        message="queued for a worker",
                        queued_ahead=ahead,
                    )
                )
        elif stage.status == Status.RUNNING or (job is not None and job.status == Status.RUNNING):
            out.append(
                WaitingReason(
                    "executing",
                    stage.stage_id,
                    message="a worker is executing the stage",
                    worker_id=job.worker_id if job is not None else None,
                )
            )
        elif stage.status == Status.PENDING:
            out.append(WaitingReason("job_queued", stage.stage_id, message="queued for a worker"))
    return out
