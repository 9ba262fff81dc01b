"""App config: autodiscovers each installed app's ``workflows`` module and installs the
django-q2 ticker schedule after ``migrate``.
"""

from __future__ import annotations

from typing import Any

from django.apps import AppConfig
from django.db.models.signals import post_migrate


class DjangoWorkflowsConfig(AppConfig):
    name = "django_workflows"
    label = "django_workflows"
    verbose_name = "Workflows"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from django.utils.module_loading import autodiscover_modules

        from . import checks  # noqa: F401  (registers system checks)
        from .conf import workflow_settings

        autodiscover_modules(workflow_settings.AUTODISCOVER_MODULE)
        post_migrate.connect(_install_schedule, sender=self)
        from django.apps import apps

        if apps.is_installed("django_q"):
            from django_q.signals import post_spawn

            from .transport.django_q import on_post_spawn

            # A new worker process announces its queues at once (stage routing presence).
            post_spawn.connect(on_post_spawn, dispatch_uid="django_workflows.presence")


def _install_schedule(using: str = "default", **kwargs: Any) -> None:
    from django.apps import apps

    from .conf import workflow_settings

    if not workflow_settings.INSTALL_SCHEDULE or not apps.is_installed("django_q"):
        return
    from .transport.django_q import install_schedule

    try:
        install_schedule()
    except Exception:  # django_q tables may not be migrated yet on this database
        return
