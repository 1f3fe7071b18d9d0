"""Workload prompts as real requests: text or token ids rebuilt from content ids.

A workload request is a sequence of content segments (``keys.py``); token ``offset`` of content
``content_id`` is ``keys.token_id(content_id, offset, ...)`` everywhere, so every load test and
every engine sees the same sharing as the simulator.

Prompts go out as text by default: every OpenAI server and every router accepts text, and the
routers that match prompt text (sglang-router's ``cache_aware``, Ray's PrefixCacheAffinityRouter)
need it. To make the text tokenize back to exactly the intended tokens, each token is rendered as
a space and a word that the model's tokenizer maps to one token of its own (``Ġword`` in a
byte-level BPE), so ``" w1 w2 w3"`` becomes ``[BOS, id(w1), id(w2), id(w3)]`` and a shared
content prefix is a shared token prefix. ``--prompt-format tokens`` sends the same ids instead.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from prefixmesh.loadtest.keys import Segment, token_id

_WORD = re.compile(r"[A-Za-z]+")
_BYTE_LEVEL_SPACE = "\u0120"  # "Ġ": a byte-level BPE's leading space


def single_token_words(
    vocab: Mapping[str, int], encode: Callable[[str], Sequence[int]]
) -> list[tuple[int, str]]:
    """(token id, word) for every vocabulary entry that is a space plus ASCII letters and that
    ``encode(" " + word)`` (no special tokens) maps back to exactly that one token; by id."""
    found = []
    for token, token_id_ in vocab.items():
        if not token.startswith(_BYTE_LEVEL_SPACE):
            continue
        word = token[1:]
        if _WORD.fullmatch(word) and list(encode(" " + word)) == [token_id_]:
            found.append((token_id_, word))
    found.sort()
    return found


@dataclass(frozen=True)
class Vocabulary:
    """The words a prompt is written in, and the tokenizer facts rendering needs."""

    words: tuple[str, ...]
    ids: tuple[int, ...]
    """``ids[i]`` is the token of ``" " + words[i]``."""
    bos_id: int | None
    """Prepended by the tokenizer to a text prompt (None: nothing is)."""

    def __post_init__(self) -> None:
        if len(self.words) != len(self.ids) or len(self.words) < 2:
            raise ValueError("a vocabulary needs at least two words, one id each")

    @classmethod
    def from_tokenizer_dir(cls, path: str | Path) -> Vocabulary:
        """From a Hugging Face tokenizer folder (``tokenizer.json``); uses only ``tokenizers``."""
        from tokenizers import Tokenizer

        folder = Path(path)
        tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        pairs = single_token_words(
            tokenizer.get_vocab(), lambda t: tokenizer.encode(t, add_special_tokens=False).ids
        )
        with_special = tokenizer.encode(" " + pairs[0][1]).ids
        bos = with_special[0] if len(with_special) == 2 else None
        return cls(tuple(w for _, w in pairs), tuple(i for i, _ in pairs), bos)

    def to_json(self) -> str:
        return json.dumps({"words": self.words, "ids": self.ids, "bos_id": self.bos_id})

    @classmethod
    def from_json(cls, text: str) -> Vocabulary:
        data = json.loads(text)
        return cls(tuple(data["words"]), tuple(data["ids"]), data["bos_id"])


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


def word_lookup(vocabulary: Vocabulary) -> dict[str, int]:
    return dict(zip(vocabulary.words, vocabulary.ids, strict=True))


def fast_encode(text: str, lookup: Mapping[str, int], bos_id: int | None) -> list[int] | None:
    """The tokenizer's own answer for a text made only of ``" " + word`` pieces whose words are
    single tokens (what ``PromptRenderer.text`` writes), by dictionary lookup; None for any other
    text (then ask the tokenizer). Exact: a byte-level pre-tokenizer splits such a text into
    exactly those pieces, and each piece is one vocabulary entry."""
    if not text.startswith(" "):
        return None
    out = [] if bos_id is None else [bos_id]
    get = lookup.get
    for word in text[1:].split(" "):
        token = get(word)
        if token is None:
            return None
        out.append(token)
    return out
