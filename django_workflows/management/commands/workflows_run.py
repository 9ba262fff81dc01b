"""``manage.py workflows_run <workflow_id>``: start a run, optionally wait for it with live
per-stage progress.

Examples::

    manage.py workflows_run package-report --input '{"limit": 50}' --wait
    manage.py workflows_run package-report --input @input.json --config @config.json
    manage.py workflows_run flaky-demo --priority 9 --idempotency-key nightly-2026-11-29
    manage.py workflows_run package-report --annotate trigger.source=cli
    manage.py workflows_run package-report --annotations @annotations.json

With ``--wait`` it prints each stage's changes and, whenever it changes, what the run waits
for (``waiting: waiting for an approval decision (stage review; run: python manage.py
workflows_approve <id> ...)``, ``waiting for a worker: no worker is live ...``): the reasons of
``workflows_status``, the admin and the API.

Exit status with ``--wait``: 0 when the run COMPLETED; 1 (with the error) when it FAILED, was
CANCELLED, or did not finish within ``--timeout`` seconds (the error says what it waited for).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from django_workflows.annotations import AnnotationError
from django_workflows.conventions import published_key, with_published_types
from django_workflows.kernel import AnnotationSpec, CreateRun, WorkflowError
from django_workflows.kernel.jsonvalue import loads_json
from django_workflows.kernel.runtime import get_kernel
from django_workflows.models import (
    TERMINAL_RUN_STATUSES,
    Status,
    WorkflowJob,
    WorkflowRun,
    WorkflowStage,
)

from ._common import run_error
from ._waiting import run_waiting


def load_json_argument(value: str | None, option: str) -> Any:
    """Parse ``value`` as JSON, or the file named after ``@``. Raises CommandError naming
    ``option``.
    """
    if value is None:
        return None
    text = value
    if value.startswith("@"):
        path = Path(value[1:])
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise CommandError(f"{option}: cannot read {path}: {exc.strerror}") from None
        except UnicodeDecodeError as exc:
            raise CommandError(
                f"{option}: {path} is not UTF-8 text (byte {exc.start}: {exc.reason})"
            ) from None
    try:
        return loads_json(text)
    except json.JSONDecodeError as exc:
        raise CommandError(
            f"{option}: invalid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})"
        ) from None


class Command(BaseCommand):
    help = "Start a workflow run; with --wait, follow its stages until it finishes."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("workflow_id", help="id of a registered workflow (see workflows_list)")
        parser.add_argument(
            "--input",
            default="{}",
            help="workflow input as JSON, or @path to a JSON file (default {})",
        )
        parser.add_argument(
            "--config", default=None, help="per-stage config {stage_id: {...}} as JSON or @path"
        )
        parser.add_argument(
            "--priority", type=int, default=5, help="higher runs sooner (default 5)"
        )
        parser.add_argument(
            "--idempotency-key",
            default=None,
            help="a repeated key returns the first run instead of a new one",
        )
        parser.add_argument(
            "--annotate",
            action="append",
            default=[],
            metavar="KEY=VALUE",
            help="run-scope annotation (repeatable); KEY is 'ns.name', VALUE is JSON or a string",
        )
        parser.add_argument(
            "--annotations",
            default=None,
            metavar="JSON|@FILE",
            help="run-scope annotations as JSON or @path: a list of envelopes "
            '[{"attributes": {...}, "actor": {...}, "payload": ..., "idempotency_key": ..., '
            '"emit_event": true}], one envelope, or a plain {key: value} object',
        )
        parser.add_argument(
            "--wait",
            action="store_true",
            help="follow the run until it is COMPLETED, FAILED or CANCELLED",
        )
        parser.add_argument(
            "--timeout",
            type=float,
            default=None,
            help="with --wait: give up after this many seconds",
        )
        parser.add_argument(
            "--poll-interval",
            type=float,
            default=0.5,
            help="with --wait: seconds between status reads (default 0.5)",
        )

    def handle(self, *args: Any, **opts: Any) -> None:
        if opts["poll_interval"] <= 0:
            raise CommandError("--poll-interval: must be a positive number of seconds")
        if opts["timeout"] is not None:
            if not opts["wait"]:
                raise CommandError("--timeout: only meaningful with --wait")
            if opts["timeout"] <= 0:
                raise CommandError("--timeout: must be a positive number of seconds")
        payload = load_json_argument(opts["input"], "--input")
        config = load_json_argument(opts["config"], "--config")
        annotations = self._annotations(opts["annotate"])
        annotations += self._annotation_file(opts["annotations"])
        try:
            result = get_kernel().dispatch(
                CreateRun(
                    workflow_id=opts["workflow_id"],
                    input=payload,
                    config=config,
                    priority=opts["priority"],
                    idempotency_key=opts["idempotency_key"],
                    annotations=annotations,
                )
            )
        except WorkflowError as exc:
            raise CommandError(str(exc)) from None
        run_id = result.workflow_run_id
        if result.replayed:  # the same request again (another one is refused by the kernel)
            self.stdout.write(
                f"run {run_id} already exists for idempotency key "
                f"{opts['idempotency_key']!r}; nothing was created"
            )
        else:
            self.stdout.write(f"run {run_id} created ({opts['workflow_id']})")
        if opts["wait"]:
            try:
                self._wait(run_id, opts["timeout"], opts["poll_interval"])
            except KeyboardInterrupt:
                raise CommandError(
                    f"stopped waiting; run {run_id} goes on in the background "
                    f"(workflows_status {run_id}, workflows_cancel {run_id})",
                    returncode=130,
                ) from None

    def _annotations(self, items: list[str]) -> tuple[AnnotationSpec, ...]:
        """``--annotate KEY=VALUE``: VALUE is parsed as JSON, else kept as text. A published
        convention key (``trigger.source``, ...) is type-checked; for a text-typed one the raw
        text is kept when the JSON reading does not fit (``trigger.reason=42`` -> ``"42"``).
        """
        attributes: dict[Any, Any] = {}
        for item in items:
            key, sep, raw = item.partition("=")
            if not sep or not key:
                raise CommandError(f"--annotate: expected KEY=VALUE, got {item!r}")
            try:
                value: Any = loads_json(raw)
            except json.JSONDecodeError:
                value = raw
            typed = published_key(key)
            if typed is not None and value != raw:
                try:
                    typed.validate(value)
                except AnnotationError:
                    value = raw
            attributes[typed or key] = value
        if not attributes:
            return ()
        return (
            AnnotationSpec(attributes=attributes, actor={"kind": "cli", "id": "workflows_run"}),
        )

    def _annotation_file(self, value: str | None) -> tuple[Any, ...]:
        """``--annotations``: envelopes for ``CreateRun.annotations`` (validated by the kernel,
        which names the entry and key at fault).
        """
        data = load_json_argument(value, "--annotations")
        if data is None:
            return ()
        if isinstance(data, dict) and "attributes" not in data:
            data = {"attributes": data, "actor": {"kind": "cli", "id": "workflows_run"}}
        if isinstance(data, dict):
            data = [data]
        if not isinstance(data, list) or not all(isinstance(item, dict) for item in data):
            raise CommandError(
                "--annotations: expected an object or a list of objects with 'attributes'"
            )
        return tuple(
            {**item, "attributes": with_published_types(item["attributes"])}
            if isinstance(item.get("attributes"), dict)
            else item
            for item in data
        )

    def _wait(self, run_id: str, timeout: float | None, interval: float) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        seen: dict[str, tuple[str, int]] = {}
        status = ""
        total = None
        said: tuple[str, ...] = ()
        waiting: tuple[str, ...] = ()
        while True:
            run = WorkflowRun.objects.get(pk=run_id)
            if total is None:
                total = self._stage_total(run)
            retries = {
                job.stage_id: job
                for job in WorkflowJob.objects.filter(
                    workflow_run_id=run_id, status=Status.PENDING, attempt__gt=0
                )
            }
            for stage in WorkflowStage.objects.filter(run_id=run_id).order_by(
                "execution_group", "stage_number"
            ):
                pct = int(stage.progress or 0)
                retry = retries.get(stage.stage_id)
                key = (
                    stage.status,
                    pct if stage.status == Status.RUNNING else (retry.attempt if retry else -1),
                )
                if seen.get(stage.stage_id) == key:
                    continue
                seen[stage.stage_id] = key
                self.stdout.write(self._stage_line(stage, total, retry))
            if run.status != status and run.status not in TERMINAL_RUN_STATUSES:
                status = run.status
                self.stdout.write(f"run {run_id} {status}")
            if run.status not in TERMINAL_RUN_STATUSES:
                # What it waits for, when that changes (a stage executing says so above).
                waiting = tuple(w.text() for w in run_waiting(run) if w.reason != "executing")
                if waiting != said:
                    said = waiting
                    for text in waiting:
                        self.stdout.write(f"  waiting: {text}")
            self.stdout.flush()
            if run.status in TERMINAL_RUN_STATUSES:
                break
            if deadline is not None and time.monotonic() > deadline:
                why = f": {'; '.join(waiting)}" if waiting else ""
                raise CommandError(f"run {run_id} still {run.status} after {timeout:g} s{why}")
            time.sleep(interval)
        if run.status == Status.COMPLETED:
            seconds = (run.duration_ms or 0) / 1000
            self.stdout.write(self.style.SUCCESS(f"run {run_id} COMPLETED in {seconds:.1f} s"))
            self.stdout.write(json.dumps(run.output, indent=2, default=str))
            return
        raise CommandError(f"run {run_id} {run.status}: {run_error(run) or 'no error recorded'}")

    def _stage_total(self, run: WorkflowRun) -> int:
        from django_workflows.definition.registry import registry

        workflow = registry.get(run.workflow_id)
        return len(workflow.stage_ids) if workflow else 0

    def _stage_line(
        self, stage: WorkflowStage, total: int, retry: WorkflowJob | None = None
    ) -> str:
        width = 20
        head = f"  [{stage.stage_number}/{total}] {stage.stage_id:<22} {stage.status:<9}"
        if stage.status == Status.RUNNING:
            pct = max(0.0, min(100.0, stage.progress or 0.0))
            filled = int(width * pct / 100)
            bar = "#" * filled + "." * (width - filled)
            return f"{head} [{bar}] {pct:5.1f}% {stage.progress_message}".rstrip()
        if stage.status == Status.COMPLETED:
            return f"{head} {(stage.duration_ms or 0) / 1000:.2f} s"
        if stage.status == Status.SUSPENDED:
            when = stage.next_poll_at.strftime("%H:%M:%S") if stage.next_poll_at else "?"
            return f"{head} waiting (next poll {when})"
        if stage.status == Status.FAILED:
            line = f"{head} {stage.error_message or ''}".rstrip()
            if retry is not None:
                when = retry.next_poll_at.strftime("%H:%M:%S") if retry.next_poll_at else "soon"
                line += f" (retry: delivery {retry.attempt + 1} of {retry.max_attempts} at {when})"
            return line
        return head
