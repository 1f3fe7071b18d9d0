"""A request's priority: the body's field first, then the header, else 0; a bad value is a
400 in OpenAI's words naming ``priority``."""

from __future__ import annotations

import pytest

from prefixmesh.api.errors import APIError
from prefixmesh.api.priority import PRIORITY_HEADER, request_priority


def test_the_body_wins_over_the_header_and_the_default_is_zero() -> None:
    assert request_priority({}, None) == 0
    assert request_priority({PRIORITY_HEADER: " -3 "}, None) == -3
    assert request_priority({PRIORITY_HEADER: "7"}, 2) == 2


@pytest.mark.parametrize(
    ("headers", "body"), [({PRIORITY_HEADER: "high"}, None), ({}, 10**7), ({}, -(10**7))]
)
def test_a_bad_priority_is_a_400(headers: dict[str, str], body: int | None) -> None:
    with pytest.raises(APIError) as raised:
        request_priority(headers, body)
    assert (raised.value.status, raised.value.param) == (400, "priority")
