from __future__ import annotations

import pytest

from prefixmesh.serve_cli import main, parse_args


def test_arguments() -> None:
    args = parse_args(["--config", "c.yaml", "--set", "a.b=1", "--set", "c=2", "--detach"], "p")
    assert (args.config, args.overrides, args.detach) == ("c.yaml", ["a.b=1", "c=2"], True)


def test_detach_needs_a_cluster(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--detach"]) == 2
    assert "--address" in capsys.readouterr().err
