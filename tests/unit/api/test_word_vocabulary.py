"""The words load-test prompts are written in are one token each, and the dictionary shortcut
agrees with the tokenizer or stays out of the way."""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import Tokenizer

from prefixmesh.api.word_vocabulary import Vocabulary, fast_encode, single_token_words, word_lookup
from prefixmesh.loadtest.keys import Segment
from prefixmesh.loadtest.prompts import PromptRenderer
from tests.fakes.tokenizer import tiny_tokenizer


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def tokenizer(folder: Path) -> Tokenizer:
    return Tokenizer.from_file(str(folder / "tokenizer.json"))


def test_vocabulary_keeps_only_words_that_are_one_token(tokenizer: Tokenizer) -> None:
    vocab = {"\u0120alpha": 5, "\u0120al": 6, "alpha": 7, "\u01201x": 8, "\u0120beta": 9}
    encodings = {" alpha": [5], " al": [6], " beta": [6, 10]}  # " beta" is two tokens here
    words = single_token_words(vocab, lambda text: encodings.get(text, []))
    assert words == [(5, "alpha"), (6, "al")]


def test_fast_encode_is_exact_or_declines(folder: Path, tokenizer: Tokenizer) -> None:
    vocabulary = Vocabulary.from_tokenizer_dir(folder)
    lookup = word_lookup(vocabulary)
    text = PromptRenderer(vocabulary).text((Segment(9, 64),))
    assert fast_encode(text, lookup, 0) == tokenizer.encode(text).ids
    a, b = vocabulary.words[-2:]
    assert fast_encode(f" {a} {b}", lookup, None) == [lookup[a], lookup[b]]
    assert fast_encode(f"{a} {b}", lookup, 0) is None  # no leading space
    assert fast_encode(f" {a}  {b}", lookup, 0) is None  # an empty word
    assert fast_encode(f" {a}, {b}", lookup, 0) is None  # punctuation
    assert fast_encode(" nosuchword", lookup, 0) is None
