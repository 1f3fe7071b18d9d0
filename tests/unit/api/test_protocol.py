from __future__ import annotations

import json

import pytest

from prefixmesh.api.errors import APIError
from prefixmesh.api.protocol import ChatCompletionRequest, CompletionRequest, parse_body


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
        (body(prompt="hi"), 400, "model"),
        (body(model="m", prompt=3), 400, "prompt"),
        (body(model="m", prompt="hi", max_tokens=0), 400, "max_tokens"),
        (body(model="m", prompt="hi", max_tokens=-5), 400, "max_tokens"),
        (body(model="m", prompt="hi", temperature=3), 400, "temperature"),
        (body(model="m", prompt="hi", n=129), 400, "n"),
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


@pytest.mark.parametrize(
    "raw",
    [
        b'{"model": "m", "prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}",  # past 4,300 digits
        b'{"model": "m", "prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}",  # past the recursion limit
        b"[" * 20000 + b"]" * 20000,
    ],
)
def test_json_python_cannot_decode_is_400_not_a_crash(raw: bytes) -> None:
    """Found by fuzzing (tests/e2e/test_fuzz.py): ``json.loads`` raises ``ValueError`` for a
    long integer and ``RecursionError`` for deep nesting, which the replica answered 500."""
    with pytest.raises(APIError) as caught:
        parse_body(raw, CompletionRequest)
    assert (caught.value.status, caught.value.param) == (400, None)
    assert caught.value.message.startswith("malformed JSON body")


def test_a_lone_surrogate_in_a_field_is_400_naming_it() -> None:
    """Found by fuzzing: JSON's ``"\\ud800"`` decodes to a string the tokenizer refuses with a
    ``TypeError`` (a 500); it is malformed input. An unknown field may hold one (ignored)."""
    for raw, model, param in [
        (b'{"model": "m", "prompt": "a\\ud800"}', CompletionRequest, "prompt"),
        (b'{"model": "m", "prompt": "a", "stop": ["\\udfff"]}', CompletionRequest, "stop"),
        (
            b'{"model": "m", "messages": [{"role": "user", "content": [{"type": "text", '
            b'"text": "\\ud83d"}]}]}',
            ChatCompletionRequest,
            "messages",
        ),
    ]:
        with pytest.raises(APIError) as caught:
            parse_body(raw, model)
        assert (caught.value.status, caught.value.param) == (400, param)
        json.dumps(caught.value.body(), ensure_ascii=False).encode()  # renders as UTF-8
    ok = parse_body(b'{"model": "m", "prompt": "\\ud83d\\ude00", "x\\ud800": 1}', CompletionRequest)
    assert ok.prompt == "\U0001f600"  # an escaped surrogate pair is one character


def test_bad_chat_bodies() -> None:
    for raw, param in [
        (body(model="m", messages=[]), "messages"),
        (body(model="m", messages=[{"role": "wizard", "content": "x"}]), "messages[0].role"),
        (body(model="m", messages="hi"), "messages"),
        (
            body(model="m", messages=[{"role": "user", "content": "x"}], max_completion_tokens=0),
            "max_completion_tokens",
        ),
    ]:
        with pytest.raises(APIError) as caught:
            parse_body(raw, ChatCompletionRequest)
        assert (caught.value.status, caught.value.param) == (400, param)


def test_a_prompt_past_the_context_is_openai_s_400() -> None:
    completion = parse_body(body(model="m", prompt="hi", max_tokens=10), CompletionRequest)
    with pytest.raises(APIError) as caught:
        completion.engine_sampling(60, 10, 64, None)
    assert caught.value.status == 400
    assert caught.value.body() == {
        "error": {
            "message": "This model's maximum context length is 64 tokens. However, you "
            "requested 70 tokens (60 in the prompt, 10 in the completion). Please reduce the "
            "length of the prompt or completion.",
            "type": "invalid_request_error",
            "param": "max_tokens",
            "code": "context_length_exceeded",
        }
    }
    with pytest.raises(APIError) as caught:  # a prompt past the context is the prompt's fault
        completion.engine_sampling(64, 10, 64, None)
    assert caught.value.param == "prompt"
    chat = parse_body(
        body(model="m", messages=[{"role": "user", "content": "x"}]), ChatCompletionRequest
    )
    with pytest.raises(APIError) as caught:
        chat.engine_sampling(64, None, 64, None)
    assert (caught.value.status, caught.value.param) == (400, "messages")
    assert caught.value.message == (
        "This model's maximum context length is 64 tokens. However, the messages resulted in "
        "64 tokens. Please reduce the length of the messages."
    )


def test_without_max_tokens_the_rest_of_the_context_up_to_the_cap() -> None:
    chat = parse_body(
        body(model="m", messages=[{"role": "user", "content": "x"}]), ChatCompletionRequest
    )
    assert chat.engine_sampling(60, None, 64, 2).max_tokens == 4
    assert chat.engine_sampling(10, None, 64, 2, max_tokens_cap=8).max_tokens == 8
    assert chat.engine_sampling(60, None, 64, 2, max_tokens_cap=8).max_tokens == 4
    assert chat.engine_sampling(10, 20, 64, 2, max_tokens_cap=8).max_tokens == 20  # checked before
    with pytest.raises(APIError) as caught:
        chat.engine_sampling(0, None, 64, 2)
    assert (caught.value.status, caught.value.param) == (400, "messages")


def test_seed_is_bounded_as_vllm_s_and_priority_is_read() -> None:
    body = {"model": "m", "prompt": "hi", "seed": 2**64}
    with pytest.raises(APIError) as raised:
        parse_body(json.dumps(body).encode(), CompletionRequest)
    assert (raised.value.status, raised.value.param) == (400, "seed")
    body = {"model": "m", "prompt": "hi", "seed": 2**64 - 1, "priority": -2}
    request = parse_body(json.dumps(body).encode(), CompletionRequest)
    assert (request.seed, request.priority) == (2**64 - 1, -2)


@pytest.mark.parametrize(
    ("fields", "param", "code", "message"),
    [
        (
            {"prompt": "hi"},
            "model",
            "missing_required_parameter",
            "Missing required parameter: 'model'.",
        ),
        (
            {"model": "m", "prompt": "hi", "max_tokens": -1},
            "max_tokens",
            "integer_below_min_value",
            "Invalid 'max_tokens': integer below minimum value. Expected a value >= 1, but got -1 "
            "instead.",
        ),
        (
            {"model": "m", "prompt": "hi", "temperature": "hot"},
            "temperature",
            "invalid_type",
            "Invalid type for 'temperature': expected a decimal, but got a string instead.",
        ),
        (
            {"model": "m", "prompt": "hi", "temperature": 2.5},
            "temperature",
            "decimal_above_max_value",
            "Invalid 'temperature': decimal above maximum value. Expected a value <= 2.0, but got "
            "2.5 instead.",
        ),
        ({"model": "m", "prompt": 3}, "prompt", "invalid_type", None),
        (  # an integer for a decimal field: the field's kind, as OpenAI names it
            {"model": "m", "prompt": "hi", "temperature": 3},
            "temperature",
            "decimal_above_max_value",
            None,
        ),
        ({"model": "m", "prompt": "hi", "n": 200}, "n", "integer_above_max_value", None),
        ({"model": "m", "prompt": "hi", "logprobs": 1}, "logprobs", "unsupported_parameter", None),
        ({"model": "m", "prompt": "hi", "best_of": 3}, "best_of", "unsupported_parameter", None),
        ({"model": "m", "prompt": "hi", "suffix": "end"}, "suffix", "unsupported_parameter", None),
        (
            {"model": "m", "prompt": "hi", "logit_bias": {"5": 1.0}},
            "logit_bias",
            "unsupported_parameter",
            None,
        ),
        (
            {"model": "m", "prompt": "hi", "response_format": {"type": "json_object"}},
            "response_format",
            "unsupported_parameter",
            None,
        ),
    ],
)
def test_completion_errors_have_openai_s_status_param_and_code(
    fields: dict[str, object], param: str, code: str, message: str | None
) -> None:
    with pytest.raises(APIError) as caught:
        parse_body(json.dumps(fields).encode(), CompletionRequest)
    error = caught.value.body()["error"]
    assert (caught.value.status, error["param"], error["code"]) == (400, param, code)
    if message is not None:
        assert error["message"] == message


USER = [{"role": "user", "content": "x"}]


@pytest.mark.parametrize(
    ("fields", "param", "code"),
    [
        ({"model": "m", "messages": []}, "messages", "empty_array"),
        ({"model": "m"}, "messages", "missing_required_parameter"),
        (
            {"model": "m", "messages": [{"role": "wizard", "content": "x"}]},
            "messages[0].role",
            "invalid_value",
        ),
        (
            {"model": "m", "messages": [{"content": "x"}]},
            "messages[0].role",
            "missing_required_parameter",
        ),
        ({"model": "m", "messages": USER, "logprobs": True}, "logprobs", "unsupported_parameter"),
        (
            {"model": "m", "messages": USER, "top_logprobs": 2},
            "top_logprobs",
            "unsupported_parameter",
        ),
        (
            {"model": "m", "messages": USER, "tools": [{"type": "function"}]},
            "tools",
            "unsupported_parameter",
        ),
        (
            {"model": "m", "messages": USER, "tool_choice": "auto"},
            "tool_choice",
            "unsupported_parameter",
        ),
    ],
)
def test_chat_errors_have_openai_s_status_param_and_code(
    fields: dict[str, object], param: str, code: str
) -> None:
    with pytest.raises(APIError) as caught:
        parse_body(json.dumps(fields).encode(), ChatCompletionRequest)
    error = caught.value.body()["error"]
    assert (caught.value.status, error["param"], error["code"]) == (400, param, code)


def test_the_sampling_fields_vllm_serves_reach_the_engine() -> None:
    fields = {
        "model": "m",
        "messages": USER,
        "n": 3,
        "seed": 7,
        "stop": ["a", "b"],
        "stop_token_ids": [5],
        "top_k": 20,
        "min_p": 0.1,
        "presence_penalty": 0.5,
        "frequency_penalty": -0.5,
        "repetition_penalty": 1.1,
        "min_tokens": 2,
        "logprobs": False,
        "tool_choice": "none",
        "response_format": {"type": "text"},
        "best_of": None,
    }
    request = parse_body(json.dumps(fields).encode(), ChatCompletionRequest)
    sampling = request.engine_sampling(10, 8, 64, 2)
    assert (sampling.n, sampling.seed, sampling.top_k, sampling.min_p) == (3, 7, 20, 0.1)
    assert (sampling.presence_penalty, sampling.frequency_penalty) == (0.5, -0.5)
    assert (sampling.repetition_penalty, sampling.min_tokens) == (1.1, 2)
    assert sampling.stop_token_ids == (5, 2)
    assert request.stop_strings() == ["a", "b"]
    defaults = parse_body(
        json.dumps({"model": "m", "messages": USER}).encode(), ChatCompletionRequest
    )
    plain = defaults.engine_sampling(10, 8, 64, 2)
    assert (plain.n, plain.temperature, plain.top_p, plain.top_k, plain.repetition_penalty) == (
        1,
        1.0,
        1.0,
        0,
        1.0,
    )


def test_min_tokens_past_max_tokens_is_a_400() -> None:
    request = parse_body(
        json.dumps({"model": "m", "prompt": "hi", "min_tokens": 9, "max_tokens": 4}).encode(),
        CompletionRequest,
    )
    with pytest.raises(APIError) as caught:
        request.engine_sampling(10, 4, 64, 2)
    assert (caught.value.status, caught.value.param) == (400, "min_tokens")
