"""The OpenAI API surface the servers accept: the request models and their parsing (the
errors are ``errors.py``'s).

Status codes, as OpenAI and vLLM answer (the openai SDK raises ``BadRequestError`` for every
400): malformed JSON 400 (an integer past Python's 4,300 digits and nesting past its recursion
limit included); a string that is not Unicode text (a lone surrogate, ``"\\ud800"``, which no
tokenizer takes) in a field 400 with ``param`` naming it; a missing, wrong-typed or
out-of-range field 400 with ``param`` naming it and OpenAI's ``code``
(``errors.field_error``); a field vLLM serves that we do not (``UNSERVED``) 400 with code
``unsupported_parameter``; an unknown model 404; a prompt that does not fit the context 400
with code ``context_length_exceeded`` and ``param`` the prompt's field (or ``max_tokens`` when
the prompt fits and the completion does not). Unknown extra fields are ignored, as vLLM does.
The limits checked before parsing and tokenizing (body size, ``max_tokens`` cap) are in
``limits.py``; docs/api.md has the table, field by field.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from prefixmesh.api.errors import APIError, context_length_exceeded, field_error
from prefixmesh.wire import SamplingSettings


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Request):
    include_usage: bool = False


class _Sampling(_Request):
    prompt_param: ClassVar[str] = "prompt"
    """The field a context-length error names (OpenAI: ``prompt``, or ``messages``)."""
    model: str
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    """None: 1.0, OpenAI's default."""
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1, le=128)
    """Choices (OpenAI's bound: 128), each an engine request of its own."""
    top_k: int | None = Field(default=None, ge=-1)
    """vLLM's: 0 or -1 (and None) consider every token."""
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=2.0)
    min_tokens: int = Field(default=0, ge=0)
    stop_token_ids: list[int] | None = None
    logit_bias: dict[str, float] | None = None
    response_format: dict[str, Any] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**64)
    """vLLM's bound (a 64-bit seed); past it the engine would fail the request."""
    priority: int | None = None
    """vLLM's extension: lower starts first when a replica is saturated (``fair_share``);
    ``api/priority.py`` bounds it and falls back to the ``x-prefixmesh-priority`` header."""
    ignore_eos: bool = False
    """vLLM's extension: keep generating past the end-of-text token (load tests)."""
    logprobs: Any = None
    user: str | None = None

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def engine_sampling(
        self,
        prompt_tokens: int,
        max_tokens: int | None,
        max_model_len: int,
        eos_token_id: int | None,
        max_tokens_cap: int | None = None,
    ) -> SamplingSettings:
        """The engine's settings for a tokenized prompt, once it is known to fit: an empty
        prompt is 400, a prompt or ``max_tokens`` past the context length 400
        ``context_length_exceeded``. Without ``max_tokens`` the request may use the rest of the
        context, up to ``max_tokens_cap`` (``limits.max_tokens``, checked against an explicit
        ``max_tokens`` before tokenizing)."""
        if prompt_tokens <= 0:
            raise APIError(400, "the prompt is empty", param=self.prompt_param, code="empty_prompt")
        room = max_model_len - prompt_tokens
        if room <= 0:
            raise context_length_exceeded(
                max_model_len, prompt_tokens, max_tokens, self.prompt_param
            )
        if max_tokens is not None and max_tokens > room:
            _, asked_by = self.requested_max_tokens()
            raise context_length_exceeded(max_model_len, prompt_tokens, max_tokens, asked_by)
        if max_tokens is None:
            max_tokens = room if max_tokens_cap is None else min(room, max_tokens_cap)
        if self.min_tokens > max_tokens:
            message = f"min_tokens ({self.min_tokens}) must be at most max_tokens ({max_tokens})"
            raise APIError(400, message, param="min_tokens", code="invalid_value")
        eos = () if self.ignore_eos or eos_token_id is None else (eos_token_id,)
        return SamplingSettings(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            seed=self.seed,
            stop_token_ids=tuple(self.stop_token_ids or ()) + eos,
            ignore_eos=self.ignore_eos,
            n=self.n,
            top_k=max(self.top_k or 0, 0),
            min_p=self.min_p or 0.0,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=self.repetition_penalty or 1.0,
            min_tokens=self.min_tokens,
        )

    def requested_max_tokens(self) -> tuple[int | None, str]:
        """The tokens asked for (None: the rest of the context) and the field that asked."""
        raise NotImplementedError


class CompletionRequest(_Sampling):
    prompt: str | list[int]
    max_tokens: int | None = Field(default=16, ge=1)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(default=None, ge=1)

    def prompt_extent(self) -> tuple[int, bool]:
        """The prompt's length without tokenizing it, and whether that counts token ids
        (else characters)."""
        return len(self.prompt), isinstance(self.prompt, list)

    def requested_max_tokens(self) -> tuple[int | None, str]:
        """The tokens asked for (None: the rest of the context) and the field that asked."""
        return self.max_tokens, "max_tokens"


class TextPart(_Request):
    type: Literal["text"]
    text: str


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_Sampling):
    prompt_param: ClassVar[str] = "messages"
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None

    def prompt_extent(self) -> tuple[int, bool]:
        """The messages' characters (the chat template adds to them), not token ids."""
        return sum(len(m.text()) for m in self.messages), False

    def requested_max_tokens(self) -> tuple[int | None, str]:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"


def loads(raw: bytes) -> Any:
    """A JSON body, or a 400 ``APIError``: not JSON or not UTF-8, an integer longer than Python
    converts (``sys.get_int_max_str_digits``), nesting past the recursion limit."""
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise APIError(400, f"malformed JSON body: {exc}") from None
    except ValueError:  # int() past the digit limit
        digits = sys.get_int_max_str_digits()
        raise APIError(400, f"malformed JSON body: a number has over {digits} digits") from None
    except RecursionError:
        raise APIError(400, "malformed JSON body: nested too deeply") from None


def _not_text(value: Any) -> bool:
    """Whether a JSON value holds a string that is not Unicode text (a lone surrogate)."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return True
        elif isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, dict):
            stack.extend(item)
            stack.extend(item.values())
    return False


RequestT = TypeVar("RequestT", bound=_Sampling)


def parse_body(raw: bytes, model: type[RequestT]) -> RequestT:
    """JSON bytes -> a validated request, or a 400 ``APIError``."""
    data = loads(raw)
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object")
    for field in model.model_fields:  # unknown fields are ignored, whatever they hold
        if field in data and _not_text(data[field]):
            message = f"{field}: a string is not valid Unicode (a lone surrogate)"
            raise APIError(400, message, param=field)
    try:
        request = model.model_validate(data)
    except ValidationError as exc:
        raise field_error(exc.errors()[0]) from None
    for unserved in UNSERVED:
        if unserved.asked(request):
            message = f"{unserved.field}: {unserved.reason}"
            raise APIError(400, message, param=unserved.field, code="unsupported_parameter")
    return request


@dataclass(frozen=True, slots=True)
class Unserved:
    """A field vLLM's OpenAI server takes that we do not serve yet, refused when it asks for
    something (its default passes)."""

    field: str
    reason: str
    asked: Callable[[_Sampling], bool]


def _value(field: str) -> Callable[[_Sampling], Any]:
    return lambda request: getattr(request, field, None)


UNSERVED: tuple[Unserved, ...] = (
    Unserved(
        "logprobs",
        "log probabilities are not served (the engines stream token ids only)",
        lambda r: r.logprobs is not None and r.logprobs is not False,
    ),
    Unserved(
        "top_logprobs",
        "log probabilities are not served",
        lambda r: bool(_value("top_logprobs")(r)),
    ),
    Unserved("echo", "echoing the prompt is not served", lambda r: bool(_value("echo")(r))),
    Unserved("suffix", "a suffix (insertion) is not served", lambda r: bool(_value("suffix")(r))),
    Unserved(
        "best_of",
        "best_of above n is not served (vLLM's V1 engine has none either)",
        lambda r: (_value("best_of")(r) or r.n) > r.n,
    ),
    Unserved("logit_bias", "logit biases are not served", lambda r: bool(r.logit_bias)),
    Unserved(
        "response_format",
        "structured output (json_object, json_schema) is not served; only type text",
        lambda r: r.response_format is not None and r.response_format.get("type") != "text",
    ),
    Unserved("tools", "tool calling is not served", lambda r: bool(_value("tools")(r))),
    Unserved(
        "tool_choice",
        "tool calling is not served; only tool_choice none",
        lambda r: _value("tool_choice")(r) not in (None, "none"),
    ),
)
"""What we refuse, in the order a request is checked (docs/api.md lists them)."""
