"""What the tier planner (``planner.py``) decides, as values: the jobs of one engine step
(loads before the forward pass; stores, moves, drops and shared-folder writes after it), the
asynchronous loads and promotions ahead of need the loader runs beside the steps, the
``StepPlan`` that carries them to the workers, the residency changes that become cache events,
and the measured rates a load is weighed with (``LoadCosts``). Pure data: no torch, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

from prefixmesh.cache_registry.types import BlockHash, EventKind, Tier


@dataclass(frozen=True, slots=True)
class LoadJob:
    """Copy ``block`` from ``tier`` into engine block ``engine_block`` before the forward."""

    block: BlockHash
    tier: Tier
    engine_block: int
    shared: bool = False
    """From the cluster's shared folder (``tier`` is then DISK), not this replica's own."""

    @property
    def from_memory(self) -> bool:
        """From this replica's own CPU tier: a memory copy, the one kind loaded layer by layer."""
        return self.tier is Tier.CPU and not self.shared


@dataclass(frozen=True, slots=True)
class StoreJob:
    """Copy engine block ``engine_block`` (computed by now) into ``tier`` as ``block``."""

    block: BlockHash
    engine_block: int
    tier: Tier = Tier.CPU


@dataclass(frozen=True, slots=True)
class MoveJob:
    """Move ``block`` from the CPU tier down to the disk tier."""

    block: BlockHash


@dataclass(frozen=True, slots=True)
class DropJob:
    """Forget ``block`` in ``tier``."""

    block: BlockHash
    tier: Tier


@dataclass(frozen=True, slots=True)
class ShareJob:
    """Write engine block ``engine_block`` (computed by now) to the shared folder as ``block``,
    unless another replica did first."""

    block: BlockHash
    engine_block: int


Job = StoreJob | MoveJob | DropJob | ShareJob


@dataclass(frozen=True, slots=True)
class RequestLoad:
    """One request's asynchronous load: the worker reports ``request_id`` once every job ran."""

    request_id: str
    jobs: tuple[LoadJob, ...]
    seconds: float
    """What the jobs cost at the measured read rates (the loader queue's backlog)."""


@dataclass(frozen=True, slots=True)
class Prefetch:
    """Read ``blocks`` from disk into the CPU tier on the loader, ahead of a waiting request;
    the worker reports ``batch`` with the blocks it could not read."""

    batch: int
    blocks: tuple[BlockHash, ...]
    shared: tuple[bool, ...]
    """Per block: from the shared folder (else this replica's disk tier)."""


@dataclass(frozen=True, slots=True)
class StepPlan:
    loads: tuple[LoadJob, ...] = ()
    jobs: tuple[Job, ...] = ()
    """In order, after the forward pass."""
    async_loads: tuple[RequestLoad, ...] = ()
    """Loads to start beside the engine's steps (the requests wait outside the batch)."""
    prefetches: tuple[Prefetch, ...] = ()
    """Promotions to start on the loader after ``jobs`` ran (they free the slots)."""

    def __bool__(self) -> bool:
        return bool(self.loads or self.jobs or self.async_loads or self.prefetches)


@dataclass(frozen=True, slots=True)
class TierChange:
    """One residency change, for the cache events."""

    kind: EventKind
    tier: Tier
    blocks: tuple[BlockHash, ...]


@dataclass(frozen=True, slots=True)
class LoadCosts:
    """What a load saves and costs, from measured rates."""

    block_tokens: int
    page_bytes: int
    prefill_tokens_per_s: float
    read_bytes_per_s: dict[Tier, float]
    shared_read_bytes_per_s: float = 1.0
    """The shared folder's read rate (measured where there is one)."""

    def saving_s(self, tier: Tier, shared: bool = False) -> float:
        """Recompute time minus load time of one block from ``tier`` (> 0: load it)."""
        return self.block_tokens / self.prefill_tokens_per_s - self.load_s(tier, shared)

    def load_s(self, tier: Tier, shared: bool = False) -> float:
        rate = self.shared_read_bytes_per_s if shared else self.read_bytes_per_s[tier]
        return self.page_bytes / rate
