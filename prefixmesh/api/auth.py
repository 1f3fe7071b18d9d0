"""API keys (issue 17): optional, off by default (``auth.api_keys_file``, ``auth.api_keys_env``).

The file has one key a line, ``<key> <tenant>``; a key may be stored hashed as
``sha256:<64 hex digits>`` (what ``key_digest`` gives), so the file need not hold secrets;
blank lines and ``#`` comments are skipped. It is read again when it changes (checked every
``auth.reload_interval_s``, on a thread); a file with a malformed line is refused whole, with
the line named in the log, and the keys read before stay in force. A Kubernetes Secret mounted
as a file fits as it is.

The environment variable (``$PREFIXMESH_API_KEYS`` by default; ``load_config`` reads it) holds
the same entries separated by newlines or commas, and may hold bare keys, whose tenant is
``default`` (a single key, as vLLM's ``--api-key`` takes it). It is read at start only; a
key in both places is refused.

Clients send ``Authorization: Bearer <key>``, as the openai SDK does with ``api_key``. A
request without a known key gets OpenAI's 401 (``invalid_api_key``) before its body is read.
Paths in ``auth.open_paths`` (health and metrics by default) need no key.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from fastapi.responses import JSONResponse

from prefixmesh.api.errors import APIError, error_response
from prefixmesh.config import PrefixmeshConfig

logger = logging.getLogger(__name__)

INVALID_API_KEY = "invalid_api_key"
ANONYMOUS = "anonymous"
"""The tenant of a request that needs no key (no keys configured, or an open path)."""
DEFAULT_TENANT = "default"
"""The tenant of a bare key in the environment's keys."""
_HASHED = re.compile(r"sha256:([0-9a-f]{64})")
_TENANT = re.compile(r"[A-Za-z0-9_.@-]{1,64}")


class KeyFileError(ValueError):
    def __init__(self, line: int, reason: str) -> None:
        super().__init__(f"line {line}: {reason}")
        self.line = line
        self.reason = reason


def key_digest(key: str) -> str:
    """How a key is stored: ``sha256:`` and its hex digest."""
    return "sha256:" + hashlib.sha256(key.encode()).hexdigest()


def parse_keys(text: str, bare_key_tenant: str | None = None) -> dict[str, str]:
    """Key digest -> tenant, from the file's text; the first malformed line raises. With
    ``bare_key_tenant``, a line of a key alone names that tenant."""
    keys: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), start=1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        fields = line.split()
        if len(fields) == 1 and bare_key_tenant is not None:
            fields.append(bare_key_tenant)
        if len(fields) != 2:
            raise KeyFileError(number, f"want '<key> <tenant>', got {len(fields)} fields")
        key, tenant = fields
        if not _TENANT.fullmatch(tenant):
            raise KeyFileError(number, "a tenant is 1-64 of A-Z a-z 0-9 _ . @ -")
        if key.startswith("sha256:"):
            if not _HASHED.fullmatch(key):
                raise KeyFileError(number, "a hashed key is sha256: and 64 lowercase hex digits")
            digest = key
        else:
            digest = key_digest(key)
        if digest in keys:
            raise KeyFileError(number, "the same key twice")
        keys[digest] = tenant
    return keys


def parse_environment_keys(value: str) -> dict[str, str]:
    """The environment variable's keys: the file's lines, or entries separated by commas, and
    bare keys (tenant ``default``)."""
    return parse_keys(value.replace(",", "\n"), bare_key_tenant=DEFAULT_TENANT)


def bearer(headers: Mapping[str, str]) -> str | None:
    value = headers.get("authorization", "")
    scheme, _, token = value.partition(" ")
    return token.strip() or None if scheme.lower() == "bearer" else None


@dataclass(frozen=True, slots=True)
class _Loaded:
    keys: dict[str, str]
    mtime_ns: int
    size: int


class ApiKeys:
    """The keys in force and the tenant a request's key names."""

    def __init__(
        self,
        path: Path | None,
        open_paths: tuple[str, ...],
        reload_interval_s: float,
        clock: Callable[[], float] = time.monotonic,
        environment_keys: Mapping[str, str] | None = None,
    ) -> None:
        self.path = path
        self.open_paths = frozenset(open_paths)
        self._interval_s = reload_interval_s
        self._clock = clock
        self._environment_keys = dict(environment_keys or {})
        self._loaded = _Loaded({}, -1, -1)
        self._next_check_s = 0.0
        self.reload_errors = 0
        self.reload()  # a bad file at start fails the server: nothing would be let in

    @classmethod
    def from_config(cls, config: PrefixmeshConfig) -> ApiKeys | None:
        auth = config.auth
        if auth.api_keys_file is None and auth.api_keys is None:
            return None
        environment_keys = {}
        if auth.api_keys is not None:
            try:
                environment_keys = parse_environment_keys(auth.api_keys.get_secret_value())
            except KeyFileError as exc:
                raise ValueError(
                    f"API keys in ${auth.api_keys_env}, entry {exc.line}: {exc.reason}"
                ) from exc
            if not environment_keys:  # set, but to separators or comments: every request a 401
                raise ValueError(f"${auth.api_keys_env} is set but holds no API key")
        path = None if auth.api_keys_file is None else Path(os.path.expanduser(auth.api_keys_file))
        return cls(
            path, tuple(auth.open_paths), auth.reload_interval_s, environment_keys=environment_keys
        )

    def reload(self) -> bool:
        """Read the file if it changed (True: new keys in force). At start a bad file
        raises; later it is logged and the keys read before stay."""
        if self.path is None:
            return False
        started = self._loaded.mtime_ns < 0
        try:
            stat = os.stat(self.path)
            if (stat.st_mtime_ns, stat.st_size) == (self._loaded.mtime_ns, self._loaded.size):
                return False
            keys = parse_keys(self.path.read_text())
            if not keys.keys().isdisjoint(self._environment_keys):
                raise ValueError("a key of the file is also in the environment's keys")
        except (OSError, ValueError) as exc:
            if started:
                raise ValueError(f"API keys file {self.path}: {exc}") from exc
            self.reload_errors += 1
            logger.error(
                "API keys file %s not reloaded (%s); the previous keys stay", self.path, exc
            )
            return False
        self._loaded = _Loaded(keys, stat.st_mtime_ns, stat.st_size)
        logger.info("API keys: %d keys of %d tenants", len(keys), len(set(keys.values())))
        return True

    async def tenant_of(self, path: str, headers: Mapping[str, str]) -> str | None:
        """The tenant of the request's key (None on an open path); 401 without a known key."""
        if path in self.open_paths:
            return None
        now = self._clock()
        if now >= self._next_check_s:
            self._next_check_s = now + self._interval_s
            await asyncio.to_thread(self.reload)
        return self.check(headers)

    def check(self, headers: Mapping[str, str]) -> str:
        token = bearer(headers)
        if token is None:
            raise APIError(
                401,
                "You didn't provide an API key. Send it as 'Authorization: Bearer <key>'.",
                code=INVALID_API_KEY,
            )
        digest = key_digest(token)
        tenant = self._environment_keys.get(digest) or self._loaded.keys.get(digest)
        if tenant is None:
            shown = f"{token[:3]}...{token[-4:]}" if len(token) > 8 else "***"
            raise APIError(401, f"Incorrect API key provided: {shown}.", code=INVALID_API_KEY)
        return tenant


class RequestLike(Protocol):
    """What ``refusal`` reads of a request (Starlette's)."""

    @property
    def url(self) -> Any: ...

    @property
    def headers(self) -> Mapping[str, str]: ...


async def request_tenant(keys: ApiKeys | None, request: RequestLike) -> str:
    """The tenant the request's key names (``anonymous`` when none is needed); raises the 401
    for a request without a known key."""
    if keys is None:
        return ANONYMOUS
    return await keys.tenant_of(request.url.path, request.headers) or ANONYMOUS


async def refusal(keys: ApiKeys | None, request: RequestLike) -> JSONResponse | None:
    """The 401 for a request without a known key (None: let it in; no keys: always)."""
    try:
        await request_tenant(keys, request)
    except APIError as exc:
        return error_response(exc)
    return None
