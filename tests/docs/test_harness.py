"""The docs harness itself: it refuses fences that would hide code, and finds blocks at the
right lines."""

from __future__ import annotations

from pathlib import Path

import pytest

from . import blocks as mdblocks


def _page(tmp_path: Path, text: str) -> list[mdblocks.Block]:
    page = tmp_path / "page.md"
    page.write_text(text, encoding="utf-8")
    return mdblocks.blocks(page)


def _problems(tmp_path: Path, text: str, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    monkeypatch.setattr(mdblocks, "ROOT", tmp_path)
    return [p for b in _page(tmp_path, text) for p in mdblocks.fence_problems(b)]


def test_blocks_carry_kind_and_first_code_line(tmp_path: Path) -> None:
    found = _page(tmp_path, "# t\n\n```python\nx = 1\n```\n\n````python settings\nY = 2\n````\n")
    assert [(b.kind, b.line, b.code) for b in found] == [
        ("python", 4, "x = 1\n"),
        ("python settings", 8, "Y = 2\n"),
    ]


def test_an_unclosed_fence_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="never closed"):
        _page(tmp_path, "```python\nx = 1\n")


@pytest.mark.parametrize(
    ("text", "complaint"),
    [
        ("```\nprint('hidden')\n```\n", "unlabelled fence"),
        ("```py\nprint('hidden')\n```\n", "```py is not allowed"),
        ("```json\n{not json}\n```\n", "json block does not parse"),
        ("```bash\ncurl http://example.invalid\n```\n", "only for the repository's own scripts"),
        ("```console\n$ pip install x\n```\n", "must be '$ python manage.py ...'"),
    ],
)
def test_fences_that_would_hide_code_are_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, text: str, complaint: str
) -> None:
    problems = _problems(tmp_path, text, monkeypatch)
    assert len(problems) == 1 and complaint in problems[0], problems
    assert "page.md:2" in problems[0]


@pytest.mark.parametrize(
    "text",
    [
        "```text\nanything\n```\n",
        "```mermaid\ngraph TD; a-->b\n```\n",
        '```json\n{"ok": true}\n```\n',
        "```bash\nbash bin/test -k cancel\nDATABASE_URL=x bash bin/demo \\\n  --input '{}'\n```\n",
        "```console\n$ python manage.py workflows_list\nshown output\n```\n",
    ],
)
def test_allowed_fences_pass(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, text: str) -> None:
    assert _problems(tmp_path, text, monkeypatch) == []
