"""``manage.py workflows_approve <run_id> [--by NAME] [--stage ID] [--comment TEXT]``: approve
the run's waiting approval stage (:func:`django_workflows.approval.approve`).

Writes ``decision.outcome = "approved"``, ``approval.approvers = [NAME]``,
``approval.timestamp`` (and ``decision.rationale`` / ``approval.policy.version`` when given) on
the stage, actor ``user:NAME``; the stage resumes at its next poll with the decision as output.
``--list`` shows which approvals wait. Errors (no approval waiting, already rejected, not an
allowed approver) exit with status 1.
"""

from __future__ import annotations

from ._approval import DecisionCommand


class Command(DecisionCommand):
    help = (
        "Approve a run's waiting approval stage (records decision.outcome=approved, "
        "approval.approvers, approval.timestamp). --list shows waiting approvals."
    )
    outcome = "approved"
    text_option = "--comment"
    text_help = "a comment (stored as decision.rationale)"
