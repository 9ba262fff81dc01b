"""Fenced code blocks of the project's Markdown pages, and the rules for each kind of fence.

Kinds (the fence's info string):

- ``python``: run, top to bottom, in one namespace per page (see ``test_docs.py``);
- ``python settings``: a settings fragment, run against a copy of ``example_project.settings``;
- ``console``: every ``$ python manage.py CMD ARGS`` line is run through ``call_command`` and
  must succeed; ``$NAME`` / ``${NAME}`` take the value of ``NAME`` in the page's namespace;
  the other lines are shown output (not compared); a ``$`` line of another command is an error;
- ``text``, ``mermaid``: shown, not run; ``json``: must parse; ``bash``: only the
  repository's own scripts (``bash bin/...``, ``.venv/bin/...``), shown, not run.

Any other fence, or one without a label, is an error: nobody can hide code from the harness.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

EXECUTED = ("python", "python settings", "console")
SHOWN = ("text", "bash", "mermaid", "json")
KINDS = EXECUTED + SHOWN

_FENCE = re.compile(r"^(?P<indent> {0,3})(?P<fence>`{3,}|~{3,})(?P<info>.*)$")
# A bash line may set environment variables, then must call one of the repository's scripts.
_BASH_LINE = re.compile(r"^(?:[A-Z_][A-Z0-9_]*=\S*\s+)*(?:bash bin/|\.venv/bin/)")


@dataclass(frozen=True)
class Block:
    """One fenced block: ``kind`` is its info string, ``line`` the 1-based line of the code's
    first line (the line after the opening fence), ``code`` its text."""

    path: Path
    kind: str
    line: int
    code: str

    @property
    def where(self) -> str:
        return f"{_rel(self.path)}:{self.line}"


def _rel(path: Path) -> Path:
    """``path`` relative to the repository (as it is when outside it)."""
    return path.relative_to(ROOT) if path.is_relative_to(ROOT) else path


def pages() -> list[Path]:
    """README.md and every Markdown page under docs/, in a stable order."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def blocks(path: Path) -> list[Block]:
    """The fenced blocks of ``path`` in order.

    Raises:
        ValueError: a fence is not closed.
    """
    lines = path.read_text(encoding="utf-8").splitlines()
    found: list[Block] = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, info, opened = m["fence"], m["info"].strip(), i + 1
        body: list[str] = []
        i += 1
        while i < len(lines) and not (
            lines[i].strip().startswith(fence[0] * len(fence))
            and lines[i].strip().strip(fence[0]) == ""
        ):
            body.append(lines[i])
            i += 1
        if i >= len(lines):
            raise ValueError(f"{_rel(path)}:{opened}: fence is never closed")
        found.append(Block(path, " ".join(info.split()), opened + 1, "\n".join(body) + "\n"))
        i += 1
    return found


def fence_problems(block: Block) -> list[str]:
    """What is wrong with a block's fence or, for shown kinds, its content (empty: nothing)."""
    import json

    if block.kind not in KINDS:
        label = f"```{block.kind}" if block.kind else "an unlabelled fence"
        return [
            f"{block.where}: {label} is not allowed; use one of "
            + ", ".join(f"```{k}" for k in KINDS)
        ]
    problems = []
    if block.kind == "json":
        try:
            json.loads(block.code)
        except ValueError as exc:
            problems.append(f"{block.where}: json block does not parse: {exc}")
    elif block.kind == "bash":
        for n, text in enumerate(block.code.splitlines()):
            stripped = text.strip()
            if not stripped or stripped.startswith("#") or _continued(block.code, n):
                continue
            if not _BASH_LINE.match(stripped):
                problems.append(
                    f"{block.where}+{n}: bash blocks are only for the repository's own scripts "
                    f"(bash bin/..., .venv/bin/...); got {stripped!r}: use ```console with "
                    "'$ python manage.py ...' (run by the tests) or ```text"
                )
    elif block.kind == "console":
        for n, text in enumerate(block.code.splitlines()):
            if text.startswith("$ ") and console_command(text) is None:
                problems.append(
                    f"{block.where}+{n}: console lines starting with '$ ' must be "
                    f"'$ python manage.py ...' (they are run); got {text!r}: use ```text"
                )
    return problems


def _continued(code: str, n: int) -> bool:
    """Whether line ``n`` continues the previous line (which ends with a backslash)."""
    previous = code.splitlines()[n - 1] if n else ""
    return previous.rstrip().endswith("\\")


def console_command(line: str) -> str | None:
    """The ``CMD ARGS`` of a ``$ python manage.py CMD ARGS`` line (None for another line)."""
    m = re.match(r"^\$ python manage\.py\s+(.+)$", line)
    return m[1] if m else None
