"""Every error a prefixmesh HTTP server answers, in OpenAI's JSON shape
(``{"error": {"message", "type", "param", "code"}}``): the ones our handlers raise
(``APIError``), and the ones FastAPI and Starlette raise before a handler runs (an unknown path
404, a wrong method 405, a parameter that fails validation 422) or a handler that fails (500).

``install_error_handlers`` puts the handlers on an app; the direct path's replica and router,
the proxy path's ingress and the standalone replica server install them where they make their
app (before ``serve.ingress`` copies it).
"""

from __future__ import annotations

import logging
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


def validation_error(errors: list[Any]) -> APIError:
    """FastAPI's 422 for a parameter or body field: the first problem, ``param`` naming the
    field (the location without its ``body``/``query`` part)."""
    first = errors[0] if errors else {}
    loc = [str(part) for part in first.get("loc", ()) if part not in ("body", "query", "path")]
    param = ".".join(loc) or None
    message = str(first.get("msg", "invalid request"))
    return APIError(422, f"{param}: {message}" if param else message, param=param)


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
