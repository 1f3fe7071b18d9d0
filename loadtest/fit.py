"""Does a load test fit its target? Pure checks on the plan and on the results (issue 17).

Before a run: every request's prompt plus the output it asks for must fit the target's context
length (``max_model_len`` in its ``/v1/models``), or the run would measure nothing but errors
(``--workload groups`` with 17,409-token prompts against a 4,096-token model: 1,212 of 1,212
failed, and the command exited 0). After it: more than an allowed share of failed requests is
a failed run, reported with its first error.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from prefixmesh.loadtest.workloads import WorkloadRequest


@dataclass(frozen=True, slots=True)
class Fit:
    requests: int
    too_long: int
    """Requests whose prompt plus asked output is longer than the context."""
    longest: int
    """The longest prompt plus asked output of any request, in tokens."""
    max_model_len: int

    @property
    def fits(self) -> bool:
        return self.too_long == 0

    def explain(self) -> str:
        return (
            f"{self.too_long} of {self.requests} requests ask for more tokens than the target's "
            f"context length ({self.max_model_len}; the longest asks {self.longest}: prompt plus "
            "output); shrink the workload with --param (prompt and output sizes) or --max-tokens"
        )


def plan_fit(
    requests: Sequence[WorkloadRequest], max_model_len: int, max_tokens_cap: int | None
) -> Fit:
    """How the plan's requests fit ``max_model_len`` with outputs capped at ``max_tokens_cap``
    (as the request builder caps them)."""

    def asked(request: WorkloadRequest) -> int:
        output = request.output_tokens
        if max_tokens_cap:
            output = min(output, max_tokens_cap)
        return request.prompt_tokens + max(1, output)

    sizes = [asked(request) for request in requests]
    too_long = sum(1 for size in sizes if size > max_model_len)
    return Fit(len(sizes), too_long, max(sizes, default=0), max_model_len)


def context_length(models: Mapping[str, Any], model: str) -> int | None:
    """``max_model_len`` of ``model`` in an OpenAI ``/v1/models`` answer (None: not given, as
    servers that do not extend the model card answer)."""
    for card in models.get("data") or ():
        if isinstance(card, Mapping) and card.get("id") == model:
            value = card.get("max_model_len")
            return value if isinstance(value, int) and value > 0 else None
    return None


def failed_run(records: Iterable[Mapping[str, Any]], max_failure_share: float) -> str | None:
    """The reason a run failed (its failures past ``max_failure_share`` of its requests, and
    the first one's error), or None."""
    total = failures = 0
    first = ""
    for record in records:
        total += 1
        ok = (
            record.get("status") == 200
            and not record.get("error")
            and record.get("ttft_s") is not None
        )
        if not ok:
            failures += 1
            if not first:
                first = f"HTTP {record.get('status')}: {record.get('error') or 'no error text'}"
    if total == 0:
        return "no request was sent"
    if failures / total <= max_failure_share:
        return None
    return (
        f"{failures} of {total} requests failed (allowed {max_failure_share:.0%}); first: {first}"
    )
