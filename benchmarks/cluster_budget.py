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
from pathlib import Path

from pipeline.bench.gpu_budget import (
    GFLOPS,
    IMAGENET_TRAIN,
    LOADER_PER_CORE,
    PAPER_METHODS,
    loop_input,
    step_inputs,
    width_epochs,
)
from pipeline.bench.records import MEASURED


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
