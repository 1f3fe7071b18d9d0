"""Every error a prefixmesh HTTP server answers, in OpenAI's JSON shape
(``{"error": {"message", "type", "param", "code"}}``): the ones our handlers raise
(``APIError``), and the ones FastAPI and Starlette raise before a handler runs (an unknown path
404, a wrong method 405, a parameter that fails validation 400 with OpenAI's ``code``) or a
handler that fails (500).

``install_error_handlers`` puts the handlers on an app; the direct path's replica and router,
the proxy path's ingress and the standalone replica server install them where they make their
app (before ``serve.ingress`` copies it).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

logger = logging.getLogger(__name__)


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        error_type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.headers = headers or {}
        """Response headers the error comes with (a 429's ``retry-after``)."""
        self.status = status
        self.message = message
        self.error_type = error_type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.error_type,
                "param": self.param,
                "code": self.code,
            }
        }


def context_length_exceeded(
    max_model_len: int,
    prompt_tokens: int,
    max_tokens: int | None,
    param: str,
    *,
    at_least: bool = False,
) -> APIError:
    """OpenAI's 400 for a prompt (and ``max_tokens``) past the context length. ``at_least``:
    ``prompt_tokens`` is a lower bound counted before tokenizing."""
    what = "the messages" if param == "messages" else "the prompt"
    bound = "at least " if at_least else ""
    if max_tokens is None:
        detail = f"However, {what} resulted in {bound}{prompt_tokens} tokens"
        advice = f"Please reduce the length of {what}."
    else:
        detail = (
            f"However, you requested {bound}{prompt_tokens + max_tokens} tokens ({bound}"
            f"{prompt_tokens} in {what}, {max_tokens} in the completion)"
        )
        advice = f"Please reduce the length of {what} or completion."
    return APIError(
        400,
        f"This model's maximum context length is {max_model_len} tokens. {detail}. {advice}",
        param=param,
        code="context_length_exceeded",
    )


def error_type_of(status: int) -> str:
    """OpenAI's ``type`` for an HTTP status."""
    if status == 401:
        return "authentication_error"
    if status == 403:
        return "permission_error"
    if status == 429:
        return "rate_limit_error"
    return "server_error" if status >= 500 else "invalid_request_error"


def error_response(error: APIError, headers: dict[str, str] | None = None) -> JSONResponse:
    merged = {**error.headers, **headers} if headers else error.headers or None
    return JSONResponse(error.body(), status_code=error.status, headers=merged)


def http_error(method: str, path: str, status: int, detail: Any) -> APIError:
    """Starlette's routing errors as OpenAI words them (``Invalid URL (GET /v1/nope)``)."""
    if status == 404:
        return APIError(404, f"Invalid URL ({method} {path})", code="not_found")
    if status == 405:
        message = f"Method {method} is not allowed on {path}"
        return APIError(405, message, code="method_not_allowed")
    message = detail if isinstance(detail, str) and detail else f"HTTP {status}"
    return APIError(status, message, error_type=error_type_of(status))


_TYPE_NAMES = {
    "int": "an integer",
    "float": "a decimal",
    "string": "a string",
    "bool": "a boolean",
    "list": "an array",
    "dict": "an object",
    "model": "an object",
    "model_attributes": "an object",
}


def _json_type(value: Any) -> str:
    """A JSON value's type as OpenAI's messages name it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a decimal"
    if isinstance(value, str):
        return "a string"
    return "an array" if isinstance(value, list) else "an object"


def field_path(loc: Sequence[Any]) -> str | None:
    """Pydantic's error location as OpenAI names a parameter (``messages[0].role``): the body
    or query part dropped, and the union members pydantic names (``str``, ``list[int]``,
    ``TextPart``: never lower-case identifiers, as our fields are) cut off."""
    path = ""
    for part in loc:
        if part in ("body", "query", "path"):
            continue
        if isinstance(part, int):
            path += f"[{part}]"
        elif (
            isinstance(part, str)
            and part.isidentifier()
            and part.islower()
            and part not in _UNION_MEMBERS
        ):
            path += f".{part}" if path else part
        else:
            break
    return path or None


_UNION_MEMBERS = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})


def _bound_error(kind: str, param: str, error: Mapping[str, Any]) -> tuple[str, str]:
    """The message and code of a number outside its bounds (pydantic's ``greater_than...``)."""
    ctx = error.get("ctx") or {}
    value = error.get("input")
    bound = next(iter(ctx.values()), "?")
    # The field's kind, as its bound gives it (``temperature: 3`` is a decimal above 2.0).
    number = "decimal" if isinstance(bound, float) else "integer"
    below = kind.startswith("greater")
    sign = {"greater_than_equal": ">=", "greater_than": ">", "less_than_equal": "<="}.get(kind, "<")
    side = "below minimum" if below else "above maximum"
    message = (
        f"Invalid '{param}': {number} {side} value. Expected a value {sign} {bound}, but got "
        f"{value} instead."
    )
    return message, f"{number}_{'below_min' if below else 'above_max'}_value"


def field_error(error: Mapping[str, Any]) -> APIError:
    """One pydantic or FastAPI validation problem as OpenAI answers it: 400, ``param`` naming
    the field, ``code`` saying what is wrong (``missing_required_parameter``, ``invalid_type``,
    ``integer_below_min_value``, ``empty_array``, ``invalid_value``)."""
    kind = str(error.get("type", ""))
    param = field_path(error.get("loc", ()))
    name = param or "body"
    value = error.get("input")
    if kind == "missing":
        return APIError(
            400,
            f"Missing required parameter: '{name}'.",
            param=param,
            code="missing_required_parameter",
        )
    expected = kind.removesuffix("_type").removesuffix("_parsing")
    if kind.endswith(("_type", "_parsing")) and expected in _TYPE_NAMES:
        message = (
            f"Invalid type for '{name}': expected {_TYPE_NAMES[expected]}, but got "
            f"{_json_type(value)} instead."
        )
        return APIError(400, message, param=param, code="invalid_type")
    if kind in ("greater_than_equal", "greater_than", "less_than_equal", "less_than"):
        message, code = _bound_error(kind, name, error)
        return APIError(400, message, param=param, code=code)
    if kind == "too_short" and isinstance(value, list) and not value:
        message = (
            f"Invalid '{name}': empty array. Expected an array with minimum length "
            f"{(error.get('ctx') or {}).get('min_length', 1)}, but got an empty array instead."
        )
        return APIError(400, message, param=param, code="empty_array")
    message = f"Invalid '{name}': {error.get('msg', 'invalid value')}."
    return APIError(400, message, param=param, code="invalid_value")


def validation_error(errors: Sequence[Any]) -> APIError:
    """A request that failed validation, as OpenAI answers it: its first problem
    (``field_error``)."""
    return field_error(errors[0] if errors else {"type": "value_error", "loc": ()})


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    return error_response(exc)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    error = http_error(request.method, request.url.path, exc.status_code, exc.detail)
    return error_response(error, dict(exc.headers) if exc.headers else None)  # 405: Allow


async def _validation_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestValidationError)
    return error_response(validation_error(list(exc.errors())))


async def _unexpected(request: Request, exc: Exception) -> Response:
    # Starlette logs and re-raises it after this answer; the client gets no traceback.
    return error_response(
        APIError(500, "internal server error", error_type="server_error", code="internal_error")
    )


def install_error_handlers(app: FastAPI) -> FastAPI:
    """Answer every error of ``app`` in OpenAI's JSON shape; returns ``app``."""
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(Exception, _unexpected)
    return app
