"""Limits before work (``prefixmesh/api/limits.py``): a body over the limit is refused by its
Content-Length without a byte read, or as soon as the bytes counted pass it; a ``max_tokens``
over the cap and a prompt that cannot fit the context are refused from the parsed request
alone; a stream past its deadline ends with an error event."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from prefixmesh.api.errors import APIError
from prefixmesh.api.limits import (
    REQUEST_TOO_LARGE,
    RequestLimits,
    longest_token_chars,
    read_body,
    read_json,
    until_deadline,
)
from prefixmesh.api.protocol import ChatCompletionRequest, CompletionRequest, parse_body
from prefixmesh.config import load_config
from tests.fakes.tokenizer import tiny_tokenizer

LIMITS = RequestLimits(
    max_body_bytes=100, max_model_len=64, max_chars_per_token=4.0, max_tokens=32, timeout_s=5.0
)


class _Request:
    """A request whose body arrives in ``chunks``; counts the chunks read."""

    def __init__(self, chunks: list[bytes], headers: dict[str, str] | None = None) -> None:
        self.headers = headers or {}
        self._chunks = chunks
        self.read = 0

    async def stream(self) -> AsyncIterator[bytes]:
        for chunk in self._chunks:
            self.read += 1
            yield chunk


def completion(**fields: Any) -> CompletionRequest:
    request: CompletionRequest = parse_body(
        json.dumps({"model": "m", **fields}).encode(), CompletionRequest
    )
    return request


def chat(*contents: str, **fields: Any) -> ChatCompletionRequest:
    messages = [{"role": "user", "content": c} for c in contents]
    body = json.dumps({"model": "m", "messages": messages, **fields}).encode()
    request: ChatCompletionRequest = parse_body(body, ChatCompletionRequest)
    return request


def refused(call: Any, *args: Any) -> APIError:
    with pytest.raises(APIError) as caught:
        call(*args)
    return caught.value


# ---- the body -------------------------------------------------------------------------------


async def test_a_declared_length_over_the_limit_is_refused_before_a_byte_is_read() -> None:
    request = _Request([b"x" * 10_000_000], {"content-length": "10000000"})
    with pytest.raises(APIError) as caught:
        await read_body(request, 100)
    assert request.read == 0
    error = caught.value
    assert (error.status, error.code, error.param) == (413, REQUEST_TOO_LARGE, None)
    assert "10000000 bytes" in error.message and "100 bytes" in error.message


async def test_an_undeclared_body_is_counted_and_refused_once_past_the_limit() -> None:
    request = _Request([b"x" * 60, b"x" * 60, b"x" * 60])  # chunked: no Content-Length
    with pytest.raises(APIError) as caught:
        await read_body(request, 100)
    assert caught.value.status == 413 and request.read == 2  # the third chunk is never read
    # a Content-Length that understates the body is no way past the limit
    lying = _Request([b"x" * 60, b"x" * 60], {"content-length": "10"})
    with pytest.raises(APIError):
        await read_body(lying, 100)


async def test_a_body_within_the_limit_is_read_whole() -> None:
    assert await read_body(_Request([b"ab", b"cd"], {"content-length": "4"}), 4) == b"abcd"
    assert await read_body(_Request([b"ab"], {"content-length": "?"}), 4) == b"ab"
    assert await read_json(_Request([b'{"a": 1}']), 100) == {"a": 1}
    with pytest.raises(APIError) as caught:
        await read_json(_Request([b"{nope"]), 100)
    assert caught.value.status == 400


@pytest.mark.parametrize("raw", [b"[" * 5000 + b"]" * 5000, b"9" * 5000])
async def test_json_python_cannot_decode_is_400(raw: bytes) -> None:
    """Found by fuzzing: deep nesting (``RecursionError``) and an integer past Python's 4,300
    digits (``ValueError``) were not caught as malformed JSON (a 500)."""
    with pytest.raises(APIError) as caught:
        await read_json(_Request([raw]), 20_000)
    assert caught.value.status == 400


# ---- the parsed request ---------------------------------------------------------------------


def test_max_tokens_over_the_cap_is_400_naming_the_field() -> None:
    error = refused(LIMITS.admit, completion(prompt="hi", max_tokens=33))
    assert (error.status, error.param, error.code) == (400, "max_tokens", None)
    assert error.message.startswith("max_tokens is too large: 33.")
    assert "at most 32 completion tokens" in error.message
    error = refused(LIMITS.admit, chat("hi", max_completion_tokens=40, max_tokens=2))
    assert error.param == "max_completion_tokens"
    LIMITS.admit(completion(prompt="hi", max_tokens=32))
    LIMITS.admit(chat("hi"))  # none asked for: the cap applies when sampling


def test_a_prompt_that_cannot_fit_is_refused_before_tokenizing() -> None:
    # 64 tokens of context, at most 4 characters a token: 241 characters are 61 tokens at
    # least, and the completion's default 16 make 77.
    error = refused(LIMITS.admit, completion(prompt="x" * 241))
    assert error.body() == {
        "error": {
            "message": "This model's maximum context length is 64 tokens. However, you requested "
            "at least 77 tokens (at least 61 in the prompt, 16 in the completion). Please "
            "reduce the length of the prompt or completion.",
            "type": "invalid_request_error",
            "param": "max_tokens",  # the prompt alone would fit: the completion's fault
            "code": "context_length_exceeded",
        }
    }
    assert refused(LIMITS.admit, completion(prompt="x" * 260)).param == "prompt"  # 65 at least
    assert refused(LIMITS.admit, chat("x" * 128, "y" * 128)).param == "messages"  # 64 at least
    assert refused(LIMITS.admit, completion(prompt=list(range(60)), max_tokens=5)).status == 400
    # what may fit is left to the tokenizer
    LIMITS.admit(completion(prompt="x" * 192))  # 48 + 16
    LIMITS.admit(chat("x" * 252))  # 63 at least, and one token of room
    LIMITS.admit(completion(prompt=list(range(59)), max_tokens=5))


def test_without_a_bound_on_characters_only_token_ids_are_prechecked() -> None:
    limits = RequestLimits(100, 64, None, None, 5.0)
    limits.admit(completion(prompt="x" * 100_000))
    assert refused(limits.admit, completion(prompt=[1] * 64, max_tokens=1)).status == 400


def test_limits_from_the_config() -> None:
    config = load_config(
        overrides=["replica.vllm.max_model_len=128", "ingress.request_timeout_s=9"]
    )
    limits = RequestLimits.from_config(config)
    assert limits == RequestLimits(config.serving.max_body_bytes, 128, None, None, 9.0)
    config = load_config(
        overrides=[
            "limits.max_body_bytes=2048",
            "limits.max_chars_per_token=3",
            "limits.max_tokens=7",
        ]
    )
    assert RequestLimits.from_config(config, tokenizer=object()) == RequestLimits(
        2048, 4096, 3.0, 7, 600.0
    )


# ---- the bound on characters per token -----------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from transformers import PreTrainedTokenizerFast

    folder = tiny_tokenizer(tmp_path_factory.mktemp("tok"))
    return PreTrainedTokenizerFast(tokenizer_file=str(Path(folder) / "tokenizer.json"))


def test_the_longest_token_bounds_every_tokenization(tokenizer: Any) -> None:
    longest = longest_token_chars(tokenizer)
    assert longest == max(len(t) for t in tokenizer.convert_ids_to_tokens(range(len(tokenizer))))
    assert longest is not None and longest >= len("<pad>")
    limits = RequestLimits.from_config(load_config(), tokenizer)
    assert limits.max_chars_per_token == longest
    for text in ("alpha beta gamma " * 40, "x" * 500, " " * 300, "é€😀 omega" * 30):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert len(ids) >= len(text) / longest


class _Backend:
    def __init__(self, normalizer: dict[str, Any] | None) -> None:
        self.normalizer = normalizer

    def to_str(self) -> str:
        return json.dumps({"normalizer": self.normalizer})


class _Tokenizer:
    def __init__(self, normalizer: dict[str, Any] | None) -> None:
        self.backend_tokenizer = _Backend(normalizer)

    def __len__(self) -> int:
        return 2

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return ["▁hello", "x"]


@pytest.mark.parametrize(
    ("normalizer", "bound"),
    [
        (None, 6),
        (
            {
                "type": "Sequence",
                "normalizers": [
                    {"type": "Prepend", "prepend": "▁"},
                    {"type": "Replace", "pattern": {"String": " "}, "content": "▁"},
                ],
            },
            6,
        ),
        ({"type": "NFKD"}, 6),
        # these may shorten the text before it is split: no bound from the vocabulary
        ({"type": "NFC"}, None),
        ({"type": "Strip", "strip_left": True, "strip_right": True}, None),
        ({"type": "BertNormalizer", "clean_text": True}, None),
        ({"type": "Replace", "pattern": {"String": "  "}, "content": " "}, None),
        ({"type": "Replace", "pattern": {"Regex": "\\s+"}, "content": " "}, None),
        ({"type": "Sequence", "normalizers": [{"type": "Lowercase"}, {"type": "NFKC"}]}, None),
    ],
)
def test_a_normalizer_that_may_shorten_the_text_gives_no_bound(
    normalizer: dict[str, Any] | None, bound: int | None
) -> None:
    assert longest_token_chars(_Tokenizer(normalizer)) == bound
    assert longest_token_chars(object()) is None  # not a fast tokenizer


# ---- the request's time ---------------------------------------------------------------------


async def test_a_stream_past_its_deadline_ends_with_an_error_event_and_is_closed() -> None:
    closed = asyncio.Event()

    async def events() -> AsyncIterator[bytes]:
        try:
            yield b"data: 1\n\n"
            await asyncio.Event().wait()  # the replica stalls
            yield b"data: never\n\n"
        finally:
            closed.set()

    def expired() -> APIError:
        return APIError(504, "too slow", error_type="server_error", code="timeout")

    loop = asyncio.get_running_loop()
    # The deadline has passed: the first event was ready at once, the wait for the next ends.
    got = [event async for event in until_deadline(events(), loop.time() - 1, expired)]
    assert closed.is_set()  # the wait was cancelled: the generation is closed (aborted)
    assert got[0] == b"data: 1\n\n" and got[-1] == b"data: [DONE]\n\n" and len(got) == 3
    assert json.loads(got[1][len(b"data: ") :])["error"] == {
        "message": "too slow",
        "type": "server_error",
        "param": None,
        "code": "timeout",
    }
    # A client gone mid-stream (Starlette closes the response's iterator): the source closes.
    closed.clear()
    stream = until_deadline(events(), loop.time() + 3600, expired)
    assert await anext(stream) == b"data: 1\n\n"
    await stream.aclose()
    assert closed.is_set()


async def test_a_stream_within_its_deadline_passes_whole() -> None:
    async def events() -> AsyncIterator[bytes]:
        for i in range(3):
            yield f"data: {i}\n\n".encode()

    loop = asyncio.get_running_loop()
    got = [e async for e in until_deadline(events(), loop.time() + 3600, lambda: APIError(504, ""))]
    assert got == [b"data: 0\n\n", b"data: 1\n\n", b"data: 2\n\n"]
