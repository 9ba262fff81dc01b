"""HTTP liveness, readiness and Prometheus metrics (issue 20 items 2 and 4).

Mount them with ``path("workflows/health/", include("django_workflows.health.urls"))``:

* ``live/`` - 200 ``{"status": "live"}`` while the process serves requests; reads nothing
  (no database), so a database outage never restarts the pods.
* ``ready/`` - the checks of :mod:`.checks`: 200 healthy, 503 unhealthy with
  ``{"status": "unhealthy", "failing": [...], "checks": [{"name", "ok"}, ...]}``. The
  database is first probed on a separate connection with a short ``connect_timeout``, and the
  probe's ``SELECT 1`` and every read run under a ``statement_timeout`` (each at most
  ``HEALTH_DB_TIMEOUT_SECONDS``, all together at most ``HEALTH_TIMEOUT_SECONDS``; set with
  ``SET LOCAL`` semantics inside a transaction, so nothing leaks into a pooled session), so a
  database that is down or hung answers 503 within about ``HEALTH_TIMEOUT_SECONDS``; a
  timeout adds ``"reason": "timeout"`` to the body. Never a stack trace. With the
  ``HEALTH_TOKEN`` bearer token (or a staff user's session) each check also has its
  ``value``, ``threshold`` and ``detail``; anonymous callers learn only names and ``ok``.
* ``metrics/`` - the Prometheus text exposition (:mod:`.prometheus`); needs the
  ``HEALTH_TOKEN`` bearer token when that setting is set (401 otherwise; a staff user's
  session also passes), else open. When the database is down or does not answer within
  the readiness view's bounds: 200 with ``workflows_up 0`` (and ``workflows_scrape_timed_out
  1`` for a timeout).

Query parameters of ``ready/``: ``queue`` (repeatable) replaces the queues that need a live
worker (``?queue=default``: a web pod that only needs its own queue's workers).
"""

from __future__ import annotations

import copy
import hmac
import logging
import math
import time

from django.db import DEFAULT_DB_ALIAS, DatabaseError, connections
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_GET

from ..conf import workflow_settings
from .checks import evaluate
from .state import (
    TIMEOUT_ERROR,
    StateSnapshot,
    db_timeout_seconds,
    empty_snapshot,
    health_timeout_seconds,
    is_timeout,
    snapshot,
)

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


#: The probe's statement (a test makes it slow).
PROBE_SQL = "SELECT 1"


def probe_database(alias: str = DEFAULT_DB_ALIAS, timeout_seconds: float | None = None) -> str:
    """Open a fresh connection to ``alias`` with a short connect timeout (PostgreSQL) and run
    ``SELECT 1`` in a transaction under ``SET LOCAL statement_timeout`` (both
    ``timeout_seconds``, default ``HEALTH_DB_TIMEOUT_SECONDS``); returns ``""`` when it
    answered, :data:`~.state.TIMEOUT_ERROR` when the statement was cancelled by that
    timeout, else the exception's class name. The connection is closed; the request's own
    connection is not touched."""
    timeout = timeout_seconds if timeout_seconds is not None else db_timeout_seconds()
    wrapper = connections[alias]
    settings_dict = copy.deepcopy(wrapper.settings_dict)
    if wrapper.vendor == "postgresql":
        options = settings_dict.setdefault("OPTIONS", {})
        # libpq counts whole seconds and treats anything under 2 as 2, so a budget under
        # 2 s can be overrun by a connect that hangs (documented with the setting).
        options["connect_timeout"] = max(2, math.ceil(timeout))
        # Pool settings (if any) must not hand this probe a pooled connection.
        options.pop("pool", None)
    if wrapper.vendor == "sqlite":
        return ""  # the request's own reads notice a missing or locked file
    probe = type(wrapper)(settings_dict, alias)
    try:
        with probe.cursor() as cursor:
            # A transaction-local bound: behind PgBouncer in transaction mode a session SET
            # would stay on the server connection for whoever gets it next.
            cursor.execute("BEGIN")
            cursor.execute(
                "SELECT set_config('statement_timeout', %s, true)",
                [str(max(1, math.ceil(timeout * 1000)))],
            )
            cursor.execute(PROBE_SQL)
            cursor.fetchone()
            cursor.execute("COMMIT")
    except Exception as exc:  # any failure means "not reachable" to a probe
        logger.warning("Health probe of database %r failed: %s", alias, exc)
        if isinstance(exc, DatabaseError) and is_timeout(exc):
            return TIMEOUT_ERROR
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


def bounded_snapshot(alias: str = DEFAULT_DB_ALIAS) -> StateSnapshot:
    """Probe the database (:func:`probe_database`), then read a :func:`~.state.snapshot`,
    all within ``HEALTH_TIMEOUT_SECONDS`` (the probe's connect and ``SELECT 1`` and each read
    also within ``HEALTH_DB_TIMEOUT_SECONDS``). A spent budget gives a snapshot with
    ``timed_out``; never raises for a database error."""
    from django.utils import timezone

    budget = health_timeout_seconds()
    deadline = time.monotonic() + budget
    error = probe_database(alias, timeout_seconds=min(db_timeout_seconds(), budget))
    left = deadline - time.monotonic()
    if error == TIMEOUT_ERROR or (not error and left <= 0):
        return empty_snapshot(timezone.now(), TIMEOUT_ERROR, timed_out=True, timeout_seconds=budget)
    if error:
        return empty_snapshot(timezone.now(), error)
    snap = snapshot(statement_timeout_ms=int(db_timeout_seconds() * 1000), timeout_seconds=left)
    if snap.timed_out:  # name the whole budget, not what was left of it after the probe
        return empty_snapshot(snap.taken_at, TIMEOUT_ERROR, timed_out=True, timeout_seconds=budget)
    return snap


@never_cache
@require_GET
def ready(request: HttpRequest) -> HttpResponse:
    """200 when every check passes, else 503; the JSON body names the failing checks (and
    says ``"reason": "timeout"`` when the database did not answer within
    ``HEALTH_TIMEOUT_SECONDS``)."""
    try:
        snap = bounded_snapshot()
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
    from .prometheus import CONTENT_TYPE, render

    if workflow_settings.HEALTH_TOKEN and not _authorized(request):
        response = HttpResponse("unauthorized\n", status=401, content_type="text/plain")
        response["WWW-Authenticate"] = 'Bearer realm="workflows-metrics"'
        return response
    try:
        started = time.perf_counter()
        snap = bounded_snapshot()
        text = render(snap, scrape_seconds=time.perf_counter() - started)
    except Exception:
        logger.exception("Rendering the metrics failed")
        return _quiet(
            HttpResponse("# metrics unavailable\n", status=503, content_type=CONTENT_TYPE)
        )
    # 200 even when the database is down: Prometheus drops the body of a non-2xx scrape, so
    # `workflows_up 0` would never be stored and an alert on it could never fire.
    return HttpResponse(text, content_type=CONTENT_TYPE)
