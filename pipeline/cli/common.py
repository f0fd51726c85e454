"""What the command groups share: the parser, the config arguments, progress on stderr, list parsing."""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from pipeline.errors import InputError

# A word that starts with '-' and then a number: -5, -0.5, -1e-3, -.5, the list -5,3, -inf, -nan.
NEGATIVE_NUMBER = re.compile(r"^-(\.?\d|inf|nan)", re.IGNORECASE)


class Parser(argparse.ArgumentParser):
    """argparse's parser, reading a negative number after an option as that option's value, so that
    ``--limit -5`` is ``--limit=-5`` and reaches the option's own check.

    argparse already does so for ``-5`` and ``-0.5`` (none of this CLI's options looks like a number), but
    reads ``-5,3`` or ``-1e-3`` as an unknown option and answers "expected one argument". Its test for "a
    negative number" is the matcher set here; subcommand parsers are made of this class too
    (``add_subparsers`` uses the parent's class).
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._negative_number_matcher = NEGATIVE_NUMBER


def add_config_args(parser: argparse.ArgumentParser, *, required: bool) -> None:
    parser.add_argument("config", type=Path, nargs=None if required else "?", default=None,
                        help="experiment YAML under configs/" + ("" if required else " (default: built-in defaults)"))
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="dotted override, for example --set pooling.options.wkmedoids.iters=3 (repeatable)")


def log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def int_list(text: str | None, what: str) -> list[int] | None:
    if text is None:
        return None
    try:
        return [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise InputError(f"{what} must be comma-separated integers, got {text!r}") from None
