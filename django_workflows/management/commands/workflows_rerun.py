"""``manage.py workflows_rerun <run_id> <stage_id> [--idempotency-key K]``: rerun a finished run
from one stage (``run.rerunFrom``, SPEC §4.5, Part I items 8 and 10).

The run must be COMPLETED or FAILED and every execution group before the stage's group must be
COMPLETED. The stage's group and every later group are deleted (with what those stages stored)
and re-executed; earlier stages keep their outputs. The new records carry the next rerun
``generation``. With ``--idempotency-key`` a repeated command returns the first result and does
nothing else (K-10).
"""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from django_workflows.kernel.commands import RerunFrom
from django_workflows.kernel.errors import WorkflowError
from django_workflows.kernel.runtime import get_kernel
from django_workflows.models import WorkflowStage

from ._common import get_run


class Command(BaseCommand):
    help = (
        "Rerun a COMPLETED or FAILED workflow run from a stage: that stage's execution group "
        "and all later groups are deleted and executed again. Prints the deleted stages."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("run_id", help="the run's id (a UUID)")
        parser.add_argument("stage_id", help="the stage to rerun from (see workflows_status)")
        parser.add_argument(
            "--idempotency-key",
            default=None,
            help="repeat-safe key: a second command with the same key changes nothing",
        )

    def handle(self, *args: Any, **opts: Any) -> None:
        run = get_run(opts["run_id"])
        key = opts["idempotency_key"]
        if key is not None and not key.strip():
            raise CommandError("--idempotency-key: must not be empty")
        try:
            result = get_kernel().dispatch(RerunFrom(run.pk, opts["stage_id"], idempotency_key=key))
        except WorkflowError as exc:
            raise CommandError(str(exc)) from None
        if result.replayed:
            self.stdout.write(
                f"run {result.workflow_run_id} was already rerun from {result.from_stage_id} "
                f"with idempotency key {key!r}; nothing was done"
            )
            return
        deleted = ", ".join(result.deleted_stages) or "none"
        generation = (
            WorkflowStage.objects.filter(run_id=run.pk, stage_id=result.from_stage_id)
            .values_list("generation", flat=True)
            .first()
        )
        self.stdout.write(
            self.style.SUCCESS(f"rerun of {result.workflow_run_id} from {result.from_stage_id}")
        )
        self.stdout.write(f"deleted stages: {deleted}")
        if generation is not None:
            self.stdout.write(f"generation: {generation}")
