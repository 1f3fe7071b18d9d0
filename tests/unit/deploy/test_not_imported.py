"""deploy/ drives a deployment from the outside (``make deploy-check``): it is not installed with
the package, so nothing that is may import it."""

from __future__ import annotations

from pathlib import Path

from tests.unit.test_layering import imported_modules, under

ROOT = Path(__file__).resolve().parents[3]
INSTALLED = ("prefixmesh", "router", "replica", "cache_registry", "kernels", "loadtest")


def test_no_installed_package_imports_deploy() -> None:
    wrong = [
        f"{path.relative_to(ROOT)}:{line} {module}"
        for folder in INSTALLED
        for path in sorted((ROOT / folder).rglob("*.py"))
        for line, module in imported_modules(path)
        if under(module, ("deploy",))
    ]
    assert wrong == []
