"""`make test-under-load`: the tests that time code on the real clock (marked ``speed``, one DAG run among them) with
busy processes beside them, the way CI can meet them on a shared 2-core machine (docs/testing.md, "Wall-clock limits
inside tests").

Two parts, each with ``--busy`` CPU-bound processes (2: one a core here) started before it and stopped after:

- the ``speed`` tests that start no Ray, on the suite's two xdist workers, beside busy processes at nice 0: the load
  the other worker of `make test` puts on them, and more;
- the ``speed`` tests that start Ray (the DAG run), beside busy processes at Ray's own worker niceness (``RAY_NICE``,
  15): Ray's workers then share the cores with them as with any other worker. Beside nice-0 processes a nice-15
  worker gets about 3% of a core, and the 84 s DAG would take most of an hour, which tests nothing but patience.

Prints, after each part, the CPU seconds the busy processes took, so that the run shows the load was there. Extra
arguments go to both pytest runs. Exits with the first failing part's code (0 when both pass).

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
RAY_NICE = 15  # the niceness Ray 2.60 starts its worker processes at (`ps -o ni` beside a DAG run)
PARTS = (("speed and not ray", 0, ["-n", "2", "--dist", "loadfile"]), ("speed and ray", RAY_NICE, []))


def cpu_seconds(pid: int) -> float:
    """A process's user and system CPU seconds from /proc/PID/stat (fields 14 and 15, in clock ticks)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_part(marks: str, nice: int, workers: list[str], busy: int, extra: list[str]) -> int:
    """pytest on the tests ``marks`` selects, beside ``busy`` CPU-bound processes at ``nice``; pytest's exit code."""
    burners = [subprocess.Popen([sys.executable, "-c", BUSY], preexec_fn=lambda: os.nice(nice))
               for _ in range(busy)]
    start = time.monotonic()
    try:
        command = [sys.executable, "-m", "pytest", "-q", *workers, "-m", marks,
                   f"--junitxml=runs/test-report-under-load-{'ray' if nice else 'cores'}.xml", *extra]
        print(f"[under-load] {busy} busy process(es) at nice {nice} beside: {' '.join(command[1:])}", flush=True)
        code = subprocess.run(command, cwd=ROOT).returncode
    finally:
        spent = [cpu_seconds(p.pid) for p in burners]
        for p in burners:
            p.kill()
            p.wait()
    wall = time.monotonic() - start
    print(f"[under-load] {marks}: {wall:.0f} s; the busy processes took {', '.join(f'{s:.0f}' for s in spent) or 'no'} "
          f"CPU seconds ({sum(spent) / max(wall, 1e-9):.2f} cores on average); pytest exited {code}", flush=True)
    return code


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--busy", type=int, default=2, help="CPU-bound processes beside the tests (default 2)")
    args, extra = parser.parse_known_args(argv)
    if args.busy < 0:
        parser.error(f"--busy {args.busy}: give 0 or more processes")
    codes = [run_part(marks, nice, workers, args.busy, extra) for marks, nice, workers in PARTS]
    return next((code for code in codes if code), 0)


if __name__ == "__main__":
    sys.exit(main())
