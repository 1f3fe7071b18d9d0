"""Every ``prefixmesh`` command's parser (``prefixmesh.cli_help``): a description of whole
sentences, and each option's help with its default (none for flags and None defaults, whose help
says what no value means). The parsers are read as the commands build them, not from output."""

from __future__ import annotations

import argparse
import importlib
from typing import NoReturn

import pytest

from prefixmesh.cli import SUBCOMMANDS
from prefixmesh.cli_help import DefaultsHelpFormatter, command_parser, describe, shows_default


class _Built(Exception):
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        super().__init__(parser.prog)
        self.parser = parser


def built_parser(command: str, monkeypatch: pytest.MonkeyPatch) -> argparse.ArgumentParser:
    """The parser ``prefixmesh COMMAND`` builds, caught as it starts parsing (every command
    parses its arguments before it does anything else)."""
    module = importlib.import_module(SUBCOMMANDS[command][0])

    def caught(self: argparse.ArgumentParser, *args: object, **kwargs: object) -> NoReturn:
        raise _Built(self)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", caught)
    with pytest.raises(_Built) as built:
        module.main([], prog=f"prefixmesh {command}")
    return built.value.parser


def option_help(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    """One option's entry of ``--help``, as the parser's own formatter writes it."""
    formatter = parser.formatter_class(prog=parser.prog)
    formatter.add_argument(action)
    return formatter.format_help()


@pytest.mark.parametrize("command", sorted(SUBCOMMANDS))
def test_every_command_describes_itself_in_whole_sentences(
    command: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    parser = built_parser(command, monkeypatch)
    assert parser.formatter_class is DefaultsHelpFormatter
    assert parser.description and parser.description.endswith("."), parser.description
    assert "``" not in parser.description and "\n" not in parser.description


@pytest.mark.parametrize("command", sorted(SUBCOMMANDS))
def test_every_option_has_help_and_shows_its_default(
    command: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    parser = built_parser(command, monkeypatch)
    options = [a for a in parser._actions if a.option_strings and a.help != argparse.SUPPRESS]
    assert options
    for action in options:
        name = action.option_strings[-1]
        assert action.help, f"{command} {name} has no help"
        entry = option_help(parser, action)
        flag = action.nargs == 0
        if not flag and action.default not in (None, argparse.SUPPRESS):
            assert "(default:" in entry, f"{command} {name}: {entry}"
        if flag or action.default is None:
            assert "(default: None)" not in entry and "(default: False)" not in entry, entry
        assert "None" not in entry, f"{command} {name}: say what no value means: {entry}"


def test_a_wrapped_first_sentence_is_joined_and_a_fragment_refused() -> None:
    doc = """``tool``: does one thing,
    then another.

    Details that stay out of --help.
    """
    assert describe(doc) == "tool: does one thing, then another."
    assert describe(None) is None
    with pytest.raises(ValueError, match="end a sentence"):
        describe("A first line cut\nmid-sentence, and no full stop\n\nMore.")


def test_defaults_are_shown_as_typed_and_never_for_flags_or_none() -> None:
    parser = command_parser("tool", "A tool.")
    parser.add_argument("--rate", type=float, default=2.5, help="arrivals per second")
    parser.add_argument("--share", type=float, default=0.05, help="at most 5%% fail")
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2], help="sizes")
    parser.add_argument("--set", action="append", default=[], help="overrides")
    parser.add_argument("--tiers", default=[1.0, 2.0], help="tier ratios")
    parser.add_argument("--model", help="a model (default: none, the first one listed)")
    parser.add_argument("--fast", action="store_true", help="go fast")
    parser.add_argument("--programs", default="0,2,8,32,64,128,256,512,1024,2048", help="p")
    text = " ".join(parser.format_help().split())
    assert "arrivals per second (default: 2.5)" in text
    assert "at most 5% fail (default: 0.05)" in text
    assert "sizes (default: 1 2)" in text and "tier ratios (default: 1.0,2.0)" in text
    assert "overrides (default: none)" in text
    assert "(default: None)" not in text and "(default: False)" not in text
    assert "(default: 0,2,8,32,64,128,256,512,1024,2048)" in text  # never broken mid-word
    actions = {a.dest: a for a in parser._actions}
    assert not shows_default(actions["fast"]) and not shows_default(actions["model"])
    assert shows_default(actions["set"])
