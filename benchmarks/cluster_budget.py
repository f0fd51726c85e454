"""The GPU budget of the paper's protocol (docs/cluster.md), from benchmark records and named assumptions.

Run: python benchmarks/cluster_budget.py [--records pipeline/bench/measured] [--gpu H200] [--gpus 32]

The step rates and speed-ups come from the records that `bench throughput --record` and `bench loop --record`
write (pipeline/bench/measured/, `pipeline.bench.records`); a run on another GPU adds its records and
`--gpu NAME` reads them. Every input is printed with its source and whether it was measured, measured on
earlier kernels (a record whose kernels are not what the code runs now), or assumed.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from pathlib import Path

from pipeline.bench.records import MEASURED, find_record, kernels_current, row
from pipeline.models.selfcheck import kernel_record
from pipeline.runtime import KernelChoice

IMAGENET_TRAIN = 1_281_167
PAPER_METHODS = ("kmeans", "kmedoids", "wkmeans", "wkmedoids", "powerbert", "random", "importance", "tome")
GFLOPS = {"deit_tiny": 1.258, "deit_e252": 2.08, "deit_e318": 3.22, "deit_small": 4.608}  # fvcore, Table 1
# Measured on the development machine's CPU (`bench loader --imagenet-like`, docs/benchmarks.md).
LOADER_PER_CORE = 1638
ASSUMED_LOOP_EFFICIENCY = 0.95  # assumption 1 of docs/cluster.md, until a GPU `bench loop` record exists


@dataclass(frozen=True)
class Input:
    name: str
    value: float
    status: str  # "measured", "measured on earlier kernels", "assumed"
    source: str


def _status(record: dict, current: dict[str, str]) -> str:
    return "measured" if kernels_current(record, current) else "measured on earlier kernels"


def step_inputs(records: Path, gpu: str) -> tuple[Input, dict[str, Input]]:
    """The unmodified DeiT-S training step rate and each paper method's training-step speed-up."""
    current = kernel_record(KernelChoice(), "cuda")
    found = find_record(records, kind="throughput", device=gpu, train=True, label="unmodified")
    if found is None:
        raise SystemExit(f"no {gpu} training-step record in {records}: run `bench throughput --train --record`")
    path, train = found
    rate = Input("DeiT-S training step, unmodified (images/s)", row(train, "unmodified")["images_per_s"], "measured",
                 f"{path.name} ({train['date']}, {train['commit'][:7]})")
    speedups = {}
    for method in PAPER_METHODS:
        if method in {r["label"] for r in train["rows"]}:
            speedups[method] = Input(f"{method} training-step speed-up", row(train, method)["speedup"],
                                     _status(train, current), path.name)
            continue
        inference = find_record(records, kind="throughput", device=gpu, train=False, label=method)
        if inference is not None and method in ("kmeans", "wkmeans"):
            value = row(inference[1], "kmeans" if method == "wkmeans" else method)["speedup"]
            speedups[method] = Input(f"{method} training-step speed-up", value, "assumed: the compiled inference "
                                     f"speed-up, {_status(inference[1], current)}", inference[0].name)
        elif method == "wkmeans" and "kmeans" in speedups:
            speedups[method] = Input(f"{method} training-step speed-up", speedups["kmeans"].value,
                                     "assumed: K-Means' figure", speedups["kmeans"].source)
        else:
            speedups[method] = Input(f"{method} training-step speed-up", 1.0, "assumed: the unmodified rate", "-")
    return rate, speedups


def loop_input(records: Path, gpu: str) -> Input:
    found = find_record(records, kind="loop", device=gpu, label="unmodified")
    if found is None:
        return Input("loop efficiency (loop / bare step)", ASSUMED_LOOP_EFFICIENCY, "assumed", "no GPU `bench loop` "
                     "record")
    return Input("loop efficiency (loop / bare step)", row(found[1], "unmodified")["efficiency"], "measured",
                 found[0].name)


def width_epochs(speedups: dict[str, float], methods: tuple[str, ...], levels: int, *, base: int = 300,
                 lambdas: int = 8, ksearch: int = 30, finetune: int = 300) -> float:
    """One width's training, in epochs at the unmodified model's cost."""
    return base + lambdas * ksearch + levels * finetune * sum(1 / speedups[m] for m in methods) + finetune


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=Path, default=MEASURED, help="the folder of benchmark records")
    parser.add_argument("--gpu", default="H200", help="the GPU whose records to read (part of the machine line)")
    parser.add_argument("--gpus", type=int, default=32)
    args = parser.parse_args()
    rate, speedup_inputs = step_inputs(args.records, args.gpu)
    loop = loop_input(args.records, args.gpu)
    print("| input | value | status | source |\n|---|---:|---|---|")
    for item in (rate, *speedup_inputs.values(), loop):
        value = f"{item.value:,.1f}" if item.value > 10 else f"{item.value:.3f}"
        print(f"| {item.name} | {value} | {item.status} | {item.source} |")
    speedups = {m: item.value for m, item in speedup_inputs.items()}
    epoch_h = IMAGENET_TRAIN / (rate.value * loop.value) / 3600
    full = width_epochs(speedups, PAPER_METHODS, 8)
    cost = sum(1 / speedups[m] for m in PAPER_METHODS)
    print(f"\none epoch: {epoch_h * 3600:.0f} s; sum of 1/speed-up over the 8 methods: {cost:.2f}; "
          f"finetunes a width: {8 * 300 * cost:,.0f} epochs; a width: {full:,.0f} epochs")
    low = sum(GFLOPS.values()) / GFLOPS["deit_small"]
    rows = [("DeiT-S alone", full), (f"all four widths, the low end (GFLOPs: x {low:.2f})", full * low),
            ("all four widths, the high end (each like DeiT-S)", full * 4)]
    print(f"\n| | GPU-hours | on {args.gpus} GPUs |\n|---|---:|---:|")
    for label, epochs in rows:
        hours = epochs * epoch_h
        days = hours / args.gpus / 24
        print(f"| {label} | {hours:,.0f} | {days:.1f} days ({hours / args.gpus:.0f} hours) |")
    reduced = width_epochs(speedups, tuple(m for m in PAPER_METHODS if m not in ("kmeans", "wkmeans")), 4)
    print(f"\nwithout K-Means and WK-Means, 4 levels: {reduced:,.0f} epochs a width, "
          f"{reduced * epoch_h:,.0f} GPU-hours for DeiT-S; the GFLOPs assumption's finetunes: "
          f"{64 * 300 * 0.5:,.0f} epochs a width; cores a GPU at {LOADER_PER_CORE:,} images/s a core (measured on "
          f"the development machine's CPU): {math.ceil(rate.value / LOADER_PER_CORE)}")


if __name__ == "__main__":
    main()
