"""Every ``prefixmesh`` subcommand names a module that exists (moving a module must move its
entry), and the dispatcher answers usage errors without importing any of them."""

from __future__ import annotations

import importlib.util

import pytest

from prefixmesh.cli import SUBCOMMANDS, main


@pytest.mark.parametrize("command", sorted(SUBCOMMANDS))
def test_each_subcommand_module_exists(command: str) -> None:
    assert importlib.util.find_spec(SUBCOMMANDS[command][0]) is not None


def test_an_unknown_command_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["no-such-command"]) == 2
    assert "unknown command" in capsys.readouterr().err
