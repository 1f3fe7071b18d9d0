from __future__ import annotations

from collections.abc import Sequence

from prefixmesh.api.detokenize import IncrementalDetokenizer

# A byte-level toy vocabulary: token i is the byte i; "é" is two bytes.
E_ACUTE = list("é".encode())


def decode(ids: Sequence[int]) -> str:
    return bytes(ids).decode("utf-8", errors="replace")


def test_deltas_add_up_to_the_text() -> None:
    detok = IncrementalDetokenizer(decode)
    deltas = [detok.add([ord(c)]) for c in "hello"]
    assert deltas == ["h", "e", "l", "l", "o"]
    assert detok.text == "hello"


def test_a_split_character_is_held_back_until_complete() -> None:
    detok = IncrementalDetokenizer(decode)
    assert detok.add([ord("a"), E_ACUTE[0]]) == ""
    assert detok.add([E_ACUTE[1]]) == "aé"
    assert detok.add([ord("!")]) == "!"
    assert detok.text == "aé!"


def test_flush_releases_a_dangling_partial_character() -> None:
    detok = IncrementalDetokenizer(decode)
    detok.add([ord("x"), E_ACUTE[0]])
    assert detok.flush() == "x\ufffd"
    assert detok.text == "x\ufffd"
