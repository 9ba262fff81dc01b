"""docs/authoring.md runs as written: its ``python`` blocks, top to bottom, in one namespace,
with a transactional test database and the global workflow registry restored afterwards (the
executable-docs rules; this test stands in until the shared docs harness covers the page)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from django_workflows import registry

pytestmark = pytest.mark.django_db(transaction=True)

PAGE = Path(__file__).resolve().parents[2] / "docs" / "authoring.md"
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def test_every_python_block_of_the_authoring_page_runs() -> None:
    blocks = BLOCK.findall(PAGE.read_text(encoding="utf-8"))
    assert len(blocks) >= 8
    saved = dict(registry._workflows)
    namespace: dict[str, object] = {"__name__": "docs_authoring"}
    try:
        for number, source in enumerate(blocks, start=1):
            code = compile(source, f"{PAGE.name} block {number}", "exec")
            exec(code, namespace)
    finally:
        registry._workflows.clear()
        registry._workflows.update(saved)
