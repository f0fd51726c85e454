"""Timing primitives of the benchmarks (as ToMe's ``utils.benchmark``); the DAG's speeds are ``bench.paired``'s.

Warm up, synchronise the device around every timed sample, repeat, and report medians; a speed-up is a
median of per-pair ratios measured side by side, never a ratio of two separate runs. A sample is one
call, or several calls queued back to back with one synchronisation after the last (``calls``): then
the host issues the next call while the device still runs the last one, as in a serving loop and in
ToMe's benchmark, and the sample measures throughput rather than the latency of an idle device.
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


def default_calls(device: torch.device) -> int:
    """Calls a timed sample queues back to back by default: 10 on CUDA, where the host's issuing of one
    call overlaps the device's running of the last; 1 on the CPU, where calls run one after another
    anyway."""
    return 10 if device.type == "cuda" else 1


def timed(fn: Callable[[], object], device: torch.device, calls: int = 1,
          clock: Callable[[], float] = time.perf_counter) -> float:
    """Seconds a call of ``fn``: ``calls`` calls back to back, the device work they queued included.
    ``clock``: wall time by default; ``time.process_time`` counts this process's CPU time, which a CPU
    run on one thread spends whatever else the machine runs (``bench blocks --clock cpu``)."""
    start = clock()
    for _ in range(calls):
        fn()
    sync(device)
    return (clock() - start) / calls


def host_seconds(fn: Callable[[], object], device: torch.device, repeats: int,
                 clock: Callable[[], float] = time.perf_counter) -> float:
    """The median seconds ``fn`` takes to return with the device idle at its start: what the host
    spends issuing one call. On CUDA, a model whose host time reaches its time a call (``timed``) is
    bound by the host's launch rate, not by the GPU."""
    times = []
    for _ in range(repeats):
        sync(device)
        start = clock()
        fn()
        times.append(clock() - start)
    sync(device)
    return statistics.median(times)


def median_iqr(samples: list[float]) -> tuple[float, float]:
    """The median and the interquartile range (the full range for fewer than 4 samples)."""
    if len(samples) < 4:
        return statistics.median(samples), max(samples) - min(samples)
    q = statistics.quantiles(samples, n=4)
    return statistics.median(samples), q[2] - q[0]


def time_paired(fn: Callable[[], object], baseline: Callable[[], object], *, warmup: int, repeats: int,
                device: torch.device, calls: int = 1, clock: Callable[[], float] = time.perf_counter
                ) -> tuple[list[float], list[float]]:
    """Times ``repeats`` (baseline, fn) pairs of samples back to back after ``warmup`` calls of each;
    seconds a call, each sample ``calls`` calls (``timed`` on ``clock``)."""
    for _ in range(warmup):
        baseline()
        fn()
    sync(device)
    base, own = [], []
    for _ in range(repeats):
        base.append(timed(baseline, device, calls, clock))
        own.append(timed(fn, device, calls, clock))
    return base, own
