"""Synthetic workloads shared by the cluster simulator and the load tests.

Every workload is a frozen dataclass of parameters with ``generate(num_requests, rate, seed,
duration_s)``: requests whose prompts are sequences of content segments (``keys.py``), arriving
at ``rate`` requests per second (Poisson, or the workload's own structure built on Poisson: bursts,
sessions). Shapes and times come from separate random streams, so the same seed gives the same
prompts at every rate (the simulator sizes ``--load`` from the shapes, then picks the rate).
"""

from __future__ import annotations

import bisect
import itertools
import math
import random
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, fields
from typing import Any, ClassVar, Protocol

from prefixmesh.loadtest.keys import Segment, prompt_tokens


@dataclass(frozen=True, slots=True)
class WorkloadRequest:
    request_id: str
    arrival_s: float
    """Arrival time; for a follow-up (``follows`` set) a nominal time that only orders it."""
    segments: tuple[Segment, ...]
    """The prompt, as content."""
    prompt_tokens: int
    output_tokens: int
    finish_segments: tuple[Segment, ...] | None = None
    """Prompt + answer as content, for requests whose answer a later prompt repeats (multi-turn):
    the engine caches these blocks when the request finishes."""
    follows: str | None = None
    """A request this one follows: it arrives ``think_s`` after that one finishes."""
    think_s: float = 0.0
    kind: str = ""
    """A label for reports: "shared", "tail", "group", "turn", "burst", "trace"."""


def make_request(
    request_id: str,
    arrival_s: float,
    segments: tuple[Segment, ...],
    output_tokens: int,
    **extra: Any,
) -> WorkloadRequest:
    return WorkloadRequest(
        request_id, arrival_s, segments, prompt_tokens(segments), output_tokens, **extra
    )


class Workload(Protocol):
    name: ClassVar[str]
    default_replicas: ClassVar[int]

    def generate(
        self, num_requests: int, rate: float, seed: int, duration_s: float | None = None
    ) -> list[WorkloadRequest]: ...


# ---- helpers ---------------------------------------------------------------------------------


def _rngs(seed: int, name: str) -> tuple[random.Random, random.Random]:
    """Independent streams for shapes and for times (string seeds hash with SHA-512: stable)."""
    return random.Random(f"{name}/{seed}/shape"), random.Random(f"{name}/{seed}/time")


def _poisson_times(rng: random.Random, rate: float) -> Iterator[float]:
    if rate <= 0:
        raise ValueError(f"rate must be > 0, got {rate}")
    now = 0.0
    while True:
        now += rng.expovariate(rate)
        yield now


def _zipf_sampler(rng: random.Random, n: int, exponent: float) -> Callable[[], int]:
    cumulative = list(itertools.accumulate(1.0 / (i + 1) ** exponent for i in range(n)))
    total = cumulative[-1]
    return lambda: min(n - 1, bisect.bisect_left(cumulative, rng.random() * total))


def _log_uniform(rng: random.Random, low: int, high: int) -> int:
    return round(math.exp(rng.uniform(math.log(low), math.log(high))))


def _within(duration_s: float | None, time_s: float) -> bool:
    return duration_s is None or time_s < duration_s


# ---- blog: one hot system prompt plus a tail ---------------------------------------------------


@dataclass(frozen=True, slots=True)
class BlogWorkload:
    """The prefix-caching survey's setup (seed-004): 80% of traffic shares one 2K-token system
    prompt followed by a short unique question; the rest are unique prompts of a long tail."""

    name: ClassVar[str] = "blog"
    default_replicas: ClassVar[int] = 8

    shared_fraction: float = 0.8
    system_prompt_tokens: int = 2048
    question_tokens_min: int = 16
    question_tokens_max: int = 128
    tail_tokens_min: int = 256
    """Tail prompt lengths are log-uniform in [min, max]."""
    tail_tokens_max: int = 4096
    tail_prefixes: int = 0
    """0: every tail prompt is unique; N > 0: tail prompts start with one of N long prefixes
    (Zipf popularity), the reading of the survey where the tail also repeats."""
    tail_zipf_exponent: float = 1.1
    output_tokens_min: int = 64
    output_tokens_max: int = 192

    def generate(
        self, num_requests: int, rate: float, seed: int, duration_s: float | None = None
    ) -> list[WorkloadRequest]:
        shape, timing = _rngs(seed, self.name)
        ids = itertools.count(1)
        system = Segment(next(ids), self.system_prompt_tokens)
        tail_ids = [next(ids) for _ in range(self.tail_prefixes)]
        pick_tail = _zipf_sampler(shape, max(1, self.tail_prefixes), self.tail_zipf_exponent)
        requests: list[WorkloadRequest] = []
        for i, arrival in enumerate(_poisson_times(timing, rate)):
            if i >= num_requests or not _within(duration_s, arrival):
                break
            output = shape.randint(self.output_tokens_min, self.output_tokens_max)
            if shape.random() < self.shared_fraction:
                question = shape.randint(self.question_tokens_min, self.question_tokens_max)
                segments = (system, Segment(next(ids), question))
                kind = "shared"
            else:
                length = _log_uniform(shape, self.tail_tokens_min, self.tail_tokens_max)
                if tail_ids:
                    head = Segment(tail_ids[pick_tail()], length)
                    segments = (head, Segment(next(ids), self.question_tokens_max))
                else:
                    segments = (Segment(next(ids), length),)
                kind = "tail"
            requests.append(make_request(f"blog-{i}", arrival, segments, output, kind=kind))
        return requests


# ---- groups: llm-d's shared-prefix benchmark shape ---------------------------------------------


@dataclass(frozen=True, slots=True)
class GroupsWorkload:
    """llm-d's shared-prefix shape (anchors-systems 3.9): G groups x P prompts, each a long
    group system prompt (a shared document) plus one of the group's P questions; groups are
    picked with Zipf popularity. 64 groups x 16k tokens = 1M tokens of documents, more than
    twice what one h100-llama8b replica holds (427k tokens), so a replica holds a fraction of
    the groups and routing decides the hit rate."""

    name: ClassVar[str] = "groups"
    default_replicas: ClassVar[int] = 8

    num_groups: int = 64
    prompts_per_group: int = 5
    system_prompt_tokens: int = 16384
    question_tokens: int = 1024
    zipf_exponent: float = 1.0
    output_tokens_min: int = 128
    output_tokens_max: int = 384

    def generate(
        self, num_requests: int, rate: float, seed: int, duration_s: float | None = None
    ) -> list[WorkloadRequest]:
        shape, timing = _rngs(seed, self.name)
        ids = itertools.count(1)
        systems = [Segment(next(ids), self.system_prompt_tokens) for _ in range(self.num_groups)]
        questions = [
            [Segment(next(ids), self.question_tokens) for _ in range(self.prompts_per_group)]
            for _ in range(self.num_groups)
        ]
        pick_group = _zipf_sampler(shape, self.num_groups, self.zipf_exponent)
        requests: list[WorkloadRequest] = []
        for i, arrival in enumerate(_poisson_times(timing, rate)):
            if i >= num_requests or not _within(duration_s, arrival):
                break
            group = pick_group()
            question = questions[group][shape.randrange(self.prompts_per_group)]
            output = shape.randint(self.output_tokens_min, self.output_tokens_max)
            segments = (systems[group], question)
            requests.append(make_request(f"groups-{i}", arrival, segments, output, kind="group"))
        return requests


# ---- multiturn: sessions that extend their previous turn -----------------------------------------


@dataclass(frozen=True, slots=True)
class MultiturnWorkload:
    """Chat sessions: turn k's prompt is turn k-1's prompt + its answer + a new user message.
    Sessions start as a Poisson process; a turn arrives ``think`` seconds (exponential) after the
    previous turn's answer is complete."""

    name: ClassVar[str] = "multiturn"
    default_replicas: ClassVar[int] = 8

    system_prompt_tokens: int = 1024
    """Shared by every session (a product's system prompt)."""
    turns_min: int = 2
    turns_max: int = 8
    user_tokens_min: int = 32
    user_tokens_max: int = 512
    output_tokens_min: int = 64
    output_tokens_max: int = 512
    think_time_mean_s: float = 5.0

    def generate(
        self, num_requests: int, rate: float, seed: int, duration_s: float | None = None
    ) -> list[WorkloadRequest]:
        shape, timing = _rngs(seed, self.name)
        ids = itertools.count(1)
        system = Segment(next(ids), self.system_prompt_tokens)
        session_rate = rate / ((self.turns_min + self.turns_max) / 2)
        requests: list[WorkloadRequest] = []
        for session, start in enumerate(_poisson_times(timing, session_rate)):
            if len(requests) >= num_requests or not _within(duration_s, start):
                break
            turns = shape.randint(self.turns_min, self.turns_max)
            history: tuple[Segment, ...] = (system,)
            previous: str | None = None
            nominal = start
            for turn in range(min(turns, num_requests - len(requests))):
                user = Segment(next(ids), shape.randint(self.user_tokens_min, self.user_tokens_max))
                output = shape.randint(self.output_tokens_min, self.output_tokens_max)
                answer = Segment(next(ids), output)
                think = timing.expovariate(1.0 / self.think_time_mean_s) if previous else 0.0
                nominal += think
                segments = (*history, user)
                request_id = f"multiturn-{session}-{turn}"
                requests.append(
                    make_request(
                        request_id,
                        nominal,
                        segments,
                        output,
                        finish_segments=(*segments, answer),
                        follows=previous,
                        think_s=think,
                        kind="turn",
                    )
                )
                history = (*segments, answer)
                previous = request_id
        requests.sort(key=lambda r: r.arrival_s)
        return requests


# ---- burst: siblings of a fresh long prefix within milliseconds ---------------------------------


@dataclass(frozen=True, slots=True)
class BurstWorkload:
    """The delay-hit case: bursts of N requests that share a long prefix nobody has seen yet,
    arriving within a few milliseconds of each other (a fan-out agent, a batch job)."""

    name: ClassVar[str] = "burst"
    default_replicas: ClassVar[int] = 8

    burst_size: int = 8
    prefix_tokens: int = 8192
    suffix_tokens: int = 64
    spread_s: float = 0.005
    output_tokens_min: int = 32
    output_tokens_max: int = 96

    def generate(
        self, num_requests: int, rate: float, seed: int, duration_s: float | None = None
    ) -> list[WorkloadRequest]:
        shape, timing = _rngs(seed, self.name)
        ids = itertools.count(1)
        requests: list[WorkloadRequest] = []
        for burst, start in enumerate(_poisson_times(timing, rate / self.burst_size)):
            if len(requests) >= num_requests or not _within(duration_s, start):
                break
            prefix = Segment(next(ids), self.prefix_tokens)
            offsets = sorted(timing.uniform(0, self.spread_s) for _ in range(self.burst_size))
            for member, offset in enumerate(offsets[: num_requests - len(requests)]):
                segments = (prefix, Segment(next(ids), self.suffix_tokens))
                output = shape.randint(self.output_tokens_min, self.output_tokens_max)
                request_id = f"burst-{burst}-{member}"
                requests.append(
                    make_request(request_id, start + offset, segments, output, kind="burst")
                )
        requests.sort(key=lambda r: r.arrival_s)
        return requests


# ---- fewshot: HotPrefix's shuffled few-shot benchmark shape --------------------------------------


@dataclass(frozen=True, slots=True)
class FewshotWorkload:
    """HotPrefix's setup (seed-000 section 3): a shuffled few-shot benchmark such as 5-shot
    MMLU, where every question of a subject starts with that subject's few-shot prefix. Subjects
    have long-tailed (Zipf) popularity, each question is unique and asked once, the answer is
    one token. MMLU has 57 subjects and a mean input of 567 tokens."""

    name: ClassVar[str] = "fewshot"
    default_replicas: ClassVar[int] = 4

    num_subjects: int = 57
    prefix_tokens_min: int = 300
    """Few-shot prefix lengths are log-uniform in [min, max], one per subject."""
    prefix_tokens_max: int = 1200
    question_tokens_min: int = 30
    question_tokens_max: int = 150
    zipf_exponent: float = 1.0
    output_tokens: int = 1

    def generate(
        self, num_requests: int, rate: float, seed: int, duration_s: float | None = None
    ) -> list[WorkloadRequest]:
        shape, timing = _rngs(seed, self.name)
        ids = itertools.count(1)
        prefixes = [
            Segment(next(ids), _log_uniform(shape, self.prefix_tokens_min, self.prefix_tokens_max))
            for _ in range(self.num_subjects)
        ]
        pick_subject = _zipf_sampler(shape, self.num_subjects, self.zipf_exponent)
        requests: list[WorkloadRequest] = []
        for i, arrival in enumerate(_poisson_times(timing, rate)):
            if i >= num_requests or not _within(duration_s, arrival):
                break
            subject = pick_subject()
            question = shape.randint(self.question_tokens_min, self.question_tokens_max)
            segments = (prefixes[subject], Segment(next(ids), question))
            requests.append(
                make_request(f"fewshot-{i}", arrival, segments, self.output_tokens, kind="fewshot")
            )
        return requests


WORKLOADS: dict[str, type[Workload]] = {
    w.name: w
    for w in (BlogWorkload, GroupsWorkload, MultiturnWorkload, BurstWorkload, FewshotWorkload)
}


def make_workload(name: str, params: Mapping[str, Any] | None = None) -> Workload:
    """A workload by name, with some of its fields overridden."""
    cls = WORKLOADS.get(name)
    if cls is None:
        raise ValueError(f"unknown workload {name!r}; choose one of {sorted(WORKLOADS)}")
    known = {f.name: f for f in fields(cls)}  # type: ignore[arg-type]
    kwargs: dict[str, Any] = {}
    for key, value in (params or {}).items():
        if key not in known:
            raise ValueError(f"workload {name!r} has no parameter {key!r}; it has {sorted(known)}")
        default = known[key].default
        kwargs[key] = type(default)(value) if isinstance(default, int | float) else value
    return cls(**kwargs)
