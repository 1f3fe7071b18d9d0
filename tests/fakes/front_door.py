"""A front door for tests that hand a server prepared requests (or none): its tokenizer is
never asked (``api/prepare.py``'s ``PromptTokenizer``)."""

from __future__ import annotations

from prefixmesh.api.limits import RequestLimits
from prefixmesh.api.prepare import FrontDoor, OpenAIRequest
from prefixmesh.cache_registry.hashing import BlockHasher


class _NoTokenizer:
    eos_token_id = None

    async def prompt_of(self, body: OpenAIRequest, chat: bool) -> tuple[list[int], int | None]:
        raise AssertionError("this test's server prepares no request")


def prepared_only(model: str = "m", block_size: int = 4) -> FrontDoor:
    """A front door for ``model`` that prepares nothing itself."""
    limits = RequestLimits(1 << 20, 64, None, None, 1.0)
    return FrontDoor(model, limits, _NoTokenizer(), BlockHasher(block_size, model))
