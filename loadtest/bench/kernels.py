"""``prefixmesh kernels-bench``: offload bandwidth of a prefix's KV blocks (issue 8, D4).

On CUDA, for an 8B-model layout (Llama-3-8B: 32 layers, 8 KV heads, head dim 128, bf16, in
vLLM 0.32's per-layer views of one LBNHC buffer), a prefix of 2K-32K tokens in scattered
blocks goes to pinned host memory by
  (a) our gather into a device staging buffer + one device-to-host copy,
  (b) one copy per (layer, block) page,
  (c) torch index_select per layer into the staging buffer + one copy,
next to one large pinned copy of the same bytes (the link's practical ceiling); the load
direction (one host-to-device copy + our scatter) is timed too. Then a matmul loop runs on
one stream while gather + copy jobs (with the kernel confined to a few or given all SMs) or
copy + scatter jobs run on another, and its slowdown is reported (median of --trials).
Without CUDA it says so; ``--cpu`` times the torch reference on a tiny cache (a smoke test).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from prefixmesh.cli_help import command_parser
from prefixmesh.kernels.ops import PagedKVCache, gather_blocks, scatter_blocks

CEILING = "ceiling: one pinned D2H copy"
LOAD_CEILING = "load ceiling: one pinned H2D copy"


@dataclass(frozen=True, slots=True)
class Row:
    """One timed transfer of a prefix; ``of_ceiling`` is against one pinned copy of its bytes."""

    tokens: int
    path: str
    mib: float
    ms: float
    gb_s: float
    of_ceiling: float


@dataclass(frozen=True, slots=True)
class Interference:
    path: str
    programs: int | None
    matmul_alone_ms: float
    matmul_with_io_ms: float
    slowdown: float
    io_gb_s: float


def add_layout_args(parser: argparse.ArgumentParser, tokens: str) -> None:
    """The prefix sizes, the model's KV layout (Llama-3-8B by default) and the repeats."""
    parser.add_argument(
        "--tokens", default=tokens, metavar="T1,T2,...", help="prefix sizes in tokens, one row each"
    )
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    parser.add_argument("--layers", type=int, default=32, help="the model's attention layers")
    parser.add_argument("--kv-heads", type=int, default=8, help="KV heads per layer")
    parser.add_argument(
        "--head-dim", type=int, default=128, help="head dimension, in bf16 elements"
    )
    parser.add_argument(
        "--repeats", type=int, default=5, help="timed runs per transfer; the median is reported"
    )


def print_rows(rows: list[Row]) -> None:
    print(f"{'tokens':>6}  {'MiB':>7}  {'path':<36} {'ms':>9} {'GB/s':>7} {'of ceiling':>10}")
    for row in rows:
        print(
            f"{row.tokens:>6}  {row.mib:>7.0f}  {row.path:<36} {row.ms:>9.3f} "
            f"{row.gb_s:>7.1f} {row.of_ceiling:>9.0%}"
        )


def parse_args(argv: list[str], prog: str) -> argparse.Namespace:
    parser = command_parser(prog, __doc__)
    add_layout_args(parser, tokens="2048,4096,8192,16384,32768")
    parser.add_argument(
        "--programs",
        default="0,2,8,32",
        metavar="P1,P2,...",
        help="gather kernel instances (programs) for the interference runs, comma-separated; "
        "0: one per work item, all SMs",
    )
    parser.add_argument(
        "--matmul-size",
        type=int,
        default=8192,
        metavar="N",
        help="the interference runs' matmul: two N x N bf16 matrices",
    )
    parser.add_argument(
        "--compute-ms",
        type=float,
        default=300.0,
        help="matmul time per interference trial, in ms",
    )
    parser.add_argument(
        "--trials", type=int, default=3, help="interference trials; the median is reported"
    )
    parser.add_argument("--json", help="write the results here, JSON (default: none)")
    parser.add_argument(
        "--cpu", action="store_true", help="smoke-test the torch reference on CPU (no numbers)"
    )
    return parser.parse_args(argv)


def median_cuda_ms(run: Callable[[], None], repeats: int) -> float:
    """Median GPU time of ``run`` over ``repeats`` timed runs after one warm-up."""
    run()  # warm-up: kernel compile, allocator
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def cuda_cache(args: argparse.Namespace, num_blocks: int) -> tuple[torch.Tensor, PagedKVCache]:
    """A random bf16 cache of ``num_blocks`` in the shape ``args`` names (--layers, --kv-heads,
    --head-dim, --block-size): one raw buffer and its per-layer views."""
    # LBNHC, the default preference when the CUDA backends declare none (FlashAttention).
    shape = (args.layers, num_blocks, args.block_size, args.kv_heads, 2 * args.head_dim)
    raw = torch.empty(shape, dtype=torch.bfloat16, device="cuda").normal_()
    views = [raw[layer].permute(0, 2, 1, 3) for layer in range(args.layers)]
    return raw, PagedKVCache.of(views)


def _bandwidth_rows(
    args: argparse.Namespace, raw: torch.Tensor, cache: PagedKVCache, tokens: int
) -> list[Row]:
    n = tokens // args.block_size
    ids_list = torch.randperm(raw.shape[1])[:n].tolist()
    ids = torch.tensor(ids_list, dtype=torch.int64)
    shape = cache.layout.staging_shape(n)
    staging = torch.empty(shape, dtype=raw.dtype, device="cuda")
    host = torch.empty(shape, dtype=raw.dtype, pin_memory=True)
    flat = torch.empty(shape, dtype=raw.dtype, device="cuda")
    nbytes = staging.numel() * staging.element_size()

    def ours() -> None:
        gather_blocks(cache, ids, out=staging)
        host.copy_(staging, non_blocking=True)

    def per_block() -> None:
        for layer in range(args.layers):
            for index, block in enumerate(ids_list):
                host[index, layer].copy_(raw[layer, block], non_blocking=True)

    def index_select() -> None:
        gather_blocks(cache, ids, out=staging, impl="torch")
        host.copy_(staging, non_blocking=True)

    def ceiling() -> None:
        host.copy_(flat, non_blocking=True)

    def load_ours() -> None:
        staging.copy_(host, non_blocking=True)
        scatter_blocks(cache, ids, staging)

    def load_ceiling() -> None:
        flat.copy_(host, non_blocking=True)

    timed = {
        CEILING: ceiling,
        "(a) gather + one D2H copy": ours,
        "(b) one copy per block": per_block,
        "(c) index_select + one D2H copy": index_select,
        LOAD_CEILING: load_ceiling,
        "load: one H2D copy + scatter": load_ours,
    }
    results = {name: median_cuda_ms(run, args.repeats) for name, run in timed.items()}
    rows = []
    for name, ms in results.items():
        ceiling_ms = results[LOAD_CEILING if name.startswith("load") else CEILING]
        rows.append(Row(tokens, name, nbytes / 2**20, ms, nbytes / ms / 1e6, ceiling_ms / ms))
    return rows


def _interference(
    args: argparse.Namespace, raw: torch.Tensor, cache: PagedKVCache, tokens: int
) -> list[Interference]:
    size = args.matmul_size
    a = torch.randn(size, size, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(size, size, dtype=torch.bfloat16, device="cuda")
    compute, io = torch.cuda.Stream(), torch.cuda.Stream()

    def matmuls(count: int) -> tuple[torch.cuda.Event, torch.cuda.Event]:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(compute):
            start.record()
            for _ in range(count):
                torch.matmul(a, b)
            end.record()
        return start, end

    def matmuls_ms(count: int) -> float:
        start, end = matmuls(count)
        torch.cuda.synchronize()
        return start.elapsed_time(end)

    matmuls_ms(5)  # warm-up: cuBLAS's choice of kernel, clocks up
    per_mm = matmuls_ms(10) / 10
    count = max(10, int(args.compute_ms / per_mm))
    alone = statistics.median(matmuls_ms(count) for _ in range(args.trials))

    n = tokens // args.block_size
    ids = torch.randperm(raw.shape[1])[:n]
    shape = cache.layout.staging_shape(n)
    staging = torch.empty(shape, dtype=raw.dtype, device="cuda")
    host = torch.empty(shape, dtype=raw.dtype, pin_memory=True)
    nbytes = staging.numel() * staging.element_size()
    results = []

    def store_job(grid: int | None) -> Callable[[], None]:
        def job() -> None:
            gather_blocks(cache, ids, out=staging, programs=grid)
            host.copy_(staging, non_blocking=True)

        return job

    def load_job() -> None:
        staging.copy_(host, non_blocking=True)
        scatter_blocks(cache, ids, staging)

    variants: list[tuple[str, int | None, Callable[[], None]]] = [
        ("(a) gather + one D2H copy", programs or None, store_job(programs or None))
        for programs in [int(p) for p in args.programs.split(",")]
    ]
    variants.append(("load: one H2D copy + scatter", None, load_job))
    for path, grid, job in variants:
        with torch.cuda.stream(io):
            job()
        torch.cuda.synchronize()
        one = _timed_on(io, job)
        jobs = max(2, int(1.5 * alone / max(one, 1e-3)))  # I/O outlasts the compute
        together, io_rates = [], []
        for _ in range(args.trials):
            io_start = torch.cuda.Event(enable_timing=True)
            io_end = torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(io):
                io_start.record()
                for _ in range(jobs):
                    job()
                io_end.record()
            together.append(matmuls_ms(count))
            io_rates.append(jobs * nbytes / io_start.elapsed_time(io_end) / 1e6)
        with_io = statistics.median(together)
        results.append(
            Interference(
                path,
                grid,
                alone,
                with_io,
                with_io / alone - 1,
                statistics.median(io_rates),
            )
        )
    return results


def _timed_on(stream: torch.cuda.Stream, run: Callable[[], None]) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(stream):
        start.record()
        run()
        end.record()
    end.synchronize()
    return start.elapsed_time(end)


def _cpu_smoke() -> int:
    print("CPU smoke test of the torch reference path: NOT the benchmark (that needs CUDA).")
    raw = torch.randn(4, 64, 16, 2, 128).to(torch.bfloat16)
    cache = PagedKVCache.of([raw[layer].permute(0, 2, 1, 3) for layer in range(4)])
    ids = torch.randperm(64)[:32]
    start = time.perf_counter()
    pages = gather_blocks(cache, ids)
    scatter_blocks(cache, ids, pages)
    elapsed = time.perf_counter() - start
    ok = torch.equal(gather_blocks(cache, ids).view(torch.int16), pages.view(torch.int16))
    mib = pages.numel() * pages.element_size() / 2**20
    print(f"gather + scatter of {mib:.1f} MiB on CPU: {elapsed * 1e3:.1f} ms, round trip ok={ok}")
    return 0 if ok else 1


def main(argv: list[str], prog: str = "kernels-bench") -> int:
    args = parse_args(argv, prog)
    if args.cpu:
        return _cpu_smoke()
    if not torch.cuda.is_available():
        print(f"{prog}: needs a CUDA GPU (none visible); --cpu runs a smoke test of the torch path")
        return 2
    tokens = [int(t) for t in args.tokens.split(",")]
    raw, cache = cuda_cache(args, 2 * max(tokens) // args.block_size)
    device = torch.cuda.get_device_name()
    print(
        f"device: {device}; layout {tuple(raw.shape)} bf16 (LBNHC), {args.block_size}-token blocks"
    )
    rows = [row for count in tokens for row in _bandwidth_rows(args, raw, cache, count)]
    print_rows(rows)
    interference = _interference(args, raw, cache, min(max(tokens), 8192))
    print("\nmatmul slowdown while transfers run on another stream:")
    for item in interference:
        grid = item.programs or "all"
        print(
            f"  {item.path:<30} programs={grid!s:>4}: matmul {item.matmul_alone_ms:.1f} -> "
            f"{item.matmul_with_io_ms:.1f} ms ({item.slowdown:+.1%}), I/O {item.io_gb_s:.1f} GB/s"
        )
    if args.json:
        payload = {
            "device": device,
            "rows": [asdict(row) for row in rows],
            "interference": [asdict(item) for item in interference],
        }
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(payload, handle, indent=2)
    return 0
