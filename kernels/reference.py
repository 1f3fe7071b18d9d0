"""Pure-torch gather/scatter: the oracle in tests and the implementation on CPU.

Works on same-width integer views (bit-exact; CPU ``index_copy_`` has no fp8 kernel).
Ids are validated by the caller (kernels/ops.py).
"""

from __future__ import annotations

import torch

from prefixmesh.kernels.layout import BlockLayout, int_view_dtype


def _inverse(perm: tuple[int, ...]) -> tuple[int, ...]:
    inverse = [0] * len(perm)
    for position, dim in enumerate(perm):
        inverse[dim] = position
    return tuple(inverse)


def gather_reference(
    layers: list[torch.Tensor], layout: BlockLayout, ids: torch.Tensor, out: torch.Tensor
) -> torch.Tensor:
    """``out[i, l] = layers[l][ids[i]]`` with the page in physical order."""
    view = int_view_dtype(layout.dtype)
    out_int = out.view(view)
    perm = (0, *layout.page_perm)
    for index, layer in enumerate(layers):
        picked = layer.view(view).index_select(layout.block_dim, ids)
        out_int[:, index].copy_(picked.movedim(layout.block_dim, 0).permute(perm))
    return out


def scatter_reference(
    layers: list[torch.Tensor], layout: BlockLayout, ids: torch.Tensor, pages: torch.Tensor
) -> None:
    """``layers[l][ids[i]] = pages[i, l]`` (ids unique)."""
    for index, layer in enumerate(layers):
        scatter_layer_reference(layer, layout, ids, pages[:, index])


def scatter_layer_reference(
    layer: torch.Tensor, layout: BlockLayout, ids: torch.Tensor, pages: torch.Tensor
) -> None:
    """``layer[ids[i]] = pages[i]``: one layer's pages ``[n, *page_shape]`` (ids unique)."""
    view = int_view_dtype(layout.dtype)
    source = pages.view(view).permute(_inverse((0, *layout.page_perm)))
    layer.view(view).index_copy_(layout.block_dim, ids, source.movedim(0, layout.block_dim))
