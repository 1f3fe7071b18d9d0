"""The package layering of DESIGN.md §4, checked on the source: production code never imports
loadtest/ (workloads, simulators, benchmark CLIs), router/ and replica/ never import each other,
and only the two top modules (and the ``serve`` CLI) import every package."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOP_MODULES = {"prefixmesh/app.py", "prefixmesh/cli.py", "prefixmesh/serve_cli.py"}
FORBIDDEN = {
    "router": ("prefixmesh.loadtest", "prefixmesh.replica"),
    "replica": ("prefixmesh.loadtest", "prefixmesh.router"),
    "cache_registry": ("prefixmesh.loadtest", "prefixmesh.router", "prefixmesh.replica"),
    "kernels": ("prefixmesh.loadtest", "prefixmesh.router", "prefixmesh.replica"),
    "prefixmesh": ("prefixmesh.loadtest",),
}
ALWAYS = ("prefixmesh.app", "prefixmesh.cli", "prefixmesh.serve_cli")


def imported_modules(path: Path) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
    return found


def under(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


@pytest.mark.parametrize("folder", sorted(FORBIDDEN))
def test_a_library_package_imports_only_what_sits_below_it(folder: str) -> None:
    wrong = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        name = path.relative_to(ROOT).as_posix()
        if name in TOP_MODULES:
            continue
        forbidden = FORBIDDEN[folder] + ALWAYS
        wrong += [f"{name}:{line} {m}" for line, m in imported_modules(path) if under(m, forbidden)]
    assert wrong == []
