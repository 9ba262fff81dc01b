"""Without ``opentelemetry`` importable (the ``otel`` extra not installed) the engine imports
none of it and still runs a workflow, log fields included (issue 20 items 3 and 6).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import sys

class NoOpenTelemetry:
    def find_spec(self, name, path=None, target=None):
        if name == "opentelemetry" or name.startswith("opentelemetry."):
            raise ImportError(f"No module named {name!r} (simulated: the extra is missing)")
        return None

sys.meta_path.insert(0, NoOpenTelemetry())

import django
from django.conf import settings

settings.configure(
    DEBUG=False,
    USE_TZ=True,
    INSTALLED_APPS=["django.contrib.contenttypes", "django.contrib.auth", "django_workflows"],
    DATABASES={"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"}},
    DJANGO_WORKFLOWS={
        "TRANSPORT": "django_workflows.transport.inline.NullTransport",
        "INSTALL_SCHEDULE": False,
        "WAKE_WITH_NOTIFY": False,
    },
)
django.setup()
from django.core.management import call_command

call_command("migrate", verbosity=0)

from django_workflows import define_workflow, telemetry
from django_workflows.kernel import CreateRun
from django_workflows.testing import make_kernel, run_to_completion
from tests.workflows import add

assert not telemetry.AVAILABLE and telemetry.tracer() is None
kernel = make_kernel(define_workflow(id="plain").pipe(add(1)).pipe(add(2)).build())
run_id = kernel.dispatch(CreateRun("plain", {"value": 1})).workflow_run_id
run = run_to_completion(kernel, run_id)
assert run.status == "COMPLETED" and run.output == {"value": 4}, (run.status, run.output)
assert run.trace_context is None
loaded = sorted(m for m in sys.modules if m.split(".")[0] == "opentelemetry")
assert not loaded, loaded
print("ran without opentelemetry")
"""


def test_engine_runs_a_workflow_without_opentelemetry() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("DJANGO_SETTINGS_MODULE", None)
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "ran without opentelemetry"
