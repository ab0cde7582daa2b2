"""Entry point of the ``mixprec`` command.

Each subcommand lives in its own module under ``mixprec.cli`` with ``register(subparsers)``, which adds its
parser and sets ``prepare(args) -> work``: ``prepare`` checks every argument before any work starts and
returns ``work() -> int``, which does the work. Exit codes: 0 success, 1 a check failed (e.g. a broken
loss-scale rule), 2 invalid input (argparse errors, and a ValueError/TypeError raised by ``prepare``).
An exception raised while the work runs is a bug or a failure of the run, not bad input: it is not caught
here and ends with its traceback (exit 1).
"""

from __future__ import annotations

import argparse
import importlib
import re
import sys
import textwrap
from collections.abc import Callable, Sequence

__all__ = ["PlainHelpFormatter", "build_parser", "main", "plain_text"]

# Order is the order of `mixprec --help`.
_SUBCOMMAND_MODULES = (
    "mixprec.cli.demo",
    "mixprec.cli.train",
    "mixprec.cli.compare",
    "mixprec.cli.check_config",
    "mixprec.cli.study",
    "mixprec.cli.audit",
    "mixprec.cli.probe",
    "mixprec.cli.report",
)

# reStructuredText markup that docstrings use and a terminal should not show.
_ROLE = re.compile(r":[a-z]+:`~?([^`]+)`")  # :class:`mixprec.Foo` -> mixprec.Foo
_LITERAL = re.compile(r"``([^`]+)``")  # ``x`` -> x
_ITEM = re.compile(r"^(\s*)([*-]|\d+\.)\s+")  # the start of a bullet or numbered item


def plain_text(text: str) -> str:
    """``text`` without reStructuredText roles and literal markup (for --help)."""
    return _LITERAL.sub(r"\1", _ROLE.sub(r"\1", text))


class PlainHelpFormatter(argparse.HelpFormatter):
    """Help as plain text: reStructuredText markup removed; the description's paragraphs and list items kept
    apart (each re-wrapped to the terminal width, items with a hanging indent); and each option's default
    shown when its help does not already state it."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        blocks: list[str] = []
        for paragraph in re.split(r"\n\s*\n", plain_text(textwrap.dedent(text)).strip("\n")):
            items: list[list[str]] = []
            for line in paragraph.splitlines():
                if _ITEM.match(line) or not items:
                    items.append([line.strip()])
                else:
                    items[-1].append(line.strip())
            for item in items:
                first = " ".join(item)
                bullet = _ITEM.match(first)
                hang = " " * (len(bullet.group(2)) + 1) if bullet else ""
                blocks.append(
                    textwrap.fill(
                        first, width, initial_indent=indent, subsequent_indent=indent + hang, break_on_hyphens=False
                    )
                )
            blocks.append("")
        return "\n".join(blocks).rstrip("\n")

    def _split_lines(self, text: str, width: int) -> list[str]:
        # Names such as fp16/32-h100 stay whole.
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)

    def _get_help_string(self, action: argparse.Action) -> str:
        help_text = plain_text(action.help or "")
        shown = action.default is not None and action.default is not False and action.default != argparse.SUPPRESS
        if shown and action.option_strings and "default" not in help_text.lower() and "%(default)" not in help_text:
            default = action.default
            if isinstance(default, tuple | list):
                default = ",".join(str(v) for v in default)
            elif default is True:
                default = "on"
            help_text += f" (default: {str(default).replace('%', '%%')})"
        return help_text


def _plain_help(parser: argparse.ArgumentParser) -> None:
    """Give ``parser`` and every subcommand parser below it the plain-text help formatter."""
    parser.formatter_class = PlainHelpFormatter
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for choice in action.choices.values():
                _plain_help(choice)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mixprec",
        description="Numerically robust low-precision training for PyTorch.",
    )
    from mixprec import __version__

    parser.add_argument("--version", action="version", version=f"mixprec {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in _SUBCOMMAND_MODULES:
        importlib.import_module(name).register(sub)
    _plain_help(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    prepare: Callable[[argparse.Namespace], Callable[[], int]] | None = getattr(args, "prepare", None)
    if prepare is None:  # a command whose arguments argparse checks completely
        return int(args.func(args) or 0)
    try:
        work = prepare(args)
    except (ValueError, TypeError) as exc:
        # Raised while checking the user's arguments, before any work: the user's input is wrong.
        command = " ".join(filter(None, (args.command, getattr(args, "study", None))))
        print(f"mixprec {command}: error: {exc}", file=sys.stderr)
        return 2
    return int(work() or 0)


if __name__ == "__main__":
    sys.exit(main())
