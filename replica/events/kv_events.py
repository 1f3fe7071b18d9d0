"""Translate vLLM's KV cache events into our block keys.

vLLM hashes blocks its own way (and may salt them); its ``BlockStored`` events carry the
stored blocks' token ids and the parent block's vLLM hash. We re-hash the token ids with our
``BlockHasher``, continuing the chain from the parent's key, and keep a vLLM-hash -> our-hash
map for the blocks the engine holds, so ``BlockRemoved`` can be translated too. The map, with
the CPU and disk blocks our KV connector reported, is the replica's exact view of what its
engine holds in every tier (the resync snapshot).

``VllmEventStream`` follows vLLM's numbered ZMQ batches. A lost batch may hide removals (the
registry would keep blocks the engine dropped) and stores (children of an unknown parent can
never be translated, llm-d-kv-cache#372), so on a gap the replica forgets what it knows and
tells the registry "cleared": it then under-reports until new stores arrive, and never lies.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from prefixmesh.cache_registry.hashing import BlockHasher
from prefixmesh.cache_registry.types import BlockHash, EventKind, Tier
from prefixmesh.replica.engines.base import BlockChange, HeldMirror, Residency

logger = logging.getLogger(__name__)

_MEDIUM_TIERS = {None: Tier.GPU, "GPU": Tier.GPU, "CPU": Tier.CPU, "DISK": Tier.DISK}
OWN_EVENTS = "prefixmesh"
"""``ownership`` of the events our KV connector emits (replica/kvcache/connector.py): they name
blocks by our own chained hashes, in the CPU or disk tier."""


class VllmEventTranslator:
    def __init__(self, hasher: BlockHasher) -> None:
        self._hasher = hasher
        self._ours: dict[Any, BlockHash] = {}
        self._lower = HeldMirror()
        """The CPU and disk blocks our KV connector reported (its own events)."""
        self.untranslatable = 0
        """Stored blocks skipped because their parent was unknown (an event was lost)."""

        self.complete = True
        """The map has seen every event since the engine started or last cleared its cache;
        False after ``reset``: blocks the engine still holds are unknown here."""

    def residency(self) -> Residency:
        lower = self._lower
        return Residency.of(
            {
                Tier.GPU: self._ours.values(),
                Tier.CPU: lower.blocks(Tier.CPU),
                Tier.DISK: lower.blocks(Tier.DISK),
            }
        )

    def reset(self) -> None:
        """Forget every block (events were lost): what we map may be gone, what we lack held."""
        self._ours.clear()
        self._lower.clear()
        self.complete = False

    def translate(self, events: Iterable[Any]) -> list[BlockChange]:
        changes: list[BlockChange] = []
        for event in events:
            kind = type(event).__name__
            if kind == "BlockStored":
                change = self._stored(event)
            elif kind == "BlockRemoved":
                change = self._removed(event)
            elif kind == "AllBlocksCleared":
                # vLLM clears its own cache (reset_prefix_cache); our connector's tiers keep
                # theirs, so the registry must keep them too.
                self._ours.clear()
                self.complete = True  # the engine tier holds nothing: we know all of it again
                change = BlockChange(EventKind.CLEARED, tier=Tier.GPU)
            else:
                logger.debug("ignoring KV event %s", kind)
                continue
            if change is not None:
                changes.append(change)
        return changes

    def _stored(self, event: Any) -> BlockChange | None:
        if getattr(event, "ownership", None) == OWN_EVENTS:
            return self._own(EventKind.STORED, event)
        if event.block_size != self._hasher.block_size:
            raise ValueError(
                f"engine block size {event.block_size} != cache.block_size "
                f"{self._hasher.block_size}: router keys would never match"
            )
        parent: BlockHash | None = None
        if event.parent_block_hash is not None:
            parent = self._ours.get(event.parent_block_hash)
            if parent is None:
                self.untranslatable += len(event.block_hashes)
                return None
        ours = self._hasher.chain(parent, event.token_ids)
        if len(ours) != len(event.block_hashes):
            logger.warning(
                "BlockStored with %d hashes but %d full blocks of tokens",
                len(event.block_hashes),
                len(ours),
            )
            return None
        for theirs, mine in zip(event.block_hashes, ours, strict=True):
            self._ours[theirs] = mine
        return BlockChange(EventKind.STORED, _MEDIUM_TIERS.get(event.medium, Tier.GPU), ours)

    def _removed(self, event: Any) -> BlockChange | None:
        if getattr(event, "ownership", None) == OWN_EVENTS:
            return self._own(EventKind.REMOVED, event)
        ours = tuple(
            mine
            for theirs in event.block_hashes
            if (mine := self._ours.pop(theirs, None)) is not None
        )
        if not ours:
            return None
        return BlockChange(EventKind.REMOVED, _MEDIUM_TIERS.get(event.medium, Tier.GPU), ours)

    def _own(self, kind: EventKind, event: Any) -> BlockChange | None:
        """An event of our KV connector: its hashes are ours already, its medium a lower
        tier."""
        tier = _MEDIUM_TIERS.get(event.medium)
        if tier is None or tier is Tier.GPU or not event.block_hashes:
            return None
        change = BlockChange(kind, tier, tuple(BlockHash(int(h)) for h in event.block_hashes))
        self._lower.apply([change])
        return change


class VllmEventStream:
    """vLLM's KV event batches in order: ``(topic, seq, payload)`` frames, seq counting from 0
    per engine publisher (``vllm/distributed/kv_events.py:ZmqEventPublisher``)."""

    def __init__(self, translator: VllmEventTranslator) -> None:
        self.translator = translator
        self.next_seq = 0
        """The batch number expected next."""
        self.gaps = 0
        """Times events were lost and the replica's view was cleared."""

    def batch(self, seq: int, events: Iterable[Any] | None) -> list[BlockChange]:
        """The changes one batch makes; ``events`` None: the batch could not be decoded."""
        changes: list[BlockChange] = []
        if seq != self.next_seq:  # dropped (ZMQ's high-water mark) or a restarted publisher
            logger.warning("KV event batches from %d to %d lost; clearing", self.next_seq, seq)
            changes.append(self._clear())
        self.next_seq = seq + 1
        if events is None:
            return [*changes, self._clear()]
        translator = self.translator
        complete, before = translator.complete, translator.untranslatable
        try:
            changes += translator.translate(events)
        except Exception:  # half applied: the map can no longer be trusted
            logger.exception("untranslatable KV event batch %d; clearing", seq)
            return [*changes, self._clear()]
        if complete and translator.untranslatable > before:
            # Every event was seen, yet a parent is unknown: one went missing unnumbered. After
            # a reset, unknown parents are expected (and skipping them only under-reports).
            logger.warning("KV event with an unknown parent in a complete stream; clearing")
            changes.append(self._clear())
        return changes

    def _clear(self) -> BlockChange:
        self.gaps += 1
        self.translator.reset()
        return BlockChange(EventKind.CLEARED, tier=None)
