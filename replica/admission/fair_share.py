"""Fair share when a replica is saturated (issue 17, item 4): which waiting request starts next.

Each request that starts carries its start tag (its tenant's counter before the charge) into
the engine with its priority, as one ``engine_priority``: the engine serves its prefills in that
order (``replica/engines/vllm_priority.py``; start-time fair queueing, Goyal et al., SIGCOMM
'96), so a light tenant's request passes the heavy prefills already in the engine too.

A replica lets a request into its engine when its prompt tokens, with those of the admitted
requests not yet at their first token that the engine serves before it, fit in
``prefill_budget_tokens`` (a prompt larger than the budget starts when the engine serves none
before it): a few of the engine's steps. The budget bounds what a request waits behind in the
engine; the engine's steps stay full, and an urgent or underserved request waits behind none of
them.
Past the budget requests wait here, and the next one to start is chosen by:

1. priority (lower first, as vLLM's ``priority``);
2. the tenant with the least service so far: a virtual token counter per tenant (VTC,
   Sheng et al., OSDI '24; llm-d's flow control does the same across flows), charged the
   prompt tokens a request makes the engine compute (its cached prefix is free) when it
   starts, and ``output_weight`` per generated token when it ends;
3. on equal counters, the tenant with fewer requests waiting;
4. arrival order.

A tenant that arrives with nothing waiting or running has its counter lifted to the virtual
time (the least start tag of the requests prefilling, or counter of the tenants waiting) less
``idle_credit_tokens``: idle time banks at most that much credit. Without it a light tenant's
burst of two or three requests alternates with a saturating tenant's backlog (VTC's strict
share) and its last request waits twice as long as alone; with it the burst goes ahead, while a
tenant that never goes idle banks nothing.

Pure: no clock, no I/O. ``replica/admission/fair_gate.py`` puts it in front of the engine.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

TAG_SPAN = 2**40
"""Start tags (tokens) an engine priority holds below one step of a request's priority: more
than any replica serves. vLLM's priority is a 64-bit integer; ``PRIORITY_RANGE`` (about 2**20
either way) times this fits."""


def engine_priority(priority: int, start_tag: float) -> int:
    """The request's priority, then its start tag, as the one integer the engine orders by
    (lower first, as vLLM's ``priority``)."""
    return priority * TAG_SPAN + min(max(0, int(start_tag)), TAG_SPAN - 1)


@dataclass(frozen=True, slots=True)
class FairTicket:
    """A request asking to start."""

    request_id: str
    tenant: str
    priority: int
    work_tokens: int
    """Prompt tokens the engine must compute (the prompt less its cached prefix)."""


@dataclass(order=True, frozen=True, slots=True)
class _Queued:
    priority: int
    seq: int
    ticket: FairTicket = field(compare=False)


class FairQueue:
    """Admission order of one replica's engine."""

    def __init__(
        self,
        prefill_budget_tokens: int,
        output_weight: float = 2.0,
        idle_credit_tokens: int = 0,
    ) -> None:
        if prefill_budget_tokens < 1 or output_weight < 0 or idle_credit_tokens < 0:
            raise ValueError(
                "need prefill_budget_tokens >= 1, output_weight >= 0 and idle_credit_tokens >= 0"
            )
        self._budget = prefill_budget_tokens
        self._output_weight = output_weight
        self._idle_credit = idle_credit_tokens
        self._seq = itertools.count()
        self._waiting: dict[str, list[_Queued]] = {}
        """Tenant -> its waiting requests, sorted by (priority, arrival)."""
        self._prefilling: dict[str, int] = {}
        """Admitted requests not yet at their first token -> their work tokens."""
        self._start_tags: dict[str, float] = {}
        """Admitted requests not yet at their first token -> their tenant's counter when they
        started."""
        self._engine_priorities: dict[str, int] = {}
        """Admitted requests (until they end) -> what the engine orders them by."""
        self._prefill_total = 0
        self._tenant_of: dict[str, str] = {}
        """Every request here, waiting or admitted -> its tenant."""
        self._present: dict[str, int] = {}
        """Tenant -> its requests here, waiting or admitted."""
        self._counters: dict[str, float] = {}
        self.waited = 0
        """Requests that could not start at once (for reports and tests)."""

    # ---- what the replica tells it ---------------------------------------------------------

    def arrive(self, ticket: FairTicket) -> list[str]:
        """A request wants to start; returns the requests that start now (it, or none)."""
        if ticket.request_id in self._tenant_of:
            raise ValueError(f"request {ticket.request_id} is already here")
        tenant = ticket.tenant
        if not self._has_requests(tenant):
            virtual_time = self._virtual_time()
            if virtual_time is not None:
                lifted = virtual_time - self._idle_credit
                self._counters[tenant] = max(self.counter(tenant), lifted)
        self._tenant_of[ticket.request_id] = tenant
        self._present[tenant] = self._present.get(tenant, 0) + 1
        queue = self._waiting.setdefault(tenant, [])
        queue.append(_Queued(ticket.priority, next(self._seq), ticket))
        queue.sort()
        started = self._dispatch()
        if ticket.request_id not in started:
            self.waited += 1
        return started

    def first_token(self, request_id: str) -> list[str]:
        """The request's prefill is done; returns the requests that start now."""
        self._prefill_total -= self._prefilling.pop(request_id, 0)
        self._start_tags.pop(request_id, None)
        return self._dispatch()

    def ended(self, request_id: str, output_tokens: int) -> list[str]:
        """The request ended (or left while waiting); returns the requests that start now."""
        tenant = self._tenant_of.pop(request_id, None)
        if tenant is None:
            return []
        if self._present[tenant] == 1:
            del self._present[tenant]
        else:
            self._present[tenant] -= 1
        queue = self._waiting.get(tenant)
        if queue is not None:
            queue[:] = [q for q in queue if q.ticket.request_id != request_id]
            if not queue:
                del self._waiting[tenant]
        self._prefill_total -= self._prefilling.pop(request_id, 0)
        self._start_tags.pop(request_id, None)
        self._engine_priorities.pop(request_id, None)
        self._counters[tenant] = self.counter(tenant) + output_tokens * self._output_weight
        return self._dispatch()

    # ---- what it knows ---------------------------------------------------------------------

    def counter(self, tenant: str) -> float:
        return self._counters.get(tenant, 0.0)

    def engine_priority(self, request_id: str) -> int:
        """What the engine orders a started request by (``engine_priority``)."""
        return self._engine_priorities[request_id]

    @property
    def waiting(self) -> int:
        return sum(len(q) for q in self._waiting.values())

    @property
    def prefill_tokens(self) -> int:
        return self._prefill_total

    def _has_requests(self, tenant: str) -> bool:
        return tenant in self._present

    def _virtual_time(self) -> float | None:
        """Where service stands: the least start tag of the requests prefilling, or counter
        of the tenants waiting (None when neither)."""
        tags = [self._start_tags[r] for r in self._prefilling]
        tags += [self.counter(t) for t in self._waiting]
        return min(tags, default=None)

    def _work_before(self, priority: int) -> int:
        """Prefill tokens in progress that the engine serves before a request of this engine
        priority (ties: the earlier arrival, the one in progress)."""
        ranks = self._engine_priorities
        return sum(work for r, work in self._prefilling.items() if ranks[r] <= priority)

    def _dispatch(self) -> list[str]:
        started: list[str] = []
        while self._waiting:
            tenant = min(self._waiting, key=self._rank)
            queue = self._waiting[tenant]
            # The next in fair order starts when it fits with the prefills the engine serves
            # before it (with none, a prompt past the budget too): the budget bounds what a
            # request waits behind in the engine. None behind it skips ahead, so a long prompt
            # is never starved by short ones.
            head = queue[0]
            work = head.ticket.work_tokens
            before = self._work_before(engine_priority(head.priority, self.counter(tenant)))
            if before and before + work > self._budget:
                break
            ticket = queue.pop(0).ticket
            if not queue:
                del self._waiting[tenant]
            self._prefilling[ticket.request_id] = ticket.work_tokens
            self._prefill_total += ticket.work_tokens
            tag = self._start_tags[ticket.request_id] = self.counter(tenant)
            self._engine_priorities[ticket.request_id] = engine_priority(ticket.priority, tag)
            self._counters[tenant] = self.counter(tenant) + ticket.work_tokens
            started.append(ticket.request_id)
        return started

    def _rank(self, tenant: str) -> tuple[int, float, int, int]:
        # On equal counters (a tenant just lifted to the backlog's, with no idle credit) the
        # shorter backlog first: a tenant back from idle waits behind none of the busy one's.
        queue = self._waiting[tenant]
        return (queue[0].priority, self.counter(tenant), len(queue), queue[0].seq)
