"""Scores the keep lists a latency check measured against another table's predictions.

A check's measured ratios (each list's model against the unmodified model, paired ABBA blocks) do not depend
on the table that predicted them, so a table measured anew can be checked on the same lists without timing
them again. Prints, per check file (``pipeline bench latency-check`` output), the summary line the check
prints, for this table:

    python benchmarks/latency_rescore.py NEW_TABLE.json check-seed1.md check-seed2.md

The measured ratios come from the check's table, rounded to 3 decimals as it prints them.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from pipeline.bench.latency import CheckRow, summarize
from pipeline.bench.paired import SpeedRatio
from pipeline.cost import load_cost_model

ROW = re.compile(r"\| ((?:random|level) \d+) \| ([\d,]+) \| [\d.]+ \| ([\d.]+) \| \[([\d.]+), ([\d.]+)\] \|")


def measured_rows(check: Path) -> list[tuple[str, list[int], SpeedRatio]]:
    """(label, keep, measured ratio with its interval) of each list of a check's table; SystemExit if none."""
    rows = []
    for line in check.read_text().splitlines():
        found = ROW.match(line)
        if found:
            label, keep, ratio, low, high = found.groups()
            rows.append((label, [int(k) for k in keep.split(",")],
                         SpeedRatio(float(ratio), float(low), float(high), 0, "", 0.0, 0.0)))
    if not rows:
        raise SystemExit(f"error: {check}: no measured list in it; give the output of `pipeline bench latency-check`")
    return rows


def check_setting(table_key: dict, check: Path) -> None:
    """SystemExit unless the check's header (model, width, depth, method, batch, dtype) is the table's."""
    k = table_key
    want = (f"{k['model']} (M={k['embed_dim']}, L={k['depth']}), {k['method']}, batch {k['batch']}, {k['dtype']}, "
            f"compile {k['compile']}")
    header = check.read_text().splitlines()[1:2]
    if not header or not header[0].startswith(want):
        raise SystemExit(f"error: {check} measured {header[0] if header else 'nothing'!r}, not the table's setting "
                         f"{want!r}; give a check of a table of the same model, method and setting")


def main() -> None:
    """Prints the table's summary, then each check's line for this table's predictions."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("table", type=Path, help="the table whose predictions are scored")
    parser.add_argument("checks", type=Path, nargs="+", help="latency-check outputs (markdown)")
    args = parser.parse_args()
    table = load_cost_model(args.table)
    full, key = table.unmodified(), table.key
    found = ", ".join(f"{name} {key[field]:.3f}" for field, name in (
        ("reference_ms", "reference block (ms)"), ("halves_closure", "halves closure"),
        ("median_relative_iqr", "median relative IQR")) if field in key)  # older tables lack some
    print(f"{args.table}: fixed {table.fixed:.3f} ms" + (f", {found}" if found else ""))
    for check in args.checks:
        check_setting(key, check)
        rows = [CheckRow(label, keep, table.predict(keep) / full, speed) for label, keep, speed in measured_rows(check)]
        s = summarize(rows)
        print(f"{check.name}: {s.lists} lists: median |error| {s.median_abs_error:.1%}, worst {s.worst_abs_error:.1%}, "
              f"Kendall tau {s.tau:.3f}")


if __name__ == "__main__":
    main()
