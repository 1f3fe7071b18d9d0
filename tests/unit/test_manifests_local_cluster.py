"""What `make deploy-check` (a real `ray up` of manifests/cluster/cluster-local.yaml on this
machine) found the local cluster needs, beyond tests/unit/test_manifests.py's checks: Ray on
loopback, and Ray's default temp dir kept for the machine's other accounts."""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]


def _cluster() -> dict[str, Any]:
    return yaml.safe_load((ROOT / "manifests" / "cluster" / "cluster-local.yaml").read_text())


def test_the_head_starts_ray_on_loopback_only() -> None:
    """Without it Ray registered the node on the machine's own address despite
    --node-ip-address=127.0.0.1."""
    start = next(c for c in _cluster()["head_start_ray_commands"] if "ray start --head" in c)
    ray_start = start.split(" && ", 1)[1]
    assert shlex.split(ray_start)[:3] == [
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0",
        "ray",
        "start",
    ]


def test_the_accounts_ray_commands_keep_out_of_tmp_ray() -> None:
    """Root's `ray up` makes the local provider's lock file in Ray's default temp dir, which
    refused the head's autoscaler; `ray stop` (ray down) removes the address file there. The
    account's ~/.bashrc, which Ray sources before every command, names its own."""
    exports = [
        m[1]
        for c in _cluster()["setup_commands"]
        for m in re.finditer(r"echo 'export RAY_TMPDIR=(\S+)' >> ~/\.bashrc", c)
    ]
    assert exports == ["/tmp/ray-pmh-local"]
