"""The command line when the reader of its output goes away early (``python -m pipeline methods | head -1``): no
traceback, and an exit status that says the output was cut."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _to_a_closed_pipe(args: list[str]) -> subprocess.CompletedProcess:
    """Runs ``args`` with stdout a pipe whose reader closed before the first write (``| head -1`` once it has
    read its line, without the race of how much the writer got out first)."""
    read, write = os.pipe()
    try:
        proc = subprocess.Popen(args, cwd=ROOT, stdout=write, stderr=subprocess.PIPE, text=True)
    finally:
        os.close(write)
        os.close(read)
    stderr = proc.communicate(timeout=300)[1]
    return subprocess.CompletedProcess(args, proc.returncode, "", stderr)


# a command of the real parser that prints more than a pipe holds, in a process that imports no model code
MANY_LINES = textwrap.dedent("""
    import sys
    from pipeline import cli

    real = cli.build_parser

    def build_parser():
        parser = real()
        commands = next(a for a in parser._actions if a.dest == "command")
        commands.add_parser("lines").set_defaults(func=lambda args: print("line\\n" * 200_000, end="") or 0)
        return parser

    cli.build_parser = build_parser
    sys.exit(cli.main(["lines"]))
""")


def test_output_cut_by_a_closed_pipe_ends_without_a_traceback():
    proc = _to_a_closed_pipe([sys.executable, "-c", MANY_LINES])
    assert proc.stderr == "" and proc.returncode == 1, proc.stderr[-2000:]


def test_another_broken_pipe_keeps_its_traceback(monkeypatch, capsys):
    """A BrokenPipeError that is not stdout's (a socket's, a subprocess's) is a fault: it is not swallowed."""
    from pipeline import cli

    real = cli.build_parser

    def build_parser():
        parser = real()
        commands = next(a for a in parser._actions if a.dest == "command")

        def fails(args):
            raise BrokenPipeError("a worker's socket")

        commands.add_parser("fails").set_defaults(func=fails)
        return parser

    monkeypatch.setattr(cli, "build_parser", build_parser)
    with pytest.raises(BrokenPipeError, match="a worker's socket"):
        cli.main(["fails"])


@pytest.mark.slow  # imports the model code: about 8 s on 2 busy cores
def test_pipeline_methods_into_a_closed_pipe_ends_without_a_traceback():
    proc = _to_a_closed_pipe([sys.executable, "-m", "pipeline", "methods"])
    assert "Traceback" not in proc.stderr and "BrokenPipeError" not in proc.stderr, proc.stderr[-2000:]
    assert proc.returncode == 1
