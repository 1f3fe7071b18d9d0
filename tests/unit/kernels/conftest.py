"""Triton's CPU interpreter for the kernel tests when no GPU is present.

The interpreter is chosen when ``@triton.jit`` runs; prefixmesh.kernels builds its kernels on
first use, so setting the variable for this package's tests (before one launches a kernel) is
enough. It is set only while these tests run: vLLM engines started by other tests inherit the
environment and must not see it.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(scope="package", autouse=True)
def triton_interpreter() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as patch:
        if not torch.cuda.is_available():
            patch.setenv("TRITON_INTERPRET", "1")
        yield
