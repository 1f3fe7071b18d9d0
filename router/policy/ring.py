"""A consistent-hash ring over the current replicas (``uhashring``), kept in step with the fleet.

Why a ring: a key's replica (or its first k replicas, walking clockwise) depends only on the key
and the set of replica ids, so every router process computes the same answer without sharing
state, and a fleet change moves only the keys of the replicas that came or went. The first k
replicas for a key are a prefix of its first k + 1, so growing or shrinking an affinity group
keeps its other members.
"""

from __future__ import annotations

from collections.abc import Sequence

from uhashring import HashRing

from prefixmesh.cache_registry.types import ReplicaId

_MAX_CACHED_KEYS = 4096
"""Memoised ``members`` answers; cleared when the fleet changes or the memo fills up."""


class ReplicaRing:
    def __init__(self, vnodes: int = 160) -> None:
        self._vnodes = vnodes
        self._ring = HashRing(nodes=[], vnodes=vnodes)
        self._ids: tuple[ReplicaId, ...] = ()
        """The candidate list of the last ``sync``, in its order (a cheap equality check)."""
        self._position: dict[ReplicaId, int] = {}
        """Where each replica sits in that list."""
        self._members: set[ReplicaId] = set()
        self._memo: dict[tuple[int, int], tuple[ReplicaId, ...]] = {}
        self._positions_memo: dict[tuple[int, int], tuple[int, ...]] = {}

    def __len__(self) -> int:
        return len(self._members)

    def sync(self, replica_ids: Sequence[ReplicaId]) -> None:
        """Make the ring hold exactly these replicas (cheap when nothing changed)."""
        ids = tuple(replica_ids)
        if ids == self._ids:
            return
        self._ids = ids
        self._position = {replica: i for i, replica in enumerate(ids)}
        self._positions_memo.clear()
        wanted = set(ids)
        if wanted == self._members:
            return  # same fleet, another order
        if not self._members or len(wanted & self._members) < len(wanted) // 2:
            # Mostly new: one bulk build sorts the points once instead of once per node.
            self._ring = HashRing(nodes=sorted(wanted), vnodes=self._vnodes)
        else:
            for gone in sorted(self._members - wanted):
                self._ring.remove_node(gone)
            for new in sorted(wanted - self._members):
                self._ring.add_node(new, {"vnodes": self._vnodes})
        self._members = wanted
        self._memo.clear()

    @property
    def positions(self) -> dict[ReplicaId, int]:
        """Where each replica sits in the list of the last ``sync`` (read only)."""
        return self._position

    def first(self, key: int) -> ReplicaId:
        """The replica owning ``key`` (the ring must hold at least one replica)."""
        return self.members(key, 1)[0]

    def members(self, key: int, count: int) -> tuple[ReplicaId, ...]:
        """The first ``count`` distinct replicas clockwise from ``key`` (all, if fewer)."""
        count = max(1, min(count, len(self._members)))
        memo_key = (key, count)
        found = self._memo.get(memo_key)
        if found is None:
            if len(self._memo) >= _MAX_CACHED_KEYS:
                self._memo.clear()
            found = tuple(ReplicaId(node["nodename"]) for node in self._ring.range(str(key), count))
            self._memo[memo_key] = found
        return found

    def member_positions(self, key: int, count: int) -> tuple[int, ...]:
        """``members``, as positions in the list of the last ``sync``."""
        memo_key = (key, count)
        found = self._positions_memo.get(memo_key)
        if found is None:
            if len(self._positions_memo) >= _MAX_CACHED_KEYS:
                self._positions_memo.clear()
            position = self._position
            found = tuple(position[replica] for replica in self.members(key, count))
            self._positions_memo[memo_key] = found
        return found
