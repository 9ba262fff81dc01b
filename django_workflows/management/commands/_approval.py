"""Shared body of ``workflows_approve`` and ``workflows_reject`` (not a command)."""

from __future__ import annotations

import getpass
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from django_workflows.approval import ApprovalRecorded, decide, waiting_approvals
from django_workflows.kernel.errors import WorkflowError

from ._common import get_run


def default_actor() -> str:
    """The OS user name, the default of ``--by``."""
    try:
        return getpass.getuser()
    except Exception:  # no user name in some containers
        return "operator"


class DecisionCommand(BaseCommand):
    """``<command> <run_id> [--by NAME] [--stage ID] [--comment TEXT] [--policy-version V]``."""

    outcome: str = "approved"
    text_option: str = "--comment"
    text_help: str = "why (stored as decision.rationale)"

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("run_id", help="the run's id (a UUID)")
        parser.add_argument(
            "--by", default=None, help="who decides (actor id; default: the OS user name)"
        )
        parser.add_argument(
            "--stage", default=None, help="the approval stage id, when several wait"
        )
        parser.add_argument(self.text_option, dest="text", default=None, help=self.text_help)
        parser.add_argument(
            "--policy-version", default=None, help="stored as approval.policy.version"
        )
        parser.add_argument("--actor-kind", default="user", help="the actor kind (default 'user')")
        parser.add_argument(
            "--list", action="store_true", help="only list the approvals waiting in the run"
        )

    def handle(self, *args: Any, **opts: Any) -> None:
        run = get_run(opts["run_id"])
        if opts["list"]:
            waiting = waiting_approvals(run.pk)
            if not waiting:
                self.stdout.write(f"run {run.pk}: no approval waiting")
            for w in waiting:
                allowed = ", ".join(w.allowed_approvers) or "anyone"
                self.stdout.write(
                    f"run {run.pk}: stage {w.stage_id} (generation {w.generation}) waits; "
                    f"allowed approvers: {allowed}"
                )
            return
        if opts["by"] is not None and not opts["by"].strip():
            raise CommandError("--by: must not be empty (omit it to use the OS user name)")
        try:
            result: ApprovalRecorded = decide(
                run.pk,
                self.outcome,  # type: ignore[arg-type]
                by=opts["by"] or default_actor(),
                stage_id=opts["stage"],
                rationale=opts["text"],
                policy_version=opts["policy_version"],
                actor_kind=opts["actor_kind"],
            )
        except WorkflowError as exc:
            raise CommandError(str(exc)) from None
        what = f"stage {result.stage_id} of run {result.workflow_run_id} {result.outcome}"
        if result.recorded:
            self.stdout.write(
                self.style.SUCCESS(
                    f"{what} (generation {result.generation}); resumes at its next poll"
                )
            )
        else:
            self.stdout.write(f"{what} already (generation {result.generation}); nothing written")
