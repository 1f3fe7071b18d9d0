"""Every error of an app with ``install_error_handlers`` is OpenAI JSON: an unknown path 404, a
wrong method 405 (with its ``Allow``), FastAPI's validation 400 naming the field, an
``APIError`` raised anywhere, and a handler that fails 500 without its traceback."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.testclient import TestClient

from prefixmesh.api.errors import APIError, install_error_handlers

OPENAI_ERROR_KEYS = {"message", "type", "param", "code"}


def openai_error(response: Any, status: int) -> dict[str, Any]:
    """The error of a response that must be OpenAI's shape with ``status``."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == OPENAI_ERROR_KEYS
    assert body["error"]["message"]
    error: dict[str, Any] = body["error"]
    return error


def app() -> FastAPI:
    api = install_error_handlers(FastAPI())

    @api.post("/v1/completions")
    async def completions() -> dict[str, str]:
        raise APIError(429, "slow down", error_type="rate_limit_error", code="rate_limited")

    @api.get("/items")
    async def items(limit: int) -> dict[str, int]:
        return {"limit": limit}

    @api.get("/boom")
    async def boom() -> dict[str, str]:
        raise RuntimeError("secret internals")

    return api


def test_unknown_paths_and_methods_are_openai_json() -> None:
    client = TestClient(app())
    error = openai_error(client.get("/v1/nope"), 404)
    assert error == {
        "message": "Invalid URL (GET /v1/nope)",
        "type": "invalid_request_error",
        "param": None,
        "code": "not_found",
    }
    response = client.get("/v1/completions")
    error = openai_error(response, 405)
    assert error["message"] == "Method GET is not allowed on /v1/completions"
    assert (error["type"], error["code"]) == ("invalid_request_error", "method_not_allowed")
    assert response.headers["allow"] == "POST"


def test_validation_errors_name_the_field() -> None:
    client = TestClient(app())
    error = openai_error(client.get("/items", params={"limit": "many"}), 400)
    assert (error["param"], error["type"]) == ("limit", "invalid_request_error")
    assert error["code"] == "invalid_type"
    assert error["message"] == (
        "Invalid type for 'limit': expected an integer, but got a string instead."
    )
    missing = openai_error(client.get("/items"), 400)
    assert (missing["param"], missing["code"]) == ("limit", "missing_required_parameter")


def test_raised_api_errors_and_failures() -> None:
    client = TestClient(app(), raise_server_exceptions=False)
    error = openai_error(client.post("/v1/completions"), 429)
    assert (error["type"], error["code"]) == ("rate_limit_error", "rate_limited")
    error = openai_error(client.get("/boom"), 500)
    assert error == {
        "message": "internal server error",
        "type": "server_error",
        "param": None,
        "code": "internal_error",
    }
