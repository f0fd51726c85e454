"""Latency targets against the lambda search, at matched measured latency (Fashion-MNIST, this CPU).

For every seed's run of ``configs/experiments/fmnist_latency.yaml`` (its ``results.csv``), every finetuned
model's keep list is measured against its method's table (``dag.latency.measure_on_table``: paired against the
unmodified model at the table's setting, batch 64, one thread, CPU clock), side by side in this one process.
It prints:

- **Targets hit:** each target model's measured ratio against its target (within +-5%?);
- **Accuracy at matched latency:** per method and seed, the lambda models (and the unpooled baseline at 1.0)
  form a curve of top-1 against measured ratio; each target model's top-1 is compared with the curve's,
  linearly interpolated at its measured ratio (outside the curve's span: not compared), and its ratio with the
  curve's ratio at its top-1 (the latency the lambda search needs for that accuracy). Means over seeds with
  standard errors.

    for s in 0 1 2; do python -m pipeline run configs/experiments/fmnist_latency.yaml --set seed=$s \\
        --set experiment.name=fmnist_latency-s$s; done
    python benchmarks/latency_targets.py runs/experiments/fmnist_latency-s{0,1,2}

``--smoke``: tiny tables measured here and made-up accuracies, to check that the script runs (its figures then
mean nothing).
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import tempfile
from pathlib import Path

from pipeline.bench.blocks import BlocksSettings, ModelSpec, measure_table
from pipeline.config import load_config
from pipeline.cost import load_cost_model
from pipeline.dag.latency import measure_on_table
from pipeline.dag.plan import archs, table_path
from pipeline.methods import keeps_all, method_spec
from pipeline.report import read_csv


def mean_se(values: list[float]) -> str:
    if not values:
        return "n/a"
    if len(values) == 1:
        return f"{values[0]:+.2f} (one seed)"
    return f"{statistics.mean(values):+.2f} +- {statistics.stdev(values) / math.sqrt(len(values)):.2f}"


def interpolate(points: list[tuple[float, float]], x: float) -> float | None:
    """y at ``x`` on the piecewise-linear curve through ``points`` (sorted by x); None outside its span."""
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x0 <= x <= x1:
            return y0 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return None


def ratio_at_accuracy(points: list[tuple[float, float]], top1: float) -> float | None:
    """The smallest measured ratio at which the curve (ratio, top-1) reaches ``top1``; None if it never does."""
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if y0 >= top1:
            return x0
        if y1 >= top1:
            return x0 + (x1 - x0) * (top1 - y0) / (y1 - y0)
    return None


def measure_rows(rows: list[dict], tables: dict[str, object], repeats: int) -> None:
    """Adds ``measured`` (ratio) to every row whose method has a table; the baseline keeps every token: 1.0."""
    for row in rows:
        if keeps_all(row["method"]):
            row["measured"] = 1.0
        elif row["method"] in tables:
            table = tables[row["method"]]
            row["predicted"] = table.predict(row["keep"]) / table.unmodified()
            samples = [measure_on_table(tables[row["method"]], row["keep"], log=lambda _: None)[0]
                       for _ in range(repeats)]
            if any(s is None for s in samples):
                raise SystemExit(f"this machine is not the key of {row['method']}'s table: nothing to measure")
            row["measured"] = statistics.median(samples)


def report(seeds: dict[str, list[dict]], fractions: dict[str, float], methods: list[str]) -> None:
    print("\n## Targets hit (measured ratio to the unmodified model, paired, at the table's setting)\n")
    print("| seed | method | target | keep | predicted | measured | error |")
    print("|---|---|---:|---|---:|---:|---:|")
    errors = []
    for seed, rows in seeds.items():
        for row in rows:
            if row["level"] in fractions and "measured" in row:
                target = fractions[row["level"]]
                errors.append(row["measured"] / target - 1)
                print(f"| {seed} | {row['method']} | {target:g} | {','.join(map(str, row['keep']))} | "
                      f"{row['predicted']:.3f} | {row['measured']:.3f} | {errors[-1]:+.1%} |")
    if errors:
        print(f"\n{len(errors)} target models: within +-5% of the target: {sum(abs(e) <= 0.05 for e in errors)}; "
              f"median |error| {statistics.median(abs(e) for e in errors):.1%}, worst {max(errors, key=abs):+.1%}")
    print("\n## Accuracy at matched measured latency (target search minus lambda search)\n")
    print("| method | target | seeds compared | measured ratio (mean) | top-1 difference, points | "
          "ratio the lambda search needs for that top-1 (mean) | lambda curve spans |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for method in methods:
        for level, target in sorted(fractions.items(), key=lambda item: item[1]):
            diffs, own, needed, spans = [], [], [], []
            for rows in seeds.values():
                curve = sorted((r["measured"], r["top1"]) for r in rows if "measured" in r and (
                    keeps_all(r["method"]) or (r["method"] == method and r["level"].startswith("lam"))))
                hit = [r for r in rows if r["level"] == level and r["method"] == method and "measured" in r]
                if not hit or len(curve) < 2:
                    continue
                spans.append(curve[-1][0] - curve[0][0])
                own.append(hit[0]["measured"])
                at = interpolate(curve, hit[0]["measured"])
                if at is not None:
                    diffs.append(hit[0]["top1"] - at)
                r = ratio_at_accuracy(curve, hit[0]["top1"])
                if r is not None:
                    needed.append(r)
            if not own:
                continue
            span = min(spans)
            need = f"{statistics.mean(needed):.3f} ({len(needed)} seeds)" if needed else "never reached"
            note = " (under 0.10: no gain expected there)" if span < 0.10 else ""
            print(f"| {method} | {target:g} | {len(diffs)} | {statistics.mean(own):.3f} | {mean_se(diffs)} | "
                  f"{need} | {span:.2f}{note} |")


def smoke() -> None:
    """Tiny tables of both methods, measured here, and two seeds of made-up rows on them."""
    tiny = ModelSpec("deit_tiny_patch16_224", img_size=16, patch_size=4, embed_dim=16, depth=2, num_heads=2,
                     num_classes=4)
    tables, out = {}, Path(tempfile.mkdtemp())
    for method in ("wkmedoids", "powerbert"):
        s = BlocksSettings(tiny, method, method_spec(method).resolve(method, {}), batch=2, step=8, warmup=1,
                           repeats=2, min_sample_s=0.0, threads=1, clock="cpu")
        tables[method] = measure_table(s, out / f"{method}.json", log=lambda _: None)[0]
    rng = random.Random(0)
    seeds = {}
    for seed in ("s0", "s1"):
        rows = [{"method": "none", "level": "full", "keep": None, "top1": 80 + rng.random()}]
        for method in tables:
            for level, keep in (("lam1e-4", [16, 8]), ("lam1e-3", [8, 4]), ("t0.7", [12, 6])):
                rows.append({"method": method, "level": level, "keep": keep, "top1": 70 + 10 * rng.random()})
        seeds[seed] = rows
    for rows in seeds.values():
        measure_rows(rows, tables, repeats=1)
    report(seeds, {"t0.7": 0.7}, list(tables))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="*", type=Path, help="each seed's report folder (RUNS_DIR/NAME)")
    parser.add_argument("--config", default="configs/experiments/fmnist_latency.yaml")
    parser.add_argument("--repeats", type=int, default=3, help="measurements a list (each paired 7 times)")
    parser.add_argument("--smoke", action="store_true", help="tiny tables, made-up accuracies: checks that it runs")
    args = parser.parse_args()
    if args.smoke:
        return smoke()
    if not args.runs:
        parser.error("give each seed's report folder (runs/experiments/fmnist_latency-s0 ...)")
    config = load_config(args.config)
    arch = archs(config)[0]
    targets = [t for t in config.experiment.ksearch_targets or [] if t.cost == "latency" and t.fraction]
    tables = {}
    for target in targets:
        for method in target.methods or config.experiment.methods:
            tables.setdefault(method, load_cost_model(table_path(target.table, arch)))
    seeds = {}
    for run in args.runs:
        rows = [r for r in read_csv(run / "results.csv") if r["arch"] == arch.label]
        print(f"{run}: {len(rows)} models; measuring their keep lists", flush=True)
        measure_rows(rows, tables, args.repeats)
        seeds[run.name] = rows
    report(seeds, {t.label: t.fraction for t in targets}, list(tables))


if __name__ == "__main__":
    main()
