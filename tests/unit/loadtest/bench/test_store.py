"""store-bench without a GPU: registered, and a clear refusal (its numbers need CUDA)."""

from __future__ import annotations

import pytest
import torch

from prefixmesh.cli import SUBCOMMANDS
from prefixmesh.loadtest.bench.store import main


def test_registered() -> None:
    assert SUBCOMMANDS["store-bench"][0] == "prefixmesh.loadtest.bench.store"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_refuses_without_cuda(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().out
