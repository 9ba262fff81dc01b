"""URLs of the health views: ``path("workflows/health/", include("django_workflows.health.urls"))``
gives ``live/``, ``ready/`` and ``metrics/`` (names ``workflows-health:live`` etc.)."""

from __future__ import annotations

from django.urls import path

from . import views

app_name = "workflows-health"

urlpatterns = [
    path("live/", views.live, name="live"),
    path("ready/", views.ready, name="ready"),
    path("metrics/", views.metrics, name="metrics"),
]
