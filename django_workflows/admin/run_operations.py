"""The operations of the run admin (SPEC §4.4-4.5): cancel (one run, or the bulk action), rerun
from a stage, approve / reject a waiting approval, attach an annotation, and the deletion of
terminal runs with their jobs and outbox rows. Each operation is a confirmation page on GET
(nothing is written) and dispatches its kernel command on POST (:mod:`.operations`).
"""

from __future__ import annotations

from typing import Any

from django.contrib import admin, messages
from django.contrib.admin.actions import delete_selected
from django.core.exceptions import PermissionDenied
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.urls import URLPattern, path, reverse
from django.utils.translation import ngettext

from .. import approval
from ..definition.registry import registry
from ..kernel.commands import CancelRun, RerunFrom
from ..kernel.errors import WorkflowError
from ..kernel.runtime import get_kernel
from ..models import (
    ACTIVE_STAGE_STATUSES,
    TERMINAL_RUN_STATUSES,
    OutboxEvent,
    Status,
    WorkflowJob,
    WorkflowRun,
)
from ..runs import waiting_reasons
from .display import (
    short_json,
)
from .operations import (
    AnnotateForm,
    CancelForm,
    DecisionForm,
    RerunForm,
    SignalForm,
    actor_of,
    has_operation_permission,
    log_operation,
    operation_page,
)

#: Ids named in one action message before "and N more".
MAX_IDS_IN_MESSAGE = 10

#: Runs one bulk cancel takes at once.
MAX_BULK_RUNS = 500


def _name_ids(items: list[tuple[Any, str]]) -> str:
    shown = ", ".join(f"{run_id} ({status})" for run_id, status in items[:MAX_IDS_IN_MESSAGE])
    rest = len(items) - MAX_IDS_IN_MESSAGE
    return f"{shown} and {rest} more" if rest > 0 else shown


class RunOperationsMixin:
    """The operations of :class:`~.runs.WorkflowRunAdmin` (a ``ModelAdmin`` mixin)."""

    def has_cancel_permission(self, request: HttpRequest) -> bool:
        """``cancel_workflowrun`` (and view): cancel single runs and the bulk action."""
        return has_operation_permission(request, "cancel")

    def has_rerun_permission(self, request: HttpRequest) -> bool:
        return has_operation_permission(request, "rerun")

    def has_approve_permission(self, request: HttpRequest) -> bool:
        return has_operation_permission(request, "approve")

    def has_annotate_permission(self, request: HttpRequest) -> bool:
        return has_operation_permission(request, "annotate")

    def has_signal_permission(self, request: HttpRequest) -> bool:
        """``add_workflowsignal`` (and ``view_workflowsignal``): send a signal to a run."""
        return has_operation_permission(request, "signal")

    @admin.action(description="Cancel selected runs…", permissions=["cancel"])
    def cancel_runs(
        self, request: HttpRequest, queryset: QuerySet[WorkflowRun]
    ) -> HttpResponse | None:
        """A confirmation page listing the selected runs with a required reason; on confirm,
        ``run.cancel`` per active run (K-CA-1..3), History per cancelled run, terminal runs
        named and left alone."""
        selected = list(
            queryset.only("pk", "status", "workflow_id").order_by("created_at")[: MAX_BULK_RUNS + 1]
        )
        if len(selected) > MAX_BULK_RUNS:
            self.message_user(
                request,
                f"Select at most {MAX_BULK_RUNS} runs to cancel at once.",
                messages.ERROR,
            )
            return None
        form = CancelForm(request.POST if request.POST.get("confirm") == "yes" else None)
        hidden = [("action", "cancel_runs"), *(("_selected_action", str(r.pk)) for r in selected)]
        changelist = reverse(f"admin:{self.opts.app_label}_{self.opts.model_name}_changelist")
        active = [r for r in selected if r.status not in TERMINAL_RUN_STATUSES]
        return operation_page(
            self,
            request,
            operation="cancel",
            obj=None,
            title=ngettext("Cancel %d run?", "Cancel %d runs?", len(selected)) % len(selected),
            form=form,
            perform=lambda data: self._cancel(request, selected, data["reason"]),
            back_url=changelist,
            facts=[
                ngettext(
                    "%d selected run is active and will be cancelled with its open stages "
                    "and queued jobs.",
                    "%d selected runs are active and will be cancelled with their open stages "
                    "and queued jobs.",
                    len(active),
                )
                % len(active),
                "Terminal runs are left as they are. This cannot be undone.",
            ],
            objects=[f"{r.pk} · {r.workflow_id} · {r.status}" for r in selected],
            submit="Yes, cancel",
            hidden=hidden,
        )

    def _cancel(self, request: HttpRequest, runs: list[WorkflowRun], reason: str) -> None:
        """Dispatch ``run.cancel`` for each run; messages for cancelled, terminal, errors."""
        kernel = get_kernel()
        who = actor_of(request)
        cancelled: list[WorkflowRun] = []
        terminal: list[tuple[Any, str]] = []
        errors: list[str] = []
        for run in runs:
            if run.status in TERMINAL_RUN_STATUSES:
                terminal.append((run.pk, run.status))
                continue
            try:
                result = kernel.dispatch(
                    CancelRun(run.pk, reason=f"Cancelled in the admin by {who}: {reason}")
                )
            except WorkflowError as exc:
                errors.append(f"{run.pk}: {exc}")
                continue
            if result.cancelled:
                cancelled.append(run)
                log_operation(request, run, f"Cancelled (run.cancel). Reason: {reason}")
            else:  # it became terminal between the list and the command
                status = WorkflowRun.objects.filter(pk=run.pk).values_list("status", flat=True)
                terminal.append((run.pk, status.first() or "deleted"))
        if cancelled:
            self.message_user(
                request,
                ngettext("Cancelled %d run.", "Cancelled %d runs.", len(cancelled))
                % len(cancelled),
                messages.SUCCESS,
            )
        if terminal:
            self.message_user(
                request,
                ngettext(
                    "%(count)d run was already terminal and was left as it is: %(ids)s.",
                    "%(count)d runs were already terminal and were left as they are: %(ids)s.",
                    len(terminal),
                )
                % {"count": len(terminal), "ids": _name_ids(terminal)},
                messages.WARNING,
            )
        for error in errors:
            self.message_user(request, f"Could not cancel {error}", messages.ERROR)

    def get_actions(self, request: HttpRequest, action_location: Any = None) -> dict[str, Any]:
        # Django 6.1 passes ``action_location`` (and deprecates overrides without that
        # parameter); Django 5.2 knows no such argument.
        if action_location is None:
            actions = super().get_actions(request)
        else:
            actions = super().get_actions(request, action_location)  # type: ignore[call-arg]
        if "delete_selected" in actions:
            actions["delete_selected"] = (
                type(self).delete_terminal_runs,
                "delete_selected",
                "Delete selected terminal runs",
            )
        return actions

    def delete_terminal_runs(
        self, request: HttpRequest, queryset: QuerySet[WorkflowRun]
    ) -> HttpResponse | None:
        """Django's delete (with its confirmation page) restricted to terminal runs."""
        active = queryset.exclude(status__in=TERMINAL_RUN_STATUSES).count()
        if active and not request.POST.get("post"):
            self.message_user(
                request,
                ngettext(
                    "%d selected run is not terminal and will not be deleted (cancel it first).",
                    "%d selected runs are not terminal and will not be deleted "
                    "(cancel them first).",
                    active,
                )
                % active,
                messages.WARNING,
            )
        terminal = queryset.filter(status__in=TERMINAL_RUN_STATUSES)
        if not terminal.exists():
            return None
        return delete_selected(self, request, terminal)

    def get_urls(self) -> list[URLPattern]:
        opts = self.opts
        views = (
            ("cancel", self.cancel_view),
            ("rerun", self.rerun_view),
            ("decide", self.decide_view),
            ("annotate", self.annotate_view),
            ("signal", self.signal_view),
        )
        return [
            *(
                path(
                    f"<path:object_id>/{name}/",
                    self.admin_site.admin_view(view),
                    name=f"{opts.app_label}_{opts.model_name}_{name}",
                )
                for name, view in views
            ),
            *super().get_urls(),
        ]

    def cancel_view(self, request: HttpRequest, object_id: str) -> HttpResponse:
        """Confirm (GET) and cancel (POST, with a reason) one run through ``run.cancel``."""
        if not self.has_cancel_permission(request):
            raise PermissionDenied
        run = self._run_or_404(request, object_id)
        change_url = self._change_url(run)
        if run.is_terminal:
            self.message_user(
                request,
                f"Run {run.pk} is already {run.status}; there is nothing to cancel.",
                messages.WARNING,
            )
            return HttpResponseRedirect(change_url)
        open_stages = run.stages.filter(status__in=ACTIVE_STAGE_STATUSES).count()
        facts = [
            f"Run {run.pk} of workflow “{run.workflow_id}” is {run.status}.",
            (
                ngettext(
                    "%d open stage is cancelled, with its queued jobs.",
                    "%d open stages are cancelled, with their queued jobs.",
                    open_stages,
                )
                % open_stages
                if open_stages
                else "No stage has started yet: no worker will pick the run up."
            ),
            "A stage that is executing right now finishes, but its result is discarded.",
            "This cannot be undone: a cancelled run is neither resumed nor rerun.",
        ]
        return operation_page(
            self,
            request,
            operation="cancel",
            obj=run,
            title="Cancel this run?",
            form=CancelForm(request.POST if request.method == "POST" else None),
            perform=lambda data: self._cancel(request, [run], data["reason"]),
            back_url=change_url,
            facts=facts,
            submit="Yes, cancel the run",
        )

    def rerun_view(self, request: HttpRequest, object_id: str) -> HttpResponse:
        """Rerun a COMPLETED or FAILED run from a chosen stage (``run.rerunFrom``, K-RR)."""
        if not self.has_rerun_permission(request):
            raise PermissionDenied
        run = self._run_or_404(request, object_id)
        change_url = self._change_url(run)
        workflow = registry.get(run.workflow_id)
        if workflow is None:
            self.message_user(
                request,
                f"Workflow {run.workflow_id!r} is not registered in this process; it cannot be "
                "rerun from here.",
                messages.ERROR,
            )
            return HttpResponseRedirect(change_url)
        if run.status not in (Status.COMPLETED, Status.FAILED):
            self.message_user(
                request,
                f"Run {run.pk} is {run.status}; only a COMPLETED or FAILED run can be rerun.",
                messages.WARNING,
            )
            return HttpResponseRedirect(change_url)
        choices = [
            (node.stage.id, f"{node.stage.id} (group {node.execution_group})")
            for node in (workflow.node(sid) for sid in workflow.stage_ids)
        ]
        initial = None
        failed = run.stages.filter(status=Status.FAILED).order_by("execution_group").first()
        if failed is not None:
            initial = {"from_stage_id": failed.stage_id}
        form = RerunForm(
            request.POST if request.method == "POST" else None, initial=initial, stages=choices
        )

        def perform(data: dict[str, Any]) -> str:
            reason = data["reason"] or ""
            result = get_kernel().dispatch(
                RerunFrom(
                    run.pk,
                    data["from_stage_id"],
                    actor=f"user:{actor_of(request)}",
                    reason=reason or None,
                )
            )
            deleted = ", ".join(result.deleted_stages) or "none"
            log_operation(
                request,
                run,
                f"Rerun from stage {data['from_stage_id']} (run.rerunFrom); deleted stage "
                f"records: {deleted}." + (f" Reason: {reason}" if reason else ""),
            )
            return (
                f"Rerunning run {run.pk} from stage {data['from_stage_id']}: "
                f"{len(result.deleted_stages)} stage record(s) replaced ({deleted})."
            )

        return operation_page(
            self,
            request,
            operation="rerun",
            obj=run,
            title="Rerun this run from a stage?",
            form=form,
            perform=perform,
            back_url=change_url,
            facts=[
                f"Run {run.pk} of workflow “{run.workflow_id}” is {run.status}.",
                "The chosen stage's execution group and every later group are deleted and run "
                "again as the next generation; earlier groups keep their outputs.",
                "The run's started_at is kept; the rerun is recorded with who, why and when.",
            ],
            submit="Yes, rerun",
        )

    def decide_view(self, request: HttpRequest, object_id: str) -> HttpResponse:
        """Approve or reject a waiting approval stage (``approval.decide``, as the user)."""
        if not self.has_approve_permission(request):
            raise PermissionDenied
        run = self._run_or_404(request, object_id)
        change_url = self._change_url(run)
        waiting = [w for w in waiting_reasons(run) if w.reason == "approval"]
        if not waiting:
            self.message_user(request, f"No approval is waiting in run {run.pk}.", messages.WARNING)
            return HttpResponseRedirect(change_url)
        choices = [
            (
                w.stage_id or "",
                w.stage_id
                + (
                    f" (approvers: {', '.join(w.allowed_approvers)})" if w.allowed_approvers else ""
                ),
            )
            for w in waiting
        ]
        data = request.POST if request.method == "POST" else None
        initial = {"outcome": request.GET.get("outcome") or "approved"}
        form = DecisionForm(data, initial=initial, stages=choices)

        def perform(data: dict[str, Any]) -> str:
            by = actor_of(request)
            comment = data["comment"] or None
            recorded = approval.decide(
                run.pk, data["outcome"], by=by, stage_id=data["stage_id"], rationale=comment
            )
            verb = "Approved" if recorded.outcome == "approved" else "Rejected"
            if not recorded.recorded:
                return f"Stage {recorded.stage_id} was already {recorded.outcome}; nothing changed."
            log_operation(
                request,
                run,
                f"{verb} stage {recorded.stage_id} (generation {recorded.generation})."
                + (f" Comment: {comment}" if comment else ""),
            )
            return (
                f"{verb} stage {recorded.stage_id} as {by}: the run resumes at the stage's "
                "next poll."
            )

        who = [
            f"{w.stage_id}: "
            + (
                f"may be decided by {', '.join(w.allowed_approvers)}"
                if w.allowed_approvers
                else "anyone with the approve permission may decide"
            )
            for w in waiting
        ]
        return operation_page(
            self,
            request,
            operation="approve",
            obj=run,
            title="Approve or reject",
            form=form,
            perform=perform,
            back_url=change_url,
            facts=[f"You decide as {actor_of(request)}; the first decision wins.", *who],
            submit="Record the decision",
        )

    def annotate_view(self, request: HttpRequest, object_id: str) -> HttpResponse:
        """Attach one annotation as the user (``kernel.annotations.attach``, AN-21)."""
        if not self.has_annotate_permission(request):
            raise PermissionDenied
        run = self._run_or_404(request, object_id)
        change_url = self._change_url(run)
        stages = [
            (sid, sid)
            for sid in run.stages.order_by("execution_group", "stage_number").values_list(
                "stage_id", flat=True
            )
        ]
        form = AnnotateForm(request.POST if request.method == "POST" else None, stages=stages)

        def perform(data: dict[str, Any]) -> str:
            options: dict[str, Any] = {
                "actor": {"kind": "user", "id": actor_of(request)},
                "emit_event": True,
            }
            if data["stage_id"]:
                options.update(scope="stage", scope_id=data["stage_id"])
            if data["comment"]:
                options["payload"] = {"comment": data["comment"]}
            result = get_kernel().annotations.attach(
                run.pk, {data["key"]: data["value"]}, **options
            )
            log_operation(
                request,
                run,
                f"Annotated {data['key']} = {short_json(data['value'], 200)}"
                + (f" on stage {data['stage_id']}" if data["stage_id"] else "")
                + ".",
            )
            return f"Attached {result.created} annotation(s) ({data['key']})."

        return operation_page(
            self,
            request,
            operation="annotate",
            obj=run,
            title="Attach an annotation",
            form=form,
            perform=perform,
            back_url=change_url,
            facts=[f"Written as actor user:{actor_of(request)}, with an annotation:created event."],
            submit="Attach",
        )

    def signal_view(self, request: HttpRequest, object_id: str) -> HttpResponse:
        """Send a signal to the run as the user (``send_signal``, actor ``user:<name>``)."""
        from ..signals import send_signal

        if not self.has_signal_permission(request):
            raise PermissionDenied
        run = self._run_or_404(request, object_id)
        change_url = self._change_url(run)
        if run.is_terminal:
            self.message_user(
                request,
                f"Run {run.pk} is {run.status}; a finished run takes no signals.",
                messages.WARNING,
            )
            return HttpResponseRedirect(change_url)
        waiting = [w for w in waiting_reasons(run) if w.reason == "signal"]
        names = [w.signal for w in waiting if w.signal]
        form = SignalForm(request.POST if request.method == "POST" else None, names=names)

        def perform(data: dict[str, Any]) -> str:
            result = send_signal(
                run.pk,
                data["name"],
                data["payload"],
                key=data["key"] or None,
                actor=f"user:{actor_of(request)}",
            )
            if not result.stored:
                return (
                    f"Key {data['key']!r} was already used for signal {result.signal_id}; "
                    "nothing was stored."
                )
            log_operation(
                request,
                run,
                f"Sent signal {data['name']} (id {result.signal_id}) with payload "
                f"{short_json(data['payload'], 200)}.",
            )
            woke = " A waiting stage takes it at the next tick." if result.woke else ""
            return f"Stored signal {data['name']} (id {result.signal_id}).{woke}"

        facts = [
            f"Sent as actor user:{actor_of(request)}, with a signal:received event.",
            *(f"Stage {w.stage_id} is {w.message}." for w in waiting),
        ]
        if not waiting:
            facts.append(
                "No stage waits for a signal right now: the signal is kept until one does."
            )
        return operation_page(
            self,
            request,
            operation="signal",
            obj=run,
            title="Send a signal",
            form=form,
            perform=perform,
            back_url=change_url,
            facts=facts,
            submit="Send",
        )


def _delete_run_rows(run_ids: list[Any]) -> None:
    """Delete the jobs and outbox rows of terminal runs being deleted (no foreign key to the
    run, DM-11, so no cascade)."""
    WorkflowJob.objects.filter(workflow_run_id__in=run_ids).delete()
    OutboxEvent.objects.filter(workflow_run_id__in=run_ids).delete()
