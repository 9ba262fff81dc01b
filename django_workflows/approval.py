"""Human approval as a stage, built on annotations (SPEC §6, AN-21, AN-51).

:func:`approval_stage` makes an async-batch stage that suspends until a decision is attached
to its run, then completes with the decision (:class:`ApprovalDecision`) as its output::

    from django_workflows.approval import approval_stage

    review = approval_stage(id="review", name="Editor review", poll_interval_seconds=2)
    publish_flow = define_workflow(id="publish").pipe(draft).pipe(review).pipe(publish).build()

A person (or a system) decides from outside the run with :func:`approve` / :func:`reject`, or
``manage.py workflows_approve <run_id> --by alice`` / ``workflows_reject <run_id> --by bob
--reason "..."``. A decision is a set of convention annotations written in one transaction on
the waiting stage (scope ``stage``, its id and generation, actor ``{"kind": "user", "id": by}``,
``annotation:created`` events emitted):

==========================  ================================  ==================================
key                         approve                           reject
==========================  ================================  ==================================
``decision.outcome``        ``"approved"``                    ``"rejected"``
``approval.approvers``      ``[by]``                          (not written)
``approval.timestamp``      ISO-8601 time of the decision     ISO-8601 time of the decision
``decision.rationale``      the comment, if any               the reason, if any
``approval.policy.version`` the policy version, if any        the policy version, if any
==========================  ================================  ==================================

The decision is also sent as the signal ``approval.<stage id>`` (docs/signals.md) in the same
transaction, with the idempotency key ``approval:<stage id>:<generation>``: it makes the waiting
stage due at once (no waiting for ``poll_interval_seconds``, which is now a safety net) and the
poll that completes (or fails) the stage consumes it exactly once. The decision itself is read
from the annotations, so provenance, allowed approvers and "first decision wins" are unchanged.

The first decision of a generation wins: a repeated identical decision is a no-op, a conflicting
one raises :class:`ApprovalConflictError`. ``check_completion`` reads the first
``decision.outcome`` of the stage's current generation, so after ``run.rerunFrom`` the stage asks
again (earlier decisions stay in the timeline with their generation, AN-13). A rejection completes
the stage with ``approved=False`` (the next stage decides what to do) unless the stage was made
with ``fail_on_reject=True``, which fails stage and run with the reason (``run.error``:
``error_type`` ``"ApprovalRejected"``, :data:`APPROVAL_REJECTED`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, Field, model_validator

from .conventions import Approval, Decision
from .definition.context import CompletionContext, StageContext
from .definition.results import CompletionCheck, StageFailed, Suspend
from .definition.signal import APPROVAL_WAIT_KIND, approval_signal
from .definition.stage import DEFAULT_QUEUE, Stage, define_async_batch_stage
from .kernel.errors import RunStateError

if TYPE_CHECKING:
    from .kernel.dispatch import Kernel

#: ``suspended_state["kind"]`` of a waiting approval stage.
APPROVAL_KIND = APPROVAL_WAIT_KIND
#: ``run.error["error_type"]`` of a run failed by a rejection (``fail_on_reject=True``).
APPROVAL_REJECTED = "ApprovalRejected"
Outcome = Literal["approved", "rejected"]
OUTCOMES: tuple[str, ...] = ("approved", "rejected")


class ApprovalConfig(BaseModel):
    """Per-run overrides (``config={"<stage id>": {...}}``) of what :func:`approval_stage` set.

    ``None`` keeps the definition's value.
    """

    poll_interval_seconds: float | None = Field(default=None, gt=0)
    max_wait_seconds: float | None = Field(default=None, ge=0)
    allowed_approvers: list[str] | None = None


class ApprovalDecision(BaseModel):
    """The output of an approval stage: the decision that resumed it.

    Attributes:
        approved: ``outcome == "approved"``.
        outcome: ``"approved"`` or ``"rejected"``.
        decided_by: the actor id of the decision (``None`` if it carried no actor).
        actor_kind: the actor kind (``"user"`` for the commands).
        approvers: ``approval.approvers`` (empty for a rejection).
        rationale: the comment or reason (``decision.rationale``).
        decided_at: ``approval.timestamp`` (ISO-8601), else the annotation's time.
        policy_version: ``approval.policy.version`` if given.
        generation: the stage's rerun generation the decision belongs to (SM-30).
    """

    approved: bool
    outcome: Outcome
    decided_by: str | None = None
    actor_kind: str | None = None
    approvers: list[str] = Field(default_factory=list)
    rationale: str | None = None
    decided_at: str
    policy_version: str | None = None
    generation: int = 0

    @model_validator(mode="before")
    @classmethod
    def _stored_before_generation(cls, data: Any) -> Any:
        """An output stored before migration 0012 names the generation by SPEC SM-30's old
        key; read it as ``generation`` (the schema, and so the fingerprint, are unchanged)."""
        if isinstance(data, dict) and _OLD_GENERATION_KEY in data and "generation" not in data:
            data = {**data, "generation": data[_OLD_GENERATION_KEY]}
            del data[_OLD_GENERATION_KEY]
        return data


#: The key stored approval outputs used for the generation before migration 0012 (SPEC SM-30).
_OLD_GENERATION_KEY = "attempt"


@dataclass(frozen=True)
class _Settings:
    poll_interval_seconds: float
    max_wait_seconds: float
    allowed_approvers: tuple[str, ...]
    fail_on_reject: bool


def approval_stage(
    *,
    id: str = "approval",
    name: str | None = None,
    description: str = "",
    dependencies: tuple[str, ...] | list[str] = (),
    poll_interval_seconds: float = 5.0,
    max_wait_seconds: float = 0.0,
    allowed_approvers: list[str] | tuple[str, ...] | None = None,
    fail_on_reject: bool = False,
    queue: str = DEFAULT_QUEUE,
) -> Stage:
    """An async-batch stage that waits for a human decision (see the module docstring).

    Args:
        id: the stage id (the scope id of the decision annotations).
        name / description / dependencies: as for any stage. The stage accepts any input.
        poll_interval_seconds: how often the maintenance tick looks for a decision (> 0); a
            decision made with :func:`decide` wakes the stage at once anyway.
        max_wait_seconds: fail stage and run when no decision came within this many seconds;
            ``0`` (default) waits forever.
        allowed_approvers: actor ids whose decisions count (empty/``None``: anyone);
            :func:`approve` / :func:`reject` refuse others.
        fail_on_reject: a rejection fails the stage and the run instead of completing it with
            ``approved=False``: the stage's ``error_message`` is ``"Rejected by <who>: <reason>"``
            and ``run.error["error_type"]`` is ``"ApprovalRejected"``.
        queue: the worker pool that runs the stage's (trivial) ``execute`` (stage routing).

    Returns:
        A :class:`~django_workflows.definition.stage.Stage` whose output model is
        :class:`ApprovalDecision` and config model :class:`ApprovalConfig`.

    Raises:
        ValueError: a non-positive poll interval or a negative maximum wait.
    """
    if poll_interval_seconds <= 0:
        raise ValueError(f"approval_stage {id!r}: poll_interval_seconds must be > 0")
    if max_wait_seconds < 0:
        raise ValueError(f"approval_stage {id!r}: max_wait_seconds must be >= 0")
    defaults = _Settings(
        float(poll_interval_seconds),
        float(max_wait_seconds),
        tuple(allowed_approvers or ()),
        bool(fail_on_reject),
    )

    def settings(config: Any) -> _Settings:
        if not isinstance(config, ApprovalConfig):
            return defaults
        return _Settings(
            config.poll_interval_seconds or defaults.poll_interval_seconds,
            defaults.max_wait_seconds
            if config.max_wait_seconds is None
            else config.max_wait_seconds,
            defaults.allowed_approvers
            if config.allowed_approvers is None
            else tuple(config.allowed_approvers),
            defaults.fail_on_reject,
        )

    def execute(ctx: StageContext[Any, Any]) -> Suspend:
        opts = settings(ctx.config)
        ctx.log(
            "INFO",
            f"waiting for approval (stage {ctx.stage_id}, generation {ctx.generation})",
            allowed_approvers=list(opts.allowed_approvers) or None,
        )
        return Suspend(
            state={
                "batch_id": f"approval:{ctx.workflow_run_id}:{ctx.stage_id}:{ctx.generation}",
                "kind": APPROVAL_KIND,
                "allowed_approvers": list(opts.allowed_approvers),
                # a decision sends this signal: it wakes the stage at once (docs/signals.md)
                "signal": approval_signal(ctx.stage_id),
            },
            poll_interval_seconds=opts.poll_interval_seconds,
            max_wait_seconds=opts.max_wait_seconds,
        )

    def check(state: dict[str, Any], ctx: CompletionContext) -> CompletionCheck:
        opts = settings(ctx.config)
        decision = find_decision(
            ctx.workflow_run_id, ctx.stage_id, ctx.generation, opts.allowed_approvers
        )
        if decision is None:
            return CompletionCheck.not_ready()
        if not decision.approved and opts.fail_on_reject:
            who = decision.decided_by or "unknown actor"
            why = f": {decision.rationale}" if decision.rationale else ""
            # A person decided: its own error type, not an async batch's "BatchFailed".
            raise StageFailed(f"Rejected by {who}{why}", error_type=APPROVAL_REJECTED)
        return CompletionCheck.done(decision)

    return define_async_batch_stage(
        id=id,
        name=name or "Approval",
        description=description or "Waits for a human decision (workflows_approve/reject)",
        output=ApprovalDecision,
        config=ApprovalConfig,
        execute=execute,
        check_completion=check,
        dependencies=dependencies,
        queue=queue,
    )


def find_decision(
    run_id: Any, stage_id: str, generation: int, allowed_approvers: tuple[str, ...] = ()
) -> ApprovalDecision | None:
    """The first decision attached to ``stage_id`` at ``generation`` of the run, or ``None``.

    The first ``decision.outcome`` row whose value is ``"approved"`` or ``"rejected"`` (and,
    with ``allowed_approvers``, whose actor is one of them) decides; the other facts are taken
    from the rows written with it (same idempotency key and actor).
    """
    from .kernel.annotations import list_annotations

    where = {
        "scope": "stage",
        "scope_id": stage_id,
        "generation": generation,
        "include_legacy": False,
    }
    outcome_row = next(
        (
            r
            for r in list_annotations(run_id, key=Decision.outcome.key, **where)
            if r.value in OUTCOMES and (not allowed_approvers or r.actor_id in allowed_approvers)
        ),
        None,
    )
    if outcome_row is None:
        return None
    written_with = list_annotations(
        run_id,
        actor_id=outcome_row.actor_id,
        since=outcome_row.created_at,
        until=outcome_row.created_at,
        **where,
    )
    facts = {
        r.key: r.value
        for r in reversed(written_with)
        if r.idempotency_key == outcome_row.idempotency_key
        and r.actor_kind == outcome_row.actor_kind
    }
    approvers = facts.get(Approval.approvers.key)
    return ApprovalDecision(
        approved=outcome_row.value == "approved",
        outcome=outcome_row.value,
        decided_by=outcome_row.actor_id,
        actor_kind=outcome_row.actor_kind,
        approvers=list(approvers) if isinstance(approvers, list) else [],
        rationale=facts.get(Decision.rationale.key),
        decided_at=str(facts.get(Approval.timestamp.key) or outcome_row.created_at.isoformat()),
        policy_version=facts.get(Approval.policy_version.key),
        generation=outcome_row.generation,
    )


# --- deciding from outside ------------------------------------------------------------------------


class ApprovalConflictError(RunStateError):
    """The stage already has the opposite decision for this generation (first decision wins)."""


@dataclass(frozen=True)
class WaitingApproval:
    """A SUSPENDED approval stage of a run."""

    workflow_run_id: str
    stage_id: str
    generation: int
    allowed_approvers: tuple[str, ...]


@dataclass(frozen=True)
class ApprovalRecorded:
    """What :func:`approve` / :func:`reject` did: ``recorded`` is ``False`` when the same
    decision was already there (nothing written).
    """

    workflow_run_id: str
    stage_id: str
    generation: int
    outcome: Outcome
    recorded: bool


def waiting_approvals(run_id: Any) -> list[WaitingApproval]:
    """The run's approval stages that wait for a decision (status SUSPENDED).

    Raises:
        InvalidCommandError: a malformed run id.
    """
    from .kernel.locking import parse_run_id
    from .models import Status, WorkflowStage

    rid = parse_run_id(run_id, field="run_id")
    out = []
    for record in WorkflowStage.objects.filter(run_id=rid, status=Status.SUSPENDED).order_by(
        "execution_group", "stage_number"
    ):
        state = record.suspended_state if isinstance(record.suspended_state, dict) else {}
        if state.get("kind") == APPROVAL_KIND:
            out.append(
                WaitingApproval(
                    str(rid),
                    record.stage_id,
                    record.generation,
                    tuple(state.get("allowed_approvers") or ()),
                )
            )
    return out


def approve(
    run_id: Any,
    *,
    by: str,
    stage_id: str | None = None,
    comment: str | None = None,
    policy_version: str | None = None,
    actor_kind: str = "user",
    kernel: Kernel | None = None,
) -> ApprovalRecorded:
    """Approve the run's waiting approval stage (see :func:`decide`)."""
    return decide(
        run_id,
        "approved",
        by=by,
        stage_id=stage_id,
        rationale=comment,
        policy_version=policy_version,
        actor_kind=actor_kind,
        kernel=kernel,
    )


def reject(
    run_id: Any,
    *,
    by: str,
    stage_id: str | None = None,
    reason: str | None = None,
    policy_version: str | None = None,
    actor_kind: str = "user",
    kernel: Kernel | None = None,
) -> ApprovalRecorded:
    """Reject the run's waiting approval stage (see :func:`decide`)."""
    return decide(
        run_id,
        "rejected",
        by=by,
        stage_id=stage_id,
        rationale=reason,
        policy_version=policy_version,
        actor_kind=actor_kind,
        kernel=kernel,
    )


def decide(
    run_id: Any,
    outcome: Outcome,
    *,
    by: str,
    stage_id: str | None = None,
    rationale: str | None = None,
    policy_version: str | None = None,
    actor_kind: str = "user",
    kernel: Kernel | None = None,
) -> ApprovalRecorded:
    """Attach a decision to the run's waiting approval stage.

    One transaction that locks the run row: find the SUSPENDED approval stage (``stage_id``
    picks one when several wait), check the actor against its allowed approvers and any
    earlier decision of the same generation, then ``kernel.annotations.attach`` the decision keys
    (table in the module docstring) with idempotency key ``approval:<stage>:<generation>`` and
    ``emit_event=True``, and send the signal ``approval.<stage id>`` (payload ``{"outcome",
    "by", "actor_kind", "generation", "rationale"}``, the same key): the stage is due at once
    and its next poll completes it, consuming the signal (docs/signals.md).

    Args:
        run_id: the run (UUID or string).
        outcome: ``"approved"`` or ``"rejected"``.
        by: the deciding actor's id (e.g. a user name).
        stage_id: which approval stage, when the run has several waiting.
        rationale: a comment or reason (``decision.rationale``).
        policy_version: ``approval.policy.version``.
        actor_kind: the actor kind (default ``"user"``).
        kernel: default: the process-wide kernel.

    Returns:
        :class:`ApprovalRecorded` (``recorded=False`` if the same decision was already there).

    Raises:
        InvalidCommandError: a malformed run id, outcome or actor; several approvals waiting
            and no ``stage_id``; ``by`` is not an allowed approver.
        RunNotFoundError: no such run.
        RunStateError: the run is not RUNNING or no (matching) approval stage is waiting.
        ApprovalConflictError: the stage already has the opposite decision.
    """
    from django.db import transaction

    from .kernel.commands import SendSignal
    from .kernel.errors import InvalidCommandError, RunNotFoundError
    from .kernel.locking import lock_run, parse_run_id
    from .kernel.runtime import get_kernel
    from .models import Status

    if outcome not in OUTCOMES:
        raise InvalidCommandError(
            f"outcome: expected 'approved' or 'rejected', got {outcome!r}", field="outcome"
        )
    if not isinstance(by, str) or not by.strip():
        raise InvalidCommandError("by: the deciding actor's id is required", field="by")
    kernel = kernel or get_kernel()
    rid = parse_run_id(run_id, field="run_id")
    with transaction.atomic():
        run = lock_run(rid)
        if run is None:
            raise RunNotFoundError(rid)
        if run.status != Status.RUNNING:
            raise RunStateError(f"Workflow run {rid} is {run.status}; nothing waits for approval")
        waiting = waiting_approvals(rid)
        if stage_id is not None:
            waiting = [w for w in waiting if w.stage_id == stage_id]
        if not waiting:
            where = f"stage {stage_id!r} of " if stage_id else ""
            raise RunStateError(f"No approval is waiting in {where}workflow run {rid}")
        if len(waiting) > 1:
            ids = ", ".join(w.stage_id for w in waiting)
            raise InvalidCommandError(
                f"stage_id: several approvals are waiting ({ids}); say which one",
                field="stage_id",
            )
        target = waiting[0]
        if target.allowed_approvers and by not in target.allowed_approvers:
            raise InvalidCommandError(
                f"by: {by!r} may not decide stage {target.stage_id!r}; allowed approvers: "
                f"{', '.join(target.allowed_approvers)}",
                field="by",
            )
        earlier = find_decision(rid, target.stage_id, target.generation, target.allowed_approvers)
        if earlier is not None:
            if earlier.outcome != outcome:
                raise ApprovalConflictError(
                    f"Stage {target.stage_id!r} of run {rid} was already {earlier.outcome} by "
                    f"{earlier.decided_by or 'an unknown actor'} (the first decision wins)"
                )
            return ApprovalRecorded(str(rid), target.stage_id, target.generation, outcome, False)
        attributes: dict[Any, Any] = {
            Decision.outcome: outcome,
            Approval.timestamp: kernel.clock.now(),
            Decision.rationale: rationale or None,
            Approval.policy_version: policy_version or None,
        }
        if outcome == "approved":
            attributes[Approval.approvers] = [by]
        result = kernel.annotations.attach(
            rid,
            attributes,
            actor={"kind": actor_kind, "id": by},
            scope="stage",
            scope_id=target.stage_id,
            generation=target.generation,
            idempotency_key=f"approval:{target.stage_id}:{target.generation}",
            emit_event=True,
        )
        if result.created:
            # The decision as a signal (same transaction): stored durably, it makes the
            # waiting stage due now and wakes the ticker after commit; the poll that
            # completes the stage consumes it exactly once. The decision itself is read from
            # the annotations above (provenance, allowed approvers, first decision wins).
            kernel.dispatch(
                SendSignal(
                    rid,
                    approval_signal(target.stage_id),
                    {
                        "outcome": outcome,
                        "by": by,
                        "actor_kind": actor_kind,
                        "generation": target.generation,
                        "rationale": rationale or None,
                    },
                    key=f"approval:{target.stage_id}:{target.generation}",
                    actor=f"{actor_kind}:{by}"[:200],
                )
            )
    return ApprovalRecorded(
        str(rid), target.stage_id, target.generation, outcome, result.created > 0
    )


__all__ = [
    "APPROVAL_KIND",
    "ApprovalConfig",
    "ApprovalConflictError",
    "ApprovalDecision",
    "ApprovalRecorded",
    "WaitingApproval",
    "approval_stage",
    "approve",
    "decide",
    "find_decision",
    "reject",
    "waiting_approvals",
]
