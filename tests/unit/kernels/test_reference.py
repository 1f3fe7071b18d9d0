"""The torch path: exact against plain indexing for every vLLM 0.32 layout, dtypes, block sizes,
round trips, and the errors."""

from __future__ import annotations

import random

import pytest
import torch

from prefixmesh.kernels import PagedKVCache, describe, gather_blocks, scatter_blocks, scatter_layer

from .helpers import FP8, VLLM_LAYOUTS, bits, expected_pages, random_bits, vllm_cache

DTYPES = [torch.float32, torch.float16, torch.bfloat16, *FP8]


def _bit_layers(layers: list[torch.Tensor]) -> list[torch.Tensor]:
    return [bits(layer) for layer in layers]


@pytest.mark.parametrize("layout", VLLM_LAYOUTS)
def test_gather_matches_indexing_in_every_layout(layout: str) -> None:
    _, layers = vllm_cache(layout, layers=3, blocks=12)
    ids = [5, 0, 11, 5, 7]  # a duplicate too
    out = gather_blocks(layers, ids, impl="torch")
    want = expected_pages(_bit_layers(layers), layout, ids)
    assert out.shape == want.shape
    assert torch.equal(bits(out), want)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("block_size", [16, 32, 128])
def test_round_trip_is_exact(dtype: torch.dtype, block_size: int) -> None:
    rng = random.Random(block_size)
    _, layers = vllm_cache("LBNHC", blocks=20, block_size=block_size, dtype=dtype, seed=1)
    ids = rng.sample(range(20), 7)
    pages = gather_blocks(layers, ids, impl="torch")
    _, empty = vllm_cache("LBNHC", blocks=20, block_size=block_size, dtype=dtype, seed=2)
    before = [bits(layer).clone() for layer in empty]
    scatter_blocks(empty, ids, pages, impl="torch")
    for old, new, src in zip(before, empty, layers, strict=True):
        for block in range(20):
            want = bits(src)[block] if block in ids else old[block]
            assert torch.equal(bits(new)[block], want), block
    assert torch.equal(bits(gather_blocks(empty, ids, impl="torch")), bits(pages))


@pytest.mark.parametrize("layout", VLLM_LAYOUTS)
def test_scatter_then_gather_random_lists(layout: str) -> None:
    rng = random.Random(layout)
    _, layers = vllm_cache(layout, blocks=32, seed=3)
    cache = PagedKVCache.of(layers)
    for trial in range(5):
        ids = rng.sample(range(32), rng.randint(1, 12))
        pages = random_bits(cache.layout.staging_shape(len(ids)), torch.bfloat16, seed=trial)
        scatter_blocks(cache, ids, pages)
        assert torch.equal(bits(gather_blocks(cache, ids)), bits(pages))


def test_legacy_kv_dim_first_layout() -> None:
    # Older vLLM FlashAttention: [2, num_blocks, block_size, heads, head_dim], blocks dim 1.
    layers = [random_bits((2, 8, 16, 2, 32), torch.float16, seed=s) for s in range(2)]
    layout = describe(layers, block_dim=1)
    assert (layout.num_segments, layout.segment_elems) == (2, 16 * 2 * 32)
    cache = PagedKVCache.of(layers, block_dim=1)
    out = gather_blocks(cache, [6, 1])
    assert out.shape == (2, 2, 2, 16, 2, 32)
    assert torch.equal(bits(out[0, 1]), bits(layers[1][:, 6]))
    assert torch.equal(bits(out[1, 0]), bits(layers[0][:, 1]))


def test_layout_descriptor_segments() -> None:
    _, compact = vllm_cache("LBNHC", layers=2, blocks=4, heads=2, block_size=16, content=64)
    layout = describe(compact)
    assert (layout.num_segments, layout.segment_elems) == (1, 2 * 16 * 64)
    assert layout.page_shape == (16, 2, 64)
    assert layout.layer_offsets == (0, 4 * 2 * 16 * 64)
    _, head_outer = vllm_cache("LHBNC", layers=2, blocks=4, heads=2, block_size=16, content=64)
    layout = describe(head_outer)
    assert (layout.num_segments, layout.segment_elems) == (2, 16 * 64)
    assert layout.segment_stride == 4 * 16 * 64


def test_separate_layer_allocations() -> None:
    layers = [random_bits((6, 2, 16, 32), torch.float32, seed=s) for s in range(3)]
    out = gather_blocks(layers, [4, 4, 0])
    for index, layer in enumerate(layers):
        assert torch.equal(bits(out[:, index]), bits(layer[[4, 4, 0]]))


def test_empty_list_is_a_no_op() -> None:
    _, layers = vllm_cache("LBHNC")
    before = [layer.clone() for layer in layers]
    out = gather_blocks(layers, [])
    assert out.shape == (0, 2, 2, 16, 64)
    scatter_blocks(layers, torch.empty(0, dtype=torch.int32), out)
    assert all(torch.equal(bits(a), bits(b)) for a, b in zip(before, layers, strict=True))


@pytest.mark.parametrize("bad", [[3, 16, 2], [-1], [99, 16, 17]])
def test_out_of_range_ids_are_named(bad: list[int]) -> None:
    _, layers = vllm_cache("LBHNC", blocks=16)
    offending = [b for b in bad if not 0 <= b < 16]
    with pytest.raises(ValueError, match=r"out of range \[0, 16\)") as error:
        gather_blocks(layers, bad)
    assert str(offending) in str(error.value)
    pages = torch.zeros((len(bad), 2, 2, 16, 64), dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="out of range"):
        scatter_blocks(layers, torch.tensor(bad), pages)


def test_scatter_rejects_duplicates() -> None:
    _, layers = vllm_cache("LBHNC")
    pages = torch.zeros((3, 2, 2, 16, 64), dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"unique.*\[4\]"):
        scatter_blocks(layers, [4, 1, 4], pages)


def test_mismatched_inputs_are_rejected() -> None:
    _, layers = vllm_cache("LBHNC")
    with pytest.raises(ValueError, match="layer 1 has dtype"):
        gather_blocks([layers[0], layers[1].float()], [0])
    with pytest.raises(ValueError, match="layer 1 has shape"):
        gather_blocks([layers[0], layers[1][:8]], [0])
    with pytest.raises(ValueError, match="out has shape"):
        gather_blocks(layers, [0, 1], out=torch.empty((1, 2, 2, 16, 64), dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="out has dtype"):
        gather_blocks(layers, [0], out=torch.empty((1, 2, 2, 16, 64), dtype=torch.float16))
    with pytest.raises(ValueError, match="pages has shape"):
        scatter_blocks(layers, [0], torch.empty((1, 2, 16, 2, 64), dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="empty"):
        gather_blocks([], [0])
    with pytest.raises(ValueError, match="integers"):
        gather_blocks(layers, torch.tensor([1.0]))


def test_out_buffer_is_filled_in_place() -> None:
    _, layers = vllm_cache("BLHNC")
    out = torch.empty((2, 2, 2, 16, 64), dtype=torch.bfloat16)
    assert gather_blocks(layers, torch.tensor([3, 9], dtype=torch.int32), out=out) is out
    assert torch.equal(bits(out), expected_pages(_bit_layers(layers), "BLHNC", [3, 9]))


@pytest.mark.parametrize("layout", VLLM_LAYOUTS)
def test_scattering_layer_by_layer_equals_one_scatter(layout: str) -> None:
    _, layers = vllm_cache(layout, layers=3, blocks=12, seed=4)
    ids = [9, 2, 4]
    pages = random_bits(PagedKVCache.of(layers).layout.staging_shape(3), torch.bfloat16, seed=5)
    _, by_layer = vllm_cache(layout, layers=3, blocks=12, seed=4)
    scatter_blocks(layers, ids, pages, impl="torch")
    for layer in (2, 0, 1):  # any order: each call touches its own layer only
        scatter_layer(by_layer, layer, ids, pages[:, layer].contiguous())
    for want, got in zip(layers, by_layer, strict=True):
        assert torch.equal(bits(want), bits(got))


def test_scatter_layer_rejects_a_wrong_layer_or_shape() -> None:
    _, layers = vllm_cache("LBNHC", layers=2, blocks=4)
    page_shape = PagedKVCache.of(layers).layout.page_shape
    with pytest.raises(ValueError, match="layer 2 out of range"):
        scatter_layer(layers, 2, [0], torch.zeros((1, *page_shape), dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="expected"):
        scatter_layer(layers, 0, [0, 1], torch.zeros((1, *page_shape), dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="unique"):
        scatter_layer(layers, 0, [1, 1], torch.zeros((2, *page_shape), dtype=torch.bfloat16))
