"""Settings of the example project's web process (the admin and the HTTP API).

The same as :mod:`example_project.settings` (which the django-q2 workers use, with
``CONN_MAX_AGE = 60``: one connection per worker process, reused across tasks) except for the
database connection's lifetime: a web request closes its connection when it ends
(``CONN_MAX_AGE = 0``), so no connection outlives its request whatever the server's threads
do; ``CONN_HEALTH_CHECKS`` is on for those who raise ``WEB_CONN_MAX_AGE`` (seconds) to keep
connections across requests - do that only under a server with a fixed thread pool (gunicorn's
``--threads``), never under ``runserver``. Serve with a real WSGI server::

    DJANGO_SETTINGS_MODULE=example_project.settings_web \\
        gunicorn example_project.wsgi --workers 2 --threads 8 --bind 127.0.0.1:8000

At most ``workers * threads`` connections are open then (plus the long polls of
``events/?wait=``, one per waiting request while it waits).
"""

from __future__ import annotations

import os

from .settings import *  # noqa: F403
from .settings import DATABASES

DATABASES["default"]["CONN_MAX_AGE"] = int(os.environ.get("WEB_CONN_MAX_AGE", "0"))
DATABASES["default"]["CONN_HEALTH_CHECKS"] = True
