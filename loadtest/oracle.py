"""What no router can beat, and how much work a workload offers.

The oracle is one unbounded cache that sees every request in arrival order: a request hits the
leading blocks any earlier request (or an earlier turn's answer) had, with the engine's rule that
the last prompt token is always computed. Its hit rate is the ceiling for every policy; the tokens
it misses are the prefill that even a perfect cache must do.

``--load F`` is offered work as a fraction of fleet capacity, counted the same for every policy:
per request, the prefill of its oracle-missed tokens plus its decode tokens, in seconds of a tp=1
replica of the profile:

- prefill of n tokens after c cached: the GPU work of those tokens (GEMMs and attention against
  the c cached ones) plus the step overhead and weight read of a full step, shared by the
  ``max_batch_tokens`` tokens of that step;
- decode, per token: the step time of a full decode batch divided by its size, where "full" is
  the profile's typical saturation: as many requests as the KV cache holds at the workload's mean
  reservation (prompt + output blocks), capped by ``max_running``, each at its mean decode context
  (prompt + output / 2).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from prefixmesh.cache_registry.types import BlockHash
from prefixmesh.loadtest.keys import KeyBuilder
from prefixmesh.loadtest.workloads import WorkloadRequest
from prefixmesh.replica.sim_model.profile import EngineProfile


@dataclass(frozen=True, slots=True)
class OracleResult:
    hit_tokens: dict[str, int]
    """Request id -> prompt tokens an unbounded single cache serves."""
    prompt_tokens: int
    total_hit_tokens: int

    @property
    def hit_rate(self) -> float:
        return self.total_hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def miss_tokens(self) -> int:
        return self.prompt_tokens - self.total_hit_tokens


def _leading_hits(hashes: tuple[BlockHash, ...], seen: set[BlockHash], limit: int) -> int:
    # ``seen`` is prefix-closed (every key enters whole and a hash names its chain), so the
    # leading run is found by bisection.
    low, high = 0, min(limit, len(hashes))
    while low < high:
        middle = (low + high + 1) // 2
        if hashes[middle - 1] in seen:
            low = middle
        else:
            high = middle - 1
    return low


def oracle_hits(requests: Sequence[WorkloadRequest], keys: KeyBuilder) -> OracleResult:
    """Leading-prefix hits of one unbounded cache over ``requests`` in arrival order."""
    size = keys.block_size
    seen: set[BlockHash] = set()
    hits: dict[str, int] = {}
    total_prompt = total_hit = 0
    for request in sorted(requests, key=lambda r: r.arrival_s):
        hashes = keys.key(request.segments).block_hashes
        num_hit = _leading_hits(hashes, seen, (request.prompt_tokens - 1) // size)
        seen.update(hashes[num_hit:])
        if request.finish_segments is not None:
            seen.update(keys.key(request.finish_segments).block_hashes)
        hits[request.request_id] = num_hit * size
        total_prompt += request.prompt_tokens
        total_hit += num_hit * size
    return OracleResult(hits, total_prompt, total_hit)


@dataclass(frozen=True, slots=True)
class WorkModel:
    """Seconds of tp=1 replica time per unit of work (see the module docstring)."""

    profile: EngineProfile
    decode_s_per_token: float
    saturation_batch: int

    def prefill_s(self, num_tokens: int, context_tokens: int) -> float:
        p = self.profile
        shared = (p.step_overhead_s + p.weight_read_s) / p.max_batch_tokens
        return num_tokens * shared + p.chunk_work_s(num_tokens, context_tokens)

    def request_s(self, prompt_tokens: int, hit_tokens: int, output_tokens: int) -> float:
        prefill = self.prefill_s(prompt_tokens - hit_tokens, hit_tokens)
        return prefill + (output_tokens - 1) * self.decode_s_per_token


def work_model(profile: EngineProfile, requests: Sequence[WorkloadRequest]) -> WorkModel:
    if not requests:
        return WorkModel(profile, profile.decode_step_s(1, 0), 1)
    size = profile.block_size
    count = len(requests)
    mean_blocks = sum(-(-(r.prompt_tokens + r.output_tokens) // size) for r in requests) / count
    mean_context = sum(r.prompt_tokens + r.output_tokens / 2 for r in requests) / count
    batch = max(1, min(profile.max_running, int(profile.kv_blocks / mean_blocks)))
    step_s = profile.decode_step_s(batch, round(batch * mean_context))
    return WorkModel(profile, step_s / batch, batch)


def fleet_capacity(profile: EngineProfile, tp_degrees: Sequence[int]) -> float:
    """The fleet's throughput in tp=1 replicas (a TP replica counts by its prefill speed-up)."""
    base = profile.prefill_tokens_per_s(1)
    return sum(profile.prefill_tokens_per_s(tp) / base for tp in tp_degrees)


def offered_work_s(
    requests: Sequence[WorkloadRequest], oracle: OracleResult, model: WorkModel
) -> float:
    return sum(
        model.request_s(r.prompt_tokens, oracle.hit_tokens[r.request_id], r.output_tokens)
        for r in requests
    )


def ttft_floor_s(
    requests: Sequence[WorkloadRequest],
    oracle: OracleResult,
    profile: EngineProfile,
    tp_degree: int = 1,
) -> float:
    """Mean over requests of the time to prefill its oracle-missed tokens alone on an idle replica
    (budget-sized chunks, one step overhead each): no routing policy gets below it on average."""
    if not requests:
        return 0.0
    total = 0.0
    for r in requests:
        hit = oracle.hit_tokens[r.request_id]
        total += profile.idle_prefill_s(r.prompt_tokens - hit, hit, tp_degree)
    return total / len(requests)
