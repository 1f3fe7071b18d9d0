"""``gather_blocks`` / ``scatter_blocks``: validation, then the Triton kernel on CUDA or the
torch reference elsewhere; ``scatter_layer`` writes one layer's pages (torch everywhere).

A connector registers the engine's layer tensors once (``PagedKVCache.of``), which checks
the layout and keeps the layer-offset table on the device; the functions also take the raw
layer list or vLLM's ``dict[name, tensor]`` and build that on each call.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from prefixmesh.kernels.layout import BlockLayout, KVCaches, as_layer_list, describe
from prefixmesh.kernels.reference import (
    gather_reference,
    scatter_layer_reference,
    scatter_reference,
)

Impl = Literal["auto", "torch", "triton"]
BlockIds = Sequence[int] | torch.Tensor
_SHOWN = 10  # offending ids quoted in an error


@dataclass(frozen=True, slots=True)
class PagedKVCache:
    """The engine's per-layer KV tensors with their layout, checked once."""

    layers: tuple[torch.Tensor, ...]
    layout: BlockLayout
    layer_offsets: torch.Tensor  # int64 on the cache's device, for the Triton kernel

    @classmethod
    def of(cls, kv_caches: KVCaches | PagedKVCache, block_dim: int = 0) -> PagedKVCache:
        if isinstance(kv_caches, PagedKVCache):
            return kv_caches
        layers = as_layer_list(kv_caches)
        layout = describe(layers, block_dim)
        offsets = torch.tensor(layout.layer_offsets, dtype=torch.int64, device=layout.device)
        return cls(tuple(layers), layout, offsets)


def _ids_tensor(block_ids: BlockIds, cache: PagedKVCache, *, unique: bool) -> torch.Tensor:
    """Ids as an int64 tensor on the cache's device, range-checked (and unique for scatter).

    The check runs on the host for a list or CPU tensor; a device tensor costs one sync.
    """
    if isinstance(block_ids, torch.Tensor):
        if block_ids.dim() != 1:
            raise ValueError(f"block_ids must be 1-d, got shape {tuple(block_ids.shape)}")
        if block_ids.dtype.is_floating_point or block_ids.dtype in (torch.bool, torch.complex64):
            raise ValueError(f"block_ids must be integers, got {block_ids.dtype}")
        ids = block_ids.to(torch.int64)
    else:
        ids = torch.as_tensor(list(block_ids), dtype=torch.int64)
        if ids.dim() != 1:
            raise ValueError("block_ids must be a flat sequence of ints")
    num_blocks = cache.layout.num_blocks
    bad = (ids < 0) | (ids >= num_blocks)
    if ids.numel() and bool(bad.any()):
        shown = ids[bad][:_SHOWN].tolist()
        raise ValueError(
            f"block ids out of range [0, {num_blocks}): {shown}"
            + (" ..." if int(bad.sum()) > _SHOWN else "")
        )
    if unique and ids.numel():
        values, counts = torch.unique(ids, return_counts=True)
        if bool((counts > 1).any()):
            shown = values[counts > 1][:_SHOWN].tolist()
            raise ValueError(f"scatter_blocks needs unique block ids; repeated: {shown}")
    return ids.to(cache.layout.device, non_blocking=True)


def _check_pages(pages: torch.Tensor, cache: PagedKVCache, n: int, what: str) -> None:
    layout = cache.layout
    want = layout.staging_shape(n)
    if tuple(pages.shape) != want:
        raise ValueError(f"{what} has shape {tuple(pages.shape)}, expected {want}")
    if pages.dtype != layout.dtype:
        raise ValueError(f"{what} has dtype {pages.dtype}, the KV cache has {layout.dtype}")
    if pages.device != layout.device:
        raise ValueError(f"{what} is on {pages.device}, the KV cache is on {layout.device}")
    if not pages.is_contiguous():
        raise ValueError(f"{what} must be contiguous (page-first buffer)")


def _use_triton(cache: PagedKVCache, impl: Impl) -> bool:
    if impl == "triton":
        return True
    if impl == "torch":
        return False
    if impl != "auto":
        raise ValueError(f"impl must be 'auto', 'torch' or 'triton', got {impl!r}")
    return cache.layout.device.type == "cuda"


def gather_blocks(
    kv_caches: KVCaches | PagedKVCache,
    block_ids: BlockIds,
    out: torch.Tensor | None = None,
    *,
    impl: Impl = "auto",
    tile: int | None = None,
    programs: int | None = None,
) -> torch.Tensor:
    """Copy blocks ``block_ids`` of every layer into one page-first buffer.

    Returns ``out`` (allocated when None) of shape ``[len(block_ids), num_layers,
    *page_shape]``; ids may repeat. ``tile`` and ``programs`` tune the Triton kernel (elements
    per work item, instances in the persistent grid).
    """
    cache = PagedKVCache.of(kv_caches)
    ids = _ids_tensor(block_ids, cache, unique=False)
    n = ids.numel()
    layout = cache.layout
    if out is None:
        out = torch.empty(layout.staging_shape(n), dtype=layout.dtype, device=layout.device)
    else:
        _check_pages(out, cache, n, "out")
    if n == 0:
        return out
    layers = list(cache.layers)
    if _use_triton(cache, impl):
        from prefixmesh.kernels.triton_impl import gather_triton

        return gather_triton(
            layers, layout, ids, out, cache.layer_offsets, tile=tile, programs=programs
        )
    return gather_reference(layers, layout, ids, out)


def scatter_blocks(
    kv_caches: KVCaches | PagedKVCache,
    block_ids: BlockIds,
    pages: torch.Tensor,
    *,
    impl: Impl = "auto",
    tile: int | None = None,
    programs: int | None = None,
) -> None:
    """Write ``pages[i, l]`` into block ``block_ids[i]`` of layer ``l``; ids must be unique
    (two writers of one block race on a GPU)."""
    cache = PagedKVCache.of(kv_caches)
    ids = _ids_tensor(block_ids, cache, unique=True)
    _check_pages(pages, cache, ids.numel(), "pages")
    if ids.numel() == 0:
        return
    layers = list(cache.layers)
    if _use_triton(cache, impl):
        from prefixmesh.kernels.triton_impl import scatter_triton

        scatter_triton(
            layers, cache.layout, ids, pages, cache.layer_offsets, tile=tile, programs=programs
        )
        return
    scatter_reference(layers, cache.layout, ids, pages)


def scatter_layer(
    kv_caches: KVCaches | PagedKVCache, layer: int, block_ids: BlockIds, pages: torch.Tensor
) -> None:
    """Write ``pages[i]`` (one layer's pages, ``[n, *page_shape]``) into block ``block_ids[i]``
    of layer ``layer`` only: a load that goes one layer at a time, each layer ready for its
    attention while the next is copied. Torch on every device (ids unique)."""
    cache = PagedKVCache.of(kv_caches)
    layout = cache.layout
    if layer not in range(layout.num_layers):
        raise ValueError(f"layer {layer} out of range [0, {layout.num_layers})")
    ids = _ids_tensor(block_ids, cache, unique=True)
    want = (ids.numel(), *layout.page_shape)
    if tuple(pages.shape) != want or pages.dtype != layout.dtype:
        raise ValueError(
            f"pages are {tuple(pages.shape)} {pages.dtype}, expected {want} {layout.dtype}"
        )
    if pages.device != layout.device:
        raise ValueError(f"pages are on {pages.device}, the KV cache is on {layout.device}")
    if ids.numel():
        scatter_layer_reference(cache.layers[layer], layout, ids, pages)
