"""A request's priority (issue 17): the body's ``priority`` field, as vLLM's OpenAI server
takes it, or the ``x-prefixmesh-priority`` header for clients that cannot add body fields.
Lower starts first when a replica is saturated (``replica.fair_share``); 0 is the default."""

from __future__ import annotations

from collections.abc import Mapping

from prefixmesh.api.errors import APIError

PRIORITY_HEADER = "x-prefixmesh-priority"
PRIORITY_RANGE = (-1_000_000, 1_000_000)


def request_priority(headers: Mapping[str, str], body_priority: int | None) -> int:
    """The body's priority, else the header's, else 0; 400 for a value out of range."""
    if body_priority is not None:
        value = body_priority
    elif (raw := headers.get(PRIORITY_HEADER)) is not None:
        try:
            value = int(raw.strip())
        except ValueError:
            raise APIError(
                400, f"{PRIORITY_HEADER} must be an integer, got {raw[:32]!r}", param="priority"
            ) from None
    else:
        return 0
    low, high = PRIORITY_RANGE
    if not low <= value <= high:
        raise APIError(400, f"priority must be within [{low}, {high}]", param="priority")
    return value
