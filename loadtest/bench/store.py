"""``prefixmesh store-bench``: the KV connector's own CPU-tier path on a GPU (issues 7 and 8).

``kernels-bench`` times the kernels; this times what a vLLM step runs through them:
``TierStore.run`` storing a prefix's blocks (one gather, then one device-to-host copy per run
of consecutive slab slots into the pinned slab) and ``TierStore.load`` bringing them back into
other engine blocks (host-to-device copies per slot run, then one scatter), for an 8B-model
layout (Llama-3-8B: 32 layers, 8 KV heads, head dim 128, bf16), next to one large pinned copy
of the same bytes each way. A fragmented slab (every other slot taken) is timed too, and one
round trip is checked bit for bit. Needs CUDA; there is no CPU mode (the CPU path is the
tests' and ``tier-bench``'s).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict

import torch

from prefixmesh.cache_registry.types import BlockHash, Tier
from prefixmesh.cli_help import command_parser
from prefixmesh.kernels.ops import gather_blocks
from prefixmesh.loadtest.bench.kernels import (
    CEILING,
    LOAD_CEILING,
    Row,
    add_layout_args,
    cuda_cache,
    median_cuda_ms,
    print_rows,
)
from prefixmesh.replica.kvcache.plan import DropJob, LoadJob, StoreJob
from prefixmesh.replica.kvcache.store import TierStore


def parse_args(argv: list[str], prog: str) -> argparse.Namespace:
    parser = command_parser(prog, __doc__)
    add_layout_args(parser, tokens="2048,8192,32768")
    parser.add_argument("--json", help="write the results here, JSON (default: none)")
    return parser.parse_args(argv)


def _rows(args: argparse.Namespace, store: TierStore, num_blocks: int, tokens: int) -> list[Row]:
    n = tokens // args.block_size
    order = torch.randperm(num_blocks).tolist()
    sources, targets = order[:n], order[n : 2 * n]
    hashes = [BlockHash(index) for index in range(n)]
    nbytes = n * store.page_bytes
    drops = [DropJob(block, Tier.CPU) for block in hashes]
    stores = [StoreJob(block, engine) for block, engine in zip(hashes, sources, strict=True)]
    loads = [
        LoadJob(block, Tier.CPU, engine) for block, engine in zip(hashes, targets, strict=True)
    ]
    flat = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def store_prefix() -> None:
        store.run(drops)  # frees the slots: every timed run writes the whole prefix again
        store.run(stores)

    def load_prefix() -> None:
        assert store.load(loads) == []

    # Fill every other slot first so the prefix's slots are single, scattered runs.
    fillers = [BlockHash(10**9 + index) for index in range(n)]

    def store_fragmented() -> None:
        store.run(drops + [DropJob(block, Tier.CPU) for block in fillers])
        store.run([StoreJob(block, sources[0]) for block in fillers])
        store.run([DropJob(block, Tier.CPU) for block in fillers[1::2]])
        store.run(stores[: n // 2])

    def ceiling() -> None:
        host.copy_(flat, non_blocking=True)

    def load_ceiling() -> None:
        flat.copy_(host, non_blocking=True)

    timed = {
        CEILING: ceiling,
        "store: gather + D2H into the slab": store_prefix,
        LOAD_CEILING: load_ceiling,
        "load: H2D from the slab + scatter": load_prefix,
    }
    results = {name: median_cuda_ms(run, args.repeats) for name, run in timed.items()}
    store_prefix()
    load_prefix()
    torch.cuda.synchronize()
    same = torch.equal(
        gather_blocks(store.cache, sources).view(torch.int16),
        gather_blocks(store.cache, targets).view(torch.int16),
    )
    print(f"{tokens} tokens: loaded blocks equal the stored ones bit for bit: {same}")
    if not same:
        raise SystemExit(1)
    fragmented = median_cuda_ms(store_fragmented, args.repeats)
    rows = []
    for name, ms in results.items():
        best = results[LOAD_CEILING if name.startswith("load") else CEILING]
        rows.append(Row(tokens, name, nbytes / 2**20, ms, nbytes / ms / 1e6, best / ms))
    # The fragmented run also stores n fillers and n/2 of the prefix: time per byte moved.
    moved = nbytes + nbytes // 2
    ceiling_per_byte = results[CEILING] / nbytes
    rows.append(
        Row(
            tokens,
            "store into a fragmented slab",
            moved / 2**20,
            fragmented,
            moved / fragmented / 1e6,
            ceiling_per_byte * moved / fragmented,
        )
    )
    return rows


def main(argv: list[str], prog: str = "store-bench") -> int:
    args = parse_args(argv, prog)
    if not torch.cuda.is_available():
        print(f"{prog}: needs a CUDA GPU (none visible)")
        return 2
    tokens = [int(t) for t in args.tokens.split(",")]
    max_blocks = max(tokens) // args.block_size
    raw, cache = cuda_cache(args, 2 * max_blocks)
    store = TierStore(cache, cpu_capacity_blocks=2 * max_blocks, disk=None)
    device = torch.cuda.get_device_name()
    print(f"device: {device}; layout {tuple(raw.shape)} bf16, CPU tier of {2 * max_blocks} slots")
    rows = [row for count in tokens for row in _rows(args, store, 2 * max_blocks, count)]
    print_rows(rows)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump({"device": device, "rows": [asdict(row) for row in rows]}, handle, indent=2)
    return 0
