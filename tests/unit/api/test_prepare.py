"""The front door (``api/prepare.py``): one body into one ``PreparedRequest``, refusals in one
order, the tokenizer and the hasher through their protocols (fakes here: one token per word)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import pytest

from prefixmesh.api.errors import APIError
from prefixmesh.api.limits import RequestLimits
from prefixmesh.api.prepare import FrontDoor, OpenAIRequest, check_model, is_chat
from prefixmesh.api.prompts import PromptEncoder
from prefixmesh.api.protocol import ChatCompletionRequest
from prefixmesh.cache_registry.hashing import BlockHasher
from prefixmesh.cache_registry.types import PrefixKey
from prefixmesh.wire import SamplingSettings

MODEL = "m"
EOS = 2


class _Words:
    """A tokenizer of one token per word (id: its length), counting its calls."""

    eos_token_id = EOS

    def __init__(self) -> None:
        self.calls = 0

    async def prompt_of(self, body: OpenAIRequest, chat: bool) -> tuple[list[int], int | None]:
        self.calls += 1
        if isinstance(body, ChatCompletionRequest):
            text = " ".join(m.text() for m in body.messages)
            return [len(w) for w in text.split()], body.max_completion_tokens or body.max_tokens
        prompt = body.prompt
        ids = list(prompt) if isinstance(prompt, list) else [len(w) for w in prompt.split()]
        return ids, body.max_tokens


class _Hasher:
    def __init__(self) -> None:
        self.hashed: list[tuple[int, ...]] = []
        self._real = BlockHasher(2, MODEL)

    def hash_tokens(self, token_ids: Sequence[int]) -> PrefixKey:
        self.hashed.append(tuple(token_ids))
        return self._real.hash_tokens(list(token_ids))


def front(**limits: Any) -> FrontDoor:
    settings = {
        "max_body_bytes": 1000,
        "max_model_len": 16,
        "max_chars_per_token": 4.0,
        "max_tokens": 8,
        "timeout_s": 1.0,
        **limits,
    }
    return FrontDoor(MODEL, RequestLimits(**settings), _Words(), _Hasher())


def raw(**body: Any) -> bytes:
    return json.dumps({"model": MODEL, **body}).encode()


async def refusal(door: FrontDoor, body: bytes, chat: bool = False, **kw: Any) -> APIError:
    with pytest.raises(APIError) as caught:
        await door.prepare(body, chat, **kw)
    return caught.value


async def test_a_completion_is_prepared_into_one_typed_value() -> None:
    door = front()
    prepared = await door.prepare(
        raw(prompt="aa bbb c dd", max_tokens=3, stream=True, stop="x"),
        False,
        tenant="team-a",
        headers={"x-prefixmesh-priority": "-4"},
    )
    assert prepared.prompt_token_ids == (2, 3, 1, 2) and prepared.prompt_tokens == 4
    assert prepared.sampling == SamplingSettings(max_tokens=3, stop_token_ids=(EOS,))
    assert prepared.key == BlockHasher(2, MODEL).hash_tokens([2, 3, 1, 2])
    assert (prepared.tenant, prepared.priority, prepared.chat) == ("team-a", -4, False)
    assert prepared.stream and not prepared.include_usage and prepared.stop_strings() == ["x"]
    with pytest.raises(AttributeError):
        prepared.tenant = "other"  # type: ignore[misc]


async def test_without_a_max_tokens_a_chat_gets_the_rest_of_the_context_up_to_the_cap() -> None:
    messages = [{"role": "user", "content": "aa bb"}]
    prepared = await front().prepare(raw(messages=messages), True)
    assert prepared.sampling.max_tokens == 8  # 14 tokens of room, capped at 8
    assert prepared.chat and prepared.priority == 0  # no headers: not judged


async def test_refusals_come_in_order_and_before_the_work_they_save() -> None:
    door = front()
    tokenizer, hasher = door.tokenizer, door.hasher
    assert isinstance(tokenizer, _Words) and isinstance(hasher, _Hasher)
    assert (await refusal(door, b"{")).status == 400  # not JSON
    assert (await refusal(door, raw(prompt=3))).param == "prompt"  # 400
    error = await refusal(door, raw(model="other", prompt="a"))
    assert (error.status, error.code) == (404, "model_not_found")
    assert "this cluster serves 'm'" in error.message
    error = await refusal(door, raw(prompt="a", max_tokens=9))  # over the cap
    assert (error.status, error.param) == (400, "max_tokens")
    error = await refusal(door, raw(prompt="x" * 80, max_tokens=1))  # 20 tokens at least
    assert (error.status, error.code) == (400, "context_length_exceeded")
    assert tokenizer.calls == 0 and hasher.hashed == []
    # past the context once tokenized (16 one-letter words): after the tokenizer, not hashed
    error = await refusal(door, raw(prompt=" ".join("a" * 16), max_tokens=1))
    assert (error.status, error.code, tokenizer.calls) == (400, "context_length_exceeded", 1)
    assert hasher.hashed == []
    # a bad priority: after the key (a quota, charged after the front door, is not charged)
    error = await refusal(
        door, raw(prompt="a", max_tokens=1), headers={"x-prefixmesh-priority": "high"}
    )
    assert (error.status, error.param, len(hasher.hashed)) == (400, "priority", 1)


async def test_the_standalone_server_names_itself_in_a_404() -> None:
    door = FrontDoor(MODEL, front().limits, _Words(), _Hasher(), "this replica")
    error = await refusal(door, raw(model="gpt", prompt="a"))
    assert error.message == "model 'gpt' does not exist; this replica serves 'm'"
    with pytest.raises(APIError, match="this cluster serves"):
        check_model("gpt", MODEL)


def test_a_chat_body_is_told_by_its_messages_key() -> None:
    assert is_chat(raw(messages=[]))
    assert not is_chat(raw(prompt='say "messages"'))  # quoted inside a string: escaped


class _Vocabulary:
    """A Hugging Face tokenizer of 10 tokens, as ``PromptEncoder`` reads one."""

    eos_token_id = EOS

    def __len__(self) -> int:
        return 10


async def test_a_token_id_out_of_the_vocabulary_is_400_on_every_server() -> None:
    """Every server's front door tokenizes through a ``PromptEncoder`` (the standalone server's
    ``PromptTokenizer`` is one), so a token-id prompt is checked the same everywhere."""
    door = FrontDoor(MODEL, front().limits, PromptEncoder(_Vocabulary()), _Hasher())
    for ids in ([1, 10], [-1, 1]):
        error = await refusal(door, raw(prompt=ids, max_tokens=1))
        assert error.body() == {
            "error": {
                "message": "prompt token ids out of the vocabulary",
                "type": "invalid_request_error",
                "param": "prompt",
                "code": "invalid_value",
            }
        }
        assert error.status == 400
    assert (await door.prepare(raw(prompt=[1, 9], max_tokens=1), False)).prompt_tokens == 2
