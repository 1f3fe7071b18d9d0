"""Layout descriptor of an engine's paged KV cache, and of the page-first staging buffer.

vLLM 0.32 (the version we pin) hands a connector one tensor per attention layer, each a
*logical* ``[num_blocks, H, N, C]`` view (``vllm/v1/kv_cache_interface.py``,
``create_kv_cache_views``): H = KV head slots, N = tokens per block, C = ``head_size +
head_size_v`` elements, i.e. K and V share the last dim (no separate K/V axis). The *physical*
order is one of ``vllm.v1.kv_cache_layout.KVCacheLayout`` (LBHNC, LBNHC, LHBNC, BLHNC, BLNHC,
BHLNC): layers may be views into one raw buffer at a fixed layer stride, and blocks are always
dim 0 of the per-layer view. Older vLLM layouts put K/V in a leading dim of size 2
(``[2, num_blocks, ...]``, blocks dim 1); ``block_dim=1`` covers them.

A block's page (everything but the block dim) is copied in *physical* order: an engine page is
then one to a few contiguous runs ("segments"), so a transfer is a handful of long memcpys and
the staging buffer ``[n, num_layers, *page_shape]`` is page-first (all layers of a block
together), which the CPU and disk tiers want. A page stored by one engine layout is read back
by the same layout; the descriptor says which.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

# Same-width integer views: copies are then bit-exact for every float format (fp8 included,
# which CPU index_copy_ and some Triton targets do not handle as floats).
_INT_VIEW: dict[int, torch.dtype] = {
    1: torch.uint8,
    2: torch.int16,
    4: torch.int32,
    8: torch.int64,
}

KVCaches = Sequence[torch.Tensor] | Mapping[str, torch.Tensor]


def int_view_dtype(dtype: torch.dtype) -> torch.dtype:
    """The integer dtype of the same width as ``dtype``."""
    size = torch.empty((), dtype=dtype).element_size()
    try:
        return _INT_VIEW[size]
    except KeyError:
        raise ValueError(f"unsupported KV cache dtype {dtype} ({size} bytes)") from None


@dataclass(frozen=True, slots=True)
class BlockLayout:
    """Where block ``b`` of layer ``l`` lives, in elements from the lowest-addressed layer.

    Page of (l, b) = ``num_segments`` runs of ``segment_elems`` contiguous elements starting at
    ``layer_offsets[l] + b * block_stride + s * segment_stride``.
    """

    num_layers: int
    num_blocks: int
    block_dim: int
    dtype: torch.dtype
    device: torch.device
    # Sizes of the page dims in physical (outer to inner) order, and their logical positions
    # in the per-layer tensor once the block dim is moved to 0 (1-based).
    page_shape: tuple[int, ...]
    page_perm: tuple[int, ...]
    num_segments: int
    segment_elems: int
    segment_stride: int
    block_stride: int
    layer_offsets: tuple[int, ...]
    base_layer: int

    @property
    def page_elems(self) -> int:
        return self.num_segments * self.segment_elems

    @property
    def page_bytes(self) -> int:
        return self.page_elems * torch.empty((), dtype=self.dtype).element_size()

    def staging_shape(self, num_ids: int) -> tuple[int, ...]:
        """Shape of the page-first buffer for ``num_ids`` blocks."""
        return (num_ids, self.num_layers, *self.page_shape)


def as_layer_list(kv_caches: KVCaches) -> list[torch.Tensor]:
    """vLLM's connector gets ``dict[layer_name, tensor]`` (insertion order = layer order)."""
    layers = list(kv_caches.values()) if isinstance(kv_caches, Mapping) else list(kv_caches)
    if not layers:
        raise ValueError("kv_caches is empty: need at least one layer tensor")
    return layers


def _page_runs(sizes: list[int], strides: list[int]) -> tuple[tuple[int, ...], int, int, int]:
    """Physical order of the page dims, then (segments, segment_elems, segment_stride).

    Contiguous inner dims merge into one run; the outer rest must form one strided axis
    (vLLM's head-outer layouts LHBNC/BHLNC, or the legacy K/V dim), else the layout is refused.
    """
    dims = [d for d in range(len(sizes)) if sizes[d] > 1]
    # Size-1 dims carry arbitrary strides (vLLM canonicalises them only for TMA): ignore them.
    order = sorted(dims, key=lambda d: -strides[d])
    run, i = 1, len(order) - 1
    while i >= 0 and strides[order[i]] == run:
        run *= sizes[order[i]]
        i -= 1
    outer = order[: i + 1]
    if not outer:
        segments, seg_stride = 1, run
    else:
        segments = 1
        for d in outer:
            segments *= sizes[d]
        inner_most = outer[-1]
        seg_stride = strides[inner_most]
        expected = seg_stride
        for d in reversed(outer):
            if strides[d] != expected:
                raise ValueError(
                    f"unsupported KV cache page layout: sizes {sizes}, strides {strides} "
                    "(the page must be a contiguous run times at most one strided axis)"
                )
            expected *= sizes[d]
        if seg_stride < run:
            raise ValueError(f"overlapping KV cache page layout: strides {strides}")
    full_order = order + [d for d in range(len(sizes)) if sizes[d] <= 1]
    return tuple(full_order), segments, run, seg_stride


def describe(kv_caches: KVCaches, block_dim: int = 0) -> BlockLayout:
    """Check that all layers agree and derive the descriptor the kernels run on."""
    layers = as_layer_list(kv_caches)
    first = layers[0]
    if block_dim not in range(first.dim()):
        raise ValueError(f"block_dim {block_dim} out of range for a {first.dim()}-d layer tensor")
    for index, layer in enumerate(layers):
        for what, got, want in (
            ("shape", tuple(layer.shape), tuple(first.shape)),
            ("stride", layer.stride(), first.stride()),
            ("dtype", layer.dtype, first.dtype),
            ("device", layer.device, first.device),
        ):
            if got != want:
                raise ValueError(f"layer {index} has {what} {got}, layer 0 has {want}")
    int_view_dtype(first.dtype)
    rest = [d for d in range(first.dim()) if d != block_dim]
    sizes = [first.shape[d] for d in rest]
    strides = [first.stride(d) for d in rest]
    order, segments, seg_elems, seg_stride = _page_runs(sizes, strides)
    itemsize = first.element_size()
    pointers = [layer.data_ptr() for layer in layers]
    base = min(range(len(layers)), key=pointers.__getitem__)
    offsets = []
    for index, pointer in enumerate(pointers):
        delta = pointer - pointers[base]
        if delta % itemsize:
            raise ValueError(f"layer {index} is not element-aligned with layer {base}")
        offsets.append(delta // itemsize)
    return BlockLayout(
        num_layers=len(layers),
        num_blocks=first.shape[block_dim],
        block_dim=block_dim,
        dtype=first.dtype,
        device=first.device,
        page_shape=tuple(sizes[d] for d in order),
        page_perm=tuple(d + 1 for d in order),
        num_segments=segments,
        segment_elems=seg_elems,
        segment_stride=seg_stride,
        block_stride=first.stride(block_dim),
        layer_offsets=tuple(offsets),
        base_layer=base,
    )
