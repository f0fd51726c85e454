"""The GPU budget of the paper's protocol (docs/cluster.md), from measured figures and named assumptions.

Run: python benchmarks/cluster_budget.py [--step-rate 8331] [--loop-efficiency 0.95] [--gpus 32]
Every input is a flag, so that a figure measured on another GPU replaces the H200's.
"""

from __future__ import annotations

import argparse
import math

IMAGENET_TRAIN = 1_281_167
# Measured (docs/benchmarks.md): the training step's speed-up over the unmodified DeiT-S, H200, bf16, batch 128.
MEASURED_SPEEDUP = {"wkmedoids": 9085 / 8331}
# Assumed (docs/cluster.md, assumption 2): the compiled inference speed-up for K-Means and WK-Means, 1.0 elsewhere.
ASSUMED_SPEEDUP = {"kmeans": 0.862, "wkmeans": 0.862}
PAPER_METHODS = ("kmeans", "kmedoids", "wkmeans", "wkmedoids", "powerbert", "random", "importance", "tome")
GFLOPS = {"deit_tiny": 1.258, "deit_e252": 2.08, "deit_e318": 3.22, "deit_small": 4.608}  # fvcore, Table 1


def speedup(method: str) -> float:
    return MEASURED_SPEEDUP.get(method, ASSUMED_SPEEDUP.get(method, 1.0))


def width_epochs(methods: tuple[str, ...], levels: int, *, base: int = 300, lambdas: int = 8, ksearch: int = 30,
                 finetune: int = 300) -> float:
    """One width's training, in epochs at the unmodified model's cost."""
    return base + lambdas * ksearch + levels * finetune * sum(1 / speedup(m) for m in methods) + finetune


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--step-rate", type=float, default=8331, help="unmodified DeiT-S training step, images/s")
    parser.add_argument("--loop-efficiency", type=float, default=0.95, help="loop / bare step (assumed on a GPU)")
    parser.add_argument("--gpus", type=int, default=32)
    args = parser.parse_args()
    epoch_h = IMAGENET_TRAIN / (args.step_rate * args.loop_efficiency) / 3600
    full = width_epochs(PAPER_METHODS, 8)
    cost = sum(1 / speedup(m) for m in PAPER_METHODS)
    print(f"one epoch: {epoch_h * 3600:.0f} s; sum of 1/speed-up over the 8 methods: {cost:.2f}; "
          f"finetunes a width: {8 * 300 * cost:,.0f} epochs; a width: {full:,.0f} epochs")
    low = sum(GFLOPS.values()) / GFLOPS["deit_small"]
    rows = [("DeiT-S alone", full), (f"all four widths, the low end (GFLOPs: x {low:.2f})", full * low),
            ("all four widths, the high end (each like DeiT-S)", full * 4)]
    print(f"\n| | GPU-hours | on {args.gpus} GPUs |\n|---|---:|---:|")
    for label, epochs in rows:
        hours = epochs * epoch_h
        days = hours / args.gpus / 24
        print(f"| {label} | {hours:,.0f} | {days:.1f} days ({hours / args.gpus:.0f} hours) |")
    reduced = width_epochs(tuple(m for m in PAPER_METHODS if m not in ("kmeans", "wkmeans")), 4)
    print(f"\nwithout K-Means and WK-Means, 4 levels: {reduced:,.0f} epochs a width, "
          f"{reduced * epoch_h:,.0f} GPU-hours for DeiT-S; the GFLOPs assumption's finetunes: "
          f"{64 * 300 * 0.5:,.0f} epochs a width; cores a GPU at 1,638 images/s a core: "
          f"{math.ceil(args.step_rate / 1638)}")


if __name__ == "__main__":
    main()
