"""``python -m pipeline``: the command line. Each command group is a module that parses, loads its config
and calls into pipeline/; this module assembles them and turns the project's errors into one line."""

from __future__ import annotations

import argparse
import os
import select
import sys
import warnings
from typing import TextIO

from pipeline.cli import analysis, bench, data, deploy, doctor, experiments, info, train
from pipeline.cli.common import Parser
from pipeline.console import VERBOSE_ENV, quiet_driver
from pipeline.errors import PipelineError, PipelineWarning, project_error


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="python -m pipeline", description="Token Pooling in Vision Transformers.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for group in (info, bench, data, train, experiments, analysis, deploy, doctor):
        group.add_commands(commands)
    return parser


def _one_line_warnings() -> None:
    """The project's own warnings (``PipelineWarning``) as ``warning: ...``, like its errors; others as Python
    shows them."""
    show = warnings.showwarning
    if getattr(show, "one_line", False):
        return

    def one_line(message: Warning | str, category: type[Warning], filename: str, lineno: int,
                 file: TextIO | None = None, line: str | None = None) -> None:
        if issubclass(category, PipelineWarning):
            print(f"warning: {message}", file=sys.stderr if file is None else file)
        else:
            show(message, category, filename, lineno, file, line)

    one_line.one_line = True  # type: ignore[attr-defined]
    warnings.showwarning = one_line


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    if getattr(args, "verbose", False):
        os.environ[VERBOSE_ENV] = "1"
    quiet_driver()
    _one_line_warnings()
    try:
        code = args.func(args)
        sys.stdout.flush()  # a reader gone (`| head -1`) shows here, in this handler, not at the interpreter's exit
        return code
    except PipelineError as err:  # ours, on purpose: one line; anything else keeps its traceback
        print(f"error: {project_error(err) or err}", file=sys.stderr)  # not Ray's wrapper of a task's error
        return 2
    except BrokenPipeError:
        if not _reader_gone():  # another pipe's (a socket, a subprocess): a fault to show
            raise
        _quiet_stdout()  # the reader of stdout closed it early: what it read is what it asked for
        return 1


def _reader_gone() -> bool:
    """Whether stdout is a pipe whose reader has closed it (poll reports an error on its end)."""
    try:
        poll = select.poll()
        poll.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poll.poll(0))
    except (OSError, ValueError, AttributeError):  # no file descriptor (a test's StringIO)
        return False


def _quiet_stdout() -> None:
    """Points stdout's file descriptor at /dev/null, so that the interpreter's last flush of what is still buffered
    raises no second BrokenPipeError (the recipe of Python's signal module docs)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
