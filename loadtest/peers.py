"""The routers prefixmesh is compared with, run as their own processes on 127.0.0.1.

sglang-router and vllm-router are installed from PyPI, pinned, into a virtualenv of their own
under the cache folder (never into the project's environment, never in CI), the first time a
comparison needs them. They run with ``HF_ENDPOINT=http://127.0.0.1:9`` and offline hub flags, so
a tokenizer lookup for a model path cannot leave the machine, and with every listener
(``--host``, ``--prometheus-host``) on 127.0.0.1. Each gets its best setup that is still honest
(``research/feasibility-peers.md``): its ``cache_aware`` policy with its shipped defaults, workers
that serve what it asks for (sglang's ``/get_server_info`` and friends; vLLM's
``/v1/completions/render`` and ``/tokenize``, without which vllm-router silently loses affinity),
and a fresh connection per client request (sglang-router holds the first event of a stream
~40 ms on a reused connection; every router gets the same client).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
import venv
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

PINS = {"sglang-router": "0.3.2", "vllm-router": "0.1.17"}
OFFLINE_ENV = {
    "HF_ENDPOINT": "http://127.0.0.1:9",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "DO_NOT_TRACK": "1",
}


@dataclass(frozen=True)
class PeerEnv:
    python: Path
    versions: dict[str, str]


def ensure_peer_env(folder: Path, timeout_s: float = 900.0) -> PeerEnv:
    """A virtualenv with the pinned peers (created and installed on first use)."""
    folder = folder.expanduser()
    python = folder / "bin" / "python"
    marker = folder / (".installed-" + "-".join(f"{k}={v}" for k, v in sorted(PINS.items())))
    if not marker.exists():
        folder.mkdir(parents=True, exist_ok=True)
        if not python.exists():
            venv.EnvBuilder(with_pip=True, clear=False).create(folder)
        specs = [f"{name}=={version}" for name, version in PINS.items()]
        subprocess.run(
            [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", *specs],
            check=True,
            timeout=timeout_s,
        )
        marker.touch()
    return PeerEnv(python, installed_versions(python))


def installed_versions(python: Path) -> dict[str, str]:
    code = (
        "import importlib.metadata as m, json; "
        f"print(json.dumps({{n: m.version(n) for n in {sorted(PINS)!r}}}))"
    )
    out = subprocess.run([str(python), "-c", code], capture_output=True, text=True, check=True)
    return dict(json.loads(out.stdout))


def _router_command(
    python: Path, module: str, workers: Sequence[str], port: int, metrics_port: int, level: str
) -> list[str]:
    """Both peers share sglang-router's launcher flags; every listener on loopback."""
    return [
        str(python), "-m", module,
        "--worker-urls", *workers,
        "--policy", "cache_aware",
        "--host", "127.0.0.1", "--port", str(port),
        "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port),
        "--log-level", level,
    ]  # fmt: skip


def sglang_command(python: Path, workers: Sequence[str], port: int, metrics_port: int) -> list[str]:
    return _router_command(
        python, "sglang_router.launch_router", workers, port, metrics_port, "warn"
    )


def vllm_router_command(
    python: Path, workers: Sequence[str], port: int, metrics_port: int
) -> list[str]:
    return _router_command(
        python, "vllm_router.launch_router", workers, port, metrics_port, "warning"
    )


class ManagedProcess:
    """A child process in its own session, stopped by its PID (SIGTERM, then SIGKILL)."""

    def __init__(self, name: str, command: list[str], log: Path, env: dict[str, str]) -> None:
        self.name = name
        self.log = log
        log.parent.mkdir(parents=True, exist_ok=True)
        self._out = log.open("w")
        self.process = subprocess.Popen(
            command,
            stdout=self._out,
            stderr=subprocess.STDOUT,
            env={**os.environ, **env},
            start_new_session=True,
        )

    @property
    def pid(self) -> int:
        return self.process.pid

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self, grace_s: float = 10.0) -> None:
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=10)
        self._out.close()


def wait_http(url: str, timeout_s: float, process: ManagedProcess | None = None) -> None:
    """Poll ``url`` until it answers 200 (or the process dies, or time runs out)."""
    import httpx

    deadline = time.monotonic() + timeout_s
    last = ""
    while time.monotonic() < deadline:
        if process is not None and not process.alive():
            tail = process.log.read_text(errors="replace")[-2000:]
            raise RuntimeError(f"{process.name} exited; its log ends:\n{tail}")
        try:
            if httpx.get(url, timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError as exc:
            last = str(exc)
        time.sleep(0.25)
    raise TimeoutError(f"{url} did not answer within {timeout_s:.0f} s ({last})")
