"""HTTP liveness, readiness and Prometheus metrics (issue 20 items 2 and 4).

Mount them with ``path("workflows/health/", include("django_workflows.health.urls"))``:

* ``live/`` - 200 ``{"status": "live"}`` while the process serves requests; reads nothing
  (no database), so a database outage never restarts the pods.
* ``ready/`` - the checks of :mod:`.checks`: 200 healthy, 503 unhealthy with
  ``{"status": "unhealthy", "failing": [...], "checks": [{"name", "ok"}, ...]}``. The
  database is first probed on a separate connection with a short ``connect_timeout``, and the
  reads run under a ``statement_timeout`` (both ``HEALTH_DB_TIMEOUT_SECONDS``), so a database
  that is down or hung answers 503 within about that long. Never a stack trace. With the
  ``HEALTH_TOKEN`` bearer token (or a staff user's session) each check also has its
  ``value``, ``threshold`` and ``detail``; anonymous callers learn only names and ``ok``.
* ``metrics/`` - the Prometheus text exposition (:mod:`.prometheus`); needs the
  ``HEALTH_TOKEN`` bearer token when that setting is set (401 otherwise; a staff user's
  session also passes), else open. When the database is down: 503 with ``workflows_up 0``,
  within the readiness view's bounds.

Query parameters of ``ready/``: ``queue`` (repeatable) replaces the queues that need a live
worker (``?queue=default``: a web pod that only needs its own queue's workers).
"""

from __future__ import annotations

import copy
import hmac
import logging
import math
import time

from django.db import DEFAULT_DB_ALIAS, connections
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_GET

from ..conf import workflow_settings
from .checks import evaluate
from .state import empty_snapshot, snapshot

logger = logging.getLogger("django_workflows.health")


def _authorized(request: HttpRequest) -> bool:
    """The request carries ``Authorization: Bearer <HEALTH_TOKEN>`` or a staff session."""
    token = workflow_settings.HEALTH_TOKEN
    user = getattr(request, "user", None)
    if user is not None and getattr(user, "is_active", False) and getattr(user, "is_staff", False):
        return True
    if not token:
        return False
    header = request.headers.get("Authorization", "")
    scheme, _, given = header.partition(" ")
    # bytes: compare_digest refuses str with non-ASCII characters (a TypeError, a 500)
    return scheme.lower() == "bearer" and hmac.compare_digest(
        given.strip().encode("utf-8", "surrogateescape"),
        str(token).encode("utf-8", "surrogateescape"),
    )


def db_timeout_seconds() -> float:
    """``HEALTH_DB_TIMEOUT_SECONDS`` as a positive float (default 2)."""
    try:
        value = float(workflow_settings.HEALTH_DB_TIMEOUT_SECONDS)
    except (TypeError, ValueError):
        return 2.0
    return value if value > 0 else 2.0


def probe_database(alias: str = DEFAULT_DB_ALIAS, timeout_seconds: float | None = None) -> str:
    """Open a fresh connection to ``alias`` with a short connect timeout (PostgreSQL) and run
    ``SELECT 1``; returns ``""`` when it answered, else the exception's class name. The
    connection is closed; the request's own connection is not touched."""
    timeout = timeout_seconds if timeout_seconds is not None else db_timeout_seconds()
    wrapper = connections[alias]
    settings_dict = copy.deepcopy(wrapper.settings_dict)
    if wrapper.vendor == "postgresql":
        options = settings_dict.setdefault("OPTIONS", {})
        options["connect_timeout"] = max(1, math.ceil(timeout))
        # Pool settings (if any) must not hand this probe a pooled connection.
        options.pop("pool", None)
    if wrapper.vendor == "sqlite":
        return ""  # the request's own reads notice a missing or locked file
    probe = type(wrapper)(settings_dict, alias)
    try:
        with probe.cursor() as cursor:
            cursor.execute("SELECT 1")
            cursor.fetchone()
    except Exception as exc:  # any failure means "not reachable" to a probe
        logger.warning("Health probe of database %r failed: %s", alias, exc)
        return type(exc).__name__
    finally:
        try:
            probe.close()
        except Exception:  # pragma: no cover - closing a broken connection
            pass
    return ""


def _quiet(response: HttpResponse) -> HttpResponse:
    """Keep Django's request logger from logging an expected 503 at ERROR level on every
    probe (the views log a warning of their own, naming what failed)."""
    response._has_been_logged = True  # type: ignore[attr-defined]
    return response


def _queues(request: HttpRequest) -> list[str] | None:
    names = [q for q in request.GET.getlist("queue") if q.strip()]
    return names or None


@never_cache
@require_GET
def live(request: HttpRequest) -> HttpResponse:
    """200 ``{"status": "live"}``: the process serves requests (reads nothing)."""
    return JsonResponse({"status": "live"})


@never_cache
@require_GET
def ready(request: HttpRequest) -> HttpResponse:
    """200 when every check passes, else 503; the JSON body names the failing checks."""
    from django.utils import timezone

    timeout = db_timeout_seconds()
    try:
        error = probe_database(timeout_seconds=timeout)
        snap = (
            empty_snapshot(timezone.now(), error)
            if error
            else snapshot(statement_timeout_ms=int(timeout * 1000))
        )
        report = evaluate(snap, queues=_queues(request))
    except Exception:  # never a stack trace in a probe's answer
        logger.exception("Readiness check failed")
        return JsonResponse({"status": "unhealthy", "failing": ["error"], "checks": []}, status=503)
    body = report.to_dict(details=_authorized(request))
    if report.healthy:
        return JsonResponse(body)
    logger.warning("Not ready: %s", ", ".join(report.failing))
    return _quiet(JsonResponse(body, status=503))


@never_cache
@require_GET
def metrics(request: HttpRequest) -> HttpResponse:
    """The Prometheus text exposition (``text/plain; version=0.0.4``); the database is
    probed and read with the readiness view's bounds."""
    from django.utils import timezone

    from .prometheus import CONTENT_TYPE, render

    if workflow_settings.HEALTH_TOKEN and not _authorized(request):
        response = HttpResponse("unauthorized\n", status=401, content_type="text/plain")
        response["WWW-Authenticate"] = 'Bearer realm="workflows-metrics"'
        return response
    try:
        started = time.perf_counter()
        timeout = db_timeout_seconds()
        error = probe_database(timeout_seconds=timeout)
        snap = (
            empty_snapshot(timezone.now(), error)
            if error
            else snapshot(statement_timeout_ms=int(timeout * 1000))
        )
        text = render(snap, scrape_seconds=time.perf_counter() - started)
    except Exception:
        logger.exception("Rendering the metrics failed")
        return _quiet(
            HttpResponse("# metrics unavailable\n", status=503, content_type=CONTENT_TYPE)
        )
    # 200 even when the database is down: Prometheus drops the body of a non-2xx scrape, so
    # `workflows_up 0` would never be stored and an alert on it could never fire.
    return HttpResponse(text, content_type=CONTENT_TYPE)
