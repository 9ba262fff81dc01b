"""Operator operations of the admin: forms, permissions and one confirmation-page flow.

Every operation is a page that shows what will happen and asks for confirmation (GET), then on
POST validates its form, dispatches the kernel command (``kernel.dispatch`` or a helper built on
it: ``approval.decide``, ``kernel.annotations.attach``), writes an admin History record
(``LogEntry``) naming what was done and why, and reports the kernel's result or error as a
message. Nothing here writes a status column itself (ARCHITECTURE §2).

Permissions (custom, created by migration 0006 and shared with the HTTP API,
``django_workflows.api.permissions``): ``cancel_workflowrun``, ``rerun_workflowrun``,
``approve_workflowrun``, ``annotate_workflowrun``, ``replay_outboxevent``, ``skip_outboxevent``;
``pause_workflowschedule``, ``trigger_workflowschedule``, ``backfill_workflowschedule``
(migration 0012); each operation also needs the view permission of its model.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from django import forms
from django.contrib import admin, messages
from django.contrib.admin.models import CHANGE, LogEntry
from django.core.exceptions import PermissionDenied
from django.db.models import Model
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.template.response import TemplateResponse

from ..kernel.errors import WorkflowError
from ..kernel.jsonvalue import loads_json

APP_LABEL = "django_workflows"

#: Longest reason / comment / note accepted by an operation form (characters).
MAX_REASON_CHARS = 2000

#: Custom permission codename per operation (``app_label.codename`` for ``has_perm``).
PERMISSIONS: dict[str, str] = {
    "cancel": "cancel_workflowrun",
    "rerun": "rerun_workflowrun",
    "approve": "approve_workflowrun",
    "annotate": "annotate_workflowrun",
    "signal": "add_workflowsignal",
    "replay": "replay_outboxevent",
    "skip": "skip_outboxevent",
    "pause": "pause_workflowschedule",
    "trigger": "trigger_workflowschedule",
    "backfill": "backfill_workflowschedule",
}


def has_operation_permission(request: HttpRequest, operation: str) -> bool:
    """Whether the request's user holds the custom permission of ``operation`` (a key of
    :data:`PERMISSIONS`) and the view permission of its model."""
    codename = PERMISSIONS[operation]
    model = codename.split("_", 1)[1]
    user = request.user
    return bool(
        user.is_active
        and user.is_staff
        and user.has_perm(f"{APP_LABEL}.{codename}")
        and user.has_perm(f"{APP_LABEL}.view_{model}")
    )


def actor_of(request: HttpRequest) -> str:
    """The user name of the request's user (the actor id of what the admin writes)."""
    return str(request.user.get_username() or request.user.pk)


def log_operation(request: HttpRequest, obj: Model, message: str) -> None:
    """An admin History (``LogEntry``) record of ``obj``: ``message`` as the change message."""
    LogEntry.objects.log_actions(
        user_id=request.user.pk,
        queryset=[obj],
        action_flag=CHANGE,
        change_message=message[:5000],
        single_object=True,
    )


def _reason_field(label: str, required: bool, help_text: str = "") -> forms.CharField:
    return forms.CharField(
        label=label,
        required=required,
        max_length=MAX_REASON_CHARS,
        strip=True,
        widget=forms.Textarea(attrs={"rows": 3, "cols": 60}),
        help_text=help_text,
    )


class CancelForm(forms.Form):
    """``reason``: why the run is cancelled (required; kept in the ``workflow:cancelled``
    event and the History record)."""

    reason = _reason_field("Reason", True, "Kept with the workflow:cancelled event and History.")


class RerunForm(forms.Form):
    """``from_stage_id``: a stage of the workflow (choices set per run); ``reason`` optional."""

    from_stage_id = forms.ChoiceField(label="Rerun from stage")
    reason = _reason_field("Reason", False, "Kept in the rerun marker and History.")

    def __init__(self, *args: Any, stages: list[tuple[str, str]], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fields["from_stage_id"].choices = stages  # type: ignore[attr-defined]


class DecisionForm(forms.Form):
    """``stage_id`` of a waiting approval, ``outcome`` approve/reject, optional ``comment``."""

    stage_id = forms.ChoiceField(label="Approval stage")
    outcome = forms.ChoiceField(
        label="Decision",
        choices=[("approved", "Approve"), ("rejected", "Reject")],
        widget=forms.RadioSelect,
    )
    comment = _reason_field("Comment / reason", False, "Stored as decision.rationale.")

    def __init__(self, *args: Any, stages: list[tuple[str, str]], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fields["stage_id"].choices = stages  # type: ignore[attr-defined]


class AnnotateForm(forms.Form):
    """One annotation: ``key``, ``value`` (JSON; plain text is kept as a string), ``scope``
    (run, or a stage named by ``stage_id``) and an optional ``comment`` (its payload)."""

    key = forms.CharField(label="Key", max_length=200, help_text="e.g. review.note or acme.flag")
    value = forms.CharField(
        label="Value",
        widget=forms.Textarea(attrs={"rows": 3, "cols": 60}),
        help_text='JSON (7, true, "text", {"a": 1}); anything else is stored as text.',
        max_length=100_000,
    )
    stage_id = forms.ChoiceField(label="Scope", required=False)
    comment = _reason_field("Comment", False, "Kept as the annotation's payload.")

    def __init__(self, *args: Any, stages: list[tuple[str, str]], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fields["stage_id"].choices = [("", "the run"), *stages]  # type: ignore[attr-defined]

    def clean_value(self) -> Any:
        text = self.cleaned_data["value"]
        try:
            return loads_json(text)
        except ValueError:
            return text


class SignalForm(forms.Form):
    """One signal: ``name``, ``payload`` (JSON; empty: null) and an optional idempotency
    ``key``."""

    name = forms.CharField(
        label="Name", max_length=200, help_text="e.g. approved (letters, digits, '._:-')"
    )
    payload = forms.CharField(
        label="Payload",
        widget=forms.Textarea(attrs={"rows": 4, "cols": 60}),
        required=False,
        help_text='JSON, e.g. {"by": "alice"}; empty: null. At most 64 KiB.',
        max_length=100_000,
    )
    key = forms.CharField(
        label="Idempotency key",
        max_length=255,
        required=False,
        help_text="optional: sending again with the same key stores nothing",
    )

    def __init__(self, *args: Any, names: list[str] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if names and not self.is_bound:
            self.fields["name"].initial = names[0]

    def clean_payload(self) -> Any:
        text = self.cleaned_data["payload"]
        if not text.strip():
            return None
        try:
            return loads_json(text)
        except ValueError as exc:
            raise forms.ValidationError(f"not JSON: {exc}") from None


class NoteForm(forms.Form):
    """An optional ``note`` (replay) or a required one (skip: kept on the row for audit)."""

    note = _reason_field("Note", False)

    def __init__(self, *args: Any, required: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fields["note"].required = required
        if required:
            self.fields["note"].help_text = "Why it is skipped; stored on the outbox row."


def operation_page(
    model_admin: admin.ModelAdmin,
    request: HttpRequest,
    *,
    operation: str,
    obj: Model | None,
    title: str,
    form: forms.Form,
    perform: Callable[[dict[str, Any]], str | None],
    back_url: str,
    done_url: str | None = None,
    facts: list[Any] | None = None,
    submit: str = "Confirm",
    hidden: list[tuple[str, str]] | None = None,
    objects: list[Any] | None = None,
) -> HttpResponse:
    """Confirm (GET, or a POST without ``confirm``) and perform (POST with ``confirm``).

    ``perform(cleaned_data)`` dispatches the command and returns the success message (or
    ``None`` when it reported its own messages); a :class:`WorkflowError` it raises is shown as
    an error message on the same page with the form kept, nothing logged.

    Raises:
        PermissionDenied: the user lacks the operation's permission (checked again on POST).
    """
    if not has_operation_permission(request, operation):
        raise PermissionDenied
    if request.method == "POST" and request.POST.get("confirm") == "yes":
        if form.is_valid():
            try:
                message = perform(form.cleaned_data)
            except WorkflowError as exc:
                model_admin.message_user(request, str(exc), messages.ERROR)
            else:
                if message:
                    model_admin.message_user(request, message, messages.SUCCESS)
                return HttpResponseRedirect(done_url or back_url)
    context = {
        **model_admin.admin_site.each_context(request),
        "title": title,
        "subtitle": None,
        "opts": model_admin.opts,
        "object": obj,
        "original": obj,
        "form": form,
        "facts": facts or [],
        "objects": objects or [],
        "submit_label": submit,
        "back_url": back_url,
        "hidden": hidden or [],
        "operation": operation,
    }
    return TemplateResponse(request, "admin/django_workflows/operation.html", context)
