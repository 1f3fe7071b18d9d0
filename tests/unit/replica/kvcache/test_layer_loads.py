"""Layer-by-layer loads (issue 16, item 1): each layer's wait returns once that layer's copy
is done, copies run in layer order on one thread, a copy's error reaches the waiter, and
``finish`` waits for the whole step."""

from __future__ import annotations

import threading

import pytest

from prefixmesh.replica.kvcache.layer_loads import LayerCopier

NAMES = ["layers.0.attn", "layers.1.attn", "layers.2.attn"]


def test_a_layer_s_wait_returns_once_its_copy_is_done_and_not_before() -> None:
    copied: list[tuple[str, int]] = []
    release = threading.Event()

    def copy(batch: str, layer: int) -> None:
        if layer == 2:
            release.wait(timeout=10)
        copied.append((batch, layer))

    copier: LayerCopier[str] = LayerCopier(NAMES, copy)
    copier.start("step-1")
    copier.wait("layers.1.attn")
    assert copied == [("step-1", 0), ("step-1", 1)]  # layer 2's copy is still held back
    copier.wait("not-an-attention-layer")  # unknown names do not wait
    release.set()
    copier.finish()
    assert copied == [("step-1", 0), ("step-1", 1), ("step-1", 2)]
    assert copier.batches == 1
    copier.wait("layers.2.attn")  # nothing in flight: returns at once
    copier.close()


def test_a_new_step_first_finishes_the_last_and_errors_reach_the_waiter() -> None:
    copied: list[tuple[str, int]] = []

    def copy(batch: str, layer: int) -> None:
        if batch == "bad" and layer == 1:
            raise RuntimeError("copy failed")
        copied.append((batch, layer))

    copier: LayerCopier[str] = LayerCopier(NAMES, copy)
    copier.start("a")
    copier.start("b")  # a's layers all ran before b's first
    copier.finish()
    assert copied == [("a", 0), ("a", 1), ("a", 2), ("b", 0), ("b", 1), ("b", 2)]
    copier.start("bad")
    copier.wait("layers.0.attn")
    with pytest.raises(RuntimeError, match="copy failed"):
        copier.wait("layers.1.attn")
    copier.close()
