"""The reference pages name everything they must (issue 11 item 5): every DJANGO_WORKFLOWS
setting, management command, event type and public exception - and every public exception of
the package is importable from ``django_workflows``.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import re
from pathlib import Path

import django_workflows

from .blocks import ROOT

REFERENCE = ROOT / "docs" / "reference"


def _documented_names(page: str) -> set[str]:
    """The names of the page's ``### `NAME` `` headings and of the first column of its tables."""
    text = (REFERENCE / page).read_text(encoding="utf-8")
    names = set(re.findall(r"^#{2,4} `([^`]+)`", text, re.M))
    names |= set(re.findall(r"^\| `([^`]+)`", text, re.M))
    return names


def test_every_setting_is_documented_and_nothing_else() -> None:
    from django_workflows.conf import DEFAULTS

    documented = _documented_names("settings.md")
    assert sorted(set(DEFAULTS) - documented) == [], "settings missing in settings.md"
    assert sorted(documented - set(DEFAULTS)) == [], "settings.md names unknown settings"


def _commands() -> set[str]:
    folder = Path(django_workflows.__file__).parent / "management" / "commands"
    return {p.stem for p in folder.glob("*.py") if not p.stem.startswith("_")}


def test_every_management_command_is_documented() -> None:
    documented = _documented_names("commands.md")
    assert sorted(_commands() - documented) == [], "commands missing in commands.md"
    assert sorted(documented - _commands()) == [], "commands.md names unknown commands"


def test_every_event_type_is_documented() -> None:
    from django_workflows.kernel import events

    types = {
        value
        for name, value in vars(events).items()
        if name.isupper() and isinstance(value, str) and re.fullmatch(r"[a-z]+:[a-z_]+", value)
    }
    assert types, "no event type constants found in django_workflows.kernel.events"
    documented = _documented_names("events.md")
    assert sorted(types - documented) == [], "event types missing in events.md"


def _public_exceptions() -> dict[str, type[BaseException]]:
    """Every exception class defined in a public module of the package (not under ``api``:
    those are DRF responses) whose name has no leading underscore."""
    found: dict[str, type[BaseException]] = {}
    for info in pkgutil.walk_packages(django_workflows.__path__, "django_workflows."):
        parts = info.name.split(".")
        if any(p.startswith("_") for p in parts[1:]) or parts[1] in ("api", "migrations"):
            continue
        module = importlib.import_module(info.name)
        for name, obj in vars(module).items():
            if (
                inspect.isclass(obj)
                and issubclass(obj, BaseException)
                and obj.__module__ == module.__name__
                and not name.startswith("_")
            ):
                found[name] = obj
    return found


def test_every_public_exception_is_importable_from_the_package_root() -> None:
    exceptions = _public_exceptions()
    assert {"InvalidWorkflowInputError", "WorkflowNotFoundError"} <= set(exceptions)
    missing = sorted(
        n for n, cls in exceptions.items() if getattr(django_workflows, n, None) is not cls
    )
    assert missing == [], "not importable from django_workflows (add them to _LAZY)"
    assert sorted(set(exceptions) - set(django_workflows.__all__)) == []


def test_every_exported_exception_is_documented() -> None:
    exported = {
        name
        for name in django_workflows.__all__
        if inspect.isclass(obj := getattr(django_workflows, name))
        and issubclass(obj, BaseException)
    }
    documented = _documented_names("errors.md")
    assert sorted(exported - documented) == [], "exceptions missing in errors.md"
    assert sorted(documented - exported) == [], "errors.md names exceptions that are not exported"
