"""Where the suite's time goes, from pytest's JUnit XML (``--junitxml``): per file and per test, in Markdown.

    .venv/bin/python -m pytest -n 2 --dist loadfile -m "not alone" --junitxml=runs/junit.xml
    .venv/bin/python -m tests.durations runs/junit.xml [more.xml ...] [--tests 40]

A test's time is its setup, call and teardown (pytest's default ``junit_duration_report = total``), so a module
fixture counts toward the first test that asks for it. The Ray files run one after the other in one xdist worker
(tests/conftest.py), so their sum is a floor for the parallel run's wall time.
"""

from __future__ import annotations

import argparse
import xml.etree.ElementTree as ElementTree
from collections import defaultdict
from pathlib import Path

from tests.conftest import RAY_FILES


def read_cases(paths: list[Path]) -> list[tuple[str, str, float, str]]:
    """(file, test name, seconds, outcome) for every test case in the reports."""
    cases = []
    for path in paths:
        for case in ElementTree.parse(path).getroot().iter("testcase"):
            file = case.get("classname", "").split(".")
            name = f"{file[-1]}::{case.get('name')}" if file[-1][:1].isupper() else case.get("name")
            file = "/".join(part for part in file if not part[:1].isupper()) + ".py"
            outcome = next((child.tag for child in case if child.tag in ("failure", "error", "skipped")), "passed")
            cases.append((file, name, float(case.get("time", 0)), outcome))
    return cases


def tables(cases: list[tuple[str, str, float, str]], top: int) -> str:
    """The per-file table (tests, seconds, share, whether the file is a Ray file) and the ``top`` slowest tests."""
    per_file: dict[str, list[float]] = defaultdict(list)
    for file, _, seconds, _ in cases:
        per_file[file].append(seconds)
    total = sum(seconds for _, _, seconds, _ in cases)
    ray = sum(sum(times) for file, times in per_file.items() if Path(file).name in RAY_FILES)
    lines = [f"{len(cases)} tests, {total:.0f} s in all; the Ray files (one worker, in turn) {ray:.0f} s.", "",
             "| file | tests | seconds | share | Ray worker |", "|---|---:|---:|---:|---|"]
    for file, times in sorted(per_file.items(), key=lambda item: -sum(item[1])):
        ray_file = "yes" if Path(file).name in RAY_FILES else ""
        share = f"{sum(times) / total:.1%}" if total else "-"
        lines.append(f"| `{file}` | {len(times)} | {sum(times):.1f} | {share} | {ray_file} |")
    lines += ["", f"The {top} slowest tests:", "", "| test | seconds | outcome |", "|---|---:|---|"]
    for file, name, seconds, outcome in sorted(cases, key=lambda case: -case[2])[:top]:
        lines.append(f"| `{file}::{name}` | {seconds:.1f} | {outcome} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("reports", nargs="+", type=Path, help="JUnit XML files written by pytest --junitxml")
    parser.add_argument("--tests", type=int, default=40, help="how many of the slowest tests to list")
    args = parser.parse_args()
    missing = [str(path) for path in args.reports if not path.is_file()]
    if missing:
        parser.error(f"no such report: {', '.join(missing)} (write one with pytest --junitxml=PATH)")
    print(tables(read_cases(args.reports), args.tests))


if __name__ == "__main__":
    main()
