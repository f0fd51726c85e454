"""Timing primitives shared by the benchmarks and the evaluate stage (as ToMe's ``utils.benchmark``).

Warm up, synchronise the device around every timed call, repeat, and report medians; a speed-up is a
median of per-pair ratios measured side by side, never a ratio of two separate runs.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def sync(device: torch.device) -> None:
    """Waits for the device's queued work (a no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], object], device: torch.device) -> float:
    """Seconds for one call of ``fn``, including the device work it queued."""
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


def median_iqr(samples: list[float]) -> tuple[float, float]:
    """The median and the interquartile range (the full range for fewer than 4 samples)."""
    if len(samples) < 4:
        return statistics.median(samples), max(samples) - min(samples)
    q = statistics.quantiles(samples, n=4)
    return statistics.median(samples), q[2] - q[0]


def time_paired(fn: Callable[[], object], baseline: Callable[[], object], *, warmup: int, repeats: int,
                device: torch.device) -> tuple[list[float], list[float]]:
    """Times ``repeats`` (baseline, fn) pairs back to back after ``warmup`` calls of each; seconds."""
    for _ in range(warmup):
        baseline()
        fn()
    sync(device)
    base, own = [], []
    for _ in range(repeats):
        base.append(timed(baseline, device))
        own.append(timed(fn, device))
    return base, own


def rate(fn: Callable[[], object], *, items: int, warmup: int, repeats: int, device: torch.device
         ) -> tuple[float, float]:
    """Items per second of ``fn``: the median over ``repeats`` timed calls, and the spread (max - min)."""
    for _ in range(warmup):
        timed(fn, device)
    rates = [items / timed(fn, device) for _ in range(repeats)]
    return statistics.median(rates), max(rates) - min(rates)
