"""The package layering of docs/design.md §4, checked on the source: production code never imports
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


def package_folders() -> dict[str, str]:
    """setup.py's mapping of import packages onto folders (``prefixmesh.router`` -> ``router``),
    read from its source: the folder a reader opens is not the name they import."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "FOLDERS" for t in node.targets
        ):
            mapping = ast.literal_eval(node.value)
            assert isinstance(mapping, dict)
            return {str(k): str(v) for k, v in mapping.items()}
    raise AssertionError("setup.py has no FOLDERS mapping")


def package_of(module: str) -> str | None:
    """The graph's node for a module: ``prefixmesh.<first part>`` (a subpackage such as
    ``prefixmesh.api``, a mapped folder such as ``prefixmesh.router``, or a top module such as
    ``prefixmesh.config``); None outside prefixmesh."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "prefixmesh" and len(parts) > 1 else None


def imported_names(path: Path) -> list[str]:
    """Every module a file imports, deferred and type-checking imports included (a cycle
    through a function-level import is still a cycle); ``from prefixmesh import x`` names
    ``prefixmesh.x``."""
    names = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "prefixmesh":
                names += [f"prefixmesh.{alias.name}" for alias in node.names]
            else:
                names.append(node.module)
    return names


def package_graph() -> dict[str, set[str]]:
    """Package -> the packages its modules import (self-imports left out)."""
    graph: dict[str, set[str]] = {}
    for package, folder in package_folders().items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            source = package_of(".".join([package, *parts]).removesuffix(".__init__"))
            if source is None:
                continue
            targets = {package_of(name) for name in imported_names(path)}
            graph.setdefault(source, set()).update(t for t in targets if t and t != source)
    return graph


def cycle_in(graph: dict[str, set[str]]) -> list[str]:
    """One cycle of ``graph`` as its nodes, first repeated last ([] when acyclic)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return []

    for start in sorted(graph):
        if start not in state and (found := visit(start)):
            return found
    return []


def test_cycle_in_finds_a_loop_and_only_a_loop() -> None:
    assert cycle_in({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert cycle_in({"a": {"b", "c"}, "b": {"c"}, "c": set()}) == []


def test_the_package_graph_is_read_through_setup_py_mapping() -> None:
    graph = package_graph()
    assert "prefixmesh.router" in graph["prefixmesh.app"]  # router/ is prefixmesh.router
    assert "prefixmesh.cache_registry" in graph["prefixmesh.router"]


def test_no_import_loop_between_packages() -> None:
    """prefixmesh.api, prefixmesh.wire, prefixmesh.cache_registry, prefixmesh.router, ...:
    each package imports only packages that do not import it back, directly or around a loop
    (777570c had prefixmesh.wire <-> prefixmesh.cache_registry through the quota code)."""
    assert cycle_in(package_graph()) == []
