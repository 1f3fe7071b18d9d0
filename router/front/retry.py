"""Ingress retries: a request whose replica died is sent again, to another replica.

Only failures of the path to the replica count: its actor died or became unreachable, or its
remote engine's connection broke. Those say nothing about the request itself, so sending it
elsewhere is safe as long as no output has reached the client: always before the first token,
and mid-generation when the response is not streamed (the ingress still holds every token).
Application errors (bad input, a 4xx from a replica server, a bug) are raised at once: a retry
would fail the same way and double the load.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

import ray.exceptions as ray_errors
from ray.serve.exceptions import ReplicaUnavailableError

from prefixmesh.wire import GenerateRequest

logger = logging.getLogger(__name__)

_ACTOR_FAILURES: tuple[type[BaseException], ...] = (
    ray_errors.RayActorError,  # ActorDiedError and ActorUnavailableError are subclasses
    ray_errors.WorkerCrashedError,
    ray_errors.NodeDiedError,
    ray_errors.ObjectLostError,  # the stream's owner or its objects went with the replica
    ReplicaUnavailableError,
)


def _transport_failure(cause: BaseException) -> bool:
    """A broken connection to a remote engine (the replica is alive, its server is not): the
    remote engine raises a ``ConnectionError`` for it (``RemoteEngineLost``), never for a slow
    answer, since sending a slow server's request elsewhere doubles load."""
    return isinstance(cause, ConnectionError)


def is_retryable(exc: BaseException) -> bool:
    """True for replica-path failures (actor gone, remote engine connection broken)."""
    if isinstance(exc, _ACTOR_FAILURES):
        return True
    if isinstance(exc, ray_errors.RayTaskError):
        # The replica ran and raised: retry only when what it raised is a broken connection
        # to its remote engine, never an error about the request.
        cause = getattr(exc, "cause", None)
        return cause is not None and _transport_failure(cause)
    return False


def retry_request(
    original: GenerateRequest, attempt: int, avoid: tuple[str, ...]
) -> GenerateRequest:
    """The request to send again: a new id and the replicas to avoid, with no decision (the
    request router decides it afresh; a hold of the failed attempt's would bind the retry to
    the failed replica's prefill)."""
    request_id = f"{original.request_id}-retry{attempt}"
    return dataclasses.replace(original, request_id=request_id, avoid_replicas=avoid, ticket=None)


class Startable(Protocol):
    async def first(self) -> None:
        """Wait for the first output (raises the failure if there is none)."""
        ...


G = TypeVar("G", bound=Startable)
T = TypeVar("T")
Phase = str
"""``before_first_token`` or ``mid_generation``."""


class AttemptFailed(Exception):
    """The request failed for good: ``phase`` says when, ``__cause__`` is the last failure
    (a retryable one after ``retries`` retries, or any other one at once)."""

    def __init__(self, phase: Phase, retries: int, cause: BaseException) -> None:
        super().__init__(f"{phase.replace('_', ' ')} after {retries} retries: {cause!r}")
        self.phase = phase
        self.retries = retries
        self.cause = cause


@dataclass(frozen=True)
class Attempted(Generic[G, T]):
    generation: G
    """The attempt that succeeded."""
    result: T
    """What ``finish`` returned for it."""
    retries: int
    avoided: tuple[str, ...]


async def run_with_retry(
    start: Callable[[tuple[str, ...], int], G],
    finish: Callable[[G], Awaitable[T]],
    *,
    retries: int,
    replica_of: Callable[[G], str],
    on_retry: Callable[[Phase, BaseException], None] | None = None,
) -> Attempted[G, T]:
    """Start an attempt (``start(avoid, attempt)``), wait for its first output, then run
    ``finish`` on it; after a retryable failure in either step, start again avoiding the
    replica that failed, at most ``retries`` times. The failure that ends it is raised as
    ``AttemptFailed`` (from it), which says in which phase it came.

    A streamed response passes a ``finish`` that returns at once: once its first token is out,
    a failure is the stream's to report, not a retry's.
    """
    avoid: tuple[str, ...] = ()
    attempt = 0
    while True:
        generation = start(avoid, attempt)
        phase: Phase = "before_first_token"
        try:
            await generation.first()
            phase = "mid_generation"
            result = await finish(generation)
        except Exception as exc:
            if attempt >= retries or not is_retryable(exc):
                raise AttemptFailed(phase, attempt, exc) from exc
            failed = replica_of(generation)
            if failed and failed not in avoid:
                avoid = (*avoid, failed)
            attempt += 1
            logger.warning(
                "replica %s failed %s (%s); retrying elsewhere (%d/%d)",
                failed or "?",
                phase.replace("_", " "),
                type(exc).__name__,
                attempt,
                retries,
            )
            if on_retry is not None:
                on_retry(phase, exc)
            continue
        return Attempted(generation, result, attempt, avoid)
