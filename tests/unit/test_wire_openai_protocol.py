from __future__ import annotations

import json

import pytest

from prefixmesh.wire.openai_protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    parse_body,
)


def body(**fields: object) -> bytes:
    return json.dumps(fields).encode()


def test_valid_requests_parse() -> None:
    request = parse_body(body(model="m", prompt="hi", max_tokens=3, stop="x"), CompletionRequest)
    assert (request.prompt, request.max_tokens, request.stop_strings()) == ("hi", 3, ["x"])
    chat = parse_body(
        body(
            model="m",
            messages=[
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                }
            ],
        ),
        ChatCompletionRequest,
    )
    assert chat.messages[0].text() == "ab"
    assert parse_body(
        body(model="m", prompt=[1, 2], unknown_field=1), CompletionRequest
    ).prompt == [1, 2]


@pytest.mark.parametrize(
    ("raw", "status", "param"),
    [
        (b"{oops", 400, None),
        (b"[1, 2]", 400, None),
        (b"\xff\xfe", 400, None),
        (body(prompt="hi"), 422, "model"),
        (body(model="m", prompt=3), 422, "prompt"),
        (body(model="m", prompt="hi", max_tokens=0), 422, "max_tokens"),
        (body(model="m", prompt="hi", max_tokens=-5), 422, "max_tokens"),
        (body(model="m", prompt="hi", temperature=3), 422, "temperature"),
        (body(model="m", prompt="hi", n=2), 400, "n"),
        (body(model="m", prompt="hi", logprobs=2), 400, "logprobs"),
        (body(model="m", prompt="hi", echo=True), 400, "echo"),
    ],
)
def test_bad_completion_bodies(raw: bytes, status: int, param: str | None) -> None:
    with pytest.raises(APIError) as caught:
        parse_body(raw, CompletionRequest)
    assert caught.value.status == status
    assert caught.value.param == param
    assert caught.value.body()["error"]["type"] == "invalid_request_error"


def test_bad_chat_bodies() -> None:
    for raw, param in [
        (body(model="m", messages=[]), "messages"),
        (body(model="m", messages=[{"role": "wizard", "content": "x"}]), "messages"),
        (body(model="m", messages="hi"), "messages"),
        (
            body(model="m", messages=[{"role": "user", "content": "x"}], max_completion_tokens=0),
            "max_completion_tokens",
        ),
    ]:
        with pytest.raises(APIError) as caught:
            parse_body(raw, ChatCompletionRequest)
        assert (caught.value.status, caught.value.param) == (422, param)
