"""``manage.py workflows_annotations <run_id>``: print a run's annotation timeline (SPEC §6,
``kernel.annotations.list``, AN-9, AN-30).

Examples::

    manage.py workflows_annotations 6f1c...                       # oldest first, 1000 rows max
    manage.py workflows_annotations 6f1c... --key-prefix decision. --generation 1
    manage.py workflows_annotations 6f1c... --scope stage --scope-id review --json

One line per annotation: time (ISO 8601, UTC), scope (``run`` or ``stage:<id>``), generation,
actor (``kind:id@version``), key and value (compact JSON, shortened unless ``--full``). Rows
the legacy metadata shim synthesises from the deprecated ``metadata`` are marked ``legacy``.
``--json`` prints a JSON array of the rows (every field, full values).
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.core.serializers.json import DjangoJSONEncoder
from django.utils.dateparse import parse_datetime

from django_workflows.definition.results import UNSET
from django_workflows.kernel.annotations import AnnotationRecord
from django_workflows.kernel.errors import WorkflowError
from django_workflows.kernel.runtime import get_kernel

from ._common import get_run

VALUE_WIDTH = 60


def parse_time_option(value: str | None, option: str) -> datetime | None:
    """An ISO 8601 time (naive means UTC). Raises :class:`CommandError` naming ``option``."""
    if value is None:
        return None
    parsed = parse_datetime(value)
    if parsed is None:
        raise CommandError(f"{option}: expected an ISO 8601 time, got {value!r}")
    return parsed if parsed.tzinfo is not None else parsed.replace(tzinfo=UTC)


def actor_label(record: AnnotationRecord) -> str:
    """``kind:id@version`` with absent parts left out; ``-`` without an actor."""
    label = ":".join(p for p in (record.actor_kind, record.actor_id) if p)
    if record.actor_version:
        label += f"@{record.actor_version}"
    return label or "-"


def value_text(value: Any, full: bool = False) -> str:
    text = json.dumps(value, cls=DjangoJSONEncoder, ensure_ascii=False, separators=(",", ":"))
    if not full and len(text) > VALUE_WIDTH:
        text = text[: VALUE_WIDTH - 3] + "..."
    return text


class Command(BaseCommand):
    help = (
        "Print a run's annotations oldest first (time, scope, generation, actor, key, value). "
        "Filters are ANDed; at most --limit rows (default 1000). --json prints a JSON array."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("run_id", help="the run's id (a UUID)")
        parser.add_argument("--key", help="exact key (overrides --key-prefix)")
        parser.add_argument("--key-prefix", help="keys starting with this, e.g. 'decision.'")
        parser.add_argument("--scope", help="run, stage or a custom scope")
        scope_id = parser.add_mutually_exclusive_group()
        scope_id.add_argument("--scope-id", help="e.g. the stage id of stage-scope rows")
        scope_id.add_argument(
            "--no-scope-id", action="store_true", help="only rows without a scope id"
        )
        parser.add_argument("--actor-id", help="the actor's id")
        parser.add_argument("--actor-kind", help="the actor's kind (user, model, system, ...)")
        parser.add_argument("--generation", type=int, help="the rerun generation (0, 1, ...)")
        parser.add_argument("--since", help="created at or after this ISO 8601 time (UTC)")
        parser.add_argument("--until", help="created at or before this ISO 8601 time (UTC)")
        parser.add_argument("--limit", type=int, default=1000, help="at most N rows (1000)")
        parser.add_argument(
            "--no-legacy",
            action="store_true",
            help="leave out rows synthesised from the deprecated run metadata",
        )
        parser.add_argument("--full", action="store_true", help="do not shorten values")
        parser.add_argument("--json", action="store_true", help="print a JSON array")

    def handle(self, *args: Any, **opts: Any) -> None:
        run = get_run(opts["run_id"])
        if opts["limit"] is not None and opts["limit"] < 0:
            raise CommandError(f"--limit: must be >= 0, got {opts['limit']}")
        scope_id: Any = UNSET
        if opts["no_scope_id"]:
            scope_id = None
        elif opts["scope_id"] is not None:
            scope_id = opts["scope_id"]
        try:
            rows = get_kernel().annotations.list(
                run.pk,
                key=opts["key"],
                key_prefix=opts["key_prefix"],
                scope=opts["scope"],
                scope_id=scope_id,
                actor_id=opts["actor_id"],
                actor_kind=opts["actor_kind"],
                generation=opts["generation"],
                since=parse_time_option(opts["since"], "--since"),
                until=parse_time_option(opts["until"], "--until"),
                limit=opts["limit"],
                include_legacy=not opts["no_legacy"],
            )
        except WorkflowError as exc:
            raise CommandError(str(exc)) from None
        if opts["json"]:
            document = [r.to_json() for r in rows]
            self.stdout.write(json.dumps(document, cls=DjangoJSONEncoder, indent=2))
            return
        self._write_table(run.pk, rows, opts["full"])

    def _write_table(self, run_id: Any, rows: list[AnnotationRecord], full: bool) -> None:
        write = self.stdout.write
        if not rows:
            write(f"run {run_id}: no annotations")
            return
        scopes = [r.scope if r.scope_id is None else f"{r.scope}:{r.scope_id}" for r in rows]
        actors = [actor_label(r) for r in rows]
        sw = max(len("scope"), *(len(s) for s in scopes))
        aw = max(len("actor"), *(len(a) for a in actors))
        kw = max(len("key"), *(len(r.key) for r in rows))
        write(f"run {run_id}: {len(rows)} annotation(s)")
        write(
            f"{'time':<32}  {'scope':<{sw}}  {'generation':>10}  {'actor':<{aw}}  "
            f"{'key':<{kw}}  value"
        )
        for row, scope, actor in zip(rows, scopes, actors, strict=True):
            mark = "  (legacy)" if row.synthesized else ""
            write(
                f"{row.created_at.astimezone(UTC).isoformat(timespec='milliseconds'):<32}  "
                f"{scope:<{sw}}  {row.generation:>10}  {actor:<{aw}}  {row.key:<{kw}}  "
                f"{value_text(row.value, full)}{mark}"
            )
