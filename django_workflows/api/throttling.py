"""Throttling of the HTTP API with DRF's throttle machinery.

:class:`WorkflowsRateThrottle` reads its rates from ``DJANGO_WORKFLOWS["API_THROTTLE_RATES"]``
by the view's ``throttle_scope`` (``"read"``, ``"write"`` or ``"events"``); a scope without a
rate is not throttled. Requests are counted per user (per IP address when anonymous) in
Django's default cache. Exceeding a rate is a 429 with code ``throttled`` and ``Retry-After``.
Any DRF throttle class can be listed in ``API_THROTTLE_CLASSES`` instead.
"""

from __future__ import annotations

from typing import Any

from rest_framework.request import Request
from rest_framework.throttling import SimpleRateThrottle

from ..conf import workflow_settings


class WorkflowsRateThrottle(SimpleRateThrottle):
    """A per-scope rate (``"100/min"``) from ``API_THROTTLE_RATES``; ``None``: unlimited."""

    scope_attr = "throttle_scope"

    def __init__(self) -> None:  # the rate depends on the view: resolved in allow_request
        pass

    def allow_request(self, request: Request, view: Any) -> bool:
        self.scope = getattr(view, self.scope_attr, None) or "read"
        rates = workflow_settings.API_THROTTLE_RATES or {}
        self.rate = rates.get(self.scope)
        if not self.rate:
            return True
        self.num_requests, self.duration = self.parse_rate(self.rate)
        return super().allow_request(request, view)

    def get_cache_key(self, request: Request, view: Any) -> str:
        user = request.user
        ident = user.pk if user and user.is_authenticated else self.get_ident(request)
        return f"django_workflows_api_throttle_{self.scope}_{ident}"
