"""``manage.py workflows_install_schedule``: create or refresh the django-q2 schedule that starts
the maintenance ticker every minute (idempotent; ``migrate`` does the same unless
``DJANGO_WORKFLOWS["INSTALL_SCHEDULE"]`` is false).
"""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand

from django_workflows.transport.django_q import SCHEDULE_NAME, TICKER_TASK, install_schedule


class Command(BaseCommand):
    help = (
        "Create or update the django-q2 schedule that starts the workflow maintenance ticker "
        "every minute (idempotent: running it again updates the one schedule row)."
    )

    def handle(self, *args: Any, **opts: Any) -> None:
        created = install_schedule()
        verb = "created" if created else "updated"
        self.stdout.write(
            self.style.SUCCESS(f"{verb} schedule {SCHEDULE_NAME} ({TICKER_TASK}, every 1 minute)")
        )
