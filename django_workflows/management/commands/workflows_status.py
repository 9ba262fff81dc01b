"""``manage.py workflows_status <run_id> [--json] [--traceback]``: show a run and one line per
stage record. A FAILED run shows its ``run.error`` (stage, message, error type, generation,
delivery); ``--traceback`` also prints the failed stage's traceback. A PENDING or RUNNING run
shows what it waits for (``waiting:`` lines, the admin's and the API's reasons, with the
command that unblocks it: ``workflows_approve <id>`` for an approval, a worker command when
no worker is live; :mod:`._waiting`).

Durations are shown in seconds (``--json`` gives the stored milliseconds, ``duration_ms``);
progress is a percentage (0-100); times are ISO 8601 in UTC.
"""

from __future__ import annotations

import json
from typing import Any

from django.core.management.base import BaseCommand, CommandParser
from django.core.serializers.json import DjangoJSONEncoder

from django_workflows.kernel.routing import describe_waiting, waiting_for_worker
from django_workflows.kernel.runtime import get_kernel
from django_workflows.kernel.versions import describe_missing_version, waiting_for_version
from django_workflows.models import Status, WorkflowJob, WorkflowRun, WorkflowStage

from ...children import child_runs
from ...runs import error_details
from ._common import format_datetime, format_duration_ms, get_run, run_error
from ._waiting import CliWaiting, run_waiting


def failed_traceback(run: WorkflowRun, stages: list[WorkflowStage]) -> str | None:
    """The traceback stored with the stage named by ``run.error`` (else the first FAILED
    stage): its ``metrics["traceback"]``, or ``None``.
    """
    wanted = (run.error or {}).get("stage_id") if isinstance(run.error, dict) else None
    failed = [s for s in stages if s.status == Status.FAILED]
    record = next((s for s in failed if s.stage_id == wanted), failed[0] if failed else None)
    value = (record.metrics or {}).get("traceback") if record is not None else None
    return value if isinstance(value, str) and value else None


def latest_jobs(run: WorkflowRun) -> dict[str, WorkflowJob]:
    """The newest job row of each stage of ``run``, by stage id."""
    jobs: dict[str, WorkflowJob] = {}
    for job in WorkflowJob.objects.filter(workflow_run_id=run.pk).order_by("id"):
        jobs[job.stage_id] = job
    return jobs


def retry_note(stage: WorkflowStage, job: WorkflowJob | None) -> str:
    """``"retry 2/3 at <time>"`` for a failed stage whose job waits for another delivery."""
    if (
        job is None
        or stage.status != Status.FAILED
        or job.status != Status.PENDING
        or job.attempt == 0
    ):
        return ""
    when = f" at {format_datetime(job.next_poll_at)}" if job.next_poll_at else ""
    return f"retry {job.attempt + 1}/{job.max_attempts}{when}"


def _job_document(job: WorkflowJob | None) -> dict[str, Any] | None:
    if job is None:
        return None
    return {
        "id": job.pk,
        "status": job.status,
        "queue": job.queue,
        "attempt": job.attempt,
        "max_attempts": job.max_attempts,
        "next_poll_at": job.next_poll_at,
        "worker_id": job.worker_id,
        "last_error": job.last_error,
    }


def run_document(
    run: WorkflowRun,
    stages: list[WorkflowStage],
    jobs: dict[str, WorkflowJob] | None = None,
    waiting_for: list[CliWaiting] | None = None,
) -> dict[str, Any]:
    """The JSON document of ``workflows_status --json``; ``job`` is the stage's newest job;
    ``waiting`` lists what the run waits for (``[{"reason", "stage_id", "message",
    "command", "at"}]``, :func:`._waiting.run_waiting`; ``[]`` for a terminal run);
    ``waiting_for_worker`` lists the queues of ready jobs that no live worker serves and
    ``waiting_reason`` says so (``"waiting for a gpu worker"``, else ``null``);
    ``waiting_for_version`` is the run's ``definition_version`` when workers are live but none
    runs it (``waiting_reason``: ``"waiting for a worker with version X"``), else ``null``.
    ``parent_run_id`` / ``parent_stage_id`` name the run whose stage started this one (child
    workflows), ``children`` lists the runs this one started (``[{"id", "workflow_id",
    "status", "parent_stage_id"}]``).
    """
    jobs = jobs if jobs is not None else latest_jobs(run)
    if waiting_for is None:
        waiting_for = run_waiting(run, stages, jobs)
    waiting = waiting_for_worker(run.pk) if run.status in (Status.PENDING, Status.RUNNING) else []
    version = None if waiting else waiting_for_version(run, lease_clock=get_kernel().lease_clock)
    reason = describe_waiting(waiting) or (describe_missing_version(version) if version else None)
    return {
        "id": str(run.pk),
        "workflow_id": run.workflow_id,
        "workflow_name": run.workflow_name,
        "status": run.status,
        "priority": run.priority,
        "created_at": run.created_at,
        "started_at": run.started_at,
        "completed_at": run.completed_at,
        "duration_ms": run.duration_ms,
        "error": run_error(run, stages),
        "error_detail": run.error,
        "traceback": failed_traceback(run, stages),
        "definition_version": run.definition_version,
        "concurrency_key": run.concurrency_key,
        "waiting_for_worker": waiting,
        "waiting_for_version": version,
        "waiting_reason": reason,
        "waiting": [w.document() for w in waiting_for],
        "parent_run_id": str(run.parent_run_id) if run.parent_run_id else None,
        "parent_stage_id": run.parent_stage_id,
        "children": [
            {k: c[k] for k in ("id", "workflow_id", "status", "parent_stage_id")}
            for c in child_runs(run.pk)
        ],
        "input": run.input,
        "config": run.config,
        "output": run.output,
        "stages": [
            {
                "execution_group": s.execution_group,
                "stage_number": s.stage_number,
                "stage_id": s.stage_id,
                "stage_name": s.stage_name,
                "status": s.status,
                "generation": s.generation,
                "progress": s.progress,
                "progress_message": s.progress_message,
                "started_at": s.started_at,
                "completed_at": s.completed_at,
                "duration_ms": s.duration_ms,
                "next_poll_at": s.next_poll_at,
                "error_message": s.error_message,
                "skip_reason": s.skip_reason,
                "items": (
                    {**s.items, "in_flight": s.items_in_flight()} if s.items is not None else None
                ),
                "job": _job_document(jobs.get(s.stage_id)),
            }
            for s in stages
        ],
    }


def _progress(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}%"


class Command(BaseCommand):
    help = (
        "Show a workflow run: header (workflow, status, priority, times, duration in seconds, "
        "error, and what a PENDING/RUNNING run waits for - an approval, a worker, a retry - "
        "with the command that unblocks it) and one "
        "line per stage record (execution group, stage id, status, rerun "
        "generation, job deliveries/max, progress in %, duration in seconds, error and any "
        "pending retry). A failed run shows its error (stage, message, error type, generation, "
        "delivery); --traceback prints the failed stage's traceback. --json prints a "
        "JSON document (durations in milliseconds)."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("run_id", help="the run's id (a UUID)")
        parser.add_argument("--json", action="store_true", help="print a JSON document")
        # --traceback is Django's own option (full stack traces of command errors); here it
        # also prints the failed stage's stored traceback.

    def handle(self, *args: Any, **opts: Any) -> None:
        run = get_run(opts["run_id"])
        stages = list(
            WorkflowStage.objects.filter(run=run).order_by("execution_group", "stage_number")
        )
        jobs = latest_jobs(run)
        waiting = run_waiting(run, stages, jobs)
        if opts["json"]:
            document = run_document(run, stages, jobs, waiting)
            self.stdout.write(json.dumps(document, cls=DjangoJSONEncoder, indent=2))
            return
        self._write_text(run, stages, jobs, bool(opts.get("traceback")), waiting)

    def _write_text(
        self,
        run: WorkflowRun,
        stages: list[WorkflowStage],
        jobs: dict[str, WorkflowJob],
        show_traceback: bool = False,
        waiting: list[CliWaiting] | None = None,
    ) -> None:
        write = self.stdout.write
        write(f"run {run.pk}")
        write(f"  workflow:  {run.workflow_id} ({run.workflow_name})")
        write(f"  status:    {run.status}")
        write(f"  priority:  {run.priority}")
        write(f"  version:   {run.definition_version or '(unversioned)'}")
        if run.concurrency_key is not None:
            write(f"  key:       {run.concurrency_key} (concurrency key)")
        write(f"  created:   {format_datetime(run.created_at)}")
        write(f"  started:   {format_datetime(run.started_at)}")
        write(f"  completed: {format_datetime(run.completed_at)}")
        write(f"  duration:  {format_duration_ms(run.duration_ms)}")
        if run.parent_run_id:
            write(
                f"  parent:    {run.parent_run_id} (stage {run.parent_stage_id}, "
                f"generation {run.parent_generation})"
            )
        for index, child in enumerate(child_runs(run.pk)):
            write(
                f"  {'children:' if index == 0 else '':<9}  {child['id']} {child['workflow_id']} "
                f"{child['status']} (stage {child['parent_stage_id']}, generation "
                f"{child['parent_generation']})"
            )
        error = run_error(run, stages)
        if error:
            write(f"  error:     {error}")
            details = error_details(run)
            if details:
                write(f"             ({details})")
        traceback = failed_traceback(run, stages) if run.status == Status.FAILED else None
        if traceback and not show_traceback:
            write("             (the stage's traceback: --traceback)")
        waiting = run_waiting(run, stages, jobs) if waiting is None else waiting
        for index, item in enumerate(waiting):
            write(f"  {'waiting:' if index == 0 else '':<9}  {item.text()}")
        unblocked = {w.stage_id: w for w in waiting if w.reason in ("no_worker", "stale_lease")}
        if not stages:
            write("stages: none yet")
            return
        width = max(len("stage"), *(len(s.stage_id) for s in stages))
        write(
            f"{'group':>5}  {'stage':<{width}}  {'status':<9}  {'generation':>10}  {'tries':>5}  "
            f"{'progress':>8}  {'duration':>10}  error"
        )
        for s in stages:
            note = retry_note(s, jobs.get(s.stage_id))
            if not note and s.stage_id in unblocked:  # RUNNING 62% but nobody works on it
                note = unblocked[s.stage_id].message
            if s.status == Status.SKIPPED and s.skip_reason:  # issue 18: why it did not run
                note = f"skipped: {s.skip_reason}"
            error = " ".join(
                part
                for part in (s.items_summary, s.error_message, f"({note})" if note else "")
                if part
            )
            job = jobs.get(s.stage_id)
            tries = f"{job.attempt}/{job.max_attempts}" if job is not None else "-"
            line = (
                f"{s.execution_group:>5}  {s.stage_id:<{width}}  {s.status:<9}  "
                f"{s.generation:>10}  {tries:>5}  {_progress(s.progress):>8}  "
                f"{format_duration_ms(s.duration_ms):>10}  {error}"
            )
            write(line.rstrip())
        if traceback and show_traceback:
            write("traceback:")
            for text in traceback.rstrip().splitlines():
                write(f"  {text}")
