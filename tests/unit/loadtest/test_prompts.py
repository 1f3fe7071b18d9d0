"""Prompts rebuilt from content ids tokenize back to exactly the intended tokens, so shared
content is a shared token prefix in any engine."""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import Tokenizer

from prefixmesh.api.word_vocabulary import Vocabulary
from prefixmesh.loadtest.keys import Segment, token_id
from prefixmesh.loadtest.prompts import PromptRenderer
from tests.fakes.tokenizer import tiny_tokenizer


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def tokenizer(folder: Path) -> Tokenizer:
    return Tokenizer.from_file(str(folder / "tokenizer.json"))


def test_rendered_text_tokenizes_to_the_rendered_ids(folder: Path, tokenizer: Tokenizer) -> None:
    vocabulary = Vocabulary.from_tokenizer_dir(folder)
    assert vocabulary.bos_id == 0
    renderer = PromptRenderer(vocabulary)
    system, question = Segment(1, 300), Segment(2, 17)
    text = renderer.text((system, question))
    ids = renderer.token_ids((system, question))
    assert len(ids) == 1 + 317
    assert tokenizer.encode(text).ids == ids
    # position i of content c is the same token everywhere
    size = len(vocabulary.words)
    assert ids[1 + 5] == vocabulary.ids[token_id(1, 5, size, reserved=0)]
    # shared content, shared prefix
    other = renderer.token_ids((system, Segment(3, 17)))
    assert other[:301] == ids[:301] and other[301:] != ids[301:]
    assert Vocabulary.from_json(vocabulary.to_json()) == vocabulary
