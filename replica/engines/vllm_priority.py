"""vLLM's scheduler with the step given in priority order (fair share, issue 17).

vLLM's ``scheduling_policy="priority"`` orders only the waiting queue (and picks the preemption
victim): each step it gives the token budget to the running requests first, in the order they
started, so a prefill in progress keeps the step from a more urgent request that arrived after
it started. The replica's fair share hands each request a priority (the request's own, then its
tenant's virtual token counter when it started: ``replica/admission/fair_share.py``) and needs
that order to hold inside the step too. Before vLLM schedules a step, these schedulers

1. sort the running requests by (priority, arrival), so the budget goes to the urgent first;
2. when the waiting queue's head can start now (a free slot, and free blocks for its prompt),
   make the running prefills less urgent than it skip this step, through the per-request step
   gate vLLM already honours (``next_decode_eligible_step``, restored after the step), so the
   head gets the step's budget: it waits for the step in progress only, as alone.

Then vLLM schedules exactly as it does. Decodes never yield. The engine model
(``replica/sim_model/engine.py``) follows the same rule, so the simulator and sim replicas agree.

vLLM names the class in ``SchedulerConfig.scheduler_cls`` and builds it in the engine-core
process; ``priority_ordered_scheduler`` stands in for the class and picks the subclass of the
scheduler vLLM would have used (the asynchronous one where async scheduling is on).
"""

from __future__ import annotations

from typing import Any, cast

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request, RequestStatus

SCHEDULER_QUALNAME = f"{__name__}.priority_ordered_scheduler"


def _urgency(request: Request) -> tuple[int, float]:
    return request.priority, request.arrival_time


def _schedule_in_priority_order(scheduler: Scheduler) -> list[tuple[Request, int]]:
    """Steps 1 and 2 of the module docstring; returns the step gates to restore."""
    running = scheduler.running
    running.sort(key=_urgency)
    if not scheduler.waiting or not running:
        return []
    head = scheduler.waiting.peek_request()
    if head.status != RequestStatus.WAITING or len(running) >= scheduler.max_num_running_reqs:
        return []
    needed = -(-head.num_tokens // scheduler.block_size)
    if needed > scheduler.kv_cache_manager.block_pool.get_num_free_blocks():
        return []
    urgency = _urgency(head)
    yielding = [r for r in running if r.is_prefill_chunk and _urgency(r) > urgency]
    saved = [(r, r.next_decode_eligible_step) for r in yielding]
    for request in yielding:
        # ``schedule`` counts this step first, then skips a request while the step is below.
        request.next_decode_eligible_step = scheduler.current_step + 2
    return saved


def _restore(saved: list[tuple[Request, int]]) -> None:
    for request, step in saved:
        request.next_decode_eligible_step = step


class _InPriorityOrder:
    """Before either of vLLM's schedulers (the next class in the MRO) plans a step."""

    def schedule(self, *args: Any, **kwargs: Any) -> SchedulerOutput:
        saved = _schedule_in_priority_order(self)  # type: ignore[arg-type]
        try:
            return cast(SchedulerOutput, super().schedule(*args, **kwargs))  # type: ignore[misc]
        finally:
            _restore(saved)


class PriorityOrderedScheduler(_InPriorityOrder, Scheduler):
    pass


class PriorityOrderedAsyncScheduler(_InPriorityOrder, AsyncScheduler):
    pass


def priority_ordered_scheduler(*args: Any, **kwargs: Any) -> Scheduler:
    """vLLM's scheduler for this engine's config, giving the step in priority order."""
    config = kwargs["vllm_config"].scheduler_config
    if config.async_scheduling:
        return PriorityOrderedAsyncScheduler(*args, **kwargs)
    return PriorityOrderedScheduler(*args, **kwargs)
