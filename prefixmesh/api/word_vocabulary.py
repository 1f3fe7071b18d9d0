"""The single-token words load-test prompts are written in, and the exact shortcut that
tokenizes such text by dictionary lookup.

The load generator (``loadtest/prompts.py``) renders each token as a space and a word the model's
tokenizer maps to one token of its own (``Ġword`` in a byte-level BPE), so its text tokenizes
back to exactly the intended ids. A server that tokenizes a lot of that text (the standalone
replica server, asked by vllm-router to tokenize every request on every replica) uses
``fast_encode`` to skip the tokenizer. It lives here, not in loadtest/, because servers use it
and production code never imports loadtest/.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

_WORD = re.compile(r"[A-Za-z]+")
_BYTE_LEVEL_SPACE = "\u0120"  # "Ġ": a byte-level BPE's leading space


def single_token_words(
    vocab: Mapping[str, int], encode: Callable[[str], Sequence[int]]
) -> list[tuple[int, str]]:
    """(token id, word) for every vocabulary entry that is a space plus ASCII letters and that
    ``encode(" " + word)`` (no special tokens) maps back to exactly that one token; by id."""
    found = []
    for token, token_id in vocab.items():
        if not token.startswith(_BYTE_LEVEL_SPACE):
            continue
        word = token[1:]
        if _WORD.fullmatch(word) and list(encode(" " + word)) == [token_id]:
            found.append((token_id, word))
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


def word_lookup(vocabulary: Vocabulary) -> dict[str, int]:
    return dict(zip(vocabulary.words, vocabulary.ids, strict=True))


def fast_encode(text: str, lookup: Mapping[str, int], bos_id: int | None) -> list[int] | None:
    """The tokenizer's own answer for a text made only of ``" " + word`` pieces whose words are
    single tokens (what ``loadtest``'s ``PromptRenderer.text`` writes), by dictionary lookup;
    None for any other text (then ask the tokenizer). Exact: a byte-level pre-tokenizer splits
    such a text into exactly those pieces, and each piece is one vocabulary entry."""
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
