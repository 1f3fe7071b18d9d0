"""Maps the top-level folders onto the ``prefixmesh`` namespace (docs/design.md §4).

``router/`` installs as ``prefixmesh.router``, ``replica/`` as ``prefixmesh.replica``, and so on,
so no bare top-level module named ``router`` or ``kernels`` can collide with other distributions.
Editable and wheel installs both go through this mapping.
"""

from __future__ import annotations

from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).parent
FOLDERS = {
    "prefixmesh": "prefixmesh",
    "prefixmesh.router": "router",
    "prefixmesh.replica": "replica",
    "prefixmesh.cache_registry": "cache_registry",
    "prefixmesh.kernels": "kernels",
    "prefixmesh.loadtest": "loadtest",
}


def _packages() -> list[str]:
    names: list[str] = []
    for package, folder in FOLDERS.items():
        for init in sorted((ROOT / folder).rglob("__init__.py")):
            relative = init.parent.relative_to(ROOT / folder)
            names.append(".".join([package, *relative.parts]))
    return names


setup(
    packages=_packages(),
    package_dir=FOLDERS,
)
