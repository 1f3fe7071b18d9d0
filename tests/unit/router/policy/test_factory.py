from __future__ import annotations

import random

import pytest

from prefixmesh.config import RoutingConfig
from prefixmesh.router.policy import POLICY_NAMES, make_policy
from tests.unit.router.policy.builders import request, view


def test_every_name_builds_a_policy_of_that_name() -> None:
    assert set(POLICY_NAMES) == {
        "round_robin",
        "pow2",
        "prefix_hash",
        "ray_prefix",
        "sglang",
        "dynamo",
        "prefixmesh",
    }
    for name in POLICY_NAMES:
        built = make_policy(name, RoutingConfig(), rng=random.Random(0), block_size=16)
        assert built.name == name


def test_unknown_names_and_bad_block_sizes_are_refused() -> None:
    with pytest.raises(ValueError, match=r"unknown routing policy 'lru'; valid names: round_robin"):
        make_policy("lru", RoutingConfig(), rng=random.Random(0), block_size=16)
    with pytest.raises(ValueError, match="block_size"):
        make_policy("pow2", RoutingConfig(), rng=random.Random(0), block_size=0)


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_zero_replicas_is_a_clear_error(name: str) -> None:
    built = make_policy(name, RoutingConfig(), rng=random.Random(0), block_size=4)
    with pytest.raises(ValueError, match=f"{name}: no candidate replicas"):
        built.route(request(1, 2), [], view(), 0.0)
