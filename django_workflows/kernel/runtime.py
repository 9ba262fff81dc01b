"""The process-wide default kernel, built from ``DJANGO_WORKFLOWS`` settings."""

from __future__ import annotations

import threading
from typing import Any

from django.core.signals import setting_changed
from django.dispatch import receiver
from django.utils.module_loading import import_string

from ..conf import workflow_settings
from .dispatch import Kernel

_lock = threading.Lock()
_kernel: Kernel | None = None


def build_kernel() -> Kernel:
    """A kernel with the configured clock (``CLOCK``, default the system clock), the database
    blob store, the configured transport and the plugins listed in ``DJANGO_WORKFLOWS["PLUGINS"]``.
    """
    from ..plugins import PluginRunner, load_plugins

    transport_cls = import_string(workflow_settings.TRANSPORT)
    stale = workflow_settings.IDEMPOTENCY_STALE_SECONDS
    clock_path = workflow_settings.CLOCK
    return Kernel(
        clock=import_string(clock_path)() if clock_path else None,
        transport=transport_cls(),
        event_sink=PluginRunner(
            load_plugins(), max_retries=int(workflow_settings.OUTBOX_MAX_RETRIES)
        ),
        idempotency_stale_seconds=None if stale is None else float(stale),
    )


def get_kernel() -> Kernel:
    """The default kernel (built on first use; rebuilt after ``DJANGO_WORKFLOWS`` changes)."""
    global _kernel
    if _kernel is None:
        with _lock:
            if _kernel is None:
                _kernel = build_kernel()
    return _kernel


def reset_default_kernel() -> None:
    global _kernel
    _kernel = None


@receiver(setting_changed)
def _reset_on_settings_change(*, setting: str, **kwargs: Any) -> None:
    """``DJANGO_WORKFLOWS`` changed (a test's ``settings`` fixture): the next
    :func:`get_kernel` builds a kernel from the new settings. Connected after
    :mod:`django_workflows.conf`'s receiver (this module imports it), so settings reload first.
    """
    if setting == "DJANGO_WORKFLOWS":
        reset_default_kernel()
