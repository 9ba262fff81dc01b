"""Settings of the example project.

The database is SQLite (``var/example.sqlite3``) unless ``DATABASE_URL`` names a PostgreSQL
database, e.g. ``postgres://postgres@127.0.0.1:5432/test``. The django-q2 broker is the ORM
unless ``Q_BROKER=redis`` (``REDIS_URL``); ``WORKFLOWS_QUEUES="gpu=gpu"`` routes stages of queue
``gpu`` to a cluster ``gpu`` (start it with ``Q_CLUSTER_NAME=gpu python manage.py qcluster``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from urllib.parse import unquote, urlparse

BASE_DIR = Path(__file__).resolve().parent.parent
VAR_DIR = Path(os.environ.get("EXAMPLE_VAR_DIR", BASE_DIR / "var"))
VAR_DIR.mkdir(parents=True, exist_ok=True)

SECRET_KEY = os.environ.get("DJANGO_SECRET_KEY", "example-project-not-secret")
DEBUG = os.environ.get("DJANGO_DEBUG", "1") == "1"
ALLOWED_HOSTS = ["*"]

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "rest_framework.authtoken",
    "drf_spectacular",
    "django_q",
    "django_workflows",
    "example_project.docpipeline",
]
# Test hook: comma-separated extra apps, e.g. the crash-test workflows of tests/acceptance
# (EXTRA_INSTALLED_APPS=tests.acceptance.crashapp). Empty by default.
INSTALLED_APPS += [app for app in os.environ.get("EXTRA_INSTALLED_APPS", "").split(",") if app]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    # The admin's pages must not be framed by another site (clickjacking).
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

ROOT_URLCONF = "example_project.urls"
TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ]
        },
    }
]


#: Bound every PostgreSQL session (docs/howto/several-hosts.md, "Bound every database
#: session"; system check django_workflows.W012). A host lost inside a transaction would
#: otherwise keep its row locks until PostgreSQL's TCP notices (minutes to hours):
#: - idle_in_transaction_session_timeout: the server ends such a session (and its locks);
#: - lock_timeout: no statement waits longer than this for a row lock (a backstop);
#: - server-side TCP keepalives: the server notices a dead client of an idle session;
#: - client keepalives and tcp_user_timeout (ms): a worker notices a dead server or link.
SESSION_BOUNDS = {
    "options": os.environ.get(
        "WORKFLOWS_PG_SESSION_OPTIONS",
        "-c idle_in_transaction_session_timeout=30s -c lock_timeout=60s"
        " -c tcp_keepalives_idle=10 -c tcp_keepalives_interval=5 -c tcp_keepalives_count=3",
    ),
    "keepalives": 1,
    "keepalives_idle": 10,
    "keepalives_interval": 5,
    "keepalives_count": 3,
    "tcp_user_timeout": 30000,
}


def _statement_options() -> dict:
    """How psycopg 3 sends statements (docs/howto/tuning-postgresql.md).

    By default the parameters are bound on the server and a statement executed 5 times on a
    connection is prepared there (psycopg's ``prepare_threshold``): PostgreSQL then skips
    parsing and planning it again, which cut its CPU per stage by ~40 % (bench/binding.py).
    ``WORKFLOWS_PG_SERVER_SIDE_BINDING=0`` restores Django's default (client-side binding,
    nothing prepared); ``WORKFLOWS_PG_PREPARE_THRESHOLD=none`` keeps server-side binding but
    prepares nothing (a pooler in transaction mode that does not track prepared statements,
    e.g. PgBouncer < 1.21 or without ``max_prepared_statements``).
    """
    if os.environ.get("WORKFLOWS_PG_SERVER_SIDE_BINDING", "1") != "1":
        return {}
    threshold = os.environ.get("WORKFLOWS_PG_PREPARE_THRESHOLD", "5").strip().lower()
    return {
        "server_side_binding": True,
        "prepare_threshold": None if threshold in ("", "none") else int(threshold),
    }


def _database() -> dict:
    url = os.environ.get("DATABASE_URL", "")
    if url.startswith(("postgres://", "postgresql://")):
        parts = urlparse(url)
        return {
            "ENGINE": "django.db.backends.postgresql",
            "NAME": unquote(parts.path.lstrip("/")) or "postgres",
            "USER": unquote(parts.username or "postgres"),
            "PASSWORD": unquote(parts.password or ""),
            "HOST": parts.hostname or "127.0.0.1",
            "PORT": str(parts.port or 5432),
            # One connection per worker process, reused across django-q2 tasks (ARCH §5).
            "CONN_MAX_AGE": 60,
            "OPTIONS": {**SESSION_BOUNDS, **_statement_options()},
            "TEST": {"NAME": os.environ.get("TEST_DATABASE_NAME", "test_django_workflows")},
        }
    if url and not url.startswith("sqlite"):
        raise RuntimeError(f"DATABASE_URL must be postgres://... or sqlite:///..., got {url!r}")
    path = url.removeprefix("sqlite:///") if url else str(VAR_DIR / "example.sqlite3")
    return {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": path,
        "CONN_MAX_AGE": 60,
        # IMMEDIATE takes the write lock at BEGIN: no lock-upgrade deadlocks between workers.
        "OPTIONS": {
            "transaction_mode": "IMMEDIATE",
            "timeout": 30,
            "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
        },
        "TEST": {"NAME": os.environ.get("TEST_SQLITE_NAME") or None},
    }


DATABASES = {"default": _database()}


def _is_pg() -> bool:
    return DATABASES["default"]["ENGINE"].endswith("postgresql")


#: Wake-ups as PostgreSQL NOTIFY on PostgreSQL (the engine's default, "auto");
#: WORKFLOWS_WAKE_WITH_NOTIFY=0 sends every wake-up as a django-q2 task instead.
_NOTIFY = os.environ.get("WORKFLOWS_WAKE_WITH_NOTIFY", "1") == "1"


DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

USE_TZ = True
TIME_ZONE = "UTC"
LANGUAGE_CODE = "en-us"
STATIC_URL = "static/"


def _queues() -> dict[str, str]:
    """Stage routing: ``WORKFLOWS_QUEUES="gpu=gpu,ocr=ocr"`` -> ``{"gpu": "gpu", ...}``."""
    queues = {}
    for pair in filter(None, os.environ.get("WORKFLOWS_QUEUES", "").split(",")):
        queue, sep, cluster = pair.partition("=")
        if not sep or not queue.strip() or not cluster.strip():
            raise RuntimeError(f"WORKFLOWS_QUEUES: expected queue=cluster pairs, got {pair!r}")
        queues[queue.strip()] = cluster.strip()
    return queues


def _broker() -> dict:
    """The django-q2 broker of wake-ups: the ORM (default) or, with ``Q_BROKER=redis``, Redis
    at ``REDIS_URL`` (default ``redis://127.0.0.1:6379/0``; needs the ``redis`` extra).
    """
    broker = os.environ.get("Q_BROKER", "orm")
    if broker == "orm":
        return {"orm": "default"}
    if broker == "redis":
        return {"redis": os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")}
    raise RuntimeError(f"Q_BROKER must be 'orm' or 'redis', got {broker!r}")


Q_CLUSTER = {
    "name": "workflows",
    **_broker(),
    "workers": int(os.environ.get("Q_WORKERS", "4")),
    # Longest stage we allow, in seconds; django-q2 kills a task past it (Q_TIMEOUT: tests).
    "timeout": int(os.environ.get("Q_TIMEOUT", "600")),
    # Must exceed timeout, or long tasks are delivered twice (ARCHITECTURE §5).
    "retry": int(os.environ.get("Q_RETRY", "660")),
    "max_attempts": 1,
    "save_limit": -1,
    "ack_failures": True,
    # How often the cluster's pusher polls the ORM broker (seconds): every wake-up waits for
    # it (0.2). With NOTIFY wake-ups on PostgreSQL (the default) they reach
    # lingering workers directly, so it bounds only a cold start and is the idle cluster's
    # main cost (one query per poll): 1.0 then.
    "poll": float(os.environ.get("Q_POLL", "1.0" if _NOTIFY and _is_pg() else "0.2")),
    "catch_up": False,
    "log_level": os.environ.get("Q_LOG_LEVEL", "WARNING"),
    # One named cluster per routed queue's cluster: start it with
    # Q_CLUSTER_NAME=<cluster> python manage.py qcluster (same settings otherwise).
    "ALT_CLUSTERS": {cluster: {} for cluster in sorted(set(_queues().values()))},
}

DJANGO_WORKFLOWS = {
    "TICK_INTERVAL_SECONDS": float(os.environ.get("WORKFLOWS_TICK_INTERVAL", "0.5")),
    "WAKE_WITH_NOTIFY": "auto" if _NOTIFY else False,
    "STALE_LEASE_SECONDS": int(os.environ.get("WORKFLOWS_STALE_LEASE_SECONDS", "300")),
    "HEARTBEAT_INTERVAL_SECONDS": float(os.environ.get("WORKFLOWS_HEARTBEAT_SECONDS", "30")),
    "SUPERVISOR_INTERVAL_SECONDS": float(os.environ.get("WORKFLOWS_SUPERVISOR_INTERVAL", "3")),
    "SUPERVISOR_TICKS": os.environ.get("WORKFLOWS_SUPERVISOR_TICKS", "1") == "1",
    "TICKER_LEASE_SECONDS": float(os.environ.get("WORKFLOWS_TICKER_LEASE_SECONDS", "10")),
    "STOP_GRACE_SECONDS": float(os.environ.get("WORKFLOWS_STOP_GRACE_SECONDS", "20")),
    "STAGE_TIMEOUT_GRACE_SECONDS": float(os.environ.get("WORKFLOWS_STAGE_TIMEOUT_GRACE", "5")),
    "DEFAULT_QUEUE_TIMEOUT_SECONDS": (
        float(os.environ["WORKFLOWS_DEFAULT_QUEUE_TIMEOUT"])
        if os.environ.get("WORKFLOWS_DEFAULT_QUEUE_TIMEOUT")
        else None
    ),
    "MAX_ATTEMPTS": int(os.environ.get("WORKFLOWS_MAX_ATTEMPTS", "3")),
    "STUCK_THRESHOLD_SECONDS": (
        float(os.environ["WORKFLOWS_STUCK_THRESHOLD"])
        if os.environ.get("WORKFLOWS_STUCK_THRESHOLD")
        else None
    ),
    "RETRY_BACKOFF_BASE_SECONDS": float(os.environ.get("WORKFLOWS_RETRY_BACKOFF_BASE", "2")),
    # Accepted but no longer used (the ticker runs in the supervisor threads); older tests
    # set it below Q_TIMEOUT.
    "TICKER_RUN_SECONDS": float(os.environ.get("WORKFLOWS_TICKER_RUN_SECONDS", "50")),
    # Test hook: dotted path of a clock factory (the acceptance tests' skewed clock).
    "CLOCK": os.environ.get("WORKFLOWS_CLOCK") or None,
    # Comma-separated dotted paths of plugins (the acceptance tests' event recorder).
    "PLUGINS": [p for p in os.environ.get("WORKFLOWS_PLUGINS", "").split(",") if p],
    # Stage routing: queue -> django-q2 cluster (WORKFLOWS_QUEUES="gpu=gpu").
    "QUEUES": _queues(),
    # Retention policy as JSON (docs/howto/retention.md), e.g.
    # WORKFLOWS_RETENTION='{"DEFAULT_DAYS": {"COMPLETED": 30}}'; unset: keep every run.
    "RETENTION": json.loads(os.environ["WORKFLOWS_RETENTION"])
    if os.environ.get("WORKFLOWS_RETENTION")
    else None,
    "RETENTION_BATCH_SIZE": int(os.environ.get("WORKFLOWS_RETENTION_BATCH_SIZE", "500")),
    "RETENTION_INTERVAL_SECONDS": float(os.environ.get("WORKFLOWS_RETENTION_INTERVAL", "3600")),
}

REST_FRAMEWORK = {
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAdminUser"],
    # The workflows API (api/workflows/) uses these unless DJANGO_WORKFLOWS names its own
    # API_AUTHENTICATION_CLASSES. Token first: an anonymous request gets 401 with a
    # "WWW-Authenticate: Token" challenge; the session (with CSRF) serves the browser.
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "rest_framework.authentication.TokenAuthentication",
        "rest_framework.authentication.SessionAuthentication",
    ],
}

DOCPIPELINE_REPORT_DIR = Path(os.environ.get("DOCPIPELINE_REPORT_DIR", VAR_DIR / "reports"))

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"console": {"class": "logging.StreamHandler"}},
    "loggers": {
        "django_workflows": {"handlers": ["console"], "level": "WARNING"},
    },
}
