"""A test kit for projects that use django-workflows (and for our own tests).

* :class:`FakeClock` - an exact, advanceable clock for the kernel.
* :func:`run_workflow` - create a run, drive it in-process to its end, return a
  :class:`WorkflowResult` (status, output, error, stage outputs, annotations, events, logs).
* :func:`override_stage` / ``run_workflow(..., overrides=...)`` - replace a stage's body in a
  test (mock an external call) without touching the definition.
* :func:`make_kernel` - a kernel with a fake clock, a private registry and no transport.
* :func:`run_to_completion` - drive an existing run through claims, jobs and polls;
  :func:`drive` - a few rounds only (act on a run halfway: approve, cancel).
* :func:`collect_result` - the :class:`WorkflowResult` of any run.
* the pytest plugin :mod:`django_workflows.testing.pytest_plugin` (fixtures ``fake_clock``,
  ``workflows_kernel``, ``run_workflow``), registered through the ``pytest11`` entry point.

Everything works under a plain ``@pytest.mark.django_db`` (inside the test's transaction) and
with ``transaction=True``. Importing this package needs no configured Django: the names other
than :class:`FakeClock` are loaded on first use.
"""

from __future__ import annotations

from typing import Any

from .clock import FakeClock

_LAZY = {
    "CollectingSink",
    "OverridingExecutor",
    "RecordingTransport",
    "TEST_WORKER_ID",
    "WorkflowResult",
    "collect_result",
    "drive",
    "make_kernel",
    "override_stage",
    "run_to_completion",
    "run_workflow",
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'django_workflows.testing' has no attribute {name!r}")
    from . import kit

    return getattr(kit, name)


__all__ = ["FakeClock", *sorted(_LAZY)]
