"""Workload shapes: the survey's 80% share, llm-d's groups, sessions, bursts."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest

from prefixmesh.loadtest.workloads import (
    BlogWorkload,
    BurstWorkload,
    GroupsWorkload,
    MultiturnWorkload,
    make_workload,
)
from prefixmesh.replica.sim_model.profile import H100_LLAMA8B


def test_blog_sends_80_percent_to_one_system_prompt() -> None:
    requests = BlogWorkload().generate(5000, rate=100.0, seed=1)
    shared = [r for r in requests if r.kind == "shared"]
    assert len(shared) / len(requests) == pytest.approx(0.8, abs=0.02)
    assert {r.segments[0] for r in shared} == {shared[0].segments[0]}
    assert shared[0].segments[0].num_tokens == 2048
    tail_heads = [r.segments[0].content_id for r in requests if r.kind == "tail"]
    assert len(set(tail_heads)) == len(tail_heads)  # the tail is unique prompts
    assert len({r.segments[-1] for r in shared}) == len(shared)  # unique questions
    gaps = [b.arrival_s - a.arrival_s for a, b in itertools.pairwise(requests)]
    assert sum(gaps) / len(gaps) == pytest.approx(0.01, rel=0.1)  # Poisson at 100/s


def test_same_seed_same_requests_and_shapes_do_not_depend_on_rate() -> None:
    slow = BlogWorkload().generate(300, rate=1.0, seed=3)
    assert slow == BlogWorkload().generate(300, rate=1.0, seed=3)
    fast = BlogWorkload().generate(300, rate=50.0, seed=3)
    assert [r.segments for r in slow] == [r.segments for r in fast]
    assert [r.arrival_s * 1.0 for r in slow] != [r.arrival_s for r in fast]
    assert BlogWorkload().generate(300, rate=1.0, seed=4) != slow


def test_groups_overflow_one_replica_and_follow_zipf() -> None:
    workload = GroupsWorkload()
    working_set = workload.num_groups * workload.system_prompt_tokens
    assert working_set > 2 * H100_LLAMA8B.kv_blocks * H100_LLAMA8B.block_size
    requests = workload.generate(4000, rate=10.0, seed=0)
    popularity = Counter(r.segments[0].content_id for r in requests)
    ranked = [count for _, count in popularity.most_common()]
    assert ranked[0] > 3 * ranked[len(ranked) // 2]
    assert len({r.segments for r in requests}) <= workload.num_groups * workload.prompts_per_group


def test_multiturn_turns_extend_the_previous_prompt_and_answer() -> None:
    requests = MultiturnWorkload().generate(200, rate=5.0, seed=2)
    by_id = {r.request_id: r for r in requests}
    follow_ups = [r for r in requests if r.follows is not None]
    assert follow_ups
    for turn in follow_ups:
        parent = by_id[turn.follows]
        assert parent.finish_segments is not None
        assert turn.segments[: len(parent.finish_segments)] == parent.finish_segments
        assert parent.finish_segments[-1].num_tokens == parent.output_tokens
        assert turn.think_s > 0 and turn.arrival_s > parent.arrival_s
    assert len(requests) == 200


def test_bursts_share_a_fresh_prefix_within_milliseconds() -> None:
    requests = BurstWorkload(burst_size=4).generate(40, rate=4.0, seed=0)
    bursts: dict[int, list[float]] = {}
    for r in requests:
        bursts.setdefault(r.segments[0].content_id, []).append(r.arrival_s)
    assert len(bursts) == 10
    assert all(len(times) == 4 and max(times) - min(times) <= 0.005 for times in bursts.values())


def test_make_workload_overrides_fields_by_name() -> None:
    workload = make_workload("groups", {"num_groups": "8", "zipf_exponent": 1})
    assert isinstance(workload, GroupsWorkload)
    assert workload.num_groups == 8 and workload.zipf_exponent == 1.0
    with pytest.raises(ValueError):
        make_workload("groups", {"nope": 1})
    with pytest.raises(ValueError):
        make_workload("nope")
