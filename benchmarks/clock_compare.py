"""The paired primitive's intervals with the timer it had and the one it has: the process's CPU time with the
collector free to run inside samples, against this thread's CPU time with the collector off during the measurement
(``bench.paired``). Each round measures the demo's pair (the 32-wide, 4-block demo model with WK-Medoids at a
pooling keep list, against its unmodified self, batch 64, one thread) once with each timer, the order alternating
by round; it prints each measurement, each timer's median half-width, and the median over rounds of the
half-widths' ratio (new over old) with its 95% interval (``median_interval``):

    python benchmarks/clock_compare.py --rounds 8 --cap-s 4
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from collections.abc import Callable

import torch

from pipeline.bench.heap import steady_heap
from pipeline.bench.paired import SpeedRatio, SpeedSettings, median_interval, paired_ratio, sample_timer
from pipeline.models import create_model
from pipeline.runtime import inference

DEMO = {"img_size": 28, "patch_size": 4, "depth": 4, "num_heads": 2, "embed_dim": 32, "num_classes": 10}
KEEP = [25, 12, 6, 0]


def process_clock(f: Callable[[], object]) -> float:
    """The earlier timer: the process's CPU time, the collector running where it will (inside samples too)."""
    gc.enable()
    try:
        begin = time.process_time()
        f()
        return time.process_time() - begin
    finally:
        gc.disable()


process_clock.describe = "the process CPU time timer on the CPU"


def measure(timer: Callable, settings: SpeedSettings, batch: int) -> SpeedRatio:
    torch.manual_seed(0)
    pooled = create_model("deit_tiny_patch16_224", method="wkmedoids", keep=KEEP, **DEMO).eval()
    plain = create_model("deit_tiny_patch16_224", **DEMO).eval()
    pooled.load_state_dict(plain.state_dict(), strict=False)
    images = torch.randn(batch, 3, 28, 28)
    with inference(torch.device("cpu"), "fp32"):
        return paired_ratio(lambda: pooled(images), lambda: plain(images), timer=timer, settings=settings)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=8, help="measurements with each timer (6 or more)")
    parser.add_argument("--cap-s", type=float, default=4.0, help="each measurement's cap (the demo's eval.speed_cap_s)")
    parser.add_argument("--tolerance", type=float, default=0.0175)
    parser.add_argument("--batch", type=int, default=64)
    args = parser.parse_args()
    torch.set_num_threads(1)
    steady_heap()
    timers = {"process clock, collector on": process_clock, "thread clock, collector off": sample_timer(
        torch.device("cpu"), clock="cpu")}
    settings = SpeedSettings(tolerance=args.tolerance, cap_s=args.cap_s, cap_key="--cap-s")
    widths: dict[str, list[float]] = {name: [] for name in timers}
    for index in range(args.rounds):
        names = list(timers) if index % 2 == 0 else list(reversed(timers))
        for name in names:
            found = measure(timers[name], settings, args.batch)
            widths[name].append(found.half_width)
            print(f"round {index + 1} {name}: {found.ratio:.3f} [{found.low:.3f}, {found.high:.3f}] ({found.label()})",
                  flush=True)
    old, new = widths.values()
    print("| timer | measurements | median half-width |\n|---|---|---|")
    for name, values in widths.items():
        print(f"| {name} | {len(values)} | {statistics.median(values):.2%} |")
    if args.rounds >= 6:
        ratio, low, high = median_interval([b / a for a, b in zip(old, new)])
        print(f"thread clock over process clock, half-width ratio by round: {ratio:.3f} [{low:.3f}, {high:.3f}] "
              "(median, 95% interval)")


if __name__ == "__main__":
    main()
