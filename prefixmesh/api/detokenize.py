"""Incremental detokenization: text deltas from a growing list of token ids.

Byte-level BPE can end a chunk in the middle of a UTF-8 character; the decoder then yields
U+FFFD, so text is held back until the character is complete (the prefix/read offset scheme
of vLLM and TGI). Decoding only a short window keeps each step O(window), not O(output).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

Decode = Callable[[Sequence[int]], str]


class IncrementalDetokenizer:
    def __init__(self, decode: Decode) -> None:
        self._decode = decode
        self.token_ids: list[int] = []
        self.text = ""
        self._prefix_offset = 0
        self._read_offset = 0

    def add(self, token_ids: Sequence[int]) -> str:
        """Append tokens; return the newly complete text."""
        self.token_ids.extend(token_ids)
        ids = self.token_ids
        prefix_text = self._decode(ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(ids[self._prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""
        delta = new_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """At the end: whatever is still held back (a dangling partial character)."""
        rest = self._decode(self.token_ids[self._prefix_offset :])
        prefix = self._decode(self.token_ids[self._prefix_offset : self._read_offset])
        delta = rest[len(prefix) :]
        self.text += delta
        self._prefix_offset = self._read_offset = len(self.token_ids)
        return delta
