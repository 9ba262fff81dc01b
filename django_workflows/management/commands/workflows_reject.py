"""``manage.py workflows_reject <run_id> [--by NAME] [--stage ID] [--reason TEXT]``: reject the
run's waiting approval stage (:func:`django_workflows.approval.reject`).

Writes ``decision.outcome = "rejected"``, ``approval.timestamp`` and ``decision.rationale``
(the reason) on the stage, actor ``user:NAME``. The stage then completes with
``approved=false`` (or fails the run if it was made with ``fail_on_reject=True``). Errors exit
with status 1.
"""

from __future__ import annotations

from ._approval import DecisionCommand


class Command(DecisionCommand):
    help = (
        "Reject a run's waiting approval stage (records decision.outcome=rejected, "
        "decision.rationale, approval.timestamp). --list shows waiting approvals."
    )
    outcome = "rejected"
    text_option = "--reason"
    text_help = "why (stored as decision.rationale)"
