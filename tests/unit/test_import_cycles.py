"""No import circles in the package (issue 17 section 1), measured by ``bin/import_cycles.py``.

The tool's analysis runs in-process on ``django_workflows`` with all four of its measures
(top-level imports or all imports including function-level ones; with or without ``--coarse``,
which counts a package's ``__init__`` as run by ``from pkg import sub``). Each is pinned at no
circle, so a change that closes a new one fails here. When it does: break the circle at its
closing import (move the shared piece into a leaf module, let the caller pass what the callee
would import, or invert the dependency); ``bin/import_cycles.py --verbose [--coarse]`` lists
the modules of each circle.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

import django_workflows

ROOT = Path(__file__).resolve().parents[2]
#: The imported package: the checkout, or the installed wheel (the Python 3.12 leg).
PACKAGE = Path(django_workflows.__file__).resolve().parent


def _tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location("import_cycles", ROOT / "bin/import_cycles.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


TOOL = _tool()


@pytest.mark.parametrize("coarse", [False, True], ids=["modules", "coarse"])
@pytest.mark.parametrize("nested", [False, True], ids=["top-level", "all-imports"])
def test_the_package_has_no_import_circle(nested: bool, coarse: bool) -> None:
    circles = TOOL.components(TOOL.graph(PACKAGE, nested=nested, coarse=coarse))
    assert circles == []


def _write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / "pkg"


def test_the_tool_finds_a_circle_closed_by_a_function_level_import(tmp_path: Path) -> None:
    """The pin above can fail: a circle closed inside a function counts under all imports;
    an ``if TYPE_CHECKING:`` import does not."""
    pkg = _write(
        tmp_path,
        {
            "pkg/__init__.py": "",
            # a -> c only for type checkers: no circle with c
            "pkg/a.py": (
                "import typing\nfrom . import b\nif typing.TYPE_CHECKING:\n    from . import c\n"
            ),
            "pkg/b.py": "def f():\n    from .a import x\n",
            "pkg/c.py": "from . import a\n",
        },
    )
    assert TOOL.components(TOOL.graph(pkg, nested=False)) == []
    assert TOOL.components(TOOL.graph(pkg, nested=True)) == [["pkg.a", "pkg.b"]]


def test_the_tool_counts_an_eager_package_initialiser_only_when_coarse(tmp_path: Path) -> None:
    """The kernel's old shape: ``__init__`` imports a module that does ``from . import sub``."""
    pkg = _write(
        tmp_path,
        {
            "pkg/__init__.py": "from .dispatch import Kernel\n",
            "pkg/dispatch.py": "from . import events\n",
            "pkg/events.py": "",
        },
    )
    assert TOOL.components(TOOL.graph(pkg, nested=True)) == []
    assert TOOL.components(TOOL.graph(pkg, nested=True, coarse=True)) == [["pkg", "pkg.dispatch"]]


# --- the kernel's lazy package initialiser ------------------------------------------------------

KERNEL_ALL = {
    "AnnotationSpec",
    "BackfillSchedule",
    "CancelRun",
    "ClaimPendingRuns",
    "CreateRun",
    "ExecuteJob",
    "FlushOutbox",
    "IdempotencyInProgressError",
    "IdempotencyKeyReusedError",
    "InvalidCommandError",
    "InvalidWorkflowConfigError",
    "InvalidWorkflowInputError",
    "Kernel",
    "OutboxEventNotFoundError",
    "OutboxEventStateError",
    "PauseSchedule",
    "PollSuspendedStages",
    "ReapStaleLeases",
    "ReapStuckRuns",
    "ReplayDeadLetters",
    "RerunFrom",
    "ResumeSchedule",
    "RunNotFoundError",
    "RunStateError",
    "ScheduleNotFoundError",
    "ScheduleOrphanedError",
    "SkipDeadLetter",
    "StageNotFoundError",
    "TransitionRun",
    "TriggerSchedule",
    "WorkflowError",
    "WorkflowNotFoundError",
}


def test_the_kernel_package_exports_its_names_lazily() -> None:
    import django_workflows.kernel as kernel
    from django_workflows.kernel import commands, dispatch, errors

    assert set(kernel.__all__) == KERNEL_ALL
    assert KERNEL_ALL <= set(dir(kernel))
    for name in KERNEL_ALL:
        source = {"Kernel": dispatch}.get(name) or (
            commands if hasattr(commands, name) and name not in vars(errors) else errors
        )
        assert getattr(kernel, name) is getattr(source, name), name
    with pytest.raises(AttributeError, match="has no attribute 'Nope'"):
        kernel.Nope  # noqa: B018


def test_importing_the_kernel_package_does_not_import_the_dispatcher() -> None:
    """``from . import events`` inside the kernel runs ``kernel/__init__``: it must stay light
    (no dispatcher, no handlers, no models), or the whole kernel is one import circle again."""
    code = (
        "import sys, django_workflows.kernel as k\n"
        "loaded = sorted(m for m in sys.modules if m.startswith('django_workflows.'))\n"
        "print(loaded)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"}
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=True
    ).stdout
    assert "django_workflows.kernel.dispatch" not in out
    assert "django_workflows.models" not in out
    assert "'django_workflows.kernel'" in out


def test_published_keys_are_registered_with_the_annotations_module() -> None:
    """AN-51: a convention's key string written as a plain string is still type-checked; the
    conventions register their keys (annotations does not import conventions)."""
    from django_workflows import annotations, conventions
    from django_workflows.annotations import TypedKey, publish_keys

    for _, _, typed in conventions.published_keys():
        assert annotations._published(typed.key) is typed
    assert annotations._published("acme.unknown") is None
    publish_keys([conventions.Trigger.source])  # the same key again: a no-op
    clash = TypedKey(conventions.Trigger.source.key, str)
    with pytest.raises(ValueError, match="registered already"):
        publish_keys([clash])
    assert annotations._published(conventions.Trigger.source.key) is conventions.Trigger.source
