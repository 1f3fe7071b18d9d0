"""kernels-bench without a GPU: a clear refusal, and the --cpu smoke test of the torch path."""

from __future__ import annotations

import pytest
import torch

from prefixmesh.cli import SUBCOMMANDS
from prefixmesh.loadtest.bench.kernels import main


def test_registered() -> None:
    assert SUBCOMMANDS["kernels-bench"][0] == "prefixmesh.loadtest.bench.kernels"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_refuses_without_cuda(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().out


def test_cpu_smoke_is_labelled(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--cpu"]) == 0
    out = capsys.readouterr().out
    assert "NOT the benchmark" in out
    assert "round trip ok=True" in out
