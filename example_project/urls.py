from django.contrib import admin
from django.urls import include, path

urlpatterns = [
    path("admin/", admin.site.urls),
    path("api/workflows/", include("django_workflows.api.urls")),
    # Liveness, readiness and Prometheus metrics: workflows/health/live/, ready/, metrics/.
    path("workflows/health/", include("django_workflows.health.urls")),
]
