"""``manage.py workflows_cancel <run_id> [--reason TEXT]``: cancel a PENDING or RUNNING run
(``run.cancel``, SPEC §4.4).

Open stages and queued jobs are cancelled with the run; a stage that is executing right now
finishes, and its result is discarded (K-JE-15).
"""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from django_workflows.kernel.commands import CancelRun
from django_workflows.kernel.runtime import get_kernel
from django_workflows.models import WorkflowRun

from ._common import get_run


class Command(BaseCommand):
    help = (
        "Cancel a PENDING or RUNNING workflow run. Prints 'cancelled'; a run that already "
        "finished is an error ('not cancelled: run is <STATUS>', exit status 1)."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("run_id", help="the run's id (a UUID)")
        parser.add_argument(
            "--reason",
            default=None,
            help="why (recorded on the run and in the workflow:cancelled event)",
        )

    def handle(self, *args: Any, **opts: Any) -> None:
        run = get_run(opts["run_id"])
        result = get_kernel().dispatch(CancelRun(run.pk, reason=opts["reason"]))
        if result.cancelled:
            self.stdout.write(self.style.SUCCESS("cancelled"))
            return
        status = WorkflowRun.objects.filter(pk=run.pk).values_list("status", flat=True).first()
        if status is None:
            raise CommandError(f"Workflow run {run.pk} not found")
        raise CommandError(f"not cancelled: run is {status}")
