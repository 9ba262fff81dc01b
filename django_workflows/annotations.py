"""Annotation keys, typed keys and input validation (SPEC §6.1, AN-1..AN-5, AN-50..AN-52).

Pure Python (pydantic only; Django's JSON encoder is imported lazily): the stage context, the
kernel's ``annotations.attach``, ``run.create`` and the management commands all build their
:class:`AnnotationInput` objects here, so every entry point enforces the same rules:

* **Keys** are dot-namespaced: at least two segments of ASCII letters, digits, ``_`` or ``-``
  (``"acme.ticket_id"``, ``"decision.outcome"``), at most 200 characters
  (:data:`KEY_PATTERN`, :func:`validate_key`). Published convention keys additionally follow
  the lower-case form of :data:`CONVENTION_KEY_PATTERN` (AN-52).
* **Values** are JSON values; ``None`` values are dropped silently (AN-5). When the key is a
  :class:`TypedKey`, the value is validated against its type (strict pydantic validation) and
  stored in its JSON form; a mismatch raises :class:`AnnotationError` naming the key.
* **Envelopes** (actor, payload, idempotency key, emit flag) are checked for shape and length.

Every error is an :class:`AnnotationError` (a ``ValueError``) whose ``field`` names the
offending part, e.g. ``attributes.decision.confidence`` or ``actor.kind``. Nothing is buffered
or written when a call fails.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import date, datetime
from typing import Annotated, Any, Generic, Literal, TypeVar, cast

from pydantic import AfterValidator, BeforeValidator, TypeAdapter, ValidationError

T = TypeVar("T")

#: Write-side key rule: two or more dot-separated segments of ``[A-Za-z0-9_-]`` (a segment
#: starts with a letter, digit or ``_``), at most :data:`MAX_KEY_LENGTH` characters.
KEY_PATTERN = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_-]*(?:\.[A-Za-z0-9_][A-Za-z0-9_-]*)+$")
#: The stricter form every published convention key follows (AN-52).
CONVENTION_KEY_PATTERN = re.compile(r"^[a-z][a-z0-9_]*(\.[a-z][a-z0-9_]*)+$")
#: Keys the legacy metadata shim synthesises (AN-30, AN-31).
LEGACY_METADATA_PREFIX = "legacy.metadata."
#: Column sizes of ``workflow_annotations`` (SPEC §1.6).
MAX_KEY_LENGTH = 200
MAX_SCOPE_LENGTH = 64
MAX_SCOPE_ID_LENGTH = 200
MAX_IDEMPOTENCY_KEY_LENGTH = 200
ACTOR_FIELD_LENGTHS = {"kind": 64, "id": 200, "version": 64}
ENVELOPE_FIELDS = frozenset({"attributes", "actor", "payload", "idempotency_key", "emit_event"})

Stability = Literal["stable", "experimental", "deprecated"]
STABILITIES: tuple[str, ...] = ("stable", "experimental", "deprecated")


class AnnotationError(ValueError):
    """An annotation call is malformed. ``field`` names the part at fault; nothing was written."""

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


def validate_key(key: object, *, field: str = "key") -> str:
    """Return ``key`` if it is a valid annotation key, else raise :class:`AnnotationError`.

    Raises:
        AnnotationError: not a string, longer than 200 characters, or not of the form
            ``namespace.name[.more]`` with segments of ``[A-Za-z0-9_-]``.
    """
    if not isinstance(key, str):
        raise AnnotationError(
            f"{field}: an annotation key must be a string, got {type(key).__name__}", field=field
        )
    if len(key) > MAX_KEY_LENGTH:
        raise AnnotationError(
            f"{field}: annotation key {key[:40]!r}... is longer than {MAX_KEY_LENGTH} characters",
            field=field,
        )
    if not KEY_PATTERN.match(key):
        raise AnnotationError(
            f"{field}: invalid annotation key {key!r}: use dot-separated segments of letters, "
            "digits, '_' or '-' with at least one namespace, e.g. 'acme.ticket_id'",
            field=field,
        )
    return key


# --- typed keys (AN-50) -----------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class TypedKey(Generic[T]):
    """An annotation key with a value type, a stability level and a description (AN-50).

    Pass it to ``ctx.annotate(key, value)`` or use it as an attribute key
    (``{Decision.outcome: "approved"}``) in ``annotations.attach`` and ``run.create``: the value
    is validated against ``value_type`` (strict pydantic validation: ``"1"`` is not an ``int``,
    ``1`` is not a ``bool``, a tuple is not a ``list``) and stored in its JSON form.

    Attributes:
        key: the key string.
        value_type: any type pydantic can validate (``str``, ``float``, ``list[str]``,
            ``Literal[...]``, a ``BaseModel`` ...); ``Any`` accepts every JSON value.
        stability: ``"stable"`` (never renamed or re-typed), ``"experimental"`` or
            ``"deprecated"``.
        description: one line for humans.
    """

    key: str
    value_type: Any = Any
    stability: Stability = "experimental"
    description: str | None = None
    _adapter: TypeAdapter[Any] | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        validate_key(self.key)
        if self.stability not in STABILITIES:
            raise AnnotationError(
                f"typed key {self.key!r}: stability must be one of {', '.join(STABILITIES)}, "
                f"got {self.stability!r}",
                field="stability",
            )
        if self.value_type is not Any:
            object.__setattr__(self, "_adapter", TypeAdapter(self.value_type))

    def validate(self, value: Any, *, field: str | None = None) -> Any:
        """Validate ``value`` against the key's type; return its JSON form.

        Raises:
            AnnotationError: the value does not match (the message names the key and the type).
        """
        if self._adapter is None:
            return value
        where = field or self.key
        try:
            parsed = self._adapter.validate_python(value, strict=True)
        except ValidationError as exc:
            problems = "; ".join(
                ".".join(str(p) for p in err["loc"]) + ": " + err["msg"]
                if err["loc"]
                else err["msg"]
                for err in exc.errors()
            )
            raise AnnotationError(
                f"{where}: invalid value {value!r} for annotation key {self.key!r} "
                f"(expected {_type_name(self.value_type)}): {problems}",
                field=where,
            ) from None
        return self._adapter.dump_python(parsed, mode="json")

    def __hash__(self) -> int:
        return hash(("TypedKey", self.key))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TypedKey):
            return NotImplemented
        return (self.key, self.value_type, self.stability, self.description) == (
            other.key,
            other.value_type,
            other.stability,
            other.description,
        )

    def __str__(self) -> str:
        return self.key


def typed_key(
    key: str,
    value_type: Any = Any,
    *,
    stability: Stability = "experimental",
    description: str | None = None,
) -> TypedKey[Any]:
    """Declare a typed annotation key for your own facts (AN-50).

    Example::

        TICKET = typed_key("acme.ticket_id", str, stability="stable", description="Zendesk id")
        ctx.annotate(TICKET, "T-4711")      # ok
        ctx.annotate(TICKET, 4711)          # AnnotationError: expected str

    Args:
        key: a valid key (:func:`validate_key`); org-prefix your own keys (``acme.``).
        value_type: the value's type (default ``Any``: any JSON value).
        stability: ``"experimental"`` unless you promise never to rename or re-type the key.
        description: optional one-line description.

    Raises:
        AnnotationError: a malformed key or an unknown stability.
    """
    return TypedKey(key, value_type, stability, description)


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


# --- value types shared by conventions ---------------------------------------------------------


def _iso_timestamp(value: Any) -> Any:
    if isinstance(value, datetime | date):
        return value.isoformat()
    return value


def _check_iso(value: str) -> str:
    try:
        datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        raise ValueError(f"not an ISO-8601 timestamp: {value!r}") from None
    return value


def _uuid_to_str(value: Any) -> Any:
    return str(value) if isinstance(value, uuid.UUID) else value


#: An ISO-8601 timestamp string; a ``datetime``/``date`` is accepted and stored as ISO text.
IsoTimestamp = Annotated[str, BeforeValidator(_iso_timestamp), AfterValidator(_check_iso)]
#: A run id string; a ``uuid.UUID`` is accepted and stored as text.
RunIdString = Annotated[str, BeforeValidator(_uuid_to_str)]


# --- inputs -------------------------------------------------------------------------------------


@dataclass
class AnnotationInput:
    """One validated annotation about to be written (AN-3, AN-4, AN-8).

    ``actor`` is ``{"kind", "id", "version"}`` (any subset) or ``None``; ``emit_event`` asks for
    an ``annotation:created`` outbox event (AN-40; never persisted, DM-17).
    """

    key: str
    value: Any
    actor: dict[str, str | None] | None = None
    payload: Any = None
    idempotency_key: str | None = None
    emit_event: bool = False


#: Largest annotation value, JSON-encoded (bytes). Annotations are facts, not documents.
MAX_VALUE_BYTES = 64 * 1024
#: Largest annotation payload, JSON-encoded (bytes).
MAX_PAYLOAD_BYTES = 1024 * 1024


def check_json(value: Any, *, field: str, max_bytes: int = MAX_VALUE_BYTES) -> None:
    """Raise :class:`AnnotationError` naming ``field`` unless ``value`` encodes as JSON that
    both databases can store (Django's encoder: datetimes, decimals and UUIDs are fine; NaN,
    Infinity and NUL characters are not) within ``max_bytes``.
    """
    from django.core.serializers.json import DjangoJSONEncoder

    from .kernel.jsonvalue import storable_json_error

    try:
        encoded = json.dumps(value, cls=DjangoJSONEncoder, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise AnnotationError(f"{field}: not a JSON value ({exc})", field=field) from None
    problem = storable_json_error(value)
    if problem:
        raise AnnotationError(f"{field}: {problem}", field=field)
    size = len(encoded.encode())
    if size > max_bytes:
        raise AnnotationError(
            f"{field}: {size} bytes of JSON is more than the {max_bytes} allowed", field=field
        )


def _check_text(value: str, field: str) -> None:
    if "\x00" in value:
        raise AnnotationError(f"{field}: contains a NUL character (\\u0000)", field=field)


def normalise_actor(actor: Any, *, field: str = "actor") -> dict[str, str | None] | None:
    """``actor`` as ``{"kind", "id", "version"}`` strings (absent members dropped), or ``None``.

    Raises:
        AnnotationError: not a mapping, an unknown member, a non-string or too-long value.
    """
    if actor is None:
        return None
    if not isinstance(actor, Mapping):
        raise AnnotationError(
            f"{field}: expected an object with kind/id/version, got {type(actor).__name__}",
            field=field,
        )
    unknown = sorted(str(k) for k in actor if k not in ACTOR_FIELD_LENGTHS)
    if unknown:
        raise AnnotationError(
            f"{field}: unknown member(s) {', '.join(unknown)}; allowed: kind, id, version",
            field=f"{field}.{unknown[0]}",
        )
    out: dict[str, str | None] = {}
    for name, limit in ACTOR_FIELD_LENGTHS.items():
        value = actor.get(name)
        if value is None:
            continue
        where = f"{field}.{name}"
        if not isinstance(value, str) or not value:
            raise AnnotationError(
                f"{where}: expected a non-empty string, got {value!r}", field=where
            )
        if len(value) > limit:
            raise AnnotationError(f"{where}: longer than {limit} characters", field=where)
        _check_text(value, where)
        out[name] = value
    return out or None


def check_idempotency_key(value: Any, *, field: str = "idempotency_key") -> str | None:
    """``value`` if it is ``None`` or a non-empty string of at most 200 characters."""
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise AnnotationError(f"{field}: expected a non-empty string, got {value!r}", field=field)
    if len(value) > MAX_IDEMPOTENCY_KEY_LENGTH:
        raise AnnotationError(
            f"{field}: longer than {MAX_IDEMPOTENCY_KEY_LENGTH} characters", field=field
        )
    _check_text(value, field)
    return value


def check_scope(scope: Any, scope_id: Any) -> tuple[str, str | None]:
    """Validate a scope (``run``, ``stage``, ``ai_call`` or any consumer string) and scope id."""
    if not isinstance(scope, str) or not scope or scope != scope.strip() or " " in scope:
        raise AnnotationError(
            f"scope: expected a non-empty string without spaces, got {scope!r}", field="scope"
        )
    if len(scope) > MAX_SCOPE_LENGTH:
        raise AnnotationError(f"scope: longer than {MAX_SCOPE_LENGTH} characters", field="scope")
    _check_text(scope, "scope")
    if scope_id is not None:
        if not isinstance(scope_id, str) or not scope_id:
            raise AnnotationError(
                f"scope_id: expected a non-empty string, got {scope_id!r}", field="scope_id"
            )
        if len(scope_id) > MAX_SCOPE_ID_LENGTH:
            raise AnnotationError(
                f"scope_id: longer than {MAX_SCOPE_ID_LENGTH} characters", field="scope_id"
            )
        _check_text(scope_id, "scope_id")
    return scope, scope_id


def build_inputs(
    attributes: Any,
    *,
    actor: Any = None,
    payload: Any = None,
    idempotency_key: Any = None,
    emit_event: Any = False,
    field_prefix: str = "",
    _name_key_only: bool = False,
) -> list[AnnotationInput]:
    """Validate one envelope and expand it into inputs, one per non-``None`` attribute
    (AN-3, AN-5). Attribute keys are strings or :class:`TypedKey` objects (whose values are
    type-checked). All-or-nothing: the first error raises and nothing is returned.

    Args:
        attributes: ``{key: value}``; ``None`` or ``{}`` yields no inputs.
        field_prefix: prepended to ``AnnotationError.field`` (e.g. ``"annotations[0]."``).

    Raises:
        AnnotationError: a malformed key, value, actor, payload, idempotency key or flag.
    """
    if attributes is None:
        return []
    if not isinstance(attributes, Mapping):
        where = f"{field_prefix}attributes"
        raise AnnotationError(
            f"{where}: expected an object of key -> value, got {type(attributes).__name__}",
            field=where,
        )
    actor_dict = normalise_actor(actor, field=f"{field_prefix}actor")
    if payload is not None:
        check_json(payload, field=f"{field_prefix}payload", max_bytes=MAX_PAYLOAD_BYTES)
    key = check_idempotency_key(idempotency_key, field=f"{field_prefix}idempotency_key")
    if not isinstance(emit_event, bool):
        where = f"{field_prefix}emit_event"
        raise AnnotationError(f"{where}: expected true or false, got {emit_event!r}", field=where)
    inputs = []
    for raw_key, value in attributes.items():
        name = raw_key.key if isinstance(raw_key, TypedKey) else raw_key
        where = str(name) if _name_key_only else f"{field_prefix}attributes.{name}"
        validate_key(name, field=where if isinstance(name, str) else f"{field_prefix}attributes")
        if value is None:  # AN-5
            continue
        typed = raw_key if isinstance(raw_key, TypedKey) else _published(cast(str, name))
        if typed is not None:
            value = typed.validate(value, field=where)
        check_json(value, field=where)
        inputs.append(AnnotationInput(cast(str, name), value, actor_dict, payload, key, emit_event))
    return inputs


#: Published key string -> its typed key (AN-51). Filled by :mod:`django_workflows.conventions`
#: when it is imported (:func:`publish_keys`); the package initialiser imports it, so it is
#: filled before any annotation is validated. Registered, not imported, so this module does not
#: import the conventions that are built from its types (an import circle).
_PUBLISHED: dict[str, TypedKey[Any]] = {}


def publish_keys(keys: Iterable[TypedKey[Any]]) -> None:
    """Register published typed keys (the conventions' namespaces, AN-51): a value written
    under one of their key strings - as a plain string too - is checked against its type.

    Raises:
        ValueError: a key string is registered already with a different typed key.
    """
    for typed in keys:
        known = _PUBLISHED.setdefault(typed.key, typed)
        if known is not typed:
            raise ValueError(f"published key {typed.key!r} is registered already")


def _published(key: str) -> TypedKey[Any] | None:
    """The convention's typed key for a published key string, so its value type is checked
    whichever way the key is written (AN-51).
    """
    return _PUBLISHED.get(key)


def inputs_from_envelope(
    envelope: Mapping[str, Any], *, field_prefix: str = ""
) -> list[AnnotationInput]:
    """The batch form ``{"attributes": {...}, "actor", "payload", "idempotency_key",
    "emit_event"}`` (AN-3) as inputs. Unknown envelope members are an error (a misspelt
    ``idempotencyKey`` must not be ignored silently).
    """
    unknown = sorted(str(k) for k in envelope if k not in ENVELOPE_FIELDS)
    if unknown:
        where = f"{field_prefix}{unknown[0]}"
        raise AnnotationError(
            f"{where}: unknown annotation envelope member(s) {', '.join(unknown)}; allowed: "
            f"{', '.join(sorted(ENVELOPE_FIELDS))}",
            field=where,
        )
    return build_inputs(
        envelope.get("attributes"),
        actor=envelope.get("actor"),
        payload=envelope.get("payload"),
        idempotency_key=envelope.get("idempotency_key"),
        emit_event=envelope.get("emit_event", False),
        field_prefix=field_prefix,
    )


def annotate_inputs(
    target: Any,
    value: Any = None,
    *,
    actor: Any = None,
    payload: Any = None,
    idempotency_key: Any = None,
    emit_event: bool = False,
) -> list[AnnotationInput]:
    """The three call forms of ``annotate`` (AN-1..AN-5) as validated inputs.

    * ``annotate(TypedKey, value, **opts)`` - the value is type-checked (AN-1);
    * ``annotate("ns.key", value, **opts)`` or any object with a string ``key`` (AN-1, AN-2);
    * ``annotate({"attributes": {...}, "actor": ..., ...})`` - the batch envelope (AN-3).

    Raises:
        TypeError: ``target`` is none of the three forms.
        AnnotationError: a malformed key, value or option.
    """
    if isinstance(target, Mapping):
        return inputs_from_envelope(target)
    if isinstance(target, TypedKey | str):
        key: Any = target
    else:
        key = getattr(target, "key", None)
        if not isinstance(key, str):
            raise TypeError(
                f"annotate() needs a key string, a typed key or an envelope, got {target!r}"
            )
    return build_inputs(
        {key: value},
        actor=actor,
        payload=payload,
        idempotency_key=idempotency_key,
        emit_event=emit_event,
        _name_key_only=True,
    )


__all__ = [
    "CONVENTION_KEY_PATTERN",
    "KEY_PATTERN",
    "LEGACY_METADATA_PREFIX",
    "AnnotationError",
    "AnnotationInput",
    "IsoTimestamp",
    "RunIdString",
    "Stability",
    "TypedKey",
    "annotate_inputs",
    "build_inputs",
    "inputs_from_envelope",
    "typed_key",
    "validate_key",
]
