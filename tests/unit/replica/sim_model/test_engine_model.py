"""The continuous-batching engine model, on a tiny profile with exact (binary) step times.

Tiny profile: block 4 tokens, 8-token step budget, a step costs 1 s + 0.125 s per prefill token
+ 0.5 s per decode token (no attention or KV-read terms unless a test adds them).
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from prefixmesh.cache_registry.types import BlockHash, EventKind, PrefixKey, Tier
from prefixmesh.replica.sim_model.engine import EngineModel
from prefixmesh.replica.sim_model.prefix_cache import CacheChange, SharedTier
from prefixmesh.replica.sim_model.profile import EngineProfile
from prefixmesh.replica.sim_model.records import (
    CacheChanged,
    EngineEvent,
    Finished,
    FirstToken,
    RequestRecord,
    SimRequest,
)
from prefixmesh.wire import Hold

TINY = EngineProfile(
    name="tiny",
    block_size=4,
    kv_blocks=16,
    max_batch_tokens=8,
    max_running=4,
    step_overhead_s=1.0,
    prefill_s_per_token=0.125,
    attn_s_per_token_ctx=0.0,
    decode_s_per_token=0.5,
    kv_read_s_per_ctx_token=0.0,
)


def key(*hashes: int) -> PrefixKey:
    return PrefixKey(tuple(BlockHash(x) for x in hashes), 4)


def request(
    request_id: str, blocks: tuple[int, ...], prompt: int, output: int, **extra: object
) -> SimRequest:
    return SimRequest(request_id, key(*blocks), prompt, output, **extra)  # type: ignore[arg-type]


def drain(engine: EngineModel, until_s: float = float("inf")) -> list[EngineEvent]:
    """Advance step by step to ``until_s`` (or until idle); every event, in order."""
    events: list[EngineEvent] = []
    while (next_s := engine.next_event_s()) is not None and next_s <= until_s:
        events += engine.advance(next_s)
    return events


def records(events: list[EngineEvent]) -> dict[str, RequestRecord]:
    return {e.record.request_id: e.record for e in events if isinstance(e, Finished)}


def test_chunked_prefill_then_one_decode_stretch() -> None:
    engine = EngineModel(TINY)
    engine.submit(request("a", (1, 2, 3), prompt=12, output=3), 0.0)
    assert engine.next_event_s() == 2.0  # 8 tokens: 1 + 8 * 0.125
    assert engine.advance(2.0) == []
    assert engine.next_event_s() == 3.5  # the last 4 tokens
    first = engine.advance(3.5)
    stored = CacheChange(EventKind.STORED, Tier.GPU, key(1, 2, 3).block_hashes)
    assert first == [CacheChanged(3.5, (stored,)), FirstToken(3.5, "a")]
    assert engine.next_event_s() == 6.5  # two decode steps of 1.5 s, as one stretch
    [finished] = engine.advance(6.5)
    assert isinstance(finished, Finished)
    assert finished.record == RequestRecord(
        "a", 12, 3, arrival_s=0.0, admitted_s=0.0, first_token_s=3.5, finish_s=6.5,
        cached_tokens=0, prefill_tokens=12,
    )  # fmt: skip
    assert engine.next_event_s() is None
    assert engine.steps == 4 and engine.busy_s == 6.5
    assert engine.cache.eviction_order() == list(key(3, 2, 1).block_hashes)


def test_a_hit_never_covers_the_last_prompt_token() -> None:
    engine = EngineModel(TINY)
    engine.submit(request("a", (1, 2, 3), prompt=12, output=1), 0.0)
    drain(engine)
    engine.submit(request("b", (1, 2, 3), prompt=12, output=1), 10.0)  # block-aligned repeat
    engine.submit(request("c", (1, 2, 3), prompt=13, output=1), 10.0)
    done = records(drain(engine))
    assert (done["b"].cached_tokens, done["b"].prefill_tokens) == (8, 4)
    assert (done["c"].cached_tokens, done["c"].prefill_tokens) == (12, 1)
    # An idle engine starts a step at the first arrival: b alone, then c.
    assert done["b"].first_token_s == 11.5
    assert done["c"].first_token_s == 12.625


def test_arrival_mid_stretch_joins_at_the_next_step_boundary() -> None:
    engine = EngineModel(TINY)
    engine.submit(request("a", (1,), prompt=4, output=4), 0.0)
    drain(engine, 1.5)  # prefill step; a decode stretch of 3 steps is planned to 6.0
    assert engine.next_event_s() == 6.0
    engine.submit(request("b", (5, 6), prompt=8, output=2), 2.0)  # during decode step 1.5-3.0
    assert engine.next_event_s() == 3.0  # the stretch is cut after the step in progress
    done = records(drain(engine))
    # 3.0: a's decode + 7 tokens of b (the budget minus one decode token): 1 + 0.5 + 0.875
    # 5.375: a's last decode + b's last token: 1 + 0.5 + 0.125 -> 7.0; then b decodes once.
    assert done["b"].admitted_s == 3.0
    assert done["a"].finish_s == 7.0
    assert done["b"].first_token_s == 7.0
    assert done["b"].finish_s == 8.5


def test_decode_stretch_equals_the_sum_of_its_growing_steps() -> None:
    profile = replace(TINY, kv_read_s_per_ctx_token=0.01)
    engine = EngineModel(profile)
    engine.submit(request("a", (1,), prompt=4, output=6), 0.0)
    done = records(drain(engine))
    # prefill 1.5 s; then 5 decode steps, step j reading 5 + j context tokens
    expected = 1.5 + sum(1.0 + 0.5 + (5 + j) * 0.01 for j in range(5))
    assert done["a"].finish_s == pytest.approx(expected)
    assert engine.steps == 6


def test_generated_tokens_follow_the_stretch() -> None:
    engine = EngineModel(TINY)
    engine.submit(request("a", (1,), prompt=4, output=5), 0.0)
    assert engine.generated_tokens("a", 1.0) == 0
    drain(engine, 1.5)
    assert engine.generated_tokens("a", 1.5) == 1
    assert engine.generated_tokens("a", 2.9) == 1
    assert engine.generated_tokens("a", 3.0) == 2
    assert engine.generated_tokens("a", 6.0) == 4
    assert engine.generated_tokens("missing", 6.0) == 0


def test_admission_waits_for_blocks_and_evicts_tail_first() -> None:
    engine = EngineModel(replace(TINY, kv_blocks=4))
    engine.submit(request("a", (1, 2), prompt=8, output=4), 0.0)  # 12 tokens: 3 blocks
    engine.submit(request("b", (7, 8), prompt=8, output=1), 0.0)  # 9 tokens: 3 blocks
    events = drain(engine)
    done = records(events)
    assert done["a"].finish_s == 6.5  # 2.0 prefill + 3 decode steps of 1.5
    assert done["b"].admitted_s == 6.5
    removals = [
        c for e in events if isinstance(e, CacheChanged) for c in e.changes
        if c.kind is EventKind.REMOVED
    ]  # fmt: skip
    assert removals == [CacheChange(EventKind.REMOVED, Tier.GPU, (BlockHash(2),))]


def test_max_running_bounds_the_batch() -> None:
    engine = EngineModel(replace(TINY, max_running=1))
    engine.submit(request("a", (1,), prompt=4, output=2), 0.0)
    engine.submit(request("b", (2,), prompt=4, output=2), 0.0)
    done = records(drain(engine))
    assert done["b"].admitted_s == done["a"].finish_s == 3.0


def test_the_oldest_request_blocks_the_queue() -> None:
    engine = EngineModel(replace(TINY, kv_blocks=6))
    engine.submit(request("a", (1,), prompt=4, output=8), 0.0)  # 3 blocks
    engine.submit(request("big", (2, 3), prompt=8, output=8), 0.0)  # 4 blocks: waits for a
    engine.submit(request("small", (4,), prompt=4, output=1), 0.0)  # 2 blocks would fit
    done = records(drain(engine))
    assert done["small"].admitted_s >= done["big"].admitted_s == done["a"].finish_s


def test_a_more_urgent_request_takes_the_next_step_from_a_prefill_in_progress() -> None:
    def first_tokens(urgent_priority: int) -> tuple[float | None, float | None]:
        engine = EngineModel(TINY)
        engine.submit(request("long", (1, 2, 3, 4, 5, 6), prompt=24, output=1, priority=5), 0.0)
        engine.submit(request("urgent", (9, 10), prompt=8, output=1, priority=urgent_priority), 0.5)
        done = records(drain(engine))
        return done["urgent"].first_token_s, done["long"].first_token_s

    # 0-2: 8 of long's 24 tokens. The urgent request then gets the next step (2-4) whole and
    # long yields it; long's last 16 tokens follow (4-8).
    assert first_tokens(urgent_priority=0) == (4.0, 8.0)
    # Equal priorities: arrival order, long keeps the budget to the end of its prefill (6.0).
    assert first_tokens(urgent_priority=5) == (8.0, 6.0)


def test_the_waiting_queue_goes_by_priority_then_arrival() -> None:
    engine = EngineModel(replace(TINY, max_running=1))
    engine.submit(request("running", (1,), prompt=4, output=1), 0.0)
    engine.submit(request("low", (2,), prompt=4, output=1, priority=5), 0.1)
    engine.submit(request("high", (3,), prompt=4, output=1, priority=1), 0.2)
    engine.submit(request("high2", (4,), prompt=4, output=1, priority=1), 0.3)
    done = records(drain(engine))
    order = sorted(done, key=lambda r: done[r].admitted_s or 0.0)
    assert order == ["running", "high", "high2", "low"]


def test_a_prefill_does_not_yield_to_a_request_that_cannot_start() -> None:
    engine = EngineModel(replace(TINY, max_running=1))  # no free slot for the urgent one
    engine.submit(request("long", (1, 2, 3, 4), prompt=16, output=1, priority=5), 0.0)
    engine.submit(request("urgent", (9,), prompt=4, output=1, priority=0), 0.5)
    done = records(drain(engine))
    assert done["long"].first_token_s == 4.0  # two full steps, as without the urgent one
    assert done["urgent"].admitted_s == 4.0


def test_hold_waits_for_the_in_flight_prefix_then_hits_it() -> None:
    engine = EngineModel(TINY)
    engine.submit(request("a", (1, 2, 3), prompt=12, output=1), 0.0)
    engine.submit(request("b", (1, 2, 3), prompt=13, output=1), 0.5, Hold(3, 10.0))
    engine.submit(request("c", (9,), prompt=4, output=1), 0.5)  # not held: passes b
    done = records(drain(engine))
    # 2.0: a's last 4 tokens and c's 4 share a step (to 4.0); b is set aside meanwhile.
    assert done["c"].admitted_s == 2.0
    assert done["a"].first_token_s == 4.0
    assert done["b"].admitted_s == 4.0
    assert (done["b"].cached_tokens, done["b"].prefill_tokens) == (12, 1)
    assert done["b"].held_s == 2.0


def test_a_held_request_counts_only_what_it_will_compute_after_its_hit() -> None:
    # Regression: held siblings of a long prefill counted their whole prompt as pending (and
    # its attention), so the replica computing it for them looked seconds busier than it was.
    engine = EngineModel(replace(TINY, attn_s_per_token_ctx=0.01))
    engine.submit(request("a", (1, 2, 3), prompt=12, output=1), 0.0)
    engine.submit(request("b", (1, 2, 3), prompt=13, output=1), 0.5, Hold(3, 10.0))
    waiting = engine.load()
    assert waiting.pending_prefill_tokens == 12 + 13  # queued, not held yet
    engine.advance(engine.next_event_s())  # type: ignore[arg-type]  # b is held for a's blocks
    held = engine.load()
    assert held.queued_requests == 1
    assert held.pending_prefill_tokens == 4 + 1  # a's last chunk, b's one token past the hit
    # a's last 4 tokens at 8-12 of context, b's one at 12 (each less the 4 the rate counts).
    assert held.pending_attention_s == pytest.approx(0.01 * (4 * (12 - 2 - 4) + (13 - 0.5 - 4)))


def test_without_a_hold_the_sibling_computes_the_prefix_again() -> None:
    engine = EngineModel(TINY)
    engine.submit(request("a", (1, 2, 3), prompt=12, output=1), 0.0)
    engine.submit(request("b", (1, 2, 3), prompt=13, output=1), 0.5)
    done = records(drain(engine))
    assert done["b"].admitted_s == 2.0
    assert (done["b"].cached_tokens, done["b"].prefill_tokens) == (0, 13)


def test_hold_runs_out_at_its_bound() -> None:
    engine = EngineModel(TINY)
    engine.submit(request("a", (1, 2, 3), prompt=12, output=1), 0.0)
    engine.submit(request("b", (1, 2, 3), prompt=13, output=1), 0.5, Hold(3, 1.0))
    done = records(drain(engine))
    assert done["b"].admitted_s == 2.0  # the bound (1.5) passed before the 2.0 boundary
    assert done["b"].cached_tokens == 0
    assert done["b"].held_s == 0.0


def test_hold_on_blocks_nobody_computes_is_no_wait() -> None:
    engine = EngineModel(TINY)
    engine.submit(request("a", (1, 2), prompt=8, output=1), 0.0)
    engine.submit(request("b", (5, 6), prompt=8, output=1), 0.0, Hold(2, 10.0))
    done = records(drain(engine))
    assert done["b"].admitted_s == 2.0 and done["b"].held_s == 0.0


def test_finish_key_caches_the_answer_for_the_next_turn() -> None:
    engine = EngineModel(TINY)
    turn1 = request("t1", (1, 2), prompt=8, output=8, finish_key=key(1, 2, 3, 4))
    engine.submit(turn1, 0.0)
    drain(engine)
    assert engine.cache.num_cached == 4
    engine.submit(request("t2", (1, 2, 3, 4), prompt=18, output=1), 20.0)
    assert records(drain(engine))["t2"].cached_tokens == 16


def test_abort_waiting_and_running_requests() -> None:
    engine = EngineModel(replace(TINY, max_running=1))
    engine.submit(request("a", (1,), prompt=4, output=10), 0.0)
    engine.submit(request("b", (2,), prompt=4, output=1), 0.0)
    drain(engine, 1.5)
    assert engine.abort("b", 2.0)
    [aborted] = engine.advance(2.0)
    assert isinstance(aborted, Finished) and aborted.record.aborted
    assert engine.abort("a", 2.0)
    assert not engine.abort("a", 2.0)
    assert engine.next_event_s() == 3.0  # the decode step in progress completes
    [done] = engine.advance(3.0)
    assert isinstance(done, Finished) and done.record.aborted and done.record.finish_s == 3.0
    assert engine.next_event_s() is None
    assert (engine.cache.num_private, engine.load().active_kv_blocks) == (0, 0)


def test_load_reports_queue_running_and_pending_prefill() -> None:
    engine = EngineModel(replace(TINY, max_running=1))
    engine.submit(request("a", (1, 2, 3), prompt=12, output=2), 0.0)
    engine.submit(request("b", (5,), prompt=6, output=2), 0.0)
    load = engine.load()
    assert (load.queued_requests, load.running_requests) == (1, 1)
    assert load.pending_prefill_tokens == 12 + 6
    assert load.active_kv_blocks == 4  # a: 14 tokens -> 4 blocks
    drain(engine, 2.0)
    assert engine.load().pending_prefill_tokens == 4 + 6


def test_load_reports_the_attention_of_the_prompt_tokens_still_to_compute() -> None:
    # 0.01 s per query-key pair: the last u of the 40-token prompt cost 0.01 x u x (40 - u/2)
    # of which the 8-token chunks' rate counts 0.01 x u x 4 (the router's pricing, exactly).
    engine = EngineModel(replace(TINY, attn_s_per_token_ctx=0.01))
    engine.submit(request("long", tuple(range(1, 11)), prompt=40, output=2), 0.0)
    engine.submit(request("short", (99,), prompt=6, output=2), 0.0)  # one chunk: none
    remaining = []
    while engine.load().pending_prefill_tokens:
        load = engine.load()
        remaining.append(round(load.pending_attention_s / 0.01, 6))
        engine.advance(engine.next_event_s())  # type: ignore[arg-type]
    # 40 left, then 32 (the first chunk at zero context costs only what the rate counts),
    # 24, 16, 8; then the short prompt's 6 alone.
    assert remaining == [640, 640, 576, 448, 256, 0]
    assert engine.load().pending_attention_s == 0.0
    # An aborted prefill takes its attention out of the report at the step's end.
    engine.submit(request("again", tuple(range(20, 30)), prompt=40, output=2), 100.0)
    assert engine.load().pending_attention_s == pytest.approx(6.4)
    assert engine.abort("again", 100.0)
    engine.advance(engine.next_event_s())  # type: ignore[arg-type]
    assert engine.load().pending_attention_s == 0.0
    # A waiting one's, at once.
    busy = EngineModel(replace(TINY, attn_s_per_token_ctx=0.01, max_running=1))
    busy.submit(request("first", (1,), prompt=4, output=10), 0.0)
    busy.submit(request("waits", tuple(range(20, 30)), prompt=40, output=2), 0.0)
    assert busy.load().pending_attention_s == pytest.approx(6.4)
    assert busy.abort("waits", 0.0)
    assert busy.load().pending_attention_s == 0.0


def test_tensor_parallel_replica_is_faster_and_holds_more() -> None:
    profile = replace(TINY, tp_efficiency=1.0)
    engine = EngineModel(profile, tp_degree=2)
    assert engine.cache.capacity_blocks == 32
    engine.submit(request("a", (1, 2), prompt=8, output=1), 0.0)
    assert engine.next_event_s() == 1.5  # overhead is not split: 1 + 1.0 / 2


def test_cpu_hits_load_back_within_the_step() -> None:
    profile = replace(TINY, kv_blocks=4, cpu_blocks=8, cpu_load_s_per_block=0.25, async_loads=False)
    engine = EngineModel(profile)
    engine.submit(request("a", (1, 2), prompt=8, output=1), 0.0)
    engine.submit(request("b", (5, 6), prompt=8, output=1), 0.0)  # evicts a's block 2
    drain(engine)
    engine.submit(request("c", (1, 2), prompt=9, output=1), 10.0)
    done = records(drain(engine))
    assert (done["c"].cached_tokens, done["c"].cpu_cached_tokens) == (8, 4)
    assert done["c"].first_token_s == 10.0 + 1.0 + 0.125 + 0.25


def test_loads_beside_the_batch_do_not_slow_the_running_requests() -> None:
    """The loading request waits outside the batch; a request decoding meanwhile finishes
    exactly as much earlier as the load lasts, against loads inside the step."""

    def run(async_loads: bool) -> dict[str, RequestRecord]:
        profile = replace(
            TINY, kv_blocks=6, cpu_blocks=8, cpu_load_s_per_block=0.25, async_loads=async_loads
        )
        engine = EngineModel(profile)
        engine.submit(request("a", (1, 2), prompt=8, output=1), 0.0)
        engine.submit(request("b", (5, 6), prompt=8, output=1), 0.0)
        events = drain(engine)
        engine.submit(request("d", (), prompt=3, output=9), 10.0)  # a's block 2 goes to CPU
        events += drain(engine, 12.0)
        engine.submit(request("c", (1, 2), prompt=9, output=1), 12.0)
        return records(events + drain(engine))

    beside, inside = run(True), run(False)
    assert beside["c"].cpu_cached_tokens == inside["c"].cpu_cached_tokens > 0
    loaded = beside["c"].cpu_cached_tokens // 4 * 0.25
    assert inside["d"].finish_s - beside["d"].finish_s == pytest.approx(loaded)
    # c itself joins the batch only once its blocks are in.
    assert beside["c"].first_token_s >= beside["c"].admitted_s + loaded + 1.0


def test_a_waiting_requests_shared_blocks_are_read_into_the_cpu_tier_while_it_waits() -> None:
    """While a long prefill spends every step's budget, the link would idle: the waiting
    request's shared-tier blocks are promoted into the CPU tier, so once its turn comes it
    loads them from memory instead of reading the shared tier then."""

    def run(prefetch_blocks: int) -> RequestRecord:
        shared = SharedTier(8)
        shared.write([BlockHash(1), BlockHash(2)])  # another replica computed them
        profile = replace(
            TINY,
            cpu_blocks=8,
            cpu_load_s_per_block=0.01,
            shared_load_s_per_block=0.5,
            prefetch_blocks=prefetch_blocks,
        )
        engine = EngineModel(profile, shared=shared)
        engine.submit(request("long", (), prompt=32, output=1), 0.0)  # 4 steps of 2 s
        engine.submit(request("w", (1, 2), prompt=9, output=1), 0.0)
        return records(drain(engine))["w"]

    ahead, then = run(64), run(0)
    assert (ahead.cpu_cached_tokens, ahead.shared_cached_tokens) == (8, 0)
    assert (then.cpu_cached_tokens, then.shared_cached_tokens) == (0, 8)
    assert ahead.admitted_s == then.admitted_s == 8.0
    assert then.first_token_s - ahead.first_token_s == pytest.approx(2 * (0.5 - 0.01))


def test_misuse_is_refused() -> None:
    engine = EngineModel(TINY)
    with pytest.raises(ValueError):
        engine.submit(request("huge", (1,), prompt=60, output=10), 0.0)  # 18 blocks > 16
    with pytest.raises(ValueError):
        engine.submit(request("bad", (1, 2, 3), prompt=8, output=1), 0.0)  # key too long
    with pytest.raises(ValueError):
        engine.submit(request("x", (1,), prompt=4, output=1, finish_key=key(9, 9)), 0.0)
    engine.submit(request("a", (1,), prompt=4, output=1), 5.0)
    with pytest.raises(ValueError):
        engine.submit(request("a", (1,), prompt=4, output=1), 5.0)
    with pytest.raises(ValueError):
        engine.advance(4.0)
