"""Paired speed ratios with a confidence interval: the one measurement behind every speed the DAG reports.

A model's speed is a ratio to a reference (the same architecture's unmodified model, or another width's
reference), measured in one process with both warm. The unit is a *block* of four timed samples, ABBA or
BAAB in turn (A the reference, B the model), whose ratio is ``(B1 + B2) / (A1 + A2)``: a drift of the
machine's speed that is linear over a block cancels, and one that is slower than a block nearly does.

The statistic is the median of the block ratios with the distribution-free 95% interval of the median from
the binomial order statistics (``median_interval``): no bootstrap of a median at these sizes. The number of
blocks is set before they are measured, from a pilot (``paired_ratio``): the spread of 8 pilot blocks sets the
fewest new blocks (at least 8) whose interval it predicts within the tolerance (``planned_blocks``), limited by what
``cap_s`` affords at the pilot's pace; the result comes from the new blocks alone. Stopping the moment the
interval first dips under the tolerance would pick a lucky run of blocks and bias the interval.

Written here rather than taken from a library: ``torch.utils.benchmark`` and pytest-benchmark time one
function at a time (no interleaved pairs, no interval of a ratio), and neither sizes a measurement from a pilot.
"""

from __future__ import annotations

import functools
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from pipeline.bench.heap import steady_heap
from pipeline.errors import InputError

CONFIDENCE = 0.95
MIN_BLOCKS = 8


@dataclass(frozen=True)
class SpeedSettings:
    """How a paired ratio is measured: the relative half-width it aims at, the time it may take, the warm-up."""

    tolerance: float = 0.02  # the interval's relative half-width aimed at (of the median)
    cap_s: float = 20.0  # the most seconds the measured blocks may take at the pilot's pace
    pilot: int = MIN_BLOCKS
    warmup: int = 2  # calls of each function before the pilot (compiles, caches, first-call costs)
    max_blocks: int = 2000


@dataclass(frozen=True)
class SpeedRatio:
    """A paired ratio: the model's time over the reference's, as the median of block ratios with its interval.

    ``stop``: ``"tolerance"`` when the blocks the pilot asked for were measured (those its spread predicts
    reach the tolerance: the median measurement does, any one may land wider or narrower), ``"cap"`` when
    ``cap_s`` allowed fewer, ``"max_blocks"`` when ``max_blocks`` did (the interval is then predicted wider than
    the tolerance). ``pilot_half_width``: the half-width the pilot's spread predicts at the pilot's size."""

    ratio: float
    low: float
    high: float
    blocks: int
    stop: str
    pilot_half_width: float
    seconds: float  # wall time of the pilot and the blocks
    block_ratios: tuple[float, ...] = field(repr=False, default=())
    reference_s: float = math.nan  # the reference's median seconds a call over the blocks (its own scale)

    @property
    def half_width(self) -> float:
        """The interval's half-width relative to the ratio."""
        return (self.high - self.low) / 2 / self.ratio

    def covers(self, value: float) -> bool:
        return self.low <= value <= self.high


@functools.cache
def order_statistic_rank(n: int, confidence: float = CONFIDENCE) -> int:
    """The largest j (1-based) such that the sorted samples' [x_(j), x_(n+1-j)] covers the median with at least
    ``confidence``: 2 P(Bin(n, 1/2) <= j - 1) <= 1 - confidence. InputError when no j does (n < 6 at 95%).
    The binomial terms in log space (exact integers took 70 ms at n = 1,900, and ``planned_blocks`` asks for
    hundreds of n)."""
    alpha, cumulative, rank = 1.0 - confidence, 0.0, 0
    log_all = math.lgamma(n + 1) - n * math.log(2)
    for i in range(n // 2 + 1):
        cumulative += math.exp(log_all - math.lgamma(i + 1) - math.lgamma(n - i + 1))
        if 2 * cumulative > alpha:
            break
        rank = i + 1
    if rank == 0:
        raise InputError(f"{n} samples are too few for a {confidence:.0%} interval of their median")
    return rank


def median_interval(samples: list[float], confidence: float = CONFIDENCE) -> tuple[float, float, float]:
    """The median of ``samples`` and the distribution-free interval of the population median around it."""
    ordered = sorted(samples)
    rank = order_statistic_rank(len(ordered), confidence)
    return statistics.median(ordered), ordered[rank - 1], ordered[len(ordered) - rank]


def block_ratio(fn: Callable[[], object], reference: Callable[[], object], index: int,
                timer: Callable[[Callable[[], object]], float]) -> float:
    """One block: ABBA for an even ``index``, BAAB for an odd one; ``(B1 + B2) / (A1 + A2)``."""
    order = "ABBA" if index % 2 == 0 else "BAAB"
    seconds = {"A": 0.0, "B": 0.0}
    for who in order:
        seconds[who] += timer(reference if who == "A" else fn)
    return seconds["B"] / seconds["A"]


def predicted_half_width(spread: float, n: int) -> float:
    """The relative half-width of ``median_interval`` over ``n`` blocks whose ratios spread with relative standard
    deviation ``spread``: its ends are the order statistics of rank j and n + 1 - j (``order_statistic_rank``),
    which for normal samples lie about ``-Phi^-1((j - 0.375) / (n + 0.25))`` standard deviations from the centre
    (Blom's approximation)."""
    rank = order_statistic_rank(n)
    return spread * -statistics.NormalDist().inv_cdf((rank - 0.375) / (n + 0.25))


def planned_blocks(pilot: list[float], pilot_s: float, s: SpeedSettings) -> tuple[int, str, float]:
    """The blocks to measure after the pilot, why (``tolerance``, ``cap`` or ``max_blocks``), and the pilot's
    half-width (its interval's, as its spread predicts it: ``predicted_half_width`` at the pilot's size).

    The blocks asked for are the fewest whose interval the pilot's spread predicts within the tolerance. Not
    ``len(pilot) * (h / tolerance)^2`` with h the pilot's own interval: at 8 blocks that interval is [min, max],
    which covers 99.2%, not 95%, and scaled so it asks for more blocks than the tolerance needs (about 2.7 times
    for normal blocks; in the synthetic test a 2% tolerance landed at 1.3% after 99 blocks, against 1.95% after
    44 with this rule)."""
    spread = statistics.stdev(pilot) / statistics.median(pilot)
    # The fewest blocks from 0.8 of the large-sample count on (the exact interval is never narrower than that
    # count's; its half-width falls with n only up to the ranks' steps, so the scan, not a bisection, finds it).
    z = statistics.NormalDist().inv_cdf(0.5 + CONFIDENCE / 2)
    large_sample = (z * math.sqrt(math.pi / 2) * spread / s.tolerance) ** 2
    needed = max(MIN_BLOCKS, min(math.floor(0.8 * large_sample), s.max_blocks + 1))
    while needed <= s.max_blocks and predicted_half_width(spread, needed) > s.tolerance:
        needed += 1  # max_blocks + 1 when not even max_blocks reach the tolerance
    affordable = max(MIN_BLOCKS, math.floor(s.cap_s / max(pilot_s / len(pilot), 1e-9)))
    n = min(needed, affordable, s.max_blocks)
    stop = "tolerance" if n == needed else "cap" if n == affordable else "max_blocks"
    return n, stop, predicted_half_width(spread, len(pilot))


def paired_ratio(fn: Callable[[], object], reference: Callable[[], object], *, timer: Callable[[Callable], float],
                 settings: SpeedSettings = SpeedSettings(), log: Callable[[str], None] | None = None,
                 wall: Callable[[], float] = time.perf_counter) -> SpeedRatio:
    """``fn``'s time over ``reference``'s (both already on their device, inputs bound), as ``SpeedRatio``.

    ``timer(f)``: seconds of one timed sample of ``f`` (``sample_timer``); ``wall``: the clock the cap is
    counted on. The pilot sets how many blocks follow; the result is theirs alone."""
    if settings.pilot < MIN_BLOCKS:
        raise InputError(f"a paired ratio needs a pilot of at least {MIN_BLOCKS} blocks, got {settings.pilot}")
    for _ in range(settings.warmup):
        reference()
        fn()
    start = wall()
    pilot = [block_ratio(fn, reference, i, timer) for i in range(settings.pilot)]
    n, stop, half = planned_blocks(pilot, wall() - start, settings)
    if log is not None:
        log(f"[speed] the pilot's spread predicts a half-width of {half:.1%} at {settings.pilot} blocks: "
            f"measuring {n} blocks ({stop})")
    reference_times: list[float] = []

    def recorded(f: Callable[[], object]) -> float:
        seconds = timer(f)
        if f is reference:
            reference_times.append(seconds)
        return seconds

    blocks = [block_ratio(fn, reference, settings.pilot + i, recorded) for i in range(n)]
    ratio, low, high = median_interval(blocks)
    return SpeedRatio(ratio, low, high, n, stop, half, wall() - start, tuple(blocks),
                      statistics.median(reference_times))


def sample_timer(device: torch.device, *, calls: int = 1, clock: str = "cpu") -> Callable[[Callable], float]:
    """Seconds a call of ``f``, over ``calls`` calls back to back: CUDA events on a GPU (the device's own time
    of the queued calls); on the CPU the process's CPU time (``clock="cpu"``, which equals latency with one
    thread and leaves out what else the machine runs) or wall time (``"wall"``). On the CPU it fixes glibc's
    malloc thresholds for the rest of the process first (``bench.heap``): a timing then varies less from one
    process to the next."""
    if device.type == "cuda":
        def cuda_time(f: Callable[[], object]) -> float:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            for _ in range(calls):
                f()
            end.record()
            end.synchronize()
            return begin.elapsed_time(end) / 1000 / calls
        return cuda_time
    if clock not in ("cpu", "wall"):
        raise InputError(f"clock {clock!r}: use cpu or wall")
    steady_heap()
    now = time.process_time if clock == "cpu" else time.perf_counter

    def cpu_time(f: Callable[[], object]) -> float:
        begin = now()
        for _ in range(calls):
            f()
        return (now() - begin) / calls
    return cpu_time


def chain(first: SpeedRatio, second: SpeedRatio) -> SpeedRatio:
    """``first * second`` (a model against its reference, that reference against an anchor): the ratios multiply,
    and so, conservatively, do the interval's ends (each end holds with its own 95%; the product's coverage is
    at least 90%, and both measurements are usually much tighter than the tolerance)."""
    return SpeedRatio(first.ratio * second.ratio, first.low * second.low, first.high * second.high,
                      first.blocks + second.blocks, first.stop if first.stop == "cap" else second.stop,
                      max(first.pilot_half_width, second.pilot_half_width), first.seconds + second.seconds,
                      reference_s=second.reference_s)
