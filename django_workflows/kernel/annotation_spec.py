""":class:`AnnotationSpec`, the annotations given with ``run.create`` (AN-20): a leaf module, so
the commands (:mod:`.commands`, which re-exports it) and their validation
(:mod:`.annotations`) both use it without importing each other.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class AnnotationSpec:
    """Annotations attached at run creation (AN-20): ``attributes`` share the envelope.

    Attributes:
        attributes: ``{key: value}``; keys are strings or typed keys (``{Trigger.source:
            "zendesk"}``, values type-checked); ``None`` values are dropped (AN-5).
        actor: ``{"kind", "id", "version"}`` (any subset).
        payload: a JSON value kept with every row (not queryable).
        idempotency_key: dedupe key per ``(run, key)`` (AN-8).
        emit_event: one ``annotation:created`` event per inserted row (AN-40).
    """

    attributes: Mapping[Any, Any]
    actor: dict[str, str | None] | None = None
    payload: Any = None
    idempotency_key: str | None = None
    emit_event: bool = False
