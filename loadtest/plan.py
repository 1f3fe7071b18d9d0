"""What a load test sends: the workload's requests in arrival order, and each one's HTTP body.

The requests come from the simulator's workloads (``workloads.py``: blog, groups, multiturn,
burst; Poisson arrivals at ``rate`` from the workload's own seeded stream) or from a trace
(``traces.py``: Mooncake or Qwen-Bailian, at its own timestamps or rescaled to a mean ``rate``).
Bodies are OpenAI completions or chat requests with streaming and usage on, ``max_tokens`` the
request's output length and ``ignore_eos`` set, so every engine generates exactly that many
tokens; prompts are rendered by ``prompts.py``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from prefixmesh.loadtest.prompts import PromptRenderer
from prefixmesh.loadtest.traces import load_trace, rescale
from prefixmesh.loadtest.workloads import WorkloadRequest, make_workload

Api = Literal["completions", "chat"]
PromptFormat = Literal["text", "tokens"]
ChatLayout = Literal["system_user", "turns", "single"]
PATHS: dict[str, str] = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


@dataclass(frozen=True)
class PlanSettings:
    workload: str | None = None
    trace: str | None = None
    trace_format: Literal["mooncake", "qwen"] | None = None
    """None: detect from the first record."""
    params: Mapping[str, Any] = field(default_factory=dict)
    """Workload fields to override (``system_prompt_tokens=4096``)."""
    rate: float | None = None
    """Arrivals per second; a trace without it plays at its own timestamps."""
    requests: int = 100_000
    """At most this many requests."""
    duration_s: float = 60.0
    """Only arrivals (session starts, for multiturn) in the first this many seconds."""
    seed: int = 0

    def __post_init__(self) -> None:
        if (self.workload is None) == (self.trace is None):
            raise ValueError("give exactly one of a workload and a trace")
        if self.workload is not None and (self.rate is None or self.rate <= 0):
            raise ValueError("a workload needs a rate > 0")
        if self.requests <= 0 or self.duration_s <= 0:
            raise ValueError("requests and duration must be > 0")

    @property
    def chat_layout(self) -> ChatLayout:
        if self.trace is not None:
            return "single"
        return "turns" if self.workload == "multiturn" else "system_user"


def parse_params(pairs: Iterable[str]) -> dict[str, Any]:
    """``FIELD=VALUE`` workload fields, each value as YAML reads it (``4096``, ``true``)."""
    import yaml

    params: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise ValueError(f"workload fields are FIELD=VALUE, got {pair!r}")
        params[key.strip()] = yaml.safe_load(value)
    return params


def build_plan(settings: PlanSettings) -> list[WorkloadRequest]:
    """The requests in arrival order, the first arriving at (or near) zero."""
    if settings.workload is not None:
        assert settings.rate is not None
        workload = make_workload(settings.workload, settings.params)
        return workload.generate(
            settings.requests, settings.rate, settings.seed, settings.duration_s
        )
    assert settings.trace is not None
    requests = load_trace(settings.trace, settings.trace_format)
    if not requests:
        return []
    first = requests[0].arrival_s
    requests = [replace(r, arrival_s=r.arrival_s - first) for r in requests]
    if settings.rate is not None and len(requests) > 1 and requests[-1].arrival_s > 0:
        own_rate = (len(requests) - 1) / requests[-1].arrival_s
        requests = rescale(requests, own_rate / settings.rate)
    kept = [r for r in requests if r.arrival_s <= settings.duration_s]
    return kept[: settings.requests]


def roots_and_followers(
    requests: Sequence[WorkloadRequest],
) -> tuple[list[WorkloadRequest], dict[str, list[WorkloadRequest]]]:
    """Requests that arrive on schedule, and for each request the ones that follow it (a
    multi-turn session's next turn arrives ``think_s`` after the previous one finished)."""
    known = {r.request_id for r in requests}
    roots: list[WorkloadRequest] = []
    followers: dict[str, list[WorkloadRequest]] = {}
    for request in requests:
        if request.follows is not None and request.follows in known:
            followers.setdefault(request.follows, []).append(request)
        else:
            roots.append(request)
    return roots, followers


@dataclass(frozen=True)
class BodySettings:
    api: Api = "completions"
    prompt_format: PromptFormat = "text"
    model: str = "demo-tiny"
    chat_layout: ChatLayout = "system_user"
    max_tokens_cap: int | None = None
    """Cap on each request's output tokens (None: the workload's)."""

    def __post_init__(self) -> None:
        if self.api == "chat" and self.prompt_format == "tokens":
            raise ValueError("chat requests carry text; use --prompt-format text")


class RequestBuilder:
    def __init__(self, renderer: PromptRenderer, settings: BodySettings) -> None:
        self.renderer = renderer
        self.settings = settings
        self.path = PATHS[settings.api]

    def max_tokens(self, request: WorkloadRequest) -> int:
        cap = self.settings.max_tokens_cap
        return max(1, min(request.output_tokens, cap) if cap else request.output_tokens)

    def messages(self, request: WorkloadRequest) -> list[dict[str, str]]:
        text = self.renderer.segment_text
        segments = request.segments
        layout = self.settings.chat_layout
        if layout == "single" or len(segments) < 2:
            return [{"role": "user", "content": self.renderer.text(segments)}]
        messages = [{"role": "system", "content": text(segments[0])}]
        if layout == "system_user":
            return [*messages, {"role": "user", "content": self.renderer.text(segments[1:])}]
        for i, segment in enumerate(segments[1:]):  # turns: user, assistant, user, ...
            messages.append({"role": "assistant" if i % 2 else "user", "content": text(segment)})
        return messages

    def body(self, request: WorkloadRequest) -> dict[str, Any]:
        s = self.settings
        body: dict[str, Any] = {
            "model": s.model,
            "max_tokens": self.max_tokens(request),
            "stream": True,
            "stream_options": {"include_usage": True},
            "ignore_eos": True,
            "temperature": 0.0,
        }
        if s.api == "chat":
            body["messages"] = self.messages(request)
        elif s.prompt_format == "tokens":
            body["prompt"] = self.renderer.token_ids(request.segments)
        else:
            body["prompt"] = self.renderer.text(request.segments)
        return body

    def payload(self, request: WorkloadRequest) -> bytes:
        return json.dumps(self.body(request), separators=(",", ":")).encode()
