"""Start a Ray instance of our own on 127.0.0.1 (DESIGN.md §7: nothing listens beyond loopback).

One place for the settings every local start needs: the node address pinned to loopback, no
dashboard, no usage reporting, the driver's logs kept out of the caller's output, and the
variable Ray on this platform needs in the workers too.
"""

from __future__ import annotations

import os
from typing import Any

_WORKER_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


def init_local_ray(temp_dir: str | None = None, num_cpus: int | None = None) -> Any:
    """``ray.init`` for a fresh single-node Ray bound to 127.0.0.1; returns its context."""
    os.environ.update(_WORKER_ENV)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray

    return ray.init(
        include_dashboard=False,
        num_cpus=num_cpus,
        _node_ip_address="127.0.0.1",
        _temp_dir=temp_dir,
        log_to_driver=False,
        runtime_env={"env_vars": dict(_WORKER_ENV)},
    )
