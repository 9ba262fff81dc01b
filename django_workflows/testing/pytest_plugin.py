"""The django-workflows pytest plugin (registered through the ``pytest11`` entry point
``django_workflows``): fixtures for testing workflows.

* ``fake_clock`` - a :class:`~django_workflows.testing.FakeClock` at the current time (whole
  seconds), shared by the other two fixtures of the test.
* ``workflows_kernel`` - a factory ``workflows_kernel(*workflows, **kernel_options) -> Kernel``:
  :func:`~django_workflows.testing.make_kernel` bound to ``fake_clock`` (a private registry
  holding ``workflows``, no transport, a collecting event sink).
* ``run_workflow`` - :func:`~django_workflows.testing.run_workflow` bound to ``fake_clock``:
  ``run_workflow(workflow, input, config=None, *, overrides=..., advance_seconds=...)``
  returns a :class:`~django_workflows.testing.WorkflowResult`.

Importing this module needs no configured Django and no database; the fixtures touch the
database only when a test calls them, so the test needs ``@pytest.mark.django_db`` (plain or
``transaction=True``). A project's own fixtures of the same names win over these.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import pytest

from .clock import FakeClock

if TYPE_CHECKING:
    from ..definition.workflow import Workflow
    from ..kernel.dispatch import Kernel
    from .kit import WorkflowResult


@pytest.fixture
def fake_clock() -> FakeClock:
    """A fake clock at the current time (microseconds cut), moved only by the test (or by
    ``run_workflow`` jumping to the next retry or poll)."""
    return FakeClock(datetime.now(UTC).replace(microsecond=0))


@pytest.fixture
def workflows_kernel(fake_clock: FakeClock) -> Callable[..., Kernel]:
    """``workflows_kernel(*workflows, **kernel_options)`` -> a test kernel on ``fake_clock``."""

    def build(*workflows: Workflow, **options: Any) -> Kernel:
        from .kit import make_kernel

        options.setdefault("clock", fake_clock)
        return make_kernel(*workflows, **options)

    return build


@pytest.fixture
def run_workflow(fake_clock: FakeClock) -> Callable[..., WorkflowResult]:
    """``run_workflow(workflow, input, config=None, *, overrides=None, advance_seconds=None,
    kernel=None, ...)`` -> :class:`~django_workflows.testing.WorkflowResult`, on ``fake_clock``
    (see :func:`django_workflows.testing.run_workflow`)."""

    def run(workflow: Workflow, input: Any = None, config: Any = None, **options: Any) -> Any:
        from .kit import run_workflow as run_workflow_

        if options.get("kernel") is None:
            options.setdefault("clock", fake_clock)
        return run_workflow_(workflow, input, config, **options)

    return run
