"""What a running request adds to a replica's engine step, learned from finished requests.

The TTFT estimate (``ttft.py``) charges every running request one token's compute per step
(its decode token) plus the KV blocks it reads, at ``kv_read_s_per_block``. A replica that does
not report that rate (0: unknown, the usual case) looks cheaper the more it decodes than it is:
on an H100 with Llama-8B a running request at 2k tokens of context costs ~0.11 ms a step, of
which the decode token is 0.04 ms. Left alone, that error lets a few cache-warm replicas pile up
hundreds of decodes and slow every step, while the router still believes them quick.

So the router measures it. When a request finishes, the time from routing to finish, less the
TTFT estimated at routing, spread over its output tokens, is the mean step time it saw (its
inter-token latency). Less the replica's fixed step cost, what remains is what the running
requests (and any prefill chunks sharing those steps) added; divided by the running requests'
token compute at routing, it is the *running cost*: step time per running request, in units
of one token's compute (1 = the decode token alone). A ratio estimator with exponential
forgetting pools the samples of the whole fleet (one value: the per-token compute already
carries each replica's speed), clipped to [1, ``max_cost``].

Everything here follows from the policy's own decisions and the adapter's ``on_finished`` calls;
without them (no finishes reported) the running cost stays 1, the plain step model.
"""

from __future__ import annotations

from collections import OrderedDict


class DecodeCost:
    def __init__(
        self,
        *,
        window: int,
        max_cost: float,
        min_output_tokens: int,
        max_tracked: int,
    ) -> None:
        if window < 1 or max_cost < 1 or max_tracked < 1:
            raise ValueError("window and max_tracked must be >= 1, max_cost >= 1")
        self._keep = 1.0 - 1.0 / window
        self._window = window
        self._max_cost = max_cost
        self._min_output = max(min_output_tokens, 2)
        self._max_tracked = max_tracked
        self._excess_s = 0.0
        """Decayed sum of (observed step time - fixed step time) over the samples."""
        self._running_s = 0.0
        """Decayed sum of the running requests' token compute at routing, same samples."""
        self._weight = 0.0
        """Decayed count of samples."""
        self._routed: OrderedDict[str, tuple[float, float, float, float]] = OrderedDict()
        """request id -> (routed at, estimated TTFT, fixed step s, running x token s)."""
        self.value = 1.0
        """The running cost now (1 until the samples weigh a quarter of a window)."""

    def routed(
        self,
        request_id: str,
        now_s: float,
        ttft_s: float,
        fixed_step_s: float,
        running_token_s: float,
        output_tokens: int,
    ) -> None:
        """A request was sent to a replica where ``running_token_s`` = its running requests
        (itself included) x the per-token compute, and ``fixed_step_s`` = the step's fixed
        part (decode_step_s plus reported KV reads)."""
        if output_tokens < self._min_output or not running_token_s > 0:
            return
        if not (ttft_s < float("inf") and fixed_step_s < float("inf")):
            return
        routed = self._routed
        routed[request_id] = (now_s, ttft_s, fixed_step_s, running_token_s)
        if len(routed) > self._max_tracked:  # the adapter does not report finishes
            routed.popitem(last=False)

    def finished(self, request_id: str, output_tokens: int, now_s: float) -> None:
        sample = self._routed.pop(request_id, None)
        if sample is None:
            return
        routed_s, ttft_s, fixed_step_s, running_token_s = sample
        decode_s = now_s - routed_s - ttft_s
        if not decode_s > 0:
            return
        step_s = decode_s / (output_tokens - 1)
        keep = self._keep
        self._excess_s = self._excess_s * keep + max(step_s - fixed_step_s, 0.0)
        self._running_s = self._running_s * keep + running_token_s
        self._weight = self._weight * keep + 1.0
        if self._weight * 4 >= self._window and self._running_s > 0:
            cost = self._excess_s / self._running_s
            self.value = 1.0 if cost < 1.0 else min(cost, self._max_cost)

    def forget(self, request_id: str) -> None:
        self._routed.pop(request_id, None)
