"""Prompts to token ids with a Hugging Face tokenizer: text or token-id prompts (checked against
the vocabulary), chat templates, decoding; the long work off the event loop. Every server's
``FrontDoor`` (``prepare.py``) tokenizes through one of these."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from prefixmesh.api.errors import APIError
from prefixmesh.api.protocol import ChatCompletionRequest


class PromptEncoder:
    """A Hugging Face tokenizer as the API uses it: text or token-id prompts, chat templates,
    decoding; long work off the event loop."""

    def __init__(self, tokenizer: Any) -> None:
        self.hf = tokenizer
        self.eos_token_id: int | None = tokenizer.eos_token_id
        self._vocab_size = len(tokenizer)

    async def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, list):
            if any(not 0 <= t < self._vocab_size for t in prompt):
                raise APIError(
                    400,
                    "prompt token ids out of the vocabulary",
                    param="prompt",
                    code="invalid_value",
                )
            return list(prompt)
        # Tokenizing a long prompt takes milliseconds of CPU: off the event loop.
        return list(await asyncio.to_thread(lambda: self.hf(prompt)["input_ids"]))

    async def encode_chat(self, body: ChatCompletionRequest) -> list[int]:
        return await self.encode_messages(
            [{"role": m.role, "content": m.text()} for m in body.messages]
        )

    async def encode_messages(self, messages: list[dict[str, str]]) -> list[int]:
        """Chat messages through the model's chat template, with the generation prompt."""

        def render() -> list[int]:
            ids = self.hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            if hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding (a UserDict)
                ids = ids["input_ids"]
            return [int(t) for t in ids]

        return await asyncio.to_thread(render)

    async def prompt_of(self, body: Any, chat: bool) -> tuple[list[int], int | None]:
        """A validated request's prompt token ids and its ``max_tokens``."""
        if chat:
            return await self.encode_chat(body), body.max_completion_tokens or body.max_tokens
        return await self.encode(body.prompt), body.max_tokens

    def decode(self, ids: Sequence[int]) -> str:
        return str(self.hf.decode(ids, skip_special_tokens=True))
