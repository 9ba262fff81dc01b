"""Request and response shapes of the HTTP API (DRF serializers; the OpenAPI schema is
generated from them).

Request fields are strict: a string field takes only JSON strings, an integer field only JSON
integers, a boolean field only ``true``/``false`` (DRF would coerce ``"5"`` or ``1``). Strings
refuse NUL characters. Times are ISO-8601 in UTC; durations are milliseconds (``*_ms``).
"""

from __future__ import annotations

import math
from typing import Any

from drf_spectacular.extensions import OpenApiSerializerFieldExtension
from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from ..models import LogLevel, Status

RUN_STATUSES = [
    Status.PENDING,
    Status.RUNNING,
    Status.COMPLETED,
    Status.FAILED,
    Status.CANCELLED,
]
STAGE_STATUSES = [choice for choice, _ in Status.choices]
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1


# --- strict request fields ---------------------------------------------------------------------


class StrictCharField(serializers.CharField):
    """A JSON string only (no numbers coerced to text); no NUL characters."""

    def to_internal_value(self, data: Any) -> str:
        if not isinstance(data, str):
            self.fail("invalid")
        return super().to_internal_value(data)  # type: ignore[no-any-return]


class StrictCharFieldSchema(OpenApiSerializerFieldExtension):
    """OpenAPI of :class:`StrictCharField`, as enforced: a string without NUL (``pattern``);
    one that may not be blank needs a character that is not whitespace (DRF trims it first,
    so ``" "`` is blank)."""

    target_class = StrictCharField

    def map_serializer_field(self, auto_schema: Any, direction: Any) -> Any:
        schema = auto_schema._map_serializer_field(self.target, direction, bypass_extensions=True)
        field = self.target
        if field.allow_blank or not field.trim_whitespace:
            schema.setdefault("pattern", NO_NUL)
        else:
            schema.setdefault("pattern", NOT_BLANK)
            schema.setdefault("minLength", 1)
        return schema


#: Any string without NUL.
NO_NUL = "^[^\\u0000]*$"
#: The characters ``str.strip()`` removes (Python's whitespace), spelled out: ``\\s`` means
#: fewer of them in ECMA-262 regular expressions (not ``\\x1c``-``\\x1f``), so a client
#: checking the pattern with those would send ``"\\x1f"`` as not blank.
_WHITESPACE = (
    "\\t\\n\\u000b\\f\\r\\u001c-\\u0020\\u0085\\u00a0\\u1680\\u2000-\\u200a"
    "\\u2028\\u2029\\u202f\\u205f\\u3000"
)
#: A string without NUL holding a character that is not whitespace.
NOT_BLANK = f"^[^\\u0000]*[^{_WHITESPACE}\\u0000][^\\u0000]*$"


class StrictIntegerField(serializers.IntegerField):
    """A JSON integer only (no ``"5"``, ``5.0`` or ``true``) - in bodies. Query parameters
    (always strings) are parsed as base-10 integers."""

    def to_internal_value(self, data: Any) -> int:
        if isinstance(data, bool) or not isinstance(data, int | str):
            self.fail("invalid")
        if isinstance(data, str) and not self.parent_is_query():
            self.fail("invalid")
        return super().to_internal_value(data)  # type: ignore[no-any-return]

    def parent_is_query(self) -> bool:
        return bool(getattr(self.root, "is_query", False))


class StrictBooleanField(serializers.BooleanField):
    """``true``/``false`` only in bodies; ``true``/``false``/``1``/``0`` in query strings."""

    def to_internal_value(self, data: Any) -> bool:
        if isinstance(data, bool):
            return data
        if getattr(self.root, "is_query", False) and data in ("true", "false", "1", "0"):
            return data in ("true", "1")
        self.fail("invalid")
        raise AssertionError  # pragma: no cover


class FiniteFloatField(serializers.FloatField):
    """A finite number (``nan``/``inf`` refused)."""

    def to_internal_value(self, data: Any) -> float:
        if isinstance(data, bool):
            self.fail("invalid")
        value = super().to_internal_value(data)
        if not math.isfinite(value):
            self.fail("invalid")
        return value  # type: ignore[no-any-return]


class JSONObjectField(serializers.DictField):
    """A JSON object (any members)."""

    def to_internal_value(self, data: Any) -> dict[str, Any]:
        if not isinstance(data, dict):
            self.fail("not_a_dict", input_type=type(data).__name__)
        return dict(data)


@extend_schema_field({"oneOf": [{"type": "integer"}, {"type": "string"}]})
class AnnotationIdField(serializers.Field):
    """A row id (integer) or ``"synthesized:<run>:<key>"`` for a legacy metadata row."""

    def to_representation(self, value: Any) -> Any:
        return value


# --- request bodies ---------------------------------------------------------------------------


class BodySerializer(serializers.Serializer):
    """A request body: a member it does not know is an error naming it (a typo such as
    ``confg`` must not be ignored silently).
    """

    def to_internal_value(self, data: Any) -> Any:
        if isinstance(data, dict):
            unknown = sorted(set(data) - set(self.fields))
            if unknown:
                raise serializers.ValidationError(
                    {
                        name: ["unknown field; expected one of " + ", ".join(self.fields)]
                        for name in unknown
                    }
                )
        return super().to_internal_value(data)


class ActorSerializer(BodySerializer):
    """Who wrote an annotation: ``{"kind", "id", "version"}`` (any subset)."""

    kind = StrictCharField(max_length=64, required=False, allow_null=True)
    id = StrictCharField(max_length=200, required=False, allow_null=True)
    version = StrictCharField(max_length=64, required=False, allow_null=True)


class AnnotationEnvelopeSerializer(BodySerializer):
    """Annotations written with a new run (run scope): attributes share the envelope."""

    attributes = JSONObjectField(help_text="{key: JSON value}; null values are dropped")
    actor = ActorSerializer(required=False, allow_null=True)
    payload = serializers.JSONField(required=False, allow_null=True)
    idempotency_key = StrictCharField(max_length=200, required=False, allow_null=True)
    emit_event = StrictBooleanField(required=False, default=False)


class CreateRunSerializer(BodySerializer):
    """``POST runs/``. The ``Idempotency-Key`` header makes a retry safe."""

    workflow_id = StrictCharField(max_length=200)
    input = JSONObjectField(required=False, default=dict)
    config = JSONObjectField(
        required=False, allow_null=True, help_text="{stage_id: {...}} over the stage defaults"
    )
    priority = StrictIntegerField(
        required=False, default=5, min_value=INT32_MIN, max_value=INT32_MAX
    )
    annotations = AnnotationEnvelopeSerializer(many=True, required=False, max_length=100)


class CancelSerializer(BodySerializer):
    reason = StrictCharField(max_length=2000, required=False, allow_null=True, allow_blank=True)


class RerunSerializer(BodySerializer):
    from_stage_id = StrictCharField(max_length=200)
    idempotency_key = StrictCharField(max_length=255, required=False, allow_null=True)


class ApproveSerializer(BodySerializer):
    comment = StrictCharField(max_length=10_000, required=False, allow_null=True, allow_blank=True)
    stage_id = StrictCharField(
        max_length=200, required=False, allow_null=True, help_text="when several approvals wait"
    )
    policy_version = StrictCharField(max_length=200, required=False, allow_null=True)


class RejectSerializer(BodySerializer):
    reason = StrictCharField(max_length=10_000, required=False, allow_null=True, allow_blank=True)
    stage_id = StrictCharField(
        max_length=200, required=False, allow_null=True, help_text="when several approvals wait"
    )
    policy_version = StrictCharField(max_length=200, required=False, allow_null=True)


class CreateAnnotationSerializer(BodySerializer):
    """``POST runs/{id}/annotations/``; ``actor`` defaults to the authenticated user."""

    attributes = JSONObjectField(help_text="{key: JSON value}; null values are dropped")
    scope = StrictCharField(max_length=64, required=False, default="run")
    scope_id = StrictCharField(max_length=200, required=False, allow_null=True)
    actor = ActorSerializer(required=False, allow_null=True)
    payload = serializers.JSONField(required=False, allow_null=True)
    idempotency_key = StrictCharField(max_length=200, required=False, allow_null=True)
    emit_event = StrictBooleanField(required=False, default=False)


class SendSignalSerializer(BodySerializer):
    """``POST runs/{id}/signals/``; ``actor`` defaults to ``user:<the authenticated user>``."""

    name = StrictCharField(
        max_length=200, help_text="1-200 letters, digits or '._:-', starting with a letter or digit"
    )
    payload = serializers.JSONField(
        required=False, allow_null=True, help_text="any JSON value, at most 64 KiB"
    )
    key = StrictCharField(
        max_length=255,
        required=False,
        allow_null=True,
        help_text="idempotency key, unique per run (or the Idempotency-Key header)",
    )
    actor = StrictCharField(max_length=200, required=False, allow_null=True)


# --- query strings ----------------------------------------------------------------------------


class QuerySerializer(serializers.Serializer):
    """Base of query-string serializers (integers and booleans arrive as text)."""

    is_query = True


class RunListQuerySerializer(QuerySerializer):
    status = serializers.ListField(
        child=serializers.ChoiceField(choices=RUN_STATUSES),
        required=False,
        max_length=len(RUN_STATUSES),
        help_text="repeatable: status=RUNNING&status=PENDING",
    )
    workflow_id = StrictCharField(max_length=200, required=False)
    created_after = serializers.DateTimeField(required=False, help_text="created_at >= this")
    created_before = serializers.DateTimeField(required=False, help_text="created_at < this")
    parent = serializers.UUIDField(
        required=False, help_text="only the child runs of this run (child workflows)"
    )
    key = StrictCharField(max_length=200, required=False, help_text="annotation key")
    value = StrictCharField(
        max_length=65_536,
        required=False,
        help_text="with key: annotation value equality; parsed as JSON when it is JSON "
        '(5, true, "5"), else taken as a string',
    )

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        if "value" in attrs and "key" not in attrs:
            raise serializers.ValidationError({"value": ["value needs key"]})
        return attrs


class AnnotationListQuerySerializer(QuerySerializer):
    key = StrictCharField(max_length=200, required=False, help_text="exact key")
    key_prefix = StrictCharField(max_length=200, required=False)
    scope = StrictCharField(max_length=64, required=False)
    scope_id = StrictCharField(max_length=200, required=False)
    no_scope_id = StrictBooleanField(
        required=False, default=False, help_text="only rows without a scope id"
    )
    actor_id = StrictCharField(max_length=200, required=False)
    actor_kind = StrictCharField(max_length=64, required=False)
    generation = StrictIntegerField(required=False, min_value=0, max_value=INT32_MAX)
    since = serializers.DateTimeField(required=False, help_text="created_at >= this")
    until = serializers.DateTimeField(required=False, help_text="created_at <= this")
    limit = StrictIntegerField(required=False, default=1000, min_value=1, max_value=1000)
    include_legacy = StrictBooleanField(
        required=False, default=True, help_text="include legacy.metadata.* virtual rows"
    )

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        if attrs.get("no_scope_id") and "scope_id" in attrs:
            raise serializers.ValidationError(
                {"no_scope_id": ["no_scope_id and scope_id exclude each other"]}
            )
        return attrs


class EventsQuerySerializer(QuerySerializer):
    after = StrictIntegerField(
        required=False,
        default=0,
        min_value=0,
        max_value=INT32_MAX,
        help_text="return events with a sequence above this",
    )
    wait = FiniteFloatField(
        required=False,
        default=0,
        min_value=0,
        max_value=30,
        help_text="long poll: wait up to this many seconds for a newer event",
    )
    limit = StrictIntegerField(required=False, default=100, min_value=1, max_value=1000)


class LogsQuerySerializer(QuerySerializer):
    after = StrictIntegerField(
        required=False,
        default=0,
        min_value=0,
        max_value=2**63 - 1,
        help_text="return log lines with an id above this",
    )
    level = serializers.ChoiceField(choices=[c for c, _ in LogLevel.choices], required=False)
    limit = StrictIntegerField(required=False, default=200, min_value=1, max_value=1000)


# --- responses ----------------------------------------------------------------------------------


class ErrorSerializer(serializers.Serializer):
    """Every error: a stable ``code``, a message, field errors by path (may be empty)."""

    code = serializers.CharField()
    message = serializers.CharField()
    errors = serializers.DictField(child=serializers.ListField(child=serializers.CharField()))


class ConditionSerializer(serializers.Serializer):
    """A stage's ``when=`` condition (issue 18)."""

    predicate = serializers.CharField(help_text="the predicate's qualified name")
    reason = serializers.CharField(help_text="what it means; a skipped stage records it")


class BranchSpotSerializer(serializers.Serializer):
    """Where a stage sits in a branch block (issue 18)."""

    id = serializers.CharField(help_text="the branch block's id")
    chooser = serializers.CharField(help_text="the choose function's qualified name")
    branches = serializers.ListField(
        child=serializers.CharField(), help_text="every declared branch"
    )
    name = serializers.CharField(help_text="the branch this stage is on")


class StageSchemaSerializer(serializers.Serializer):
    stage_id = serializers.CharField()
    name = serializers.CharField()
    description = serializers.CharField(allow_blank=True)
    mode = serializers.ChoiceField(choices=["sync", "async-batch"])
    dependencies = serializers.ListField(child=serializers.CharField())
    config_schema = serializers.JSONField(help_text="JSON Schema of the stage config")
    config_defaults = serializers.JSONField()
    output_schema = serializers.JSONField(allow_null=True)
    timeout_seconds = serializers.FloatField(
        allow_null=True,
        help_text="Longest one delivery may run (seconds; the stage's own or "
        "DEFAULT_STAGE_TIMEOUT_SECONDS); null: no limit",
    )
    queue_timeout_seconds = serializers.FloatField(
        allow_null=True,
        help_text="Longest a ready job may wait for a worker of its queue (seconds); null: "
        "no limit",
    )
    when = ConditionSerializer(
        allow_null=True,
        help_text="the stage's when= condition; null: it always runs (SKIPPED when false)",
    )
    branch = BranchSpotSerializer(
        allow_null=True, help_text="the branch block the stage is on; null: none"
    )


class ExecutionGroupSerializer(serializers.Serializer):
    execution_group = serializers.IntegerField()
    parallel = serializers.BooleanField()
    stages = StageSchemaSerializer(many=True)


class DefinitionSerializer(serializers.Serializer):
    workflow_id = serializers.CharField()
    name = serializers.CharField()
    description = serializers.CharField(allow_blank=True)
    input_schema = serializers.JSONField(help_text="JSON Schema of the run input")
    execution_groups = ExecutionGroupSerializer(many=True)


class RunSerializer(serializers.Serializer):
    """A run in the list."""

    id = serializers.UUIDField()
    url = serializers.CharField(help_text="the run in this API")
    workflow_id = serializers.CharField()
    workflow_name = serializers.CharField(allow_blank=True)
    status = serializers.ChoiceField(choices=RUN_STATUSES)
    priority = serializers.IntegerField()
    created_at = serializers.DateTimeField()
    updated_at = serializers.DateTimeField()
    started_at = serializers.DateTimeField(allow_null=True)
    completed_at = serializers.DateTimeField(allow_null=True)
    duration_ms = serializers.IntegerField(allow_null=True)
    definition_version = serializers.CharField(
        allow_blank=True,
        help_text="the version of the definition the run started with (explicit or a "
        "fingerprint 'fp-...'); empty: unversioned",
    )
    concurrency_key = serializers.CharField(
        allow_null=True,
        help_text="the run's concurrency key (its workflow's concurrency_key(input)): at most "
        "max_running_per_key runs with one key are RUNNING at once; null: not limited by key",
    )


class MapItemProgressSerializer(serializers.Serializer):
    """One map item being executed: its index and its own ``ctx.progress``."""

    index = serializers.IntegerField()
    progress = serializers.FloatField(allow_null=True, help_text="0-100; null before any")
    message = serializers.CharField(allow_blank=True)


class MapItemsSerializer(serializers.Serializer):
    """A map stage's items: how many ``over`` returned, completed, failed for good."""

    total = serializers.IntegerField()
    completed = serializers.IntegerField()
    failed = serializers.IntegerField()
    in_flight = MapItemProgressSerializer(
        many=True,
        required=False,
        help_text="the items executing now (at most 5, lowest index first) with their own "
        "ctx.progress",
    )


class StageSerializer(serializers.Serializer):
    stage_id = serializers.CharField()
    name = serializers.CharField(allow_blank=True)
    execution_group = serializers.IntegerField()
    stage_number = serializers.IntegerField()
    generation = serializers.IntegerField(help_text="rerun generation (0 first)")
    status = serializers.ChoiceField(choices=STAGE_STATUSES)
    started_at = serializers.DateTimeField(allow_null=True)
    completed_at = serializers.DateTimeField(allow_null=True)
    duration_ms = serializers.IntegerField(allow_null=True)
    error = serializers.CharField(allow_null=True, allow_blank=True)
    progress = serializers.FloatField(allow_null=True, help_text="0-100")
    progress_message = serializers.CharField(allow_blank=True)
    next_poll_at = serializers.DateTimeField(allow_null=True)
    skip_reason = serializers.CharField(
        allow_blank=True,
        help_text="why a SKIPPED stage did not run (its when= condition was false, or another "
        "branch was chosen); empty for every other status",
    )
    items = MapItemsSerializer(
        allow_null=True,
        required=False,
        help_text="a map stage's item counts (docs/fan-out.md); null for a plain stage",
    )


class WaitingSerializer(serializers.Serializer):
    """Why the run is not moving right now (one entry per waiting stage)."""

    reason = serializers.ChoiceField(
        choices=[
            "claim",
            "job_queued",
            "no_worker",
            "retry",
            "executing",
            "poll",
            "approval",
            "signal",
            "child",
            "limit",
        ],
        help_text="no_worker: the stage's queue has no live worker (stage routing); child: a "
        "child-workflow stage waits for its child run; limit: a shared limit is full",
    )
    stage_id = serializers.CharField(allow_null=True)
    at = serializers.DateTimeField(allow_null=True, help_text="when it is due, if known")
    message = serializers.CharField()
    allowed_approvers = serializers.ListField(child=serializers.CharField())


class ChildRunSerializer(serializers.Serializer):
    """A child run started by one of the run's child-workflow stages (oldest first)."""

    id = serializers.UUIDField()
    workflow_id = serializers.CharField()
    status = serializers.ChoiceField(choices=RUN_STATUSES)
    parent_stage_id = serializers.CharField(help_text="the stage that started it")
    parent_generation = serializers.IntegerField(
        help_text="that stage's rerun generation (a rerun starts a new child)"
    )
    url = serializers.CharField()


class RunLinksSerializer(serializers.Serializer):
    events = serializers.CharField()
    annotations = serializers.CharField()
    logs = serializers.CharField()
    admin = serializers.CharField(allow_null=True)


class RunErrorSerializer(serializers.Serializer):
    """``run.error``: the failure of a FAILED run."""

    stage_id = serializers.CharField(
        allow_null=True, help_text="the failed stage; null when no stage caused it"
    )
    message = serializers.CharField(allow_blank=True)
    error_type = serializers.CharField(
        allow_null=True,
        help_text="exception class, StageFailed error_type, DeliveriesExhausted, "
        "StuckRunReaped, WorkflowNotFound, ...",
    )
    generation = serializers.IntegerField(
        allow_null=True, required=False, help_text="the stage's rerun generation"
    )
    delivery = serializers.IntegerField(
        allow_null=True, required=False, help_text="the job delivery it failed on"
    )


class RunDetailSerializer(RunSerializer):
    """A run with its stages, data, error and what it waits for."""

    input = serializers.JSONField()
    config = serializers.JSONField()
    output = serializers.JSONField(allow_null=True)
    error = serializers.CharField(
        allow_null=True, help_text="the run's error as one line (see error_detail)"
    )
    error_detail = RunErrorSerializer(
        allow_null=True,
        help_text="why a FAILED run failed (run.error); null otherwise (a CANCELLED run's "
        "reason is in output.error)",
    )
    stages = StageSerializer(many=True)
    waiting = WaitingSerializer(many=True)
    parent_run_id = serializers.UUIDField(
        allow_null=True, help_text="the run whose child-workflow stage started this run"
    )
    parent_stage_id = serializers.CharField(
        allow_null=True, help_text="that parent stage's id (null without a parent)"
    )
    children = ChildRunSerializer(many=True, help_text="the runs this run's stages started")
    links = RunLinksSerializer()


class RunPageSerializer(serializers.Serializer):
    next = serializers.CharField(allow_null=True)
    previous = serializers.CharField(allow_null=True)
    results = RunSerializer(many=True)


class CancelResultSerializer(serializers.Serializer):
    cancelled = serializers.BooleanField(help_text="false: the run was already terminal")
    status = serializers.ChoiceField(choices=RUN_STATUSES)


class RerunResultSerializer(serializers.Serializer):
    workflow_run_id = serializers.UUIDField()
    from_stage_id = serializers.CharField()
    deleted_stages = serializers.ListField(child=serializers.CharField())
    replayed = serializers.BooleanField(help_text="true: an idempotency-key replay")


class DecisionResultSerializer(serializers.Serializer):
    workflow_run_id = serializers.UUIDField()
    stage_id = serializers.CharField()
    generation = serializers.IntegerField()
    outcome = serializers.ChoiceField(choices=["approved", "rejected"])
    recorded = serializers.BooleanField(help_text="false: the same decision was already there")
    decided_by = serializers.CharField()


class AnnotationSerializer(serializers.Serializer):
    id = AnnotationIdField()
    created_at = serializers.DateTimeField()
    workflow_run_id = serializers.UUIDField()
    stage_record_id = serializers.UUIDField(allow_null=True)
    generation = serializers.IntegerField()
    scope = serializers.CharField()
    scope_id = serializers.CharField(allow_null=True)
    actor_kind = serializers.CharField(allow_null=True)
    actor_id = serializers.CharField(allow_null=True)
    actor_version = serializers.CharField(allow_null=True)
    key = serializers.CharField()
    value = serializers.JSONField()
    payload = serializers.JSONField(allow_null=True)
    idempotency_key = serializers.CharField(allow_null=True)


class AnnotationListSerializer(serializers.Serializer):
    results = AnnotationSerializer(many=True)


class AttachResultSerializer(serializers.Serializer):
    created = serializers.IntegerField()
    duplicates = serializers.IntegerField(help_text="skipped: same (key, idempotency_key)")


class SignalSerializer(serializers.Serializer):
    id = serializers.IntegerField()
    name = serializers.CharField()
    payload = serializers.JSONField(allow_null=True)
    key = serializers.CharField(allow_null=True, help_text="the idempotency key, if given")
    actor = serializers.CharField(allow_null=True)
    created_at = serializers.DateTimeField()
    consumed_at = serializers.DateTimeField(allow_null=True, help_text="null: not consumed yet")
    consumed_stage_id = serializers.CharField(allow_null=True)
    consumed_generation = serializers.IntegerField(allow_null=True)


class SignalListSerializer(serializers.Serializer):
    results = SignalSerializer(many=True)


class SendSignalResultSerializer(serializers.Serializer):
    workflow_run_id = serializers.UUIDField()
    signal_id = serializers.IntegerField()
    name = serializers.CharField()
    stored = serializers.BooleanField(help_text="false: a duplicate key (nothing written)")
    woke = serializers.BooleanField(help_text="true: a waiting stage was made due now")


class EventSerializer(serializers.Serializer):
    id = serializers.IntegerField(help_text="outbox row id")
    sequence = serializers.IntegerField(help_text="1, 2, 3, ... within the run")
    event_type = serializers.CharField()
    occurred_at = serializers.DateTimeField()
    published_at = serializers.DateTimeField(allow_null=True)
    payload = serializers.JSONField()


class EventListSerializer(serializers.Serializer):
    results = EventSerializer(many=True)
    next_after = serializers.IntegerField(help_text="pass as after= to get later events")
    run_status = serializers.ChoiceField(choices=RUN_STATUSES)


class LogSerializer(serializers.Serializer):
    id = serializers.IntegerField()
    created_at = serializers.DateTimeField()
    level = serializers.ChoiceField(choices=[c for c, _ in LogLevel.choices])
    message = serializers.CharField(allow_blank=True)
    stage_id = serializers.CharField(allow_null=True)
    metadata = serializers.JSONField(allow_null=True)


class LogListSerializer(serializers.Serializer):
    results = LogSerializer(many=True)
    next_after = serializers.IntegerField()


# --- schedules (issue 12) ----------------------------------------------------------------------


class AwareDateTimeField(serializers.DateTimeField):
    """An ISO-8601 date-time with a UTC offset (a naive one is refused, not guessed), in the
    years :data:`~django_workflows.definition.schedule.MIN_YEAR`-``MAX_YEAR`` (1900-9000, the
    bounds the kernel's backfill checks)."""

    def to_internal_value(self, value: Any) -> Any:
        from django.utils.dateparse import parse_datetime

        if not isinstance(value, str):
            self.fail("invalid", format="ISO-8601 with offset")
        try:
            parsed = parse_datetime(value)
        except ValueError:
            parsed = None
        if parsed is None or parsed.utcoffset() is None:
            raise serializers.ValidationError(
                "expected an ISO-8601 date-time with a UTC offset (e.g. 2025-01-01T00:00:00Z)"
            )
        from ..definition.schedule import MAX_YEAR, MIN_YEAR

        if not MIN_YEAR <= parsed.year <= MAX_YEAR:
            raise serializers.ValidationError(f"the year must be between {MIN_YEAR} and {MAX_YEAR}")
        return parsed


class SchedulePauseSerializer(BodySerializer):
    reason = StrictCharField(max_length=500, required=False, allow_null=True, allow_blank=True)


class EmptyBodySerializer(BodySerializer):
    """A body with no members (``{}`` or none)."""


class ScheduleBackfillSerializer(BodySerializer):
    start = AwareDateTimeField(help_text="first scheduled time to backfill (inclusive)")
    end = AwareDateTimeField(help_text="last scheduled time to backfill (inclusive)")


class ScheduleSerializer(serializers.Serializer):
    """A schedule row with its firing state."""

    name = serializers.CharField()
    workflow_id = serializers.CharField()
    description = serializers.CharField(allow_blank=True)
    spec = serializers.CharField(help_text='"cron <expr> (<tz>)" or "every <n>s"')
    cron = serializers.CharField(allow_null=True)
    every_seconds = serializers.FloatField(allow_null=True)
    tz = serializers.CharField()
    input = serializers.DictField()
    config = serializers.DictField()
    priority = serializers.IntegerField()
    overlap = serializers.ChoiceField(
        choices=["skip", "buffer_one", "allow_all", "cancel_previous"]
    )
    catchup = serializers.ChoiceField(choices=["skip", "run_once", "run_all"])
    catchup_window_seconds = serializers.FloatField()
    jitter_seconds = serializers.FloatField()
    paused = serializers.BooleanField()
    pause_reason = serializers.CharField(allow_blank=True)
    orphaned = serializers.BooleanField(help_text="its definition disappeared from code")
    next_scheduled_at = serializers.DateTimeField(allow_null=True)
    next_fire_at = serializers.DateTimeField(allow_null=True, help_text="scheduled time + jitter")
    last_scheduled_at = serializers.DateTimeField(allow_null=True)
    last_fired_at = serializers.DateTimeField(allow_null=True)
    last_run_id = serializers.UUIDField(allow_null=True)
    last_run = serializers.CharField(allow_null=True, help_text="URL of the last run")
    fired_count = serializers.IntegerField()
    skipped_count = serializers.IntegerField()
    last_error = serializers.CharField(allow_blank=True)
    url = serializers.CharField()


class ScheduleDetailSerializer(ScheduleSerializer):
    upcoming = serializers.ListField(
        child=serializers.DateTimeField(), help_text="the next scheduled times (up to 5)"
    )


class SchedulePauseResultSerializer(serializers.Serializer):
    paused = serializers.BooleanField()
    changed = serializers.BooleanField(help_text="false: it was in that state already")
    next_fire_at = serializers.DateTimeField(allow_null=True)


class ScheduleTriggerResultSerializer(serializers.Serializer):
    workflow_run_id = serializers.UUIDField()


class ScheduleBackfillResultSerializer(serializers.Serializer):
    times = serializers.ListField(child=serializers.DateTimeField())
    run_ids = serializers.ListField(child=serializers.UUIDField(), help_text="runs started")
    existing = serializers.IntegerField(help_text="times whose run existed already")


# --- dead letters (issue 17) ------------------------------------------------------------------


class DeadLetterQuerySerializer(QuerySerializer):
    after = StrictIntegerField(
        required=False, default=0, min_value=0, max_value=2**63 - 1, help_text="an event id"
    )
    limit = StrictIntegerField(required=False, default=100, min_value=1, max_value=500)
    workflow_run_id = serializers.UUIDField(required=False, help_text="only this run's")


DEAD_LETTER_STATES = ["dead_letter", "pending", "published", "skipped"]


class DeadLetterSerializer(serializers.Serializer):
    """A dead-lettered outbox event (``state``: ``dead_letter`` in the list)."""

    id = serializers.IntegerField(help_text="the outbox event id")
    workflow_run_id = serializers.UUIDField()
    sequence = serializers.IntegerField()
    event_type = serializers.CharField()
    occurred_at = serializers.DateTimeField()
    dlq_at = serializers.DateTimeField(allow_null=True)
    retry_count = serializers.IntegerField()
    last_error = serializers.CharField(allow_null=True)
    state = serializers.ChoiceField(choices=DEAD_LETTER_STATES)


class DeadLetterListSerializer(serializers.Serializer):
    results = DeadLetterSerializer(many=True)
    next_after = serializers.IntegerField(help_text="pass as after= for the next page")


class DeadLetterSkipSerializer(BodySerializer):
    note = StrictCharField(max_length=2000, help_text="why it is skipped (kept on the row)")


class DeadLetterReplayResultSerializer(serializers.Serializer):
    event_id = serializers.IntegerField()
    replayed = serializers.BooleanField(
        help_text="this request re-armed it (false: it was no dead letter any more)"
    )
    state = serializers.ChoiceField(
        choices=DEAD_LETTER_STATES, help_text="pending: the next outbox flush delivers it"
    )


class DeadLetterSkipResultSerializer(serializers.Serializer):
    event_id = serializers.IntegerField()
    workflow_run_id = serializers.UUIDField()
    sequence = serializers.IntegerField()
    event_type = serializers.CharField()
    changed = serializers.BooleanField(help_text="false: it was already skipped")
    skipped_at = serializers.DateTimeField()
    note = serializers.CharField(allow_blank=True)
    unblocked = serializers.IntegerField(
        help_text="unpublished later events of the run (the next flush delivers them)"
    )
