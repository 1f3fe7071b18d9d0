"""``prefixmesh/serve_private.py`` is the one place library code reaches Ray Serve's private
API: these tests pin each internal it relies on to Ray as installed (2.60), so that an upgrade
that moves one fails here, not in a cluster, and check that no other library module reaches a
private attribute of Serve's."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from ray.serve._private.request_router import request_router as ray_request_router
from ray.serve._private.request_router.replica_wrapper import ReplicaSelection

from prefixmesh import serve_private
from prefixmesh.serve_private import (
    ServeRequestRouter,
    pending_arguments,
    pick_replica,
    send_instead,
)

ROOT = Path(__file__).resolve().parents[2]
LIBRARY = ("router", "replica", "cache_registry", "prefixmesh", "kernels")
SERVE_PRIVATE = {
    "_pending_requests_to_fulfill",
    "_replica_id_set",
    "_event_loop",
    "_with_ingress_request_router",
    "_get_pending_request_matching_metadata",
}
"""Serve's private names, wherever they are read or defined (a subclass reads them on self)."""
SERVE_PRIVATE_ELSEWHERE = {"_init", "_replica"}
"""Serve's private names that our own classes use too: flagged when read off another object."""


def test_the_request_router_internals_are_where_ray_2_60_has_them() -> None:
    source = inspect.getsource(ray_request_router.RequestRouter)
    for name in ("_pending_requests_to_fulfill", "_replica_id_set", "_event_loop"):
        assert f"self.{name}" in source or f"def {name}" in source, name
    # Serve's FIFO mixin asks this hook which pending request a chosen replica goes to; the
    # base class matches by internal request id (serve_private's note).
    fifo = inspect.getsource(ray_request_router.FIFOMixin._fulfill_next_pending_request)
    assert "_get_pending_request_matching_metadata" in fifo
    base = inspect.getsource(ray_request_router.RequestRouter._fulfill_next_pending_request)
    assert "_get_pending_request_matching_internal_request_id" in base


def test_serve_sends_the_pending_request_s_arguments_after_routing() -> None:
    """What ``send_instead`` relies on: the same ``PendingRequest`` is routed, then sent."""
    from ray.serve._private.request_router import replica_wrapper
    from ray.serve._private.router import AsyncioRouter

    once = inspect.getsource(AsyncioRouter._route_and_send_request_once)
    chose = once.index("_choose_replica_for_request(")
    assert once.index("try_send_request(pr", chose) > chose
    assert "*pr.args, **pr.kwargs" in inspect.getsource(replica_wrapper.ActorReplicaWrapper)


def test_the_pick_only_path_and_the_ingress_router_hook_exist() -> None:
    from ray.serve._private.router import AsyncioRouter
    from ray.serve.deployment import Application
    from ray.serve.handle import DeploymentHandle

    assert "_reserve" in inspect.getsource(AsyncioRouter.choose_replica)
    assert "_replica" in ReplicaSelection.__dataclass_fields__
    assert callable(DeploymentHandle._init)
    assert callable(Application._with_ingress_request_router)
    assert issubclass(serve_private.power_of_two_router_class(), ray_request_router.RequestRouter)


def test_send_instead_swaps_the_argument_and_nothing_else() -> None:
    sent, other = object(), object()
    replacement = object()
    pending: Any = SimpleNamespace(args=[other, sent], kwargs={"a": sent, "b": other})
    send_instead(pending, sent, replacement)
    assert pending.args == [other, replacement]
    assert pending.kwargs == {"a": replacement, "b": other}
    assert list(pending_arguments(pending)) == [other, replacement, replacement, other]


async def test_a_pick_names_the_selected_replica_without_reserving() -> None:
    import contextlib

    class _Handle:
        @contextlib.asynccontextmanager
        async def choose_replica(self, *args: Any, _reserve: bool = True) -> Any:
            assert args == ("call",) and _reserve is False
            replica_id = SimpleNamespace(unique_id="r1", to_full_id_str=lambda: "S::a#r#r1")
            yield SimpleNamespace(_replica=SimpleNamespace(replica_id=replica_id))

    picked = await pick_replica(_Handle(), "call")
    assert (picked.full_id, picked.unique_id) == ("S::a#r#r1", "r1")


def test_the_chosen_replica_goes_to_the_request_it_was_chosen_for() -> None:
    done = SimpleNamespace(done=lambda: True)
    waiting = SimpleNamespace(done=lambda: False)
    first, second = object(), object()
    router: Any = SimpleNamespace(
        _pending_requests_to_fulfill=[
            SimpleNamespace(metadata=first, future=waiting),
            SimpleNamespace(metadata=second, future=done),
            SimpleNamespace(metadata=second, future=waiting),
        ]
    )
    match = ServeRequestRouter._get_pending_request_matching_metadata
    assert match(router, second) is router._pending_requests_to_fulfill[2]
    assert match(router, first) is router._pending_requests_to_fulfill[0]
    assert match(router, None) is None
    assert match(router, object()) is None


def _private_attributes(path: Path) -> list[str]:
    found = []
    where = path.relative_to(ROOT)
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Attribute):
            on_self = isinstance(node.value, ast.Name) and node.value.id == "self"
            if node.attr in SERVE_PRIVATE or (node.attr in SERVE_PRIVATE_ELSEWHERE and not on_self):
                found.append(f"{where}:{node.lineno} .{node.attr}")
        elif isinstance(node, ast.FunctionDef) and node.name in SERVE_PRIVATE:
            found.append(f"{where}:{node.lineno} def {node.name}")
        elif isinstance(node, ast.keyword) and node.arg == "_reserve":
            found.append(f"{where}:{node.lineno} _reserve=")
        elif (
            isinstance(node, ast.ImportFrom)
            and (node.module or "").startswith("ray.")
            and "._" in (node.module or "")
        ):
            found.append(f"{where}:{node.lineno} {node.module}")
    return found


@pytest.mark.parametrize("folder", LIBRARY)
def test_only_the_adapter_reaches_serve_s_private_api(folder: str) -> None:
    wrong = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        if path == ROOT / "prefixmesh" / "serve_private.py":
            continue
        wrong += _private_attributes(path)
    assert wrong == []
