"""No admin GET writes (issue 17): showing any admin page of the app - every list (also
filtered), every object page, every operation's confirmation page, the app index - executes
no INSERT, UPDATE or DELETE. Writes happen on POST only (each dispatches a kernel command).
"""

from __future__ import annotations

import re
from typing import Any

import pytest
from django.contrib import admin
from django.contrib.admin.utils import quote
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.urls import URLPattern, reverse

from django_workflows import define_schedule
from django_workflows.definition.registry import registry
from django_workflows.kernel import FlushOutbox, Kernel
from django_workflows.kernel.runtime import get_kernel
from django_workflows.kernel.schedules import sync_schedules
from django_workflows.models import OutboxEvent, WorkflowSchedule

from .test_admin import kernel, make_runs, workflows  # noqa: F401 (fixtures)

pytestmark = pytest.mark.django_db(transaction=True)

WRITE = re.compile(r"^\s*(INSERT|UPDATE|DELETE|REPLACE)\b", re.IGNORECASE)

#: Query strings each list is also shown with (filters, search, paging of the run page).
EXTRA = ("?status=FAILED", "?attention=human", "?attention=failures", "?q=admin", "?p=2")


def _admin_get_urls(objects: dict[type, Any]) -> list[str]:
    """Every GET-able URL of the app's model admins, objects filled in from ``objects``."""
    urls = [reverse("admin:index"), reverse("admin:app_list", args=["django_workflows"])]
    for model, model_admin in admin.site._registry.items():
        if model._meta.app_label != "django_workflows":
            continue
        prefix = f"admin:{model._meta.app_label}_{model._meta.model_name}"
        changelist = reverse(f"{prefix}_changelist")
        urls += [changelist, *(changelist + q for q in EXTRA)]
        obj = objects.get(model) or model._default_manager.order_by("pk").first()
        for pattern in model_admin.get_urls():
            if not isinstance(pattern, URLPattern) or not pattern.name:
                continue
            if pattern.name.endswith(("_add", "_delete", "_history", "_changelist")):
                continue
            if pattern.name.endswith("_change") and obj is None:
                continue
            if "object_id" in str(pattern.pattern):
                if obj is None:
                    continue
                urls.append(reverse(f"admin:{pattern.name}", args=[quote(obj.pk)]))
            else:
                urls.append(reverse(f"admin:{pattern.name}"))
        if obj is not None:
            urls.append(reverse(f"{prefix}_history", args=[quote(obj.pk)]))
            urls.append(reverse(f"{prefix}_change", args=[quote(obj.pk)]) + "?timeline_page=2")
    return urls


def test_no_admin_page_writes_on_get(admin_client: Any, kernel: Kernel) -> None:  # noqa: F811
    runs = make_runs(kernel)
    registry.register_schedule(
        define_schedule("get-writes", "admin-two-stage", every=60, input={"value": 1})
    )
    try:
        sync_schedules(get_kernel())
        kernel.dispatch(FlushOutbox(max_events=1000))
        dead = OutboxEvent.objects.order_by("pk").first()
        assert dead is not None
        OutboxEvent.objects.filter(pk=dead.pk).update(
            dlq_at=dead.occurred_at, published_at=None, retry_count=5
        )
        # A definition with no row yet: a GET of the schedules list must not create it.
        registry.register_schedule(
            define_schedule("get-writes-new", "admin-two-stage", every=60, input={"value": 1})
        )
        objects = {OutboxEvent: dead, type(runs.suspended): runs.suspended}
        urls = _admin_get_urls(objects)
        assert len(urls) > 20
        writes: dict[str, list[str]] = {}
        for url in urls:
            with CaptureQueriesContext(connection) as queries:
                response = admin_client.get(url)
            assert response.status_code in (200, 302), (url, response.status_code)
            found = [q["sql"] for q in queries.captured_queries if WRITE.match(q["sql"])]
            if found:
                writes[url] = found
        assert writes == {}
        assert not WorkflowSchedule.objects.filter(pk="get-writes-new").exists()
    finally:
        for name in ("get-writes", "get-writes-new"):
            if name in {s.name for s in registry.schedules()}:
                registry.unregister_schedule(name)
