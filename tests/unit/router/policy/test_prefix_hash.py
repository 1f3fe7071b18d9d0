from __future__ import annotations

from uhashring import HashRing

from prefixmesh.cache_registry.types import PrefixKey
from prefixmesh.router.policy.base import RouteRequest
from prefixmesh.router.policy.prefix_hash import PrefixHashPolicy
from tests.unit.router.policy.builders import chain, fleet, policy, request, snap, view

NAMES = ("a", "b", "c", "d")


def owner_of(key: int) -> str:
    """The ring's choice, computed independently with uhashring."""
    return str(HashRing(nodes=list(NAMES)).get_node(str(key)))


def prefix_hash(**section: object) -> PrefixHashPolicy:
    built = policy("prefix_hash", prefix_tokens=8, **section)  # 2 blocks of 4 tokens
    assert isinstance(built, PrefixHashPolicy)
    return built


def test_the_ring_key_is_the_block_hash_naming_the_first_prefix_tokens() -> None:
    ph = prefix_hash()
    assert ph.ring_key(request(1, 2, 3)) == chain(1, 2, 3)[1]  # 8 tokens: block index 1
    assert ph.ring_key(request(1)) == chain(1)[0]  # shorter prompt: its last full block
    assert ph.ring_key(RouteRequest("q", PrefixKey((), 4), 3, 0)) is None
    assert policy("prefix_hash", prefix_tokens=2).ring_key(request(1, 2)) == chain(1)[0]


def test_same_head_same_replica_on_the_uhashring_ring() -> None:
    ph = prefix_hash()
    replicas = fleet(*NAMES)
    first = ph.route(request(1, 2, 3), replicas, view(), 0.0)
    second = ph.route(request(1, 2, 9, 9), replicas, view(), 0.0)
    assert str(first.chosen) == str(second.chosen) == owner_of(chain(1, 2)[1])
    assert first.reason == "ring"


def test_spills_to_the_least_loaded_when_over_load_factor_times_mean() -> None:
    key = chain(1, 2)[1]
    owner = owner_of(key)
    others = [n for n in NAMES if n != owner]

    def route(owner_load: int, other_loads: list[int]) -> tuple[str, str]:
        loads = dict(zip(others, other_loads, strict=True)) | {owner: owner_load}
        replicas = [snap(n, running=loads[n]) for n in NAMES]
        decision = prefix_hash().route(request(1, 2, 3), replicas, view(), 0.0)
        return str(decision.chosen), decision.reason

    # SGLang's load_ok: load <= (total + 1) / n * 1.25.
    assert route(2, [1, 2, 2]) == (owner, "ring")  # total 7: limit 2.5
    assert route(3, [2, 1, 2]) == (others[1], "load_factor")  # total 8: limit 2.8125
    assert route(3, [1, 1, 2]) == (others[0], "load_factor")  # tie: first in order
    assert route(0, [0, 0, 0]) == (owner, "ring")


def test_prompt_without_a_full_block_goes_to_the_least_loaded() -> None:
    replicas = [snap("a", running=2), snap("b", running=1), snap("c", running=1)]
    empty = RouteRequest("q", PrefixKey((), 4), 3, 0)
    decision = prefix_hash().route(empty, replicas, view(), 0.0)
    assert (str(decision.chosen), decision.reason) == ("b", "no_tokens")
