"""Every use of Ray Serve's private API, in one place: a Ray upgrade touches this file only.

prefixmesh routes with Serve's public ``RequestRouter`` seam, but a few things it needs have no
public form in Ray 2.60: hand the chosen request its own replica, send the replica the decision
on the call's argument, pick a replica without dispatching to it (the direct path), build the
handle's request router eagerly, and mount a router deployment in front of HTTP replicas. Each
function below names the Ray 2.60 internal it relies on; ``tests/unit/test_serve_private.py``
checks that they are still there.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ray.serve.request_router import PendingRequest, RequestRouter


class ServeRequestRouter(RequestRouter):
    """Serve's ``RequestRouter`` with the private parts our request router needs."""

    def _get_pending_request_matching_metadata(self, request_metadata: Any = None) -> Any:
        """The pending request a chosen replica goes to: the one whose metadata object it was
        chosen for (Ray 2.60: the private hook ``FIFOMixin._fulfill_next_pending_request``
        calls, over ``RequestRouter._pending_requests_to_fulfill``). NOTE: in Ray 2.60 the base
        ``RequestRouter._fulfill_next_pending_request`` matches by internal request id and
        does not call this hook (only ``FIFOMixin`` does); it is kept as it was, for Ray
        versions (and mixins) that hand a replica to the oldest pending request.

        Serve's FIFO mixin hands the replica chosen for a request to the OLDEST pending
        request unless a mixin matches metadata (only MultiplexMixin does). Our decisions are
        per request (its prefix, its hold), so the replica must go to the request it was
        chosen for. Serve's internal request id does not tell requests apart (calls made while
        serving one HTTP request share it), so the metadata object itself is matched. Without
        this, concurrent requests swap replicas and a request pinned to one replica (an admin
        call) can spin forever."""
        if request_metadata is None:
            return None
        for pending in self._pending_requests_to_fulfill:
            if pending.metadata is request_metadata and not pending.future.done():
                return pending
        return None

    def known_replica_ids(self) -> set[Any]:
        """The ids of the replicas Serve knew before its current ``update_replicas`` call
        (Ray 2.60: ``RequestRouter._replica_id_set``, unset before the first update)."""
        return set(getattr(self, "_replica_id_set", set()))

    def router_loop(self) -> asyncio.AbstractEventLoop:
        """The event loop Serve runs this router on (Ray 2.60: ``RequestRouter._event_loop``;
        Serve's membership callbacks are not always on it)."""
        loop: asyncio.AbstractEventLoop = self._event_loop
        return loop


def pending_arguments(pending: PendingRequest) -> Iterator[Any]:
    """The call's arguments, positional then keyword (public fields of ``PendingRequest``)."""
    yield from pending.args
    yield from pending.kwargs.values()


def send_instead(pending: PendingRequest, sent: object, replacement: object) -> None:
    """Make the call carry ``replacement`` where it carried ``sent`` (the same object).

    Ray 2.60 sends ``pending.args`` and ``pending.kwargs`` to the chosen replica after
    ``choose_replicas`` returns: ``AsyncioRouter._route_and_send_request_once`` awaits
    ``_choose_replica_for_request(pr)`` and then calls ``replica.try_send_request(pr, ...)``
    on the same ``PendingRequest``, whose ``RunningReplica`` wrapper passes ``*pr.args,
    **pr.kwargs`` to the actor (``replica_wrapper.py``). A re-routed request (the replica
    refused it) is routed again with the same ``PendingRequest``, so it carries the
    replacement from then on. The caller's own object is never changed."""
    pending.args = [replacement if arg is sent else arg for arg in pending.args]
    for name, value in pending.kwargs.items():
        if value is sent:
            pending.kwargs[name] = replacement


def init_handle(handle: Any) -> None:
    """Build a deployment handle's request router now, not at its first call (Ray 2.60:
    ``DeploymentHandle._init``)."""
    handle._init()


@dataclass(frozen=True, slots=True)
class PickedReplica:
    full_id: str
    """Serve's full replica id (what HAProxy's Lua pins a request to)."""
    unique_id: str
    """The replica's unique id (what our reports, registry and tickets name)."""


async def pick_replica(handle: Any, *args: Any) -> PickedReplica:
    """The replica the handle's request router picks for a call with ``args``, without sending
    it or reserving a slot there (Ray 2.60: ``DeploymentHandle.choose_replica(...,
    _reserve=False)``, the pick-only path Serve's HAProxy ingress uses, and the selection's
    ``_replica``)."""
    async with handle.choose_replica(*args, _reserve=False) as selection:
        replica_id = selection._replica.replica_id
        return PickedReplica(replica_id.to_full_id_str(), replica_id.unique_id)


def with_ingress_request_router(bound_replicas: Any, bound_router: Any) -> Any:
    """The application whose HTTP ingress is the replicas themselves, HAProxy asking the
    router deployment which one takes each POST (Ray 2.60: ``Application.
    _with_ingress_request_router``, which Ray Serve LLM's direct streaming uses)."""
    return bound_replicas._with_ingress_request_router(bound_router)


def power_of_two_router_class() -> type[RequestRouter]:
    """Serve's default request router (Ray 2.60: ``ray.serve._private.request_router.
    PowerOfTwoChoicesRequestRouter``, defined in ``pow_2_router``), for side-by-side
    comparisons."""
    from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter

    router: type[RequestRouter] = PowerOfTwoChoicesRequestRouter
    return router


def prefix_affinity_router_class() -> type[RequestRouter]:
    """Ray Serve LLM's prefix-aware request router (Ray 2.60: ``ray.llm._internal.serve.
    routing_policies.prefix_aware.prefix_aware_router``; the public alias in
    ``ray.serve.llm.request_router`` needs vLLM or SGLang and pyarrow to import)."""
    from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router import (
        PrefixCacheAffinityRouter,
    )

    router: type[RequestRouter] = PrefixCacheAffinityRouter
    return router
