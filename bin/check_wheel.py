"""Build the wheel and check what it ships: migrations and templates in, example project and
tests out. Exits non-zero naming what is wrong.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path


def main() -> int:
    with tempfile.TemporaryDirectory() as out:
        subprocess.run(
            [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", out, "."],
            check=True,
        )
        wheel = next(Path(out).glob("django_workflows-*.whl"))
        names = zipfile.ZipFile(wheel).namelist()
    problems = []
    if not any(n.startswith("django_workflows/migrations/0001_") for n in names):
        problems.append("migrations missing")
    if not any(n.startswith("django_workflows/templates/") for n in names):
        problems.append("templates missing")
    if "django_workflows/py.typed" not in names:
        problems.append("py.typed missing")
    for bad in ("example_project/", "tests/", "bench/"):
        if any(n.startswith(bad) for n in names):
            problems.append(f"{bad} must not be in the wheel")
    if problems:
        print(f"{wheel.name}: " + "; ".join(problems), file=sys.stderr)
        return 1
    print(f"{wheel.name}: {len(names)} files, migrations and templates included")
    return 0


if __name__ == "__main__":
    sys.exit(main())
