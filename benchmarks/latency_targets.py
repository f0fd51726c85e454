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
from pipeline.cost import CostModel, load_cost_model
from pipeline.dag.latency import measure_on_table
from pipeline.dag.plan import archs, table_path
from pipeline.methods import keeps_all, method_spec
from pipeline.report import read_csv


def mean_se(values: list[float], unit: str = "") -> str:
    """``mean +- standard error (n seeds)``; the standard error is the seeds' sample deviation / sqrt(n)."""
    if not values:
        return "n/a"
    if len(values) == 1:
        return f"{values[0]:+.3g}{unit} (1 seed)"
    se = statistics.stdev(values) / math.sqrt(len(values))
    return f"{statistics.mean(values):+.3g}{unit} +- {se:.2g} ({len(values)} seeds)"


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


def measure_rows(rows: list[dict], tables: dict[str, CostModel], repeats: int) -> None:
    """Adds ``predicted`` and ``measured`` (ratios to the unmodified model) to every row whose method has a table
    (``tables``: by the method its key names); the baseline keeps every token: 1.0."""
    for row in rows:
        if keeps_all(row["method"]):
            row["measured"] = 1.0
        elif row["method"] in tables and row["keep"]:
            table = tables[row["method"]]
            row["predicted"] = table.predict(row["keep"]) / table.unmodified()
            samples = []
            for _ in range(repeats):
                ratio, status = measure_on_table(table, row["keep"], log=lambda _: None)
                if ratio is None:
                    raise SystemExit(f"{row['method']}'s table cannot be measured here: {status}")
                samples.append(ratio.ratio)  # a paired ratio's median (bench.paired)
            row["measured"] = statistics.median(samples)


def lambda_curve(rows: list[dict], method: str) -> list[tuple[float, float]]:
    """(measured ratio, top-1) of ``method``'s lambda models and the unpooled baseline (ratio 1.0), by ratio."""
    return sorted((r["measured"], r["top1"]) for r in rows if "measured" in r and (
        keeps_all(r["method"]) or (r["method"] == method and r["level"].startswith("lam"))))


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
    print("\n## Accuracy at matched measured latency (each target model against its seed's lambda curve)\n")
    print("The lambda curve: the lambda models of the method and the unpooled baseline (ratio 1.0), top-1 "
          "against measured ratio, linear between them. A target model outside the curve's span of ratios is "
          "not compared on top-1; one more accurate than the whole curve has no ratio of equal accuracy. "
          "Where a seed's curve spans under 0.10 of the unmodified time, no gain is expected there: the "
          "lambda search alone cannot reach other latencies to compare with.\n")
    print("| method | target | measured ratio | top-1 minus the curve's at that ratio, points | "
          "the curve's ratio at that top-1 minus the model's | curve spans (smallest) |")
    print("|---|---:|---:|---:|---:|---:|")
    for method in methods:
        for level, target in sorted(fractions.items(), key=lambda item: item[1]):
            own, diffs, saved, spans = [], [], [], []
            for rows in seeds.values():
                curve = lambda_curve(rows, method)
                hit = [r for r in rows if r["level"] == level and r["method"] == method and "measured" in r]
                if not hit or len(curve) < 2:
                    continue
                model = hit[0]
                spans.append(curve[-1][0] - curve[0][0])
                own.append(model["measured"])
                at = interpolate(curve, model["measured"])
                if at is not None:
                    diffs.append(model["top1"] - at)
                needed = ratio_at_accuracy(curve, model["top1"])
                if needed is not None:
                    saved.append(needed - model["measured"])
            if not own:
                continue
            span = min(spans)
            note = " (under 0.10: no gain expected)" if span < 0.10 else ""
            print(f"| {method} | {target:g} | {mean_se(own).lstrip('+')} | {mean_se(diffs)} | {mean_se(saved)} | "
                  f"{span:.2f}{note} |")


def smoke() -> None:
    """Tiny tables of both methods, measured here, and two seeds of made-up rows on them."""
    tiny = ModelSpec("deit_tiny_patch16_224", img_size=16, patch_size=4, embed_dim=16, depth=2, num_heads=2,
                     num_classes=4)
    tables, out = {}, Path(tempfile.mkdtemp())
    for method in ("wkmedoids", "powerbert"):
        s = BlocksSettings(tiny, method, method_spec(method).resolve(method, {}), batch=2, step=8, warmup=1,
                           repeats=2, min_sample_s=0.0, threads=1, clock="cpu",
                           anchor_tolerance=0.5, anchor_cap_s=300.0)  # a loose interval; a cap only a hang reaches
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
    parser.add_argument("--repeats", type=int, default=3, help="measurements a list (each a paired ratio)")
    parser.add_argument("--smoke", action="store_true", help="tiny tables, made-up accuracies: checks that it runs")
    args = parser.parse_args()
    if args.smoke:
        return smoke()
    if not args.runs:
        parser.error("give each seed's report folder (runs/experiments/fmnist_latency-s0 ...)")
    config = load_config(args.config)
    arch = archs(config)[0]
    targets = [t for t in config.experiment.ksearch_targets or [] if t.cost == "latency" and t.fraction]
    tables: dict[str, CostModel] = {}
    for path in sorted({table_path(t.table, arch) for t in targets}):
        table = load_cost_model(path)
        if tables.setdefault(table.key["method"], table) is not table:
            raise SystemExit(f"two tables of {table.key['method']} among the targets; give one a method")
    seeds = {}
    for run in args.runs:
        if not (run / "results.csv").is_file():
            raise SystemExit(f"{run}: no results.csv; give a report folder that `pipeline run` wrote "
                             "(runs/experiments/NAME), after its select stage")
        rows = [r for r in read_csv(run / "results.csv") if r["arch"] == arch.label and r["top1"] is not None]
        print(f"{run}: {len(rows)} models; measuring their keep lists", flush=True)
        measure_rows(rows, tables, args.repeats)
        seeds[run.name] = rows
    report(seeds, {t.label: t.fraction for t in targets}, list(tables))


if __name__ == "__main__":
    main()
