"""Event delivery to plugins and in-process listeners (SPEC §5.3, EV-30..32).

Outbox events are published by ``outbox.flush`` (run by the maintenance tick) through a
:class:`PluginRunner`, which sends the :data:`workflow_event` Django signal and calls every
plugin subscribed to the event type, in order. If any of them raises, the event is retried on
the next flush and, after ``max_retries`` failures, dead-lettered (EV-4, EV-5): handlers must be
idempotent (delivery is at-least-once, EV-6).

::

    from django_workflows import define_plugin

    def notify(event):
        ...

    audit = define_plugin(id="audit", name="Audit log", on=["workflow:completed"], handle=notify)

    # settings.py
    DJANGO_WORKFLOWS = {"PLUGINS": ["myapp.plugins.audit"]}
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import django.dispatch
from django.utils.module_loading import import_string

from .conf import workflow_settings
from .kernel.events import EVENT_TYPES

#: Sent for every published outbox event: ``sender`` is :class:`PluginRunner`, ``event`` the
#: event dict (``type``, ``timestamp``, ``workflow_run_id``, ...).
workflow_event = django.dispatch.Signal()


@dataclass(frozen=True)
class Plugin:
    """A subscriber to outbox events (EV-30)."""

    id: str
    name: str
    on: tuple[str, ...]
    handle: Callable[[dict[str, Any]], None]


def define_plugin(
    *, id: str, name: str, on: Iterable[str], handle: Callable[[dict[str, Any]], None]
) -> Plugin:
    """Define a plugin subscribed to the event types in ``on`` (EV-30).

    Raises:
        ValueError: an unknown event type in ``on`` or a non-callable ``handle``.
    """
    types = tuple(on)
    unknown = [t for t in types if t not in EVENT_TYPES]
    if unknown:
        raise ValueError(
            f"Plugin {id!r}: unknown event types {unknown}; known: {', '.join(EVENT_TYPES)}"
        )
    if not callable(handle):
        raise ValueError(f"Plugin {id!r}: handle must be callable")
    return Plugin(id=id, name=name, on=types, handle=handle)


class PluginRunner:
    """An event sink that calls plugins in registration order (EV-31)."""

    def __init__(self, plugins: Sequence[Plugin], *, max_retries: int = 3) -> None:
        self.plugins = list(plugins)
        self.max_retries = max_retries

    def receives_nothing(self) -> bool:
        """``True`` when :meth:`emit` would hand an event to no one: it is this class's own
        (a subclass may record events), there is no plugin, and no receiver of
        :data:`workflow_event` is connected now. The outbox flush then marks the waiting events
        published without reading them (:mod:`.kernel.handlers.outbox_flush`, issue 19)."""
        return (
            type(self).emit is PluginRunner.emit
            and not self.plugins
            and not workflow_event.has_listeners(PluginRunner)
        )

    def emit(self, event: dict[str, Any]) -> None:
        """Deliver ``event``; the first error propagates so the outbox retries it (EV-31)."""
        workflow_event.send(sender=PluginRunner, event=event)
        for plugin in self.plugins:
            if event.get("type") in plugin.on:
                plugin.handle(event)


def load_plugins() -> list[Plugin]:
    """The plugins named in ``DJANGO_WORKFLOWS["PLUGINS"]`` (dotted paths).

    Raises:
        ImproperlyConfigured-style ``ImportError``/``TypeError`` naming the bad entry.
    """
    plugins = []
    for path in workflow_settings.PLUGINS:
        obj = import_string(path)
        if not isinstance(obj, Plugin):
            raise TypeError(f"DJANGO_WORKFLOWS['PLUGINS'] entry {path!r} is not a Plugin")
        plugins.append(obj)
    return plugins
