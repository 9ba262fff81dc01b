"""The run page of the admin (read-only): the context it renders besides the run's fields -
the stage table with the not-started stages of the run's own definition, waiting reasons, the
run error, rerun markers, the Gantt chart, the jobs, a page of the timeline and the links of
the operations the user may perform (:class:`RunPageMixin`), and the data helpers behind it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from django.contrib.admin.utils import unquote
from django.http import Http404, HttpRequest, HttpResponse
from django.urls import reverse
from django.utils import timezone
from django.utils.html import format_html
from django.utils.safestring import SafeString

from ..children import child_runs
from ..definition.registry import registry
from ..kernel import timeouts
from ..models import (
    ACTIVE_STAGE_STATUSES,
    OutboxEvent,
    Status,
    WorkflowJob,
    WorkflowRun,
    WorkflowSignal,
    WorkflowStage,
)
from ..runs import error_details, run_error, waiting_reasons
from .display import (
    duration_display,
    format_duration_ms,
    short_json,
    status_badge,
)
from .gantt import build_gantt
from .run_list import waiting_line
from .timeline import build_timeline

#: Jobs shown on the run page (a run has one per stage and delivery).
MAX_JOBS_SHOWN = 200

#: Signals shown on the run page, newest first (the signal list has them all).
MAX_SIGNALS_SHOWN = 50

#: Timeline rows per source on one page of the run page (``?timeline_page=N`` for older).
TIMELINE_PAGE = 200


def ms_time(at: Any) -> str:
    """``2026-12-01 14:00:27.125`` (local time, milliseconds); ``-`` for ``None``."""
    if at is None:
        return "-"
    return timezone.localtime(at).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]


class RunPageMixin:
    """The run page of :class:`~.runs.WorkflowRunAdmin` (a ``ModelAdmin`` mixin)."""

    def render_change_form(
        self,
        request: HttpRequest,
        context: dict[str, Any],
        add: bool = False,
        change: bool = False,
        form_url: str = "",
        obj: WorkflowRun | None = None,
    ) -> HttpResponse:
        if obj is not None:
            context.update(self.run_context(request, obj))
        return super().render_change_form(request, context, add, change, form_url, obj)

    def run_context(self, request: HttpRequest, run: WorkflowRun) -> dict[str, Any]:
        """Everything the run page shows besides its fields: the stage table (with the
        workflow's not-started stages), waiting reasons, the run error, rerun markers, the
        Gantt chart, jobs, a page of the timeline, dead letter and operation links."""
        stages = list(
            WorkflowStage.objects.filter(run=run)
            .defer("input_data", "output_data", "config", "resume_data", "embedding_info")
            .order_by("execution_group", "stage_number")
        )
        jobs = list(
            WorkflowJob.objects.filter(workflow_run_id=run.pk)
            .defer("payload")
            .order_by("created_at", "id")[: MAX_JOBS_SHOWN + 1]
        )
        open_jobs = {j.stage_id: j for j in jobs if j.status in (Status.PENDING, Status.RUNNING)}
        waiting = waiting_reasons(run, stages, open_jobs, count_queue=True)
        dead_letter = (
            OutboxEvent.objects.filter(
                workflow_run_id=run.pk, dlq_at__isnull=False, published_at__isnull=True
            )
            .order_by("sequence")
            .first()
        )
        try:
            page = max(1, int(request.GET.get("timeline_page", "1")))
        except ValueError:
            page = 1
        timeline = build_timeline(run, limit=TIMELINE_PAGE, page=page)
        rid = str(run.pk)
        opts = self.opts

        def url(name: str) -> str:
            return reverse(f"admin:{opts.app_label}_{opts.model_name}_{name}", args=[rid])

        active = not run.is_terminal
        change = f"admin:{opts.app_label}_{opts.model_name}_change"
        parent = (
            {
                "id": str(run.parent_run_id),
                "stage_id": run.parent_stage_id,
                "generation": run.parent_generation,
                "url": reverse(change, args=[str(run.parent_run_id)]),
            }
            if run.parent_run_id
            else None
        )
        children = [
            {**c, "url": reverse(change, args=[c["id"]]), "badge": status_badge(c["status"])}
            for c in child_runs(run.pk)
        ]
        return {
            "dw_parent": parent,
            "dw_children": children,
            "dw_stages": stage_rows(run, stages),
            "dw_waiting": [(w, waiting_line(w)) for w in waiting],
            "dw_error": run_error(run, stages),
            "dw_error_details": error_details(run),
            "dw_reruns": rerun_markers(run),
            "dw_gantt": build_gantt(run),
            "dw_timeline": timeline,
            "dw_timeline_page": page,
            "dw_jobs": [
                {
                    "job": job,
                    "status": status_badge(job.status),
                    "url": reverse("admin:django_workflows_workflowjob_change", args=[job.pk]),
                }
                for job in jobs[:MAX_JOBS_SHOWN]
            ],
            "dw_jobs_truncated": len(jobs) > MAX_JOBS_SHOWN,
            "dw_dead_letter": dead_letter,
            "dw_signals": [
                (sig, short_json(sig.payload, 120))
                for sig in WorkflowSignal.objects.filter(run_id=run.pk).order_by(
                    "-created_at", "-id"
                )[:MAX_SIGNALS_SHOWN]
            ],
            "dw_signals_url": reverse("admin:django_workflows_workflowsignal_changelist")
            + f"?run__id__exact={rid}",
            "dw_ops": [
                (label, url(name), name)
                for label, name, allowed in (
                    ("Cancel run", "cancel", active and self.has_cancel_permission(request)),
                    (
                        "Approve / reject",
                        "decide",
                        any(w.is_human for w in waiting) and self.has_approve_permission(request),
                    ),
                    (
                        "Rerun from a stage",
                        "rerun",
                        run.status in (Status.COMPLETED, Status.FAILED)
                        and self.has_rerun_permission(request),
                    ),
                    ("Annotate", "annotate", self.has_annotate_permission(request)),
                    ("Send signal", "signal", active and self.has_signal_permission(request)),
                )
                if allowed
            ],
            "dw_can_cancel": active and self.has_cancel_permission(request),
            "dw_cancel_url": url("cancel"),
            "dw_links": {
                "events": reverse("admin:django_workflows_outboxevent_changelist")
                + f"?workflow_run_id={rid}",
                "jobs": reverse("admin:django_workflows_workflowjob_changelist")
                + f"?workflow_run_id={rid}",
                "logs": reverse("admin:django_workflows_workflowlog_changelist")
                + f"?run__id__exact={rid}",
                "annotations": reverse("admin:django_workflows_workflowannotation_changelist")
                + f"?run__id__exact={rid}",
            },
        }

    def _run_or_404(self, request: HttpRequest, object_id: str) -> WorkflowRun:
        run = self.get_object(request, unquote(object_id))
        if run is None:
            raise Http404(f"No workflow run with id {object_id!r}")
        return run

    def _change_url(self, run: WorkflowRun) -> str:
        return reverse(
            f"admin:{self.opts.app_label}_{self.opts.model_name}_change", args=[str(run.pk)]
        )


@dataclass
class StageRow:
    """One row of the run page's stage table: a stage record, or a stage of the workflow that
    has no record yet (``record`` ``None``: "not started")."""

    stage_id: str
    name: str
    execution_group: int
    record: WorkflowStage | None
    #: The registered stage's effective timeouts, e.g. "timeout 600 s" ('' for none).
    limits: str = ""
    #: When the stage runs, from the stored structure (issue 18): ``"when: total over
    #: 1000"``, ``"branch 'small' of size"``; ``""`` for a stage that always runs.
    condition: str = ""

    @property
    def status(self) -> SafeString | str:
        if self.record is None:
            return format_html('<span class="dw-muted dw-not-started">{}</span>', "not started")
        badge = status_badge(self.record.status)
        if self.record.status == Status.SKIPPED and self.record.skip_reason:
            return format_html(
                '{}<br><span class="dw-muted dw-skip-reason">{}</span>',
                badge,
                self.record.skip_reason,
            )
        if self.record.status == Status.SUSPENDED and self.record.next_poll_at is not None:
            return format_html(
                '{}<br><span class="dw-muted">next poll {}</span>',
                badge,
                timezone.localtime(self.record.next_poll_at).strftime("%Y-%m-%d %H:%M:%S"),
            )
        return badge

    @property
    def progress(self) -> str:
        """Whole percent (``83%``), ``-`` when unknown."""
        rec = self.record
        if rec is None:
            return "-"
        value = rec.progress
        if value is None and rec.status == Status.COMPLETED:
            value = 100.0
        return "-" if value is None else f"{value:.0f}%"

    @property
    def duration(self) -> SafeString | str:
        rec = self.record
        if rec is None:
            return "-"
        if rec.duration_ms is not None:
            return (
                f"{rec.duration_ms:,} ms"
                if rec.duration_ms < 10_000
                else (format_duration_ms(rec.duration_ms))
            )
        return duration_display(None, rec.started_at, rec.status in ACTIVE_STAGE_STATUSES)

    @property
    def traceback(self) -> str | None:
        rec = self.record
        metrics = rec.metrics if rec is not None and isinstance(rec.metrics, dict) else {}
        value = metrics.get("traceback")
        return str(value) if value else None


def run_structure(run: WorkflowRun) -> list[list[dict[str, Any]]] | None:
    """The execution groups of the definition ``run`` started with (issue 12 item 3):
    ``[[{"id", "name", ...}, ...], ...]`` from its version's stored structure (one query),
    else from the registered definition if it has the run's version (or the run is
    unversioned), else ``None`` (the version's structure is unknown here).
    """
    workflow = registry.get(run.workflow_id)
    version = run.definition_version
    if version:
        from ..kernel.versions import stored_structure

        stored = stored_structure(run.workflow_id, version)
        if stored is not None and isinstance(stored.get("groups"), list):
            return stored["groups"]
        if workflow is None or workflow.version != version:
            return None
    if workflow is None:
        return None
    return workflow.structure()["groups"]


def stage_rows(run: WorkflowRun, stages: list[WorkflowStage]) -> list[StageRow]:
    """The stage records of ``run`` and, after them in workflow order, the stages of the
    definition the run started with (:func:`run_structure`: its version, not necessarily
    today's definition) that have no record yet (not started)."""
    by_id = {s.stage_id: s for s in stages}
    rows = [StageRow(s.stage_id, s.stage_name, s.execution_group, s) for s in stages]
    workflow = registry.get(run.workflow_id)
    if workflow is not None:
        for row in rows:
            defined = workflow.get_stage(row.stage_id)
            row.limits = timeouts.text(defined) if defined is not None else ""
    structure = run_structure(run) or []
    maps = {
        str(entry.get("id", "")): entry["map"]
        for group in structure
        if isinstance(group, list)
        for entry in group
        if isinstance(entry, dict) and isinstance(entry.get("map"), dict)
    }
    for row in rows:
        row.limits = _with_map(row.limits, maps.get(row.stage_id))
    row_of = {r.stage_id: r for r in rows}
    for group_number, group in enumerate(structure, start=1):
        for entry in group if isinstance(group, list) else []:
            sid = str(entry.get("id", ""))
            if sid in row_of:
                row_of[sid].condition = condition_text(entry)
            if sid and sid not in by_id:
                defined = workflow.get_stage(sid) if workflow is not None else None
                limits = timeouts.text(defined) if defined is not None else ""
                limits = _with_map(limits, maps.get(sid))
                rows.append(
                    StageRow(
                        sid,
                        str(entry.get("name") or sid),
                        group_number,
                        None,
                        limits,
                        condition_text(entry),
                    )
                )
    rows.sort(key=lambda r: r.execution_group)
    return rows


def condition_text(entry: Any) -> str:
    """When a stage of the stored structure runs (issue 18): ``"when: <reason>"`` and/or
    ``"branch '<name>' of <block>"``; ``""`` for a stage that always runs."""
    if not isinstance(entry, dict):
        return ""
    parts = []
    branch = entry.get("branch")
    if isinstance(branch, dict):
        parts.append(f"branch {branch.get('name')!r} of {branch.get('id')}")
    when = entry.get("when")
    if isinstance(when, dict):
        parts.append(f"when: {when.get('reason') or when.get('predicate')}")
    return "; ".join(parts)


def _with_map(limits: str, spec: dict[str, Any] | None) -> str:
    """A map stage's placement (docs/fan-out.md) after its limits text: "map over items(),
    max_concurrency 10, on_item_failure fail"."""
    if spec is None:
        return limits
    over = str(spec.get("over", "?")).rsplit("<locals>.", 1)[-1]  # a nested function's name
    text = (
        f"map over {over}(), max_concurrency {spec.get('max_concurrency')}, "
        f"on_item_failure {spec.get('on_item_failure')}"
    )
    return f"{limits}; {text}" if limits else text


@dataclass
class RerunMarker:
    """A rerun of a run: when, from which stage, the new generation, who and why."""

    at: Any
    from_stage_id: str
    generation: int | None
    actor: str | None
    reason: str | None


def rerun_markers(run: WorkflowRun, limit: int = 50) -> list[RerunMarker]:
    """The run's reruns, newest first (its ``workflow:started`` events with a ``rerun``
    marker; one query on the run's outbox rows)."""
    out = []
    for event in (
        OutboxEvent.objects.filter(workflow_run_id=run.pk, event_type="workflow:started")
        .only("payload", "occurred_at")
        .order_by("-sequence")[:limit]
    ):
        payload = event.payload if isinstance(event.payload, dict) else {}
        marker = payload.get("rerun")
        if isinstance(marker, dict):
            out.append(
                RerunMarker(
                    event.occurred_at,
                    str(marker.get("from_stage_id") or ""),
                    marker.get("generation"),
                    marker.get("actor"),
                    marker.get("reason"),
                )
            )
    return out
