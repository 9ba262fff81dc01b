"""A WSGI wrapper for the process that serves the HTTP API (issue 17 §4).

Django builds its request object before any middleware runs, and a ``Content-Type`` whose
``charset`` holds a NUL byte makes that constructor raise ``ValueError`` (``codecs.lookup``
refuses embedded NULs), so the server answers a bare 500 that no view or exception handler of
ours can shape. :func:`guard` answers such a request ``400`` in the API's error shape before
Django sees it::

    # wsgi.py
    from django.core.wsgi import get_wsgi_application
    from django_workflows.wsgi import guard

    application = guard(get_wsgi_application())
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from typing import Any

WSGIApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]

#: The headers whose value Django parses while building the request (before middleware).
_PARSED_HEADERS = ("CONTENT_TYPE",)


def _malformed(environ: dict[str, Any]) -> str | None:
    """The name of the first header Django would choke on, or ``None``."""
    for key in _PARSED_HEADERS:
        value = environ.get(key, "")
        if isinstance(value, str) and any(ord(ch) < 32 or ord(ch) == 127 for ch in value):
            return key.replace("_", "-").title()
    return None


def guard(application: WSGIApp) -> WSGIApp:
    """Wrap a WSGI ``application``: a request whose ``Content-Type`` holds a control character
    (NUL included) gets ``400`` with ``{"code": "malformed_header", "message": ..., "errors":
    {"Content-Type": [...]}}`` and never reaches Django; every other request passes unchanged.

    Args:
        application: the WSGI callable (``get_wsgi_application()``).

    Returns:
        A WSGI callable of the same signature.
    """

    def guarded(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        header = _malformed(environ)
        if header is None:
            return application(environ, start_response)
        message = f"the {header} header holds a control character"
        body = json.dumps(
            {"code": "malformed_header", "message": message, "errors": {header: [message]}}
        ).encode()
        start_response(
            "400 Bad Request",
            [("Content-Type", "application/json"), ("Content-Length", str(len(body)))],
        )
        return [body]

    return guarded
