"""Commands (data) and their results (SPEC §4, Appendix A).

Every state change is one of these, passed to :meth:`Kernel.dispatch`. Time fields are in
seconds (``*_seconds``); ids are strings or UUIDs.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, ClassVar, Literal

from django.utils.dateparse import parse_datetime

from .annotation_spec import AnnotationSpec as AnnotationSpec


class Result:
    """Base of command results: JSON-able for the idempotency cache (K-10, K-14).

    ``replayed`` is ``True`` on a result returned from the cache for a repeated idempotency key
    (nothing was executed); it is not part of the cached JSON.
    """

    replayed: bool = False

    def mismatch(self, command: Any) -> str | None:
        """``None`` if this cached result answers ``command``, else what differs (a phrase
        such as ``"another input"``).
        """
        return None

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)  # type: ignore[call-overload,no-any-return]

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Any:
        return cls(**data)


# --- run.create (K-CR) ------------------------------------------------------------------------


@dataclass(frozen=True)
class CreateRun:
    """Create a PENDING run of a registered workflow (SPEC §4.1).

    Attributes:
        workflow_id: a registered workflow id.
        input: JSON object validated by the workflow's input model; stored raw.
        config: ``{stage_id: {...}}`` merged shallowly over the stage defaults (WF-44).
        priority: higher runs sooner (default 5).
        idempotency_key: a replay with the same key returns the first result.
        metadata: deprecated (since 0.8) free-form JSON object, stored verbatim; it shows up in
            ``kernel.annotations.list`` as ``legacy.metadata.*`` rows (AN-30). Passing it warns.
        annotations: run-scope annotations written atomically with the run (AN-20): a tuple
            of :class:`AnnotationSpec` (or envelope dicts); validated before anything is written.
        parent_run_id / parent_stage_id / parent_generation: set by a child-workflow stage
            (issue 18 item 5, :mod:`..children`): the run, stage and rerun generation that
            start this run as a child. ``None`` for a top-level run.
    """

    type: ClassVar[str] = "run.create"
    workflow_id: str
    input: Any = field(default_factory=dict)
    config: dict[str, Any] | None = None
    priority: int = 5
    idempotency_key: str | None = None
    metadata: dict[str, Any] | None = None
    annotations: tuple[AnnotationSpec | Mapping[str, Any], ...] = ()
    parent_run_id: str | None = None
    parent_stage_id: str | None = None
    parent_generation: int | None = None

    def __post_init__(self) -> None:
        if self.metadata is not None:
            warnings.warn(
                "CreateRun.metadata is deprecated (AN-30, removal planned for 1.0): attach "
                "run-scope annotations instead (annotations=[AnnotationSpec({...})]); "
                "annotations.list still shows metadata as legacy.metadata.* rows",
                DeprecationWarning,
                stacklevel=3,
            )


def _annotation_request(specs: Any) -> list[Any]:
    """Run-creation annotations as comparable data (validated; typed keys as their strings)."""
    from .annotations import inputs_from_specs

    return [
        [i.key, i.value, i.actor, i.payload, i.idempotency_key, i.emit_event]
        for i in inputs_from_specs(specs)
    ]


def fingerprint(value: Any) -> str:
    """A stable SHA-256 of a JSON value (object keys sorted; Django's JSON encoder)."""
    import hashlib
    import json

    from django.core.serializers.json import DjangoJSONEncoder

    text = json.dumps(value, sort_keys=True, cls=DjangoJSONEncoder, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


@dataclass
class CreateRunResult(Result):
    """``request``: what the run was created from - ``workflow_id``, ``priority`` and
    fingerprints of the given ``input``, ``config`` and ``annotations`` - so a replay of the
    key with another request is refused.
    """

    workflow_run_id: str
    status: str
    request: dict[str, str] | None = None

    @staticmethod
    def request_of(command: CreateRun) -> dict[str, str]:
        return {
            "workflow_id": command.workflow_id,
            "input": fingerprint(command.input),
            "config": fingerprint(command.config or {}),
            "priority": str(command.priority),
            "annotations": fingerprint(_annotation_request(command.annotations)),
        }

    def mismatch(self, command: Any) -> str | None:
        if not self.request or not isinstance(command, CreateRun):
            return None  # a key stored before requests were recorded
        given = self.request_of(command)
        if given["workflow_id"] != self.request.get("workflow_id"):
            return (
                f"workflow {self.request.get('workflow_id')!r} (this request names "
                f"{command.workflow_id!r})"
            )
        for part in ("input", "config", "priority", "annotations"):
            if part in self.request and given[part] != self.request[part]:
                return "other annotations" if part == "annotations" else f"another {part}"
        return None


# --- run.claimPending (K-CP) ------------------------------------------------------------------


@dataclass(frozen=True)
class ClaimPendingRuns:
    """Claim up to ``max_claims`` PENDING runs and enqueue their first group (SPEC §4.2)."""

    type: ClassVar[str] = "run.claimPending"
    worker_id: str
    max_claims: int = 10


@dataclass
class ClaimedRun:
    workflow_run_id: str
    workflow_id: str
    job_ids: list[int]


@dataclass
class ClaimPendingRunsResult(Result):
    claimed: list[ClaimedRun]

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ClaimPendingRunsResult:
        return cls(claimed=[ClaimedRun(**c) for c in data["claimed"]])


# --- run.transition (K-TR) --------------------------------------------------------------------


@dataclass(frozen=True)
class TransitionRun:
    """Advance a RUNNING run to its next group, complete it or fail it (SPEC §4.3)."""

    type: ClassVar[str] = "run.transition"
    workflow_run_id: Any


@dataclass
class TransitionRunResult(Result):
    action: Literal["advanced", "completed", "failed", "noop"]
    next_group: int | None = None


# --- run.cancel (K-CA) ------------------------------------------------------------------------


@dataclass(frozen=True)
class CancelRun:
    """Cancel a PENDING or RUNNING run, its open stages and queued jobs (SPEC §4.4)."""

    type: ClassVar[str] = "run.cancel"
    workflow_run_id: Any
    reason: str | None = None


@dataclass
class CancelRunResult(Result):
    cancelled: bool


# --- run.rerunFrom (K-RR) ---------------------------------------------------------------------


@dataclass(frozen=True)
class RerunFrom:
    """Rerun a COMPLETED or FAILED run from the execution group of ``from_stage_id`` (§4.5).

    Attributes:
        actor: who asked for the rerun (e.g. ``"user:alice"``); kept in the rerun marker.
        reason: why (free text, at most 2,000 characters kept); kept in the rerun marker.

    The rerun marker is the ``rerun`` member of the ``workflow:started`` event the command
    appends: ``{"from_stage_id", "generation", "actor", "reason"}`` (``None`` members left out).
    """

    type: ClassVar[str] = "run.rerunFrom"
    workflow_run_id: Any
    from_stage_id: str
    idempotency_key: str | None = None
    actor: str | None = None
    reason: str | None = None


@dataclass
class RerunFromResult(Result):
    workflow_run_id: str
    from_stage_id: str
    deleted_stages: list[str]

    def mismatch(self, command: Any) -> str | None:
        if str(self.workflow_run_id) != str(command.workflow_run_id):
            return f"another run (this request names {command.workflow_run_id})"
        if self.from_stage_id != command.from_stage_id:
            return f"another stage (this request names {command.from_stage_id!r})"
        return None


# --- job.execute (K-JE) -----------------------------------------------------------------------


@dataclass(frozen=True)
class ExecuteJob:
    """Deliver the newest job of one stage of one run through the production stage path
    (SPEC §4.6; :mod:`.handlers.job_execute`): lease it, run the stage, commit the outcome -
    the job settled and the run transitioned in that one transaction (a documented difference
    from K-JE-19 / H-5, which leave both to the caller).

    Attributes:
        config: the whole run-config map (the stage reads its own slice, WF-45). Empty: the
            job's (the run's); a different map raises :class:`.errors.InvalidCommandError`.

    Raises:
        WorkflowNotFoundError, StageNotFoundError, RunNotFoundError: K-JE-1.
        InvalidCommandError: ``config`` differs from the job's; or the run has no job for the
            stage yet (its group was not reached) while RUNNING and the stage not COMPLETED.
    """

    type: ClassVar[str] = "job.execute"
    workflow_run_id: Any
    workflow_id: str
    stage_id: str
    config: dict[str, Any] = field(default_factory=dict)
    idempotency_key: str | None = None


@dataclass
class ExecuteJobResult(Result):
    outcome: Literal["completed", "suspended", "failed"]
    output: Any = None
    error: str | None = None
    next_poll_at: datetime | None = None
    ghost: bool = False
    retryable: bool | None = None

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ExecuteJobResult:
        data = dict(data)
        if isinstance(data.get("next_poll_at"), str):
            data["next_poll_at"] = parse_datetime(data["next_poll_at"])
        return cls(**data)


# --- stage.pollSuspended (K-PS) ---------------------------------------------------------------


@dataclass(frozen=True)
class PollSuspendedStages:
    """Call ``check_completion`` of due suspended stages (SPEC §4.7)."""

    type: ClassVar[str] = "stage.pollSuspended"
    max_checks: int = 50


@dataclass
class PollSuspendedStagesResult(Result):
    checked: int = 0
    resumed: int = 0
    failed: int = 0
    resumed_workflow_run_ids: list[str] = field(default_factory=list)


# --- lease.reapStale (K-LR) -------------------------------------------------------------------


@dataclass(frozen=True)
class ReapStaleLeases:
    """Return RUNNING jobs whose lease is older than the threshold to the queue (SPEC §4.8)."""

    type: ClassVar[str] = "lease.reapStale"
    stale_threshold_seconds: float


@dataclass
class ReapStaleLeasesResult(Result):
    released: int
    failed: int = 0


# --- run.reapStuck (K-RS) ---------------------------------------------------------------------


@dataclass(frozen=True)
class ReapStuckRuns:
    """Recover or fail RUNNING runs that nothing will advance (SPEC §4.9, Part I item 4)."""

    type: ClassVar[str] = "run.reapStuck"
    stuck_threshold_seconds: float


@dataclass
class ReapStuckRunsResult(Result):
    transitioned: int = 0
    failed: int = 0
    recovered: int = 0


# --- outbox.flush / plugin.replayDLQ (§5) -----------------------------------------------------


@dataclass(frozen=True)
class FlushOutbox:
    """Publish unpublished outbox events in per-run order (EV-4)."""

    type: ClassVar[str] = "outbox.flush"
    max_events: int = 100


@dataclass
class FlushOutboxResult(Result):
    published: int


@dataclass(frozen=True)
class ReplayDeadLetters:
    """Re-arm up to ``max_events`` dead-lettered outbox events (EV-32).

    Attributes:
        max_events: at most this many rows (>= 0).
        event_ids: only these outbox row ids (``OutboxEvent.id``); ids that are not dead
            letters are left alone (``None``: any dead letter).
    """

    type: ClassVar[str] = "plugin.replayDLQ"
    max_events: int = 100
    event_ids: tuple[int, ...] | None = None


@dataclass
class ReplayDeadLettersResult(Result):
    replayed: int


@dataclass(frozen=True)
class SkipDeadLetter:
    """Skip one dead-lettered outbox event so the later events of its run flow again
    (Part I item 16, EC-27). An operator tool: the event is never delivered.

    The row is kept for audit: ``published_at`` = ``skipped_at`` = now, ``skip_note`` = ``note``
    (``dlq_at`` and ``retry_count`` stay as they were).

    Attributes:
        event_id: the outbox row id (``OutboxEvent.id``).
        note: why it was skipped (free text, stored on the row).
    """

    type: ClassVar[str] = "outbox.skipDeadLetter"
    event_id: int
    note: str = ""


@dataclass
class SkipDeadLetterResult(Result):
    event_id: int
    workflow_run_id: str
    sequence: int
    event_type: str
    #: unpublished events of the run behind the skipped one (they flow on the next flush)
    unblocked: int


# --- schedule.pause / resume / trigger / backfill (issue 12 item 1, issue 17) ----------------


@dataclass(frozen=True)
class PauseSchedule:
    """Pause schedule ``name``: no firing until resumed (an orphaned one may be paused).

    Attributes:
        name: the schedule's name (its row's primary key).
        reason: free text kept as ``pause_reason`` (at most 500 characters are stored).

    Raises (from dispatch): ``ScheduleNotFoundError``.
    """

    type: ClassVar[str] = "schedule.pause"
    name: str
    reason: str = ""


@dataclass
class PauseScheduleResult(Result):
    name: str
    #: ``False``: it was paused already (nothing written)
    changed: bool


@dataclass(frozen=True)
class ResumeSchedule:
    """Resume a paused schedule: its next firing is its next time after now (times that passed
    while paused are not caught up).

    Raises (from dispatch): ``ScheduleNotFoundError``, ``ScheduleOrphanedError``.
    """

    type: ClassVar[str] = "schedule.resume"
    name: str


@dataclass
class ResumeScheduleResult(Result):
    name: str
    #: ``False``: it was not paused (nothing written)
    changed: bool


@dataclass(frozen=True)
class TriggerSchedule:
    """Start one run of schedule ``name`` now (also when paused; its overlap policy is not
    applied). Its scheduled time is now; its idempotency key ``schedule:<name>:manual:<now>``.

    Attributes:
        name: the schedule.
        actor: who asked (kept in the run's ``trigger.reason``: "triggered now by <actor>").

    Raises (from dispatch): ``ScheduleNotFoundError``, ``ScheduleOrphanedError``, and the
    errors of ``run.create`` (``WorkflowNotFoundError``, ``InvalidWorkflowInputError``, ...);
    nothing is written then.
    """

    type: ClassVar[str] = "schedule.trigger"
    name: str
    actor: str = ""


@dataclass
class TriggerScheduleResult(Result):
    name: str
    workflow_run_id: str


@dataclass(frozen=True)
class BackfillSchedule:
    """Start one run for every scheduled time of ``name`` in ``[start, end]`` (oldest first;
    also when paused; overlap not applied), each with the firing's own idempotency key.

    Attributes:
        name: the schedule.
        start, end: aware datetimes, ``start <= end``, at most ``MAX_BACKFILL`` times between.

    Raises (from dispatch): ``ScheduleNotFoundError``, ``ScheduleOrphanedError``,
    ``InvalidCommandError`` (field ``start``/``end``); nothing is written then.
    """

    type: ClassVar[str] = "schedule.backfill"
    name: str
    start: datetime
    end: datetime


@dataclass
class BackfillScheduleResult(Result):
    """``run_ids``: the runs started, one per new scheduled time; ``existing``: times whose
    run existed already (fired by the ticker or an earlier backfill); ``times``: every
    scheduled time of the range."""

    name: str
    times: list[datetime] = field(default_factory=list)
    run_ids: list[str] = field(default_factory=list)
    existing: int = 0


# --- run.signal (issue 18 item 4) ------------------------------------------------------------


@dataclass(frozen=True)
class SendSignal:
    """Store a named signal for a run (:func:`django_workflows.send_signal`).

    Attributes:
        workflow_run_id: the run (UUID or its string).
        name: 1-200 characters: letters, digits and ``._:-`` (no spaces).
        payload: any JSON value (``None`` allowed), at most ``MAX_SIGNAL_PAYLOAD_BYTES`` bytes
            as compact JSON.
        key: the signal's idempotency key, unique per run (at most 255 characters): a repeated
            send with the same key stores nothing and answers ``stored=False`` (also once the
            run has finished).
        actor: who sent it (free text, at most 200 characters, e.g. ``"user:alice"``).

    One transaction that locks the run row: the signal row, the ``signal:received`` outbox
    event, and - when a ``wait_for_signal`` stage of the run is waiting for ``name`` - that
    stage's ``next_poll_at`` set to now (the ticker is woken after commit).

    Raises (from dispatch): ``InvalidCommandError`` (field ``name``, ``payload``, ``key`` or
    ``actor``), ``RunNotFoundError``, ``RunTerminalError`` (the run is COMPLETED, FAILED or
    CANCELLED); nothing is written then.
    """

    type: ClassVar[str] = "run.signal"
    workflow_run_id: Any
    name: str
    payload: Any = None
    key: str | None = None
    actor: str | None = None


@dataclass
class SendSignalResult(Result):
    """``stored``: ``False`` when ``key`` was used before for this run (a duplicate: the first
    signal's ``signal_id`` is returned and nothing was written). ``woke``: a waiting stage was
    made due now."""

    workflow_run_id: str
    signal_id: int
    name: str
    stored: bool
    woke: bool = False

    @property
    def duplicate(self) -> bool:
        return not self.stored


Command = (
    CreateRun
    | ClaimPendingRuns
    | TransitionRun
    | CancelRun
    | RerunFrom
    | ExecuteJob
    | PollSuspendedStages
    | ReapStaleLeases
    | ReapStuckRuns
    | FlushOutbox
    | ReplayDeadLetters
    | PauseSchedule
    | ResumeSchedule
    | TriggerSchedule
    | BackfillSchedule
    | SkipDeadLetter
    | SendSignal
)
