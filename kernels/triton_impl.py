"""Triton gather/scatter: one launch moves every layer of every requested block.

Work item = (page i, layer l, segment s, tile t): a copy of up to TILE contiguous elements of
``layers[l][ids[i]]``'s segment s into (or out of) the page-first buffer. Layers are reached as
element offsets from the lowest-addressed layer (vLLM's layers are views into one allocation;
separate allocations work too, since the addresses share one space). A persistent grid of
``programs`` instances walks the items with a stride, so a caller can confine the copy to a few
SMs (Strata's interference control) or use one instance per item.

triton is imported and the kernels are built on first use, not at import: the interpreter
(``TRITON_INTERPRET=1``, used by the CPU tests) is chosen when ``@triton.jit`` runs.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

from prefixmesh.kernels.layout import BlockLayout, int_view_dtype

# Elements per tile: 4096 x 2 B = 8 KiB per item, enough in flight per program on GPU.
DEFAULT_TILE = 4096


@dataclass(frozen=True, slots=True)
class _Kernels:
    copy: Any
    next_power_of_2: Any


@functools.cache
def _kernels() -> _Kernels:
    import triton
    import triton.language as tl

    # triton.jit is unannotated, and Triton reads a parameter's annotation as its kind
    # (tl.constexpr): the pointers and sizes stay unannotated.
    @triton.jit  # type: ignore[untyped-decorator]
    def _copy(  # type: ignore[no-untyped-def]
        cache_ptr,
        pages_ptr,
        ids_ptr,
        layer_off_ptr,
        num_items,
        block_stride,
        segment_stride,
        SEG_ELEMS: tl.constexpr,
        NUM_SEGS: tl.constexpr,
        NUM_LAYERS: tl.constexpr,
        TILES: tl.constexpr,
        TILE: tl.constexpr,
        TO_PAGES: tl.constexpr,
    ):
        # Items are ordered (page, layer, segment, tile) so neighbours touch neighbouring bytes
        # of the page-first buffer.
        for item in range(tl.program_id(0), num_items, tl.num_programs(0)):
            tile = item % TILES
            rest = item // TILES
            seg = rest % NUM_SEGS
            rest = rest // NUM_SEGS
            layer = rest % NUM_LAYERS
            page = rest // NUM_LAYERS
            block = tl.load(ids_ptr + page).to(tl.int64)  # int64: caches pass 2**31 elements
            offs = tile * TILE + tl.arange(0, TILE)
            mask = offs < SEG_ELEMS
            src_off = (
                tl.load(layer_off_ptr + layer)
                + block * block_stride
                + seg.to(tl.int64) * segment_stride
                + offs
            )
            page_off = ((page.to(tl.int64) * NUM_LAYERS + layer) * NUM_SEGS + seg) * SEG_ELEMS
            dst_off = page_off + offs
            if TO_PAGES:
                tl.store(pages_ptr + dst_off, tl.load(cache_ptr + src_off, mask=mask), mask=mask)
            else:
                tl.store(cache_ptr + src_off, tl.load(pages_ptr + dst_off, mask=mask), mask=mask)

    return _Kernels(copy=_copy, next_power_of_2=triton.next_power_of_2)


def kernel_is_interpreted() -> bool:
    """True when the kernels were built for Triton's CPU interpreter."""
    return type(_kernels().copy).__name__ == "InterpretedFunction"


def _launch(
    layers: list[torch.Tensor],
    layout: BlockLayout,
    ids: torch.Tensor,
    pages: torch.Tensor,
    layer_offsets: torch.Tensor,
    *,
    to_pages: bool,
    tile: int | None,
    programs: int | None,
) -> None:
    kernels = _kernels()
    view = int_view_dtype(layout.dtype)
    base = layers[layout.base_layer].view(view)
    tile_elems = kernels.next_power_of_2(min(layout.segment_elems, tile or DEFAULT_TILE))
    tiles = -(-layout.segment_elems // tile_elems)
    num_items = ids.numel() * layout.num_layers * layout.num_segments * tiles
    grid = (max(1, min(num_items, programs or num_items)),)
    kernels.copy[grid](
        base,
        pages.view(view),
        ids,
        layer_offsets,
        num_items,
        layout.block_stride,
        layout.segment_stride,
        SEG_ELEMS=layout.segment_elems,
        NUM_SEGS=layout.num_segments,
        NUM_LAYERS=layout.num_layers,
        TILES=tiles,
        TILE=tile_elems,
        TO_PAGES=to_pages,
    )


def gather_triton(
    layers: list[torch.Tensor],
    layout: BlockLayout,
    ids: torch.Tensor,
    out: torch.Tensor,
    layer_offsets: torch.Tensor,
    *,
    tile: int | None = None,
    programs: int | None = None,
) -> torch.Tensor:
    _launch(layers, layout, ids, out, layer_offsets, to_pages=True, tile=tile, programs=programs)
    return out


def scatter_triton(
    layers: list[torch.Tensor],
    layout: BlockLayout,
    ids: torch.Tensor,
    pages: torch.Tensor,
    layer_offsets: torch.Tensor,
    *,
    tile: int | None = None,
    programs: int | None = None,
) -> None:
    _launch(layers, layout, ids, pages, layer_offsets, to_pages=False, tile=tile, programs=programs)
