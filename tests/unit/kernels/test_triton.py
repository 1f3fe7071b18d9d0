"""The Triton kernels against the torch reference: under TRITON_INTERPRET=1 on CPU tensors
(small grids: the interpreter costs about 1 ms per work item), natively when a GPU is lent."""

from __future__ import annotations

import random

import pytest
import torch

pytest.importorskip("triton")
pytest.importorskip("numpy")  # the interpreter imports it

from prefixmesh.kernels import PagedKVCache, gather_blocks, scatter_blocks
from prefixmesh.kernels.triton_impl import kernel_is_interpreted

from .helpers import FP8, VLLM_LAYOUTS, bits, random_bits, vllm_cache

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
TILE = 1 << 14  # one tile per segment at test sizes: fewer interpreted programs


def _check_gather(layers: list[torch.Tensor], ids: list[int], **kwargs: int) -> torch.Tensor:
    want = gather_blocks(layers, ids, impl="torch")
    got = gather_blocks(layers, ids, impl="triton", **kwargs)
    assert torch.equal(bits(got), bits(want))
    return got


def test_interpreter_is_used_without_a_gpu() -> None:
    assert kernel_is_interpreted() is not CUDA


@pytest.mark.parametrize("layout", VLLM_LAYOUTS)
def test_gather_and_scatter_in_every_layout(layout: str) -> None:
    _, layers = vllm_cache(layout, device=DEVICE)
    ids = [9, 2, 9]
    _check_gather(layers, ids, tile=TILE)
    cache = PagedKVCache.of(layers)
    pages = random_bits(cache.layout.staging_shape(2), torch.bfloat16, seed=5).to(DEVICE)
    _, twin = vllm_cache(layout, device=DEVICE)
    scatter_blocks(layers, [4, 13], pages, impl="triton", tile=TILE)
    scatter_blocks(twin, [4, 13], pages, impl="torch")
    for a, b in zip(layers, twin, strict=True):
        assert torch.equal(bits(a), bits(b))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, *FP8], ids=str)
def test_dtypes(dtype: torch.dtype) -> None:
    _, layers = vllm_cache("LBNHC", dtype=dtype, device=DEVICE)
    pages = _check_gather(layers, [0, 15], tile=TILE)
    _, empty = vllm_cache("LBNHC", dtype=dtype, device=DEVICE, seed=9)
    scatter_blocks(empty, [0, 15], pages, impl="triton", tile=TILE)
    assert torch.equal(bits(gather_blocks(empty, [0, 15], impl="torch")), bits(pages))


def test_block_size_128_with_small_tiles_and_a_persistent_grid() -> None:
    # 2 ids x 2 layers x 4 tiles = 16 items walked by 3 programs; head size 80 (not a power of 2).
    _, layers = vllm_cache("LBHNC", heads=1, block_size=128, content=160, device=DEVICE)
    _check_gather(layers, [7, 3], tile=8192, programs=3)


def test_random_lists_with_duplicates_and_int32_ids() -> None:
    rng = random.Random(0)
    _, layers = vllm_cache("BLNHC", blocks=32, device=DEVICE)
    ids = [rng.randrange(32) for _ in range(6)] + [1, 1]
    want = gather_blocks(layers, ids, impl="torch")
    got = gather_blocks(layers, torch.tensor(ids, dtype=torch.int32), impl="triton", tile=TILE)
    assert torch.equal(bits(got), bits(want))


def test_empty_list_launches_nothing() -> None:
    _, layers = vllm_cache("LBHNC", device=DEVICE)
    assert gather_blocks(layers, [], impl="triton").shape == (0, 2, 2, 16, 64)
    scatter_blocks(layers, [], torch.empty((0, 2, 2, 16, 64), dtype=torch.bfloat16, device=DEVICE))


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("layout", VLLM_LAYOUTS)
def test_gpu_llama_like_shape(layout: str) -> None:
    # 8 KV heads, head dim 128 (C = 256), 16-token blocks, default tiles and grid.
    _, layers = vllm_cache(
        layout, layers=4, blocks=256, heads=8, block_size=16, content=256, device="cuda"
    )
    rng = random.Random(layout)
    ids = rng.sample(range(256), 64)
    pages = _check_gather(layers, ids)
    _, twin = vllm_cache(
        layout, layers=4, blocks=256, heads=8, block_size=16, content=256, device="cuda", seed=4
    )
    _, twin_ref = vllm_cache(
        layout, layers=4, blocks=256, heads=8, block_size=16, content=256, device="cuda", seed=4
    )
    scatter_blocks(twin, ids, pages, impl="triton", programs=2)
    scatter_blocks(twin_ref, ids, pages, impl="torch")
    for a, b in zip(twin, twin_ref, strict=True):
        assert torch.equal(bits(a), bits(b))
