from __future__ import annotations

from django.apps import AppConfig


class CrashAppConfig(AppConfig):
    name = "tests.acceptance.crashapp"
    label = "crashapp"
    verbose_name = "Crash-test workflows"
