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

_MAX_CACHED_KEYS = 8192
"""Keys whose walk around the ring is memoised; cleared when the fleet changes or the memo
fills up. One walk per key serves every k: the first k members are a prefix of the first
k + 1, so a group whose k moves costs no new walk until it grows past the longest one."""


class ReplicaRing:
    def __init__(self, vnodes: int = 160) -> None:
        self._vnodes = vnodes
        self._ring = HashRing(nodes=[], vnodes=vnodes)
        self._ids: tuple[ReplicaId, ...] = ()
        """The candidate list of the last ``sync``, in its order (a cheap equality check)."""
        self._position: dict[ReplicaId, int] = {}
        """Where each replica sits in that list."""
        self._members: set[ReplicaId] = set()
        self._walks: dict[int, tuple[ReplicaId, ...]] = {}
        """Per key, the longest walk computed so far (distinct replicas, clockwise)."""
        self._position_walks: dict[int, tuple[int, ...]] = {}
        """The same walks as positions in the list of the last ``sync``."""

    def __len__(self) -> int:
        return len(self._members)

    def sync(self, replica_ids: Sequence[ReplicaId]) -> None:
        """Make the ring hold exactly these replicas (cheap when nothing changed)."""
        ids = tuple(replica_ids)
        if ids == self._ids:
            return
        self._ids = ids
        self._position = {replica: i for i, replica in enumerate(ids)}
        self._position_walks.clear()
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
        self._walks.clear()

    @property
    def positions(self) -> dict[ReplicaId, int]:
        """Where each replica sits in the list of the last ``sync`` (read only)."""
        return self._position

    def first(self, key: int) -> ReplicaId:
        """The replica owning ``key`` (the ring must hold at least one replica)."""
        return self.members(key, 1)[0]

    def _walk(self, key: int, count: int) -> tuple[ReplicaId, ...]:
        """At least the first ``count`` members of ``key``'s walk (all, if fewer)."""
        walk = self._walks.get(key)
        if walk is None or (len(walk) < count and len(walk) < len(self._members)):
            if len(self._walks) >= _MAX_CACHED_KEYS:
                self._walks.clear()
                self._position_walks.clear()
            walk = tuple(ReplicaId(node["nodename"]) for node in self._ring.range(str(key), count))
            self._walks[key] = walk
        return walk

    def members(self, key: int, count: int) -> tuple[ReplicaId, ...]:
        """The first ``count`` distinct replicas clockwise from ``key`` (all, if fewer)."""
        count = max(1, min(count, len(self._members)))
        walk = self._walk(key, count)
        return walk if len(walk) == count else walk[:count]

    def member_positions(self, key: int, count: int) -> tuple[int, ...]:
        """``members``, as positions in the list of the last ``sync``."""
        count = max(1, min(count, len(self._members)))
        walk = self._position_walks.get(key)
        if walk is None or len(walk) < count:
            position = self._position
            walk = tuple(position[replica] for replica in self._walk(key, count))
            self._position_walks[key] = walk
        return walk if len(walk) == count else walk[:count]
