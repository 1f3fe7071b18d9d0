"""The in-process registry's state: speculative entries leave it when they expire."""

from __future__ import annotations

from prefixmesh.cache_registry.hashing import BlockHasher
from prefixmesh.cache_registry.memory import RegistryState
from prefixmesh.cache_registry.types import ReplicaId

HASHER = BlockHasher(2, "m")
R1 = ReplicaId("r1")


def test_a_short_lived_entry_leaves_the_state_behind_a_longer_lived_one() -> None:
    # Routing-time entries live until the request's expected first token: a long prefill's
    # entry, written first, outlives a short one's written after it.
    now = [0.0]
    state = RegistryState(clock=lambda: now[0])
    long_key = HASHER.hash_tokens(list(range(8)))
    short_key = HASHER.hash_tokens(list(range(100, 108)))
    state.add_speculative(long_key, R1, 30.0)
    state.add_speculative(short_key, R1, 2.0)
    now[0] = 3.0
    state.add_speculative(HASHER.hash_tokens(list(range(200, 204))), R1, 2.0)  # expires others
    assert not set(short_key.block_hashes) & set(state.blocks)
    assert set(long_key.block_hashes) <= set(state.blocks)
    assert state.lookup(long_key, [R1])[R1].num_speculative == 4
    assert state.lookup(short_key, [R1]) == {}
