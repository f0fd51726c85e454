"""What the command groups share: the config arguments, progress on stderr, list parsing."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pipeline.errors import InputError


def add_config_args(parser: argparse.ArgumentParser, *, required: bool) -> None:
    parser.add_argument("config", type=Path, nargs=None if required else "?", default=None,
                        help="experiment YAML under configs/" + ("" if required else " (default: built-in defaults)"))
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="dotted override, for example --set pooling.iters=3 (repeatable)")


def log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def int_list(text: str | None, what: str) -> list[int] | None:
    if text is None:
        return None
    try:
        return [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise InputError(f"{what} must be comma-separated integers, got {text!r}") from None
