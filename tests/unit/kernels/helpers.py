"""Small KV caches in each of vLLM 0.32's physical layouts, as per-layer logical views."""

from __future__ import annotations

import torch

# vllm.v1.kv_cache_layout.KVCacheLayout members: physical order of the logical (L, B, H, N, C).
VLLM_LAYOUTS = ("LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC")

FP8 = [
    dtype
    for dtype in (getattr(torch, "float8_e4m3fn", None), getattr(torch, "float8_e5m2", None))
    if dtype is not None
]


def random_bits(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random bit patterns (NaNs, -0 and infs included) of ``dtype``."""
    gen = torch.Generator().manual_seed(seed)
    size = torch.empty((), dtype=dtype).element_size()
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[size]
    info = torch.iinfo(ints)
    raw = torch.randint(info.min, info.max, shape, generator=gen, dtype=torch.int64)
    return raw.to(ints).view(dtype)


def vllm_cache(
    layout: str,
    *,
    layers: int = 2,
    blocks: int = 16,
    heads: int = 2,
    block_size: int = 16,
    content: int = 64,
    dtype: torch.dtype = torch.bfloat16,
    device: str = "cpu",
    seed: int = 0,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One raw buffer in ``layout``'s physical order and its per-layer [B, H, N, C] views."""
    sizes = {"L": layers, "B": blocks, "H": heads, "N": block_size, "C": content}
    physical = tuple(sizes[axis] for axis in layout)
    raw = random_bits(physical, dtype, seed).to(device)
    logical = raw.permute(*(layout.index(axis) for axis in "LBHNC"))
    return raw, [logical[index] for index in range(layers)]


def expected_pages(layers: list[torch.Tensor], layout: str, ids: list[int]) -> torch.Tensor:
    """The page-first buffer built by plain indexing: page interior in physical H/N/C order."""
    interior = sorted(range(3), key=lambda dim: layout.index("HNC"[dim]))
    if not ids:
        shape = layers[0].shape[1:]
        return torch.empty((0, len(layers), *(shape[d] for d in interior)), dtype=layers[0].dtype)
    return torch.stack(
        [torch.stack([layer[b].permute(*interior) for layer in layers]) for b in ids]
    )


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """Integer view for bit-exact comparison (NaN payloads compare equal)."""
    size = tensor.element_size()
    return tensor.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[size])
