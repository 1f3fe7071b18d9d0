"""``prefixmesh tier-bench``'s arguments."""

from __future__ import annotations

import pytest

from prefixmesh.config import ENGINE_BLOCK_SIZES
from prefixmesh.loadtest.bench.tier import parse_args


def test_the_default_block_size_is_the_one_vllm_replicas_run() -> None:
    args = parse_args([], prog="tier-bench")
    assert args.block_size == ENGINE_BLOCK_SIZES["vllm"]
    assert args.prefix_tokens % args.block_size == 0


def test_a_prefix_that_is_not_whole_blocks_is_refused() -> None:
    with pytest.raises(SystemExit):
        parse_args(["--prefix-tokens", "2000", "--block-size", "128"], prog="tier-bench")
