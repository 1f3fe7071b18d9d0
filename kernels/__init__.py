"""Batched KV block gather/scatter between the engine's paged cache and a page-first buffer
(issue 8): Triton on CUDA, a pure-torch reference elsewhere and as the test oracle."""

from prefixmesh.kernels.layout import BlockLayout, describe
from prefixmesh.kernels.ops import PagedKVCache, gather_blocks, scatter_blocks, scatter_layer

__all__ = [
    "BlockLayout",
    "PagedKVCache",
    "describe",
    "gather_blocks",
    "scatter_blocks",
    "scatter_layer",
]
