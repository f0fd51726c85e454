"""`make test-under-load`: the tests that time code on the real clock (marked ``speed``, one DAG run among them) with
busy processes beside them, the way CI can meet them on a shared 2-core machine (docs/testing.md, "Wall-clock limits
inside tests").

Starts ``--busy`` CPU-bound processes (2: one a core here), runs pytest on the ``speed`` tests with the suite's two
xdist workers, stops the busy processes, and prints the CPU seconds they took, so that the run shows the load was
there. Extra arguments go to pytest. Exits with pytest's code.

    .venv/bin/python -m tests.under_load [--busy N] [PYTEST ARGS...]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BUSY = "while True: pass"


def cpu_seconds(pid: int) -> float:
    """A process's user and system CPU seconds from /proc/PID/stat (fields 14 and 15, in clock ticks)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--busy", type=int, default=2, help="CPU-bound processes beside the tests (default 2)")
    args, pytest_args = parser.parse_known_args(argv)
    if args.busy < 0:
        parser.error(f"--busy {args.busy}: give 0 or more processes")
    busy = [subprocess.Popen([sys.executable, "-c", BUSY]) for _ in range(args.busy)]
    start = time.monotonic()
    try:
        command = [sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "loadfile", "-m", "speed",
                   "--junitxml=runs/test-report-under-load.xml", *pytest_args]
        print(f"[under-load] {args.busy} busy process(es) beside: {' '.join(command[1:])}", flush=True)
        code = subprocess.run(command, cwd=ROOT).returncode
    finally:
        spent = [cpu_seconds(p.pid) for p in busy]
        for p in busy:
            p.kill()
            p.wait()
    wall = time.monotonic() - start
    print(f"[under-load] {wall:.0f} s; the busy processes took {', '.join(f'{s:.0f}' for s in spent) or 'no'} CPU "
          f"seconds ({sum(spent) / max(wall, 1e-9):.2f} cores on average); pytest exited {code}")
    return code


if __name__ == "__main__":
    sys.exit(main())
