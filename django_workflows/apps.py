"""App config: autodiscovers each installed app's ``workflows`` module, installs the
django-q2 ticker schedule after ``migrate`` and starts the supervisor thread of each django-q2
worker process (``post_spawn``).
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
        from .logging import install as install_log_fields

        install_log_fields()  # run_id, stage_id, delivery, generation on engine log records

        autodiscover_modules(workflow_settings.AUTODISCOVER_MODULE)
        post_migrate.connect(_install_schedule, sender=self)
        post_migrate.connect(_forget_stored_versions, sender=self)
        _connect_worker_spawn()


def _connect_worker_spawn() -> None:
    """Start the supervisor thread in every new django-q2 worker process (prompt recovery and
    graceful stop: :mod:`django_workflows.kernel.supervisor`).
    """
    from django.apps import apps

    if not apps.is_installed("django_q"):
        return
    from django_q.signals import post_spawn

    from .transport.django_q import on_post_spawn

    post_spawn.connect(on_post_spawn, dispatch_uid="django_workflows.supervisor", weak=False)


def _forget_stored_versions(**kwargs: Any) -> None:
    """After ``migrate`` or ``flush`` (tests) the stored definition versions may be gone."""
    from .kernel.versions import forget_stored

    forget_stored()


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
