"""Published annotation keys (SPEC §6.7, AN-50..AN-52): ``Trigger``, ``Decision``, ``Approval``,
``Revision``.

Use them instead of hand-typed strings; their values are type-checked when written::

    from django_workflows.conventions import Decision, Trigger

    ctx.annotate(Decision.outcome, "escalate")
    ctx.annotate(Decision.confidence, 0.82)          # a number; "0.82" is rejected
    start_run("triage", annotations=[AnnotationSpec({Trigger.source: "zendesk"})])

Key strings, value types and stability follow upstream's registry (AN-51); attribute names are
the snake_case forms of upstream's camelCase ones (``Trigger.parentRunId`` ->
``Trigger.parent_run_id``). A ``stable`` key is never renamed or re-typed: new keys are added
instead. Declare your own keys with :func:`~django_workflows.annotations.typed_key` under your
organisation's prefix (``acme.``). The engine itself never reads these keys (AN-52) - only the
ready-made approval stage (:mod:`django_workflows.approval`) does.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .annotations import IsoTimestamp, RunIdString, TypedKey, publish_keys, typed_key


class Trigger:
    """Why and by whom a run was started."""

    source = typed_key(
        "trigger.source", str, stability="stable", description="System that started the run"
    )
    parent_run_id = typed_key(
        "trigger.parent_run_id",
        RunIdString,
        stability="stable",
        description="Run that spawned this run (a UUID is stored as text)",
    )
    reason = typed_key(
        "trigger.reason", str, stability="stable", description="Why the run was started"
    )
    actor_kind = typed_key(
        "trigger.actor.kind",
        str,
        stability="stable",
        description="Kind of actor that started the run (user, system, schedule, ...)",
    )
    actor_id = typed_key("trigger.actor.id", str, stability="stable", description="Id of the actor")


class Decision:
    """What a stage decided and how sure it was."""

    outcome = typed_key(
        "decision.outcome",
        Any,
        stability="stable",
        description="The decision taken (any JSON value)",
    )
    rationale = typed_key(
        "decision.rationale", str, stability="stable", description="Why this outcome"
    )
    confidence = typed_key(
        "decision.confidence",
        float,
        stability="stable",
        description="Confidence in the outcome, a number (typically 0-1)",
    )
    alternatives = typed_key(
        "decision.alternatives",
        list[Any],
        stability="stable",
        description="Other outcomes that were considered",
    )
    used_fallback = typed_key(
        "decision.used_fallback",
        bool,
        stability="experimental",
        description="Whether a fallback path produced the outcome",
    )


class Approval:
    """Human (or policy) approval of a run or stage."""

    approvers = typed_key(
        "approval.approvers",
        list[str],
        stability="stable",
        description="Who approved (always a list of ids, even for one approver)",
    )
    timestamp = typed_key(
        "approval.timestamp",
        IsoTimestamp,
        stability="stable",
        description="When it was approved (ISO-8601; a datetime is stored as ISO text)",
    )
    policy_version = typed_key(
        "approval.policy.version",
        str,
        stability="experimental",
        description="Version of the approval policy applied",
    )


class Revision:
    """How a run relates to an earlier one it revises."""

    previous_run_id = typed_key(
        "revision.previous_run_id",
        RunIdString,
        stability="stable",
        description="The run this one revises (a UUID is stored as text)",
    )
    reason = typed_key(
        "revision.reason", str, stability="stable", description="Why the revision was made"
    )


#: The namespaces, by name.
NAMESPACES: dict[str, type] = {
    "Trigger": Trigger,
    "Decision": Decision,
    "Approval": Approval,
    "Revision": Revision,
}


def published_keys() -> list[tuple[str, str, TypedKey[Any]]]:
    """Every published key as ``(namespace, attribute, typed_key)``, in declaration order."""
    out = []
    for ns_name, ns in NAMESPACES.items():
        for attr, value in vars(ns).items():
            if isinstance(value, TypedKey):
                out.append((ns_name, attr, value))
    return out


def published_key(key: str) -> TypedKey[Any] | None:
    """The published typed key whose string is ``key``, or ``None``."""
    return _BY_KEY.get(key)


def with_published_types(attributes: Mapping[Any, Any]) -> dict[Any, Any]:
    """``attributes`` with every string key that is a published key replaced by its typed key,
    so its value is type-checked when written. Used where callers cannot pass typed keys (the
    management commands, JSON files); the kernel itself checks only the typed keys it is given.
    """
    return {published_key(k) or k if isinstance(k, str) else k: v for k, v in attributes.items()}


_BY_KEY: dict[str, TypedKey[Any]] = {k.key: k for _, _, k in published_keys()}
publish_keys(_BY_KEY.values())

__all__ = [
    "NAMESPACES",
    "Approval",
    "Decision",
    "Revision",
    "Trigger",
    "published_key",
    "published_keys",
    "with_published_types",
]
