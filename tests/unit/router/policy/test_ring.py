from __future__ import annotations

from uhashring import HashRing

from prefixmesh.router.policy.ring import ReplicaRing
from tests.unit.router.policy.builders import rid

NAMES = [rid(f"r{i}") for i in range(8)]
KEYS = range(1000, 1200)


def test_members_are_uhashring_range_and_nest_as_k_grows() -> None:
    ring = ReplicaRing()
    ring.sync(NAMES)
    reference = HashRing(nodes=sorted(NAMES))
    for key in KEYS:
        expected = [node["nodename"] for node in reference.range(str(key), 4)]
        assert list(ring.members(key, 4)) == expected
        assert ring.members(key, 3) == ring.members(key, 4)[:3]
        assert ring.first(key) == expected[0]
    assert len(ring.members(1, 99)) == 8  # clipped to the fleet


def test_a_fleet_change_moves_only_what_it_must() -> None:
    ring = ReplicaRing()
    ring.sync(NAMES)
    before = {key: ring.members(key, 3) for key in KEYS}
    ring.sync([*NAMES, rid("r8")])  # one more replica
    for key in KEYS:
        after = ring.members(key, 3)
        assert len(set(after) - set(before[key])) <= 1
        assert set(after) - set(before[key]) <= {rid("r8")}
    ring.sync([n for n in NAMES if n != rid("r3")])  # r3 and r8 gone
    for key in KEYS:
        after = ring.members(key, 3)
        assert rid("r3") not in after
        kept = [m for m in before[key] if m != rid("r3")]
        assert list(after[: len(kept)]) == kept  # survivors keep their order
    rebuilt = ReplicaRing()
    rebuilt.sync(list(reversed([n for n in NAMES if n != rid("r3")])))
    assert all(rebuilt.members(key, 3) == ring.members(key, 3) for key in KEYS)
