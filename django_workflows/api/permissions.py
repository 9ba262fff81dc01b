"""Permissions of the HTTP API.

Each API view names the Django permissions a request needs in ``required_permissions``
(``{"GET": [...], "POST": [...]}``, codenames of the ``django_workflows`` app):

==============================  =================================================
route                           permissions
==============================  =================================================
``GET definitions/...``         ``view_workflowrun``
``GET runs/``, ``runs/{id}/``   ``view_workflowrun``
``POST runs/``                  ``add_workflowrun``
``POST runs/{id}/cancel/``      ``cancel_workflowrun``
``POST runs/{id}/rerun/``       ``rerun_workflowrun``
``POST runs/{id}/approve|reject/`` ``approve_workflowrun``
``GET runs/{id}/annotations/``  ``view_workflowrun`` + ``view_workflowannotation``
``POST runs/{id}/annotations/`` ``annotate_workflowrun``
``GET runs/{id}/signals/``      ``view_workflowrun`` + ``view_workflowsignal``
``POST runs/{id}/signals/``     ``add_workflowsignal``
``GET runs/{id}/events/``       ``view_workflowrun`` + ``view_outboxevent``
``GET runs/{id}/logs/``         ``view_workflowrun`` + ``view_workflowlog``
``GET schedules/...``           ``view_workflowschedule``
``POST schedules/{n}/pause|resume/`` ``pause_workflowschedule``
``POST schedules/{n}/trigger/``  ``trigger_workflowschedule``
``POST schedules/{n}/backfill/`` ``backfill_workflowschedule``
``GET dead-letters/``           ``view_outboxevent``
``POST dead-letters/{id}/replay/`` ``replay_outboxevent``
``POST dead-letters/{id}/skip/``  ``skip_outboxevent``
==============================  =================================================

The custom permissions (``cancel_``, ``rerun_``, ``approve_``, ``annotate_workflowrun``,
``replay_``, ``skip_outboxevent``) are the ones the admin uses. Replace the class with
``DJANGO_WORKFLOWS["API_PERMISSION_CLASSES"]`` (it can read ``view.required_permissions``
too).
"""

from __future__ import annotations

from typing import Any

from rest_framework.permissions import BasePermission
from rest_framework.request import Request

APP_LABEL = "django_workflows"


def required_permissions(view: Any, method: str) -> list[str]:
    """The full permission names (``app_label.codename``) ``view`` needs for ``method``.
    HEAD and OPTIONS need what GET needs."""
    spec: dict[str, list[str]] = getattr(view, "required_permissions", {}) or {}
    method = "GET" if method in ("HEAD", "OPTIONS") else method
    return [f"{APP_LABEL}.{codename}" for codename in spec.get(method, [])]


class WorkflowModelPermissions(BasePermission):
    """An authenticated (active) user who has every permission the view names for the method.

    Anonymous requests are refused as "not authenticated" (401 with token authentication, 403
    with session authentication only); a missing permission is a 403 naming it.
    """

    message = "You do not have permission to perform this action."

    def has_permission(self, request: Request, view: Any) -> bool:
        user = request.user
        if not (user and user.is_authenticated and user.is_active):
            return False
        missing = [
            p for p in required_permissions(view, request.method or "GET") if not user.has_perm(p)
        ]
        if missing:
            self.message = f"Missing permission: {', '.join(missing)}."
            return False
        return True
