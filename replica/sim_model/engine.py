"""A continuous-batching engine (vLLM v1's scheduler, simplified) as an incremental model.

Each step the engine schedules, within ``max_batch_tokens``: one token for every running decode,
then the next chunk of every running prefill, then new requests from the waiting queue while
budget, ``max_running`` and KV blocks allow (head-of-line blocking, as vLLM's FCFS). Prefills and
the waiting queue go in (``priority``, arrival) order, lower first: arrival order when every
priority is equal, as it is unless the replica's fair share sets them. With priorities, a
prefill in progress also yields the step to a more urgent waiting request that can start, as
vLLM's running requests do under prefixmesh's scheduler (``replica/engines/vllm_priority.py``),
so the urgent one waits for the step in progress only. A request is admitted when
its KV blocks fit: the blocks of prompt and expected output are reserved up front, so nothing is
ever preempted. At admission its leading cached blocks are hits (pinned); the last prompt token
is always computed (vLLM caps a hit at prompt_tokens - 1). When a prompt's prefill completes its
full blocks are cached (stored events) and the first token comes out at the end of that step; at
finish, a multi-turn request's ``finish_key`` blocks (prompt and answer) are cached too.

Holds (delay-hit deferral): a request submitted with a ``Hold`` is not admitted while another
request on this engine is prefilling any of its first ``hold.num_blocks`` blocks, until they are
stored or ``hold.max_wait_s`` has passed; it keeps its place in the queue meanwhile, others pass it.

Loads from the lower tiers (a CPU tier, the cluster's shared tier) run beside the batch, as the
KV connector runs them (Strata's rule, ``kvcache.async_loads``): an admitted request whose hit
needs a load waits outside the batch until its load is done, one load after the other per
replica, and joins the batch at the next step boundary after it; the other requests' steps
never wait for a load. (``profile.async_loads`` False: the step that admits it takes the load's
time too, as loads inside the step did.)

Speed: a pure-decode stretch runs as one macro step up to the next finish (finishes come from a
heap over a global decode counter, so no running request is touched per step); an arrival or an
abort cuts the stretch at the end of the step in progress. Time only moves forward.

Driving it: ``submit`` / ``abort`` at ``now_s``; ``next_event_s()`` is when something happens next
(None: idle); ``advance(now_s)`` processes every step that ended by ``now_s`` and returns what
happened (``CacheChanged``, ``FirstToken``, ``Finished``), oldest first. A request's state and
the steps in progress (``ModelRequest``, ``Stretch``) are in ``steps.py``.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque

from prefixmesh.replica.kvcache.policy import TierPolicy
from prefixmesh.replica.sim_model.prefix_cache import PrefixCache, SharedTier
from prefixmesh.replica.sim_model.profile import EngineProfile
from prefixmesh.replica.sim_model.records import (
    CacheChanged,
    EngineEvent,
    Finished,
    FirstToken,
    ModelLoad,
    RequestRecord,
    SimRequest,
)
from prefixmesh.replica.sim_model.steps import (
    DECODE,
    DONE,
    HELD,
    PREFILL,
    WAITING,
    ModelRequest,
    Stretch,
    insert_in_order,
)
from prefixmesh.wire.replica_report import extra_attention_pairs
from prefixmesh.wire.route_ticket import Hold

PROMOTE_LOOKAHEAD = 16
"""Waiting requests looked at, oldest first, for blocks to promote ahead of their turn."""


class EngineModel:
    """One replica's engine; see the module docstring."""

    def __init__(
        self,
        profile: EngineProfile,
        tp_degree: int = 1,
        shared: SharedTier | None = None,
        *,
        cpu_policy: TierPolicy | None = None,
    ) -> None:
        self.profile = profile
        self.tp_degree = tp_degree
        self.block_size = profile.block_size
        self.cache = PrefixCache(
            profile.kv_blocks_at(tp_degree),
            profile.cpu_blocks,
            shared,
            cpu_policy=cpu_policy,
        )
        inverse = 1.0 / profile.tp_speedup(tp_degree)
        self._overhead_s = profile.step_overhead_s
        self._weights_s = profile.weight_read_s * inverse
        self._prefill_s = profile.prefill_s_per_token * inverse
        self._attn_s = profile.attn_s_per_token_ctx * inverse
        self._decode_s = profile.decode_s_per_token * inverse
        self._kv_read_s = profile.kv_read_s_per_ctx_token * inverse
        self._load_s = profile.cpu_load_s_per_block * inverse
        self._shared_load_s = profile.shared_load_s_per_block * inverse
        self._async_loads = profile.async_loads
        self._prefetch_blocks = profile.prefetch_blocks if profile.async_loads else 0
        self._link_free_s = -math.inf
        """When the loads handed to the loader so far are done (they run one at a time)."""
        self._ready: list[float] = []
        """Heap of the times loading requests become ready."""
        self._waiting: deque[ModelRequest] = deque()
        self._held: list[ModelRequest] = []
        self._prefilling: list[ModelRequest] = []
        self._decodes: list[tuple[int, int, ModelRequest]] = []  # (finish counter, seq, request)
        self._num_decoding = 0
        self._decode_context = 0
        self._decode_steps = 0
        """Global decode counter: decode steps run since the engine started."""
        self._requests: dict[str, ModelRequest] = {}
        self._aborting: list[ModelRequest] = []
        self._seq = 0
        self._clock_s = -math.inf
        self._stretch: Stretch | None = None
        self._events: list[EngineEvent] = []
        self._load: ModelLoad | None = None
        self._pending_prefill = 0
        self._pending_attention_s = 0.0
        self._active_kv_blocks = 0
        self.busy_s = 0.0
        """Total time spent running steps."""
        self.steps = 0
        """Steps run (a decode stretch counts its steps)."""

    # ---- driving -----------------------------------------------------------------------------

    def submit(self, request: SimRequest, now_s: float, hold: Hold | None = None) -> None:
        """Queue ``request`` at ``now_s``; it joins the batch at the next step boundary."""
        self._catch_up(now_s)
        if request.request_id in self._requests:
            raise ValueError(f"request {request.request_id!r} is already on this engine")
        self._check(request)
        record = RequestRecord(
            request.request_id, request.prompt_tokens, request.output_tokens, now_s
        )
        req = ModelRequest(request, record, hold)
        req.estimate = request.prompt_tokens - self._hit_blocks(request) * self.block_size
        self._pending_prefill += req.estimate
        self._to_compute(req, req.estimate)
        self._requests[request.request_id] = req
        insert_in_order(self._waiting, req, first_of_priority=False)
        self.cache.arrived(request.request_id, request.key.block_hashes)
        self._load = None
        self._wake(now_s)

    def abort(self, request_id: str, now_s: float) -> bool:
        """Drop a request: at once if it waits, at the end of the step in progress if it runs.
        Its ``Finished`` event (``record.aborted``) comes out then. False if unknown."""
        self._catch_up(now_s)
        req = self._requests.get(request_id)
        if req is None or req.aborting:
            return False
        self._load = None
        if req.state in (WAITING, HELD):
            if req.state == WAITING:
                self._waiting.remove(req)
            else:
                self._held.remove(req)
            self._pending_prefill -= req.estimate
            self._to_compute(req, 0)
            self.cache.left(request_id)
            self._events.append(self._finish(req, now_s, aborted=True))
            return True
        req.aborting = True
        self._aborting.append(req)
        self._cut(now_s)
        return True

    def next_event_s(self) -> float | None:
        """When the step in progress ends or a load finishes (None when idle)."""
        end_s = math.inf if self._stretch is None else self._stretch.end_s
        if self._ready and self._ready[0] < end_s:
            return self._ready[0]
        return None if end_s == math.inf else end_s

    def advance(self, now_s: float) -> list[EngineEvent]:
        """Run every step that ends by ``now_s``; what happened, oldest first."""
        self._catch_up(now_s)
        events, self._events = self._events, []
        return events

    def load(self) -> ModelLoad:
        if self._load is None:
            self._load = ModelLoad(
                queued_requests=len(self._waiting) + len(self._held),
                running_requests=len(self._prefilling) + self._num_decoding,
                pending_prefill_tokens=self._pending_prefill,
                pending_attention_s=max(self._pending_attention_s, 0.0),
                active_kv_blocks=self._active_kv_blocks,
            )
        return self._load

    def record(self, request_id: str) -> RequestRecord | None:
        """What is known so far about a request still on this engine (None once finished)."""
        req = self._requests.get(request_id)
        return None if req is None else req.record

    def generated_tokens(self, request_id: str, now_s: float) -> int:
        """Output tokens a running request has produced by ``now_s`` (for streaming)."""
        req = self._requests.get(request_id)
        if req is None or req.state in (WAITING, HELD, PREFILL):
            return 0
        counter = self._decode_steps
        stretch = self._stretch
        if stretch is not None and stretch.batch:
            counter += stretch.steps_done_by(now_s)
        return min(req.spec.output_tokens, 1 + counter - req.decode_start)

    @property
    def idle(self) -> bool:
        return self._stretch is None

    # ---- the step loop -----------------------------------------------------------------------

    def _catch_up(self, now_s: float) -> None:
        if now_s < self._clock_s:
            raise ValueError(f"time went backwards: {now_s} < {self._clock_s}")
        self._clock_s = now_s
        ready = self._ready
        while True:
            stretch = self._stretch
            end_s = math.inf if stretch is None else stretch.end_s
            if ready and ready[0] < end_s and ready[0] <= now_s:
                self._wake(heapq.heappop(ready))  # a load is done: it joins at the next step
            elif stretch is not None and end_s <= now_s:
                self._complete(stretch)
                self._start(end_s)
            else:
                return

    def _wake(self, now_s: float) -> None:
        """Something new is queued: start now if idle, else end a decode stretch early."""
        if self._stretch is None:
            self._start(now_s)
        else:
            self._cut(now_s)

    def _cut(self, now_s: float) -> None:
        stretch = self._stretch
        if stretch is None or stretch.num_steps == 1:
            return
        steps = min(stretch.num_steps, stretch.steps_done_by(now_s) + 1)
        if steps < stretch.num_steps:
            stretch.num_steps = steps
            stretch.end_s = stretch.start_s + stretch.elapsed_after(steps)

    def _start(self, now_s: float) -> None:
        """Schedule the next step (or decode stretch) at ``now_s``; idle if nothing to run."""
        self._load = None
        if self._held:
            self._release_held(now_s)
        budget = self.profile.max_batch_tokens - self._num_decoding
        chunks: list[tuple[ModelRequest, int]] = []
        yield_above = self._yield_above(now_s)
        for req in self._prefilling:  # most urgent first
            if budget <= 0 or (yield_above is not None and req.spec.priority > yield_above):
                break
            if req.ready_s > now_s:
                continue  # its blocks are still loading
            n = min(req.spec.prompt_tokens - req.num_computed, budget)
            chunks.append((req, n))
            budget -= n
        load_s = 0.0
        max_running = self.profile.max_running
        waiting = self._waiting
        while budget > 0 and waiting:
            if len(self._prefilling) + self._num_decoding >= max_running:
                break
            req = waiting[0]
            if req.hold is not None and self._blocked(req, now_s):
                waiting.popleft()
                req.state = HELD
                req.held_since = now_s
                self._expect_hit(req)
                self._held.append(req)
                continue
            loaded = self._admit(req, now_s)
            if loaded < 0:
                break  # head-of-line: the oldest request waits for blocks
            waiting.popleft()
            if loaded > 0 and self._async_loads:
                req.ready_s = self._link_free_s = max(now_s, self._link_free_s) + loaded
                heapq.heappush(self._ready, req.ready_s)
                continue
            load_s += loaded
            n = min(req.spec.prompt_tokens - req.num_computed, budget)
            chunks.append((req, n))
            budget -= n
        if waiting and self._link_free_s <= now_s and self._prefetch_blocks:
            self._promote_ahead(now_s)
        batch = self._num_decoding
        base_s = self._overhead_s + (
            self._weights_s + batch * self._decode_s + self._decode_context * self._kv_read_s
        )
        if chunks:
            attn, prefill = self._attn_s, self._prefill_s
            work = sum(n * (prefill + (r.num_computed + n / 2) * attn) for r, n in chunks)
            step_s = base_s + work + load_s
            stretch = Stretch(now_s, 1, step_s, 0.0, batch, chunks)
        elif batch:
            decodes = self._decodes
            while decodes[0][2].state != DECODE:  # aborted ones leave their entries behind
                heapq.heappop(decodes)
            steps = decodes[0][0] - self._decode_steps
            growth = batch * self._kv_read_s
            stretch = Stretch(now_s, steps, base_s, growth, batch, chunks)
        else:
            self._stretch = None
            return
        stretch.end_s = now_s + stretch.elapsed_after(stretch.num_steps)
        self._stretch = stretch

    def _promote_ahead(self, now_s: float) -> None:
        """The link idles and requests wait: the oldest ones' shared-tier blocks are read into
        the CPU tier, up to ``prefetch_blocks`` (the connector's promotion ahead of need). The
        read occupies the link, so a load that comes meanwhile waits for it."""
        room = self._prefetch_blocks
        for req in itertools.islice(self._waiting, PROMOTE_LOOKAHEAD):
            spec = req.spec
            limit = (spec.prompt_tokens - 1) // self.block_size
            room -= self.cache.promote(spec.key.block_hashes, limit, room)
            if room <= 0:
                break
        if room < self._prefetch_blocks:
            self._link_free_s = now_s + (self._prefetch_blocks - room) * self._shared_load_s

    def _yield_above(self, now_s: float) -> int | None:
        """The waiting queue head's priority if it is more urgent than a prefill in progress
        and can start now: the less urgent prefills yield this step to it, as vLLM's running
        requests do under ``vllm_priority.py``. None: nobody yields (always, with equal
        priorities)."""
        if not self._waiting or not self._prefilling:
            return None
        head = self._waiting[0]
        spec = head.spec
        if self._prefilling[-1].spec.priority <= spec.priority:
            return None
        if head.hold is not None and self._blocked(head, now_s):
            return None
        if len(self._prefilling) + self._num_decoding >= self.profile.max_running:
            return None
        hashes = spec.key.block_hashes
        hit = self.cache.match(hashes, (spec.prompt_tokens - 1) // self.block_size).num_blocks
        total = -(-(spec.prompt_tokens + spec.output_tokens) // self.block_size)
        return spec.priority if self.cache.fits(hashes, hit, total - hit) else None

    def _complete(self, stretch: Stretch) -> None:
        """Apply the effects of a stretch that has ended."""
        self._load = None
        end_s = stretch.end_s
        self.busy_s += end_s - stretch.start_s
        self.steps += stretch.num_steps
        if stretch.batch:
            self._decode_steps += stretch.num_steps
            self._decode_context += stretch.num_steps * stretch.batch
        first_tokens: list[FirstToken] = []
        completed = False
        for req, n in stretch.chunks:
            if req.state != PREFILL or req.aborting:
                continue
            req.num_computed += n
            self._pending_prefill -= n
            self._to_compute(req, req.spec.prompt_tokens - req.num_computed)
            if req.num_computed >= req.spec.prompt_tokens:
                completed = True
                self._prefill_done(req)
                first_tokens.append(FirstToken(end_s, req.spec.request_id))
                req.record.first_token_s = end_s
        if completed:
            self._prefilling = [r for r in self._prefilling if r.state == PREFILL]
        ending: list[ModelRequest] = [
            req for req, _ in stretch.chunks if req.state == DECODE and req.spec.output_tokens == 1
        ]
        decodes = self._decodes
        while decodes and decodes[0][0] <= self._decode_steps:
            _, _, req = heapq.heappop(decodes)
            if req.state == DECODE:
                ending.append(req)
        finished: list[Finished] = []
        for req in ending:
            self._stop_decoding(req)
            finished.append(self._finish(req, end_s))
        if self._aborting:
            finished += self._drop_aborted(end_s)
        changes = self.cache.take_changes()
        if changes:
            self._events.append(CacheChanged(end_s, tuple(changes)))
        self._events += first_tokens
        self._events += finished

    # ---- request life cycle ------------------------------------------------------------------

    def _check(self, request: SimRequest) -> None:
        size = self.block_size
        if request.prompt_tokens <= 0 or request.output_tokens <= 0:
            raise ValueError("prompt_tokens and output_tokens must be > 0")
        if request.key.block_size != size or len(request.key) > request.prompt_tokens // size:
            raise ValueError("the key must hash the prompt's full blocks at the engine's size")
        needed = -(-(request.prompt_tokens + request.output_tokens) // size)
        if needed > self.cache.capacity_blocks:
            raise ValueError(
                f"request {request.request_id!r} needs {needed} blocks; the engine has "
                f"{self.cache.capacity_blocks}"
            )
        finish = request.finish_key
        if finish is not None and (
            finish.block_hashes[: len(request.key)] != request.key.block_hashes
            or len(finish) > (request.prompt_tokens + request.output_tokens) // size
        ):
            raise ValueError("finish_key must extend key within prompt + output tokens")

    def _hit_blocks(self, request: SimRequest) -> int:
        limit = (request.prompt_tokens - 1) // self.block_size
        return self.cache.match(request.key.block_hashes, limit).num_blocks

    def _blocked(self, req: ModelRequest, now_s: float) -> bool:
        """Whether a held request must still wait for an in-flight prefix.

        Another request computes blocks [num_hit, len(key)) of its own key. Hashes chain, so it
        computes one of this request's first blocks iff their keys agree at its first computed
        position: one comparison per prefilling request, none per block."""
        assert req.hold is not None
        if now_s >= req.hold_deadline_s:
            return False
        hashes = req.spec.key.block_hashes
        limit = min(req.hold.num_blocks, len(hashes))
        for other in self._prefilling:
            start = other.num_hit
            theirs = other.spec.key.block_hashes
            if start < limit and start < len(theirs) and theirs[start] == hashes[start]:
                return True
        return False

    def _release_held(self, now_s: float) -> None:
        released: list[ModelRequest] = []
        still_held: list[ModelRequest] = []
        for req in self._held:
            (still_held if self._blocked(req, now_s) else released).append(req)
        if not released:
            return
        self._held = still_held
        for req in released:
            req.state = WAITING
            req.record.held_s += now_s - req.held_since
        # They arrived before anything of their priority queued behind them while they were held.
        for req in reversed(released):
            insert_in_order(self._waiting, req, first_of_priority=True)

    def _admit(self, req: ModelRequest, now_s: float) -> float:
        """Reserve blocks and pin hits; the time to load its CPU and shared-tier blocks, or -1
        if it does not fit."""
        spec = req.spec
        size = self.block_size
        hashes = spec.key.block_hashes
        match = self.cache.match(hashes, (spec.prompt_tokens - 1) // size)
        total = -(-(spec.prompt_tokens + spec.output_tokens) // size)
        private = total - match.num_blocks
        if not self.cache.acquire(hashes, match.num_blocks, private):
            return -1
        self.cache.admitted(spec.request_id, hashes)
        req.state = PREFILL
        req.num_hit = match.num_blocks
        req.pins = list(hashes[: match.num_blocks])
        req.private_blocks = private
        req.reserved_blocks = total
        req.num_computed = match.num_blocks * size
        record = req.record
        record.admitted_s = now_s
        record.cached_tokens = req.num_computed
        record.cpu_cached_tokens = match.num_cpu_blocks * size
        record.shared_cached_tokens = match.num_shared_blocks * size
        record.prefill_tokens = spec.prompt_tokens - req.num_computed
        self._pending_prefill += record.prefill_tokens - req.estimate
        req.estimate = 0
        self._to_compute(req, record.prefill_tokens)
        insert_in_order(self._prefilling, req, first_of_priority=False)
        self._active_kv_blocks += total
        return match.num_cpu_blocks * self._load_s + match.num_shared_blocks * self._shared_load_s

    def _expect_hit(self, req: ModelRequest) -> None:
        """``req`` is held for blocks another request is computing here: it is expected to
        hit them, so it counts only the rest of its prompt as pending (admission counts it
        exactly)."""
        assert req.hold is not None
        spec = req.spec
        blocks = min(
            req.hold.num_blocks, len(spec.key), (spec.prompt_tokens - 1) // self.block_size
        )
        estimate = min(req.estimate, spec.prompt_tokens - blocks * self.block_size)
        self._pending_prefill += estimate - req.estimate
        req.estimate = estimate
        self._to_compute(req, estimate)

    def _to_compute(self, req: ModelRequest, tokens: int) -> None:
        """``req`` has ``tokens`` of its prompt left to compute: the attention they will cost
        beyond the linear rate, as the router prices it, replaces what was counted for it."""
        if self._attn_s <= 0:
            return
        pairs = extra_attention_pairs(req.spec.prompt_tokens, tokens, self.profile.max_batch_tokens)
        attention_s = pairs * self._attn_s
        self._pending_attention_s += attention_s - req.attention_s
        req.attention_s = attention_s
        if self._pending_prefill <= 0:  # nothing pending: no rounding left behind
            self._pending_attention_s = 0.0

    def _prefill_done(self, req: ModelRequest) -> None:
        spec = req.spec
        stored = self.cache.store(spec.key.block_hashes, req.num_hit)
        req.pins.extend(stored)
        req.private_blocks -= len(stored)
        req.state = DECODE
        if spec.output_tokens > 1:
            req.context = spec.prompt_tokens + 1
            req.decode_start = self._decode_steps
            self._num_decoding += 1
            self._decode_context += req.context
            self._seq += 1
            finish_at = self._decode_steps + spec.output_tokens - 1
            heapq.heappush(self._decodes, (finish_at, self._seq, req))

    def _stop_decoding(self, req: ModelRequest) -> None:
        if req.spec.output_tokens > 1:
            self._num_decoding -= 1
            self._decode_context -= req.context + self._decode_steps - req.decode_start

    def _finish(self, req: ModelRequest, now_s: float, *, aborted: bool = False) -> Finished:
        spec = req.spec
        if req.reserved_blocks:
            if spec.finish_key is not None and not aborted:
                stored = self.cache.store(spec.finish_key.block_hashes, len(spec.key))
                req.pins.extend(stored)
                req.private_blocks -= len(stored)
            self.cache.release(req.pins, req.private_blocks)
            self._active_kv_blocks -= req.reserved_blocks
        req.state = DONE
        req.record.finish_s = now_s
        req.record.aborted = aborted
        del self._requests[spec.request_id]
        return Finished(now_s, req.record)

    def _drop_aborted(self, now_s: float) -> list[Finished]:
        finished: list[Finished] = []
        for req in self._aborting:
            if req.state == PREFILL:
                self._pending_prefill -= req.spec.prompt_tokens - req.num_computed
                self._to_compute(req, 0)
                self._prefilling.remove(req)
            elif req.state == DECODE:
                self._stop_decoding(req)
            if req.state != DONE:
                finished.append(self._finish(req, now_s, aborted=True))
        self._aborting.clear()
        return finished
