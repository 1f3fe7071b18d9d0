"""Argument parsers of the ``prefixmesh`` commands, all built the same way (``command_parser``).

A command's description is the first paragraph of its module's docstring, its lines joined into
whole sentences (never a first line cut mid-sentence), and every option's help ends with its
default, except for flags and options whose default is None (their help says what no value
means). Imports nothing but the standard library, so any command module may use it.
"""

from __future__ import annotations

import argparse
import textwrap

SENTENCE_ENDS = (".", "!", "?")


def describe(doc: str | None) -> str | None:
    """The first paragraph of ``doc`` on one line, without reST's ````literal```` marks.

    None when there is no docstring (``python -OO``); ValueError when the paragraph does not end
    a sentence, so a docstring edited into a fragment fails its test instead of showing one."""
    if not doc:
        return None
    paragraph = doc.strip().split("\n\n", 1)[0]
    text = " ".join(paragraph.split()).replace("``", "")
    if not text.endswith(SENTENCE_ENDS):
        raise ValueError(f"a description must end a sentence: {text!r}")
    return text


def shows_default(action: argparse.Action) -> bool:
    """Whether ``action``'s help names its default: an option that takes a value, has one, and
    is shown (flags such as ``store_true`` take none: their default is their absence)."""
    return (
        bool(action.option_strings)
        and action.nargs != 0
        and action.default is not None
        and action.default is not argparse.SUPPRESS
        and action.help is not argparse.SUPPRESS
    )


def default_text(action: argparse.Action) -> str:
    """The default as one types it: a list comma-separated (space-separated for ``nargs``
    ``+``/``*``), an empty one ``none``."""
    value = action.default
    if isinstance(value, list | tuple):
        if not value:
            return "none"
        separator = " " if action.nargs in ("+", "*") else ","
        return separator.join(str(item) for item in value)
    return str(value)


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """``argparse.ArgumentDefaultsHelpFormatter`` without ``(default: None)``, ``(default:
    False)`` on flags, or Python's list syntax; a help that names ``%(default)s`` itself is kept.
    Lines break at spaces only: an option name or a comma-separated default stays whole."""

    def _split_lines(self, text: str, width: int) -> list[str]:
        return textwrap.wrap(
            " ".join(text.split()), width, break_long_words=False, break_on_hyphens=False
        )

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        return textwrap.fill(
            " ".join(text.split()),
            width,
            initial_indent=indent,
            subsequent_indent=indent,
            break_long_words=False,
            break_on_hyphens=False,
        )

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if "%(default)" in text or not shows_default(action):
            return action.help
        default = default_text(action).replace("%", "%%")
        return f"{text} (default: {default})" if text else f"default: {default}"


def command_parser(prog: str, doc: str | None) -> argparse.ArgumentParser:
    """A parser for the command ``prog`` described by its module's docstring ``doc``."""
    return argparse.ArgumentParser(
        prog=prog, description=describe(doc), formatter_class=DefaultsHelpFormatter
    )


def add_overrides(
    parser: argparse.ArgumentParser,
    dest: str = "overrides",
    help: str = "override a config field, after --config; repeatable",
) -> None:
    """``--set SECTION.FIELD=VALUE``, repeatable, kept in ``args.<dest>`` (every command that
    loads a config takes it so)."""
    parser.add_argument(
        "--set", dest=dest, action="append", default=[], metavar="SECTION.FIELD=VALUE", help=help
    )
