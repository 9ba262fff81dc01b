#!/usr/bin/env python3
"""Measure the import circles of a package: strongly connected components of its module graph.

Usage: ``bin/import_cycles.py [PACKAGE_DIR] [--verbose]`` (default ``django_workflows``).

Builds the graph of intra-package imports with :mod:`ast` twice - top-level imports only
(module-level statements, including ``if``/``try`` blocks but not ``if TYPE_CHECKING:``), and
all imports including those inside functions - and prints, for each, the number of
strongly connected components with more than one module and their sizes (Tarjan's algorithm).
``--verbose`` lists the modules of each component. ``--coarse`` also counts ``from pkg import
sub`` as an edge to ``pkg`` (its ``__init__`` runs first; this lumps a package's modules with
its ``__init__``). Exit status 0 always (a measuring tool).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.Module, *, nested: bool) -> list[ast.Import | ast.ImportFrom]:
    found: list[ast.Import | ast.ImportFrom] = []

    def visit(body: list[ast.stmt], top: bool) -> None:
        for node in body:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                if top or nested:
                    found.append(node)
            elif isinstance(node, ast.If) and _is_type_checking(node):
                continue
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                if nested:
                    visit(node.body, False)
            elif isinstance(node, ast.ClassDef):
                visit(node.body, top)
            else:
                for field in ("body", "orelse", "finalbody", "handlers"):
                    sub = getattr(node, field, None)
                    if isinstance(sub, list):
                        visit(
                            [s for s in sub if isinstance(s, ast.stmt)]
                            + [s for h in sub if isinstance(h, ast.ExceptHandler) for s in h.body],
                            top,
                        )

    visit(tree.body, True)
    return found


def graph(root: Path, *, nested: bool, coarse: bool = False) -> dict[str, set[str]]:
    modules = {module_name(root, p): p for p in root.rglob("*.py")}
    edges: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in _imports(ast.parse(path.read_text()), nested=nested):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = package
                for _ in range(max(node.level - 1, 0)):
                    base = base.rpartition(".")[0]
                mod = node.module or ""
                full = (f"{base}.{mod}" if mod else base) if node.level else mod
                # ``from pkg import sub``: an edge to the submodule; ``from mod import name``:
                # an edge to the module.
                targets = [
                    f"{full}.{a.name}" if f"{full}.{a.name}" in modules else full
                    for a in node.names
                ]
                if coarse:  # the package's __init__ runs first: an edge to it as well
                    targets.append(full)
            for t in targets:
                while t and t not in modules:
                    t = t.rpartition(".")[0]
                if t and t != name:
                    edges[name].add(t)
    return edges


def components(edges: dict[str, set[str]]) -> list[list[str]]:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]
    sys.setrecursionlimit(10000)

    def strong(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            strong(v)
    return sorted(out, key=len, reverse=True)


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("-")]
    verbose = "--verbose" in sys.argv
    coarse = "--coarse" in sys.argv
    root = Path(args[0] if args else "django_workflows").resolve()
    for label, nested in (("top-level imports", False), ("all imports", True)):
        comps = components(graph(root, nested=nested, coarse=coarse))
        sizes = [len(c) for c in comps]
        print(f"{label}: {len(comps)} circles, sizes {sizes}, {sum(sizes)} modules")
        if verbose:
            for c in comps:
                print("   ", ", ".join(c))


if __name__ == "__main__":
    main()
