"""WSGI entry point of the example project, for a real server (issue 17 §4)::

    DJANGO_SETTINGS_MODULE=example_project.settings_web \\
        gunicorn example_project.wsgi --workers 2 --threads 8 --bind 127.0.0.1:8000

``manage.py runserver`` is a development server: it starts a thread per request, and with
``CONN_MAX_AGE > 0`` each finished thread leaves its PostgreSQL connection open until
garbage collection - 50 concurrent clients exhaust ``max_connections``.
"""

from __future__ import annotations

import os

from django.core.wsgi import get_wsgi_application

from django_workflows.wsgi import guard

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "example_project.settings_web")

# guard: a NUL in Content-Type's charset is a 400, not a bare 500 from Django's request build.
application = guard(get_wsgi_application())
