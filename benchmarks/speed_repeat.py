"""Do two runs of an experiment measure the same speeds? Their ``results.csv`` files side by side.

Each model's speed is a paired ratio to its architecture's unmodified model with a 95% interval (the evaluate
stage, ``bench.paired``). Two runs agree on a model when ``|r2 / r1 - 1| <= sqrt(h1^2 + h2^2)``, r the ratio and h
the interval's relative half-width in each run. It prints every model's two ratios, the share that agree, the
median half-width of each run, and the two speed fronts (``report.fronts``) with their ties: they should hold the
same models, or differ only by models marked as ties. With ``--spread`` (a ``pipeline doctor --speed`` record), also
the share of models whose ``|r2 / r1 - 1|`` is within the machine's recorded spread between processes.

    rm -rf runs && make demo && cp -r runs/experiments/demo /tmp/demo-1
    rm -rf runs && make demo && cp -r runs/experiments/demo /tmp/demo-2
    python benchmarks/speed_repeat.py /tmp/demo-1 /tmp/demo-2 \
        --spread runs/machine/speed-intel-r-xeon-r-processor-t1.json
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import tempfile
from pathlib import Path

from pipeline.pareto import relative_half_width
from pipeline.report import fronts, read_csv, write_csv
from pipeline.spread import read_record


def half_width(row: dict) -> float:
    return relative_half_width(row["speed_ratio"], row["speed_ratio_low"], row["speed_ratio_high"])


def key(row: dict) -> tuple[str, str, str]:
    return row["arch"], row["level"], row["method"]


def compare(first: list[dict], second: list[dict]) -> tuple[list[str], float]:
    """The table's lines and the share of the models whose two ratios agree within their intervals."""
    other = {key(r): r for r in second}
    lines = ["| model | run 1 ratio [interval] | run 2 ratio [interval] | r2/r1 - 1 | allowed | agree |",
             "|---|---|---|---:|---:|---|"]
    agree = 0
    for row in sorted(first, key=key):
        again = other[key(row)]
        change, allowed = again["speed_ratio"] / row["speed_ratio"] - 1, math.hypot(half_width(row), half_width(again))
        agree += abs(change) <= allowed
        lines.append(f"| {'/'.join(key(row))} | {row['speed_ratio']:.3f} [{row['speed_ratio_low']:.3f}, "
                     f"{row['speed_ratio_high']:.3f}] | {again['speed_ratio']:.3f} [{again['speed_ratio_low']:.3f}, "
                     f"{again['speed_ratio_high']:.3f}] | {change:+.1%} | {allowed:.1%} | "
                     f"{'yes' if abs(change) <= allowed else 'NO'} |")
    return lines, agree / len(first)


# Where 90% of the differences of two runs fall if each run's ratio spreads by an sd s: 1.645 sqrt(2) s.
BAND = 1.645 * math.sqrt(2)


def spread_line(first: list[dict], second: list[dict], spread: float) -> str:
    """How many models' ``|r2 / r1 - 1|`` are within ``spread`` (an sd of one run, relative) and within the band
    that would hold 90% of two runs' differences at that sd, and the median and widest of them."""
    other = {key(r): r for r in second}
    changes = sorted(abs(other[key(r)]["speed_ratio"] / r["speed_ratio"] - 1) for r in first)
    within, band = (sum(change <= limit for change in changes) for limit in (spread, BAND * spread))
    return (f"within the machine's spread of {spread:.2%}: {within} of {len(changes)} models "
            f"({within / len(changes):.0%}); within {BAND * spread:.2%} (90% of two runs' differences at that sd): "
            f"{band} ({band / len(changes):.0%}); |r2/r1 - 1| median {statistics.median(changes):.2%}, "
            f"widest {changes[-1]:.2%}")


def front_lines(rows: list[dict], name: str) -> list[str]:
    front = fronts(rows, "images_per_s")["all"]
    return [f"{name} speed front ({len(front)} models):"] + [
        f"  {'/'.join(key(r))}: {r['images_per_s']:.0f} img/s [{r['images_per_s_low']:.0f}, "
        f"{r['images_per_s_high']:.0f}], top-1 {r['top1']:.2f}" + (f"  ties: {r['speed_ties']}" if r.get("speed_ties")
                                                                     else "") for r in front]


def smoke_runs(root: Path) -> list[Path]:
    """Two made-up results folders of four models and a spread record of 2.5% beside them (``--smoke``: the script
    runs; its figures then mean nothing).
    ``c`` is on run 1's front as ``b``'s tie, and off run 2's, where ``b`` is faster beyond the intervals."""
    folders = []
    for run, ratios in enumerate(([0.5, 0.7, 0.69, 1.0], [0.51, 0.66, 0.75, 1.0]), 1):
        rows = [{"arch": "M32", "level": level, "method": method, "keep": [8], "gflops": gflops, "top1": top1,
                 "images_per_s": 1000 / r, "images_per_s_low": 980 / r, "images_per_s_high": 1020 / r,
                 "speed_ratio": r, "speed_ratio_low": r * 0.98, "speed_ratio_high": r * 1.02, "stage_id": level,
                 "run_id": "", "checkpoint": ""}
                for (level, method, gflops, top1), r in zip((("a", "powerbert", 0.001, 60.0),
                                                             ("b", "wkmedoids", 0.002, 65.0),
                                                             ("c", "tome", 0.0015, 62.0),
                                                             ("full", "none", 0.003, 70.0)), ratios)]
        folders.append(root / f"run-{run}")
        folders[-1].mkdir(parents=True)
        write_csv(rows, folders[-1] / "results.csv")
    record = {"device": "Made-up CPU", "threads": 1, "setting": "cpu fp32 compile:none", "torch": "-", "timm": "-",
              "date": "-", "over_s": 180.0, "seconds": 180.0, "pair": {},
              "processes": [{"ratio": 0.99}, {"ratio": 1.01}], "between": 0.025, "within": 0.02, "max_over_min": 1.02}
    (root / "spread.json").write_text(json.dumps(record))
    return folders


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="*", type=Path, help="two results folders (each holding results.csv)")
    parser.add_argument("--spread", type=Path, default=None,
                        help="the machine's record of `pipeline doctor --speed` (runs/machine/speed-*.json)")
    parser.add_argument("--smoke", action="store_true", help="compare two made-up runs (the script runs)")
    args = parser.parse_args()
    if args.smoke:
        root = Path(tempfile.mkdtemp())
        args.runs, args.spread = smoke_runs(root), args.spread or root / "spread.json"
    if len(args.runs) != 2:
        parser.error("give two results folders (or --smoke)")
    first, second = (read_csv(folder / "results.csv") for folder in args.runs)
    if {key(r) for r in first} != {key(r) for r in second}:
        raise SystemExit("the two runs hold different models; compare two runs of one experiment")
    lines, share = compare(first, second)
    print("\n".join(lines))
    for name, rows in (("run 1", first), ("run 2", second)):
        print(f"{name}: median half-width {statistics.median(half_width(r) for r in rows):.2%}, widest "
              f"{max(half_width(r) for r in rows):.2%}")
    print(f"agree within their intervals: {share:.0%} of {len(first)} models (the criterion: at least 90%)")
    if args.spread is not None:
        print(spread_line(first, second, read_record(args.spread).between))
    one, two = ({key(r): r for r in fronts(rows, 'images_per_s')['all']} for rows in (first, second))
    print("\n".join(front_lines(first, "run 1") + front_lines(second, "run 2")))
    only = [(key_, front[key_]) for front, other in ((one, two), (two, one)) for key_ in front if key_ not in other]
    print(f"the fronts hold the same models: {one.keys() == two.keys()}; only in run 1: {sorted(one.keys() - two)}; "
          f"only in run 2: {sorted(two.keys() - one)}; each of those marked as a tie in its run: "
          f"{all(row.get('speed_ties') for _, row in only)}")


if __name__ == "__main__":
    main()
