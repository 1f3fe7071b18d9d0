"""Workload prompts as real requests: text or token ids rebuilt from content ids.

A workload request is a sequence of content segments (``keys.py``); token ``offset`` of content
``content_id`` is ``keys.token_id(content_id, offset, ...)`` everywhere, so every load test and
every engine sees the same sharing as the simulator.

Prompts go out as text by default: every OpenAI server and every router accepts text, and the
routers that match prompt text (sglang-router's ``cache_aware``, Ray's PrefixCacheAffinityRouter)
need it. To make the text tokenize back to exactly the intended tokens, each token is rendered as
a space and a word that the model's tokenizer maps to one token of its own (``Ġword`` in a
byte-level BPE), so ``" w1 w2 w3"`` becomes ``[BOS, id(w1), id(w2), id(w3)]`` and a shared
content prefix is a shared token prefix (the words: ``prefixmesh/api/word_vocabulary.py``).
``--prompt-format tokens`` sends the same ids instead.
"""

from __future__ import annotations

from collections.abc import Sequence

from prefixmesh.api.word_vocabulary import Vocabulary
from prefixmesh.loadtest.keys import Segment, token_id


class PromptRenderer:
    """Segments -> text or token ids, memoised per segment (shared system prompts and trace
    blocks render once)."""

    def __init__(self, vocabulary: Vocabulary, memo_limit: int = 100_000) -> None:
        self.vocabulary = vocabulary
        self._memo: dict[tuple[int, int], list[int]] = {}
        self._text_memo: dict[tuple[int, int], str] = {}
        self._limit = memo_limit

    def _indices(self, segment: Segment) -> list[int]:
        key = (segment.content_id, segment.num_tokens)
        found = self._memo.get(key)
        if found is None:
            size = len(self.vocabulary.words)
            found = [
                token_id(segment.content_id, i, size, reserved=0) for i in range(segment.num_tokens)
            ]
            if len(self._memo) >= self._limit:
                self._memo.clear()
                self._text_memo.clear()
            self._memo[key] = found
        return found

    def segment_text(self, segment: Segment) -> str:
        key = (segment.content_id, segment.num_tokens)
        found = self._text_memo.get(key)
        if found is None:
            words = self.vocabulary.words
            found = "".join([" " + words[i] for i in self._indices(segment)])
            self._text_memo[key] = found
        return found

    def text(self, segments: Sequence[Segment]) -> str:
        return "".join(self.segment_text(s) for s in segments)

    def token_ids(self, segments: Sequence[Segment]) -> list[int]:
        """What the tokenizer makes of ``text(segments)``: BOS, then one token per position."""
        ids = self.vocabulary.ids
        out = [] if self.vocabulary.bos_id is None else [self.vocabulary.bos_id]
        for segment in segments:
            out.extend(ids[i] for i in self._indices(segment))
        return out
