"""What a load test sends: plans from workloads and traces, follow-up turns, request bodies."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from prefixmesh.api.word_vocabulary import Vocabulary
from prefixmesh.loadtest.plan import (
    BodySettings,
    PlanSettings,
    RequestBuilder,
    build_plan,
    roots_and_followers,
)
from prefixmesh.loadtest.prompts import PromptRenderer
from tests.fakes.tokenizer import tiny_tokenizer


@pytest.fixture(scope="module")
def renderer(tmp_path_factory: pytest.TempPathFactory) -> PromptRenderer:
    folder = tiny_tokenizer(tmp_path_factory.mktemp("tok"))
    return PromptRenderer(Vocabulary.from_tokenizer_dir(folder))


def test_a_workload_plan_is_seeded_bounded_and_in_order() -> None:
    settings = PlanSettings(
        workload="groups", params={"num_groups": 3}, rate=50.0, duration_s=2.0, seed=1
    )
    plan = build_plan(settings)
    assert plan == build_plan(settings)
    assert 60 < len(plan) < 140 and all(r.arrival_s < 2.0 for r in plan)
    assert [r.arrival_s for r in plan] == sorted(r.arrival_s for r in plan)
    capped = build_plan(PlanSettings(workload="groups", rate=50.0, requests=10, seed=1))
    assert len(capped) == 10
    with pytest.raises(ValueError, match="rate"):
        PlanSettings(workload="groups")
    with pytest.raises(ValueError, match="exactly one"):
        PlanSettings(workload="groups", trace="x.jsonl", rate=1.0)


def test_a_trace_starts_at_zero_and_can_be_rescaled_to_a_rate(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    records = [
        {"timestamp": 5000 + 1000 * i, "input_length": 600, "output_length": 3, "hash_ids": [0, i]}
        for i in range(5)
    ]
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    own = build_plan(PlanSettings(trace=str(path)))
    assert [r.arrival_s for r in own] == [0.0, 1.0, 2.0, 3.0, 4.0]
    fast = build_plan(PlanSettings(trace=str(path), rate=4.0))
    assert [r.arrival_s for r in fast] == pytest.approx([0.0, 0.25, 0.5, 0.75, 1.0])
    assert len(build_plan(PlanSettings(trace=str(path), duration_s=2.5))) == 3
    assert PlanSettings(trace=str(path)).chat_layout == "single"


def test_follow_up_turns_wait_for_their_predecessor() -> None:
    plan = build_plan(PlanSettings(workload="multiturn", rate=5.0, duration_s=4.0, seed=2))
    roots, followers = roots_and_followers(plan)
    assert all(r.follows is None for r in roots)
    chained = [f for fs in followers.values() for f in fs]
    assert len(roots) + len(chained) == len(plan) and chained
    by_id = {r.request_id: r for r in plan}
    for parent, children in followers.items():
        assert all(c.follows == parent for c in children)
        child = children[0]
        assert child.segments[: len(by_id[parent].finish_segments or ())] == (
            by_id[parent].finish_segments
        )


def test_bodies_stream_with_usage_and_exact_lengths(renderer: PromptRenderer) -> None:
    request = build_plan(PlanSettings(workload="groups", rate=10.0, requests=1, seed=0))[0]
    text = RequestBuilder(renderer, BodySettings(model="m")).body(request)
    assert text["model"] == "m" and text["stream"] is True and text["ignore_eos"] is True
    assert text["stream_options"] == {"include_usage": True}
    assert text["max_tokens"] == request.output_tokens
    assert text["prompt"] == renderer.text(request.segments)
    tokens = RequestBuilder(renderer, BodySettings(prompt_format="tokens")).body(request)
    assert tokens["prompt"] == renderer.token_ids(request.segments)
    capped = RequestBuilder(renderer, BodySettings(max_tokens_cap=3))
    assert capped.body(request)["max_tokens"] == 3
    assert json.loads(capped.payload(request))["max_tokens"] == 3


def test_chat_layouts(renderer: PromptRenderer) -> None:
    request = build_plan(PlanSettings(workload="groups", rate=10.0, requests=1, seed=0))[0]
    chat = RequestBuilder(renderer, BodySettings(api="chat"))
    assert chat.path == "/v1/chat/completions"
    messages = chat.body(request)["messages"]
    assert [m["role"] for m in messages] == ["system", "user"]
    assert messages[0]["content"] == renderer.segment_text(request.segments[0])
    single = RequestBuilder(renderer, BodySettings(api="chat", chat_layout="single"))
    assert [m["role"] for m in single.messages(request)] == ["user"]
    turns = RequestBuilder(renderer, BodySettings(api="chat", chat_layout="turns"))
    plan = build_plan(PlanSettings(workload="multiturn", rate=5.0, duration_s=4.0, seed=2))
    third = next(r for r in plan if r.request_id.endswith("-2"))
    roles = [m["role"] for m in turns.messages(third)]
    assert roles == ["system", "user", "assistant", "user", "assistant", "user"]
    with pytest.raises(ValueError, match="text"):
        BodySettings(api="chat", prompt_format="tokens")
